#!/usr/bin/env bash
# One call on the lent TPU v5e (the device tool): installs the project's dependencies from the machine's own package
# index, then, with no JAX_PLATFORMS set (the platform is the project's choice), runs the stages of $STAGES in order:
#   platform    which platform MaxOffload picks, and why
#   quickstart  python train.py configs/quickstart.py (real text, 300 steps)
#   hostlink    the host link, both ways (benchmarks/tpu/host_link.py)
#   attention   the attention kernels side by side (benchmarks/tpu/attention.py -> attention.json)
#   attention_sweep  splash's block sizes side by side (benchmarks/tpu/attention.py --sweep -> attention_sweep.json)
#   variants    the variants of benchmarks/tpu/variants.py ($VARIANTS: those named, default all), in one process per
#               xla.preset (benchmarks/tpu/run_variants.py: the TPU runtime starts once)
#   profile     an xprof trace of variant $PROFILE_VARIANT (default l4b4_offload, the overlap report's TPU reading),
#               profile.tar.gz; skipped once 420 s have passed
# LIBTPU_SETS="NAME=FLAGS;NAME=FLAGS": the attention, attention_sweep and variants stages run again under each set of
# libtpu flags (LIBTPU_INIT_ARGS: libtpu reads them once, when a process starts it), their outputs tagged NAME
# (attention_NAME.json, variant@NAME); SWEEP_ONLY=CHOICE,CHOICE limits attention_sweep to those block choices;
# EXTRA="KEY=VALUE ..." adds overrides to every variant (e.g. train.steps=20: more steps in the timed mean).
# Everything lands in $OUT: device_check.json (collect.py: every run's summary and key log lines), host_link.json,
# logs.tar.gz, profile.tar.gz, attention.json. A train.py process takes ~80 s on the v5e (TPU start-up and shut-down,
# init, two compiles, 8 steps); run_variants.py keeps one process for all the variants of a preset, which is meant to
# fit issue 43's eight variants in one 10-minute call (478 s on 2026-12-06); a run is skipped, not cut, once 540 s have passed:
#     device run: STAGES="platform quickstart hostlink profile" bash benchmarks/tpu/device_check.sh
#                 STAGES="attention variants" VARIANTS="l4b4_splash ds_auto" bash benchmarks/tpu/device_check.sh
set -u -o pipefail
OUT=${OUT:-/tmp/device_check}
RUNS=/tmp/device_check_runs
STAGES=${STAGES:-platform quickstart attention hostlink variants profile}
mkdir -p "$OUT" "$RUNS"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
SITE=/tmp/site
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple \
    --target "$SITE" flax optax orbax-checkpoint ml-collections absl-py tensorboard > "$RUNS/pip.log" 2>&1 \
    || { tail -5 "$RUNS/pip.log"; exit 1; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE:$PWD
export PYTHONUNBUFFERED=1
unset JAX_PLATFORMS
echo "installed in $(elapsed) s"

platform() {
    python3 - <<'PY' 2>&1 | tee "$RUNS/platform.log" | grep -v "^W0\|^I0"
import glob, os
from MaxOffload import platform
print("tpu_present:", platform.tpu_present(), "| /dev/accel*:", glob.glob("/dev/accel*"), "| /dev/vfio:",
      glob.glob("/dev/vfio/*"), "| google pci:", sum(open(v).read().strip() == platform.GOOGLE_PCI_VENDOR
                                                      for v in glob.glob("/sys/bus/pci/devices/*/vendor")))
platform.pick_platform()
print("JAX_PLATFORMS ->", os.environ.get("JAX_PLATFORMS"))
import jax
print("devices:", jax.devices())
PY
    if ! grep -q "TPU" "$RUNS/platform.log"; then
        echo "PLATFORM PICK FAILED: the rest runs with JAX_PLATFORMS=tpu"; export JAX_PLATFORMS=tpu
    fi
}

quickstart() {
    python3 train.py configs/quickstart.py run.output_dir="$RUNS/quickstart" > "$RUNS/quickstart.log" 2>&1
    echo "quickstart rc=$? at $(elapsed) s"; grep -E " on [0-9]+ x |^done" "$RUNS/quickstart.log"
}

TAG=""  # the LIBTPU_SETS entry a stage runs under ("" the default flags)

attention() {
    python3 benchmarks/tpu/attention.py --json "$OUT/attention${TAG:+_$TAG}.json" 2>&1 \
        | tee "$RUNS/attention${TAG:+_$TAG}.log" | grep -v "^W0\|^I0"
    echo "attention${TAG:+ @$TAG} done at $(elapsed) s"
}

attention_sweep() {
    python3 benchmarks/tpu/attention.py --sweep ${SWEEP_ONLY:+--only $SWEEP_ONLY} \
        --json "$OUT/attention_sweep${TAG:+_$TAG}.json" 2>&1 | tee "$RUNS/attention_sweep${TAG:+_$TAG}.log" \
        | grep -v "^W0\|^I0"
    echo "attention sweep${TAG:+ @$TAG} done at $(elapsed) s"
}

hostlink() {
    python3 benchmarks/tpu/host_link.py --sizes_mib 256,1024 --json "$OUT/host_link.json" 2>&1 | grep -v "^W0\|^I0"
    echo "host link done at $(elapsed) s"
}

variants() {
    # one process per xla.preset (XLA reads its flags once), each running its variants in turn (run_variants.py:
    # the TPU runtime starts once, not once a variant)
    local names=(${VARIANTS:-$(python3 benchmarks/tpu/variants.py names)}) preset
    declare -A by_preset=()
    for name in "${names[@]}"; do
        preset=$(python3 benchmarks/tpu/variants.py args "$name" | sed -n 's/^xla.preset=//p'); preset=${preset:-baseline}
        by_preset[$preset]+="$name "
    done
    for preset in baseline $(printf '%s\n' "${!by_preset[@]}" | grep -v '^baseline$'); do
        [ -n "${by_preset[$preset]:-}" ] || continue
        left=$(( 540 - $(elapsed) ))
        if [ $left -le 0 ]; then echo "${by_preset[$preset]}skipped: $(elapsed) s gone"; continue; fi
        timeout $(( left + 60 )) python3 benchmarks/tpu/run_variants.py "$RUNS" ${by_preset[$preset]} --budget_s "$left" \
            ${TAG:+--tag "@$TAG"} ${EXTRA:+-- $EXTRA} 2>&1 | grep -v "^W0\|^I0"
    done
}

profile() {
    if [ $(elapsed) -gt 420 ]; then echo "profile skipped: $(elapsed) s gone"; return; fi
    mapfile -t args < <(python3 benchmarks/tpu/variants.py args "${PROFILE_VARIANT:-l4b4_offload}")
    timeout 170 python3 train.py "${args[@]}" profile.mode=xprof profile.start_step=4 \
        profile.num_steps=2 run.output_dir="$RUNS/profile" > "$RUNS/profile.log" 2>&1
    echo "profile rc=$? at $(elapsed) s"; tail -3 "$RUNS/profile.log"
    tar -czf "$OUT/profile.tar.gz" -C "$RUNS/profile" profile
}

IFS=';' read -r -a flag_sets <<< "${LIBTPU_SETS:-}"
for stage in $STAGES; do
    case $stage in
        platform|quickstart|attention|attention_sweep|hostlink|variants|profile) $stage ;;
        *) echo "unknown stage $stage: platform quickstart attention attention_sweep hostlink variants profile"; exit 2 ;;
    esac
    case $stage in attention|attention_sweep|variants) ;; *) continue ;; esac
    for set in "${flag_sets[@]}"; do
        [ -n "$set" ] || continue
        TAG=${set%%=*}
        echo "--- $stage under LIBTPU_INIT_ARGS=${set#*=}"
        LIBTPU_INIT_ARGS="${set#*=}" $stage
        TAG=""
    done
done
python3 benchmarks/tpu/collect.py "$RUNS" "$OUT/device_check.json"
tar -czf "$OUT/logs.tar.gz" -C "$RUNS" $(cd "$RUNS" && ls *.log)
echo "all done at $(elapsed) s"
