#!/usr/bin/env bash
# The whole GPU check in one call of a lent GPU machine (a fresh image: jax, flax, optax, orbax, absl and
# tensorboard present, ml-collections carried as a wheel in .whl/). Ordered so a failure costs little:
# versions, a 3-step smoke run with a host-offloaded tensor, then benchmarks/gpu/offload_check.py (remat vs
# offload: losses, host memory, overlap, the parity gate), then the XLA-preset sweep
# (benchmarks/offload_sweep.py: remat, offload, +LHS, +pipelined, auto) on the same model, then each of the sweep's
# variants predicted from its deviceless compile for the H200 beside its measured step time
# (benchmarks/predict_vs_measured.py: the table, ratios, ranks and the calibration fitted to these points).
# CHECK_OVERRIDES: extra overrides for both (e.g. a tiny model to try the script on a CPU).
# Writes at most 8 files to $OUT (the device tool's limit).
set -u
OUT=${OUT:-runs/device_check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 3
fi
WORK=/tmp/device_check; rm -rf "$WORK"; mkdir -p "$WORK"
exec > >(tee "$OUT/device_check.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, jax, flax, optax, orbax.checkpoint as o, ml_collections as m; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, jax.devices())"
free -g | head -2

echo "== smoke: 3 steps of a small Llama with query_proj and mlpwi_0 offloaded"
timeout 150 python3 train.py configs/llama3_1.py:tiny train.seq_len=256 train.per_device_batch_size=8 train.steps=3 train.warmup_steps=1 \
  data.source=synthetic train.eval_every=0 run.log_every=1 checkpoint.enabled=false run.output_dir=$WORK/smoke \
  remat.policy=custom remat.tensors.query_proj=offload remat.tensors.mlpwi_0=offload || { echo "SMOKE FAILED"; exit 1; }

echo "== offload check (remat vs offload, parity)"
timeout 280 python3 benchmarks/gpu/offload_check.py --output_dir $WORK/check --steps 8 ${CHECK_OVERRIDES:-}
check=$?
cp $WORK/check/offload_check.json "$OUT/" 2>/dev/null
cp $WORK/check/offload/profile/overlap.json "$OUT/overlap_offload.json" 2>/dev/null
cp $WORK/check/offload/log.txt "$OUT/offload_train_log.txt" 2>/dev/null

echo "== XLA-preset sweep (measured)"
MODEL=$(python3 -c "import sys; sys.path.insert(0, '.'); from benchmarks.gpu.offload_check import MODEL, OFFLOAD; print(' '.join(MODEL + OFFLOAD))")
timeout 260 python3 benchmarks/offload_sweep.py $MODEL ${CHECK_OVERRIDES:-} --output_dir $WORK/sweep --steps 5
sweep=$?
cp $WORK/sweep/offload_sweep.csv $WORK/sweep/offload_sweep.png "$OUT/" 2>/dev/null
echo "== predicted (compiled timelines) vs measured"
timeout 240 python3 benchmarks/predict_vs_measured.py --measured $WORK/sweep/offload_sweep.csv --output_dir $WORK/predict
predicted=$?
cp $WORK/predict/predict_vs_measured.md "$OUT/" 2>/dev/null
echo "== exit: offload_check $check, sweep $sweep, predicted $predicted"
exit $(( check || sweep || predicted ))
