"""Predicted against measured step times:
    python benchmarks/predict_vs_measured.py [--measured CSV] [--output_dir DIR] [--target h200]
                                             [--save_programs DIR]

The measured side is an offload sweep run on a GPU (benchmarks/offload_sweep.py's CSV, default
benchmarks/results/h200_2026-11-29/offload_sweep.csv: one H200, jax 0.11.2, the model of
benchmarks/gpu/offload_check.py, XLA's chunked attention then). Each variant is compiled here, deviceless for the
same GPU, as it was run (its policy and xla.preset, model.attention=xla; the `auto` row as the planner planned it
then: every tagged tensor kept in HBM; with another --measured CSV, as today's planner plans it for the target),
and its compiled schedule is simulated (MaxOffload/timeline/) with the calibration in the code. Printed: per variant the measured and predicted step time, their ratio, and both
rankings. Then the three constants fitted to these points (least squares of the log ratio, a pattern search from
the code's values) and leave-one-out: each point predicted by the constants fitted on the others.
Writes DIR/predict_vs_measured.md and .json. Five deviceless compiles: about 4 minutes on 2 CPU cores.
TPUs: --target v5e --measured benchmarks/results/tpu_v5e_2026-12-05/measured_variants.json (the device check's
JSON, benchmarks/tpu/device_check.sh): each measured variant of benchmarks/tpu/variants.py compiled deviceless for
one v5e, its calibration fitted from TPU_CALIBRATION.
--save_programs DIR also writes each variant's compiled program (DIR/<variant>.hlo.gz): tests/test_timeline.py
holds the H200 programs of jax 0.12 so that it checks the simulation and calibration against the measurement
without compiling.
"""
import csv
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)

MEASURED = os.path.join(ROOT, "benchmarks", "results", "h200_2026-11-29", "offload_sweep.csv")
KEPT = [f"remat.tensors.{n}=device" for n in ("query_proj", "key_proj", "value_proj", "attention_out", "out_proj",
                                               "mlpwi_0", "mlpwi_1")]
# variant -> (overrides after the model's, xla.preset), as the sweep ran them
AS_RUN = {"remat": (["remat.policy=full"], "baseline"),
          "offload": ("OFFLOAD", "baseline"),
          "offload+lhs": ("OFFLOAD", "lhs"),
          "offload+lhs+pipelined": ("OFFLOAD", "lhs_pipelined_offload"),
          "auto": (["remat.policy=custom", *KEPT], "lhs_pipelined_offload")}


def measured_rows(path):
    from MaxOffload.errors import ConfigError

    if path.endswith(".json"):  # the TPU device check's runs: {variant: {"summary": {...}}}
        from MaxOffload.jsonfile import read_json

        runs = read_json(path, "give a device check's JSON (benchmarks/tpu/collect.py)", dict)
        known = {v: r["summary"]["mean_step_time_s"] for v, r in runs.items()
                 if isinstance(r, dict) and isinstance(r.get("summary"), dict) and "mean_step_time_s" in r["summary"]
                 and v != "quickstart"}
        if not known:
            raise ConfigError(f"--measured {path}: no run of it has a summary with mean_step_time_s")
        return known
    try:
        with open(path) as f:
            rows = {r["variant"]: float(r["step_s"]) for r in csv.DictReader(f) if r.get("step_s")}
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"--measured {path}: not an offload sweep CSV with variant and step_s columns ({e})") from None
    known = {v: s for v, s in rows.items() if v in AS_RUN}
    if not known:
        raise ConfigError(f"--measured {path}: none of the variants {', '.join(AS_RUN)} has a step time")
    return known


def tpu_variant(name):
    """The config and overrides of a TPU device-check variant, as benchmarks/tpu/device_check.sh asks for them."""
    import subprocess

    script = os.path.join(ROOT, "benchmarks", "tpu", "variants.py")
    return subprocess.run([sys.executable, script, "args", name], capture_output=True, text=True,
                          check=True).stdout.split()


def compile_variant(name, target, plan_auto=False):
    """The optimized HLO text of one variant's step, compiled deviceless for `target`; `plan_auto`: the auto row
    as the planner plans it now (else as it was measured in 2026-11)."""
    from benchmarks.gpu.offload_check import MODEL, OFFLOAD
    from MaxOffload import deviceless, from_config, hardware
    from MaxOffload.config import load
    from MaxOffload.offload import planner

    if hardware.ACCELERATORS[target].platform == "tpu":
        cfg = load(tpu_variant(name))
        devices = deviceless.compile_only_devices(target, "1x1")
        setup = from_config.train_setup(cfg, devices, planner.plan_for(cfg, target, "1x1", log=lambda *a: None))
        return setup.compile_train_step().as_text()

    overrides, preset = (["remat.policy=auto"], "lhs_pipelined_offload") if plan_auto and name == "auto" else \
        AS_RUN[name]
    cfg = load([*MODEL, *(OFFLOAD if overrides == "OFFLOAD" else overrides), f"xla.preset={preset}",
                "model.attention=xla"])
    devices = deviceless.compile_only_devices(target, "1x1x1")
    setup = from_config.train_setup(cfg, devices, planner.plan_for(cfg, target, "1x1x1", log=lambda *a: None))
    return setup.compile_train_step().as_text()


def predict(modules, accelerator, calibration):
    from MaxOffload.timeline import engines, simulate

    rates = engines.Rates.of(accelerator, "1x1" if accelerator.platform == "tpu" else "1x1x1", calibration)
    return {name: simulate.simulate(m, rates, work=work)[0]["step_s"] for name, (m, work) in modules.items()}


def loss(predicted, measured):
    return sum(math.log(predicted[n] / measured[n]) ** 2 for n in predicted)


def fit(modules, measured, accelerator, start):
    """The calibration minimising the squared log ratios (a pattern search over the three shares, each kept in
    (0.05, 1])."""
    best = dict(start)
    best_loss = loss(predict(modules, accelerator, best), measured)
    step = 0.08
    while step > 0.004:
        improved = False
        for key in sorted(best):
            for sign in (1, -1):
                trial = dict(best, **{key: min(1.0, max(0.05, best[key] + sign * step))})
                value = loss(predict(modules, accelerator, trial), measured)
                if value < best_loss - 1e-12:
                    best, best_loss, improved = trial, value, True
        if not improved:
            step /= 2
    return best


def ranks(values):
    order = sorted(values, key=values.get)
    return {name: order.index(name) + 1 for name in values}


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli

    _, options, _ = cli.parse(argv, __doc__, keys=(), options={"--measured": MEASURED, "--output_dir":
                                                                   "runs/predict_vs_measured", "--target": "h200",
                                                                   "--save_programs": ""})
    from MaxOffload.platform import use_cpu_runtime

    use_cpu_runtime()
    import jax

    from MaxOffload import hardware, hlo
    from MaxOffload.deviceless import require_plugin
    from MaxOffload.errors import require_choice

    require_choice("--target", options["--target"], tuple(hardware.ACCELERATORS))
    measured = measured_rows(options["--measured"])
    require_plugin(target=options["--target"])
    accelerator = hardware.ACCELERATORS[options["--target"]]
    modules = {}
    for name in measured:
        print(f"compiling {name} deviceless for {options['--target']} ...", flush=True)
        text = compile_variant(name, options["--target"], plan_auto=options["--measured"] != MEASURED)
        if options["--save_programs"]:
            import gzip

            os.makedirs(options["--save_programs"], exist_ok=True)
            with gzip.open(os.path.join(options["--save_programs"], f"{name}.hlo.gz"), "wt") as f:
                f.write(text)
        modules[name] = (hlo.parse(text), {})
    calibration = dict(hardware.calibration_for(accelerator))
    predicted = predict(modules, accelerator, calibration)
    fitted = fit(modules, measured, accelerator, calibration)
    refit = predict(modules, accelerator, fitted)
    left_out = {}
    for name in measured:
        others = {n: v for n, v in measured.items() if n != name}
        constants = fit({n: modules[n] for n in others}, others, accelerator, calibration)
        left_out[name] = predict({name: modules[name]}, accelerator, constants)[name]
    rank_m, rank_p, rank_l = ranks(measured), ranks(predicted), ranks(left_out)
    lines = [f"# Predicted vs measured step time ({options['--target']}, jax {jax.__version__})", "",
             f"measured: {os.path.relpath(options['--measured'], ROOT)}; calibration in the code: {_cal(calibration)};"
             f" fitted here: {_cal(fitted)}", "",
             "| variant | measured s | predicted s | ratio | rank measured / predicted | fitted s | ratio "
             "| left out s | ratio | rank |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in measured.items():
        lines.append(f"| {name} | {m:.3f} | {predicted[name]:.3f} | {predicted[name] / m:.2f} | {rank_m[name]} / "
                     f"{rank_p[name]} | {refit[name]:.3f} | {refit[name] / m:.2f} | {left_out[name]:.3f} | "
                     f"{left_out[name] / m:.2f} | {rank_l[name]} |")
    worst = max(abs(predicted[n] / measured[n] - 1) for n in measured)
    worst_out = max(abs(left_out[n] / measured[n] - 1) for n in measured)
    ranked = all(_same_order(measured, p) for p in (predicted,))
    lines += ["", f"largest error with the code's calibration: {worst:.1%}; left out: {worst_out:.1%}; ranked as "
              f"measured: {'yes' if ranked else 'NO'} (ties in the measurement, within 1%, may come in either order)"]
    from benchmarks.common import write

    write(options["--output_dir"], "predict_vs_measured", lines,
          {"measured": measured, "predicted": predicted, "calibration": calibration, "fitted": fitted,
           "fitted_predicted": refit, "left_out": left_out, "jax": jax.__version__, "target": options["--target"]})
    return 0 if worst <= 0.2 and ranked else 1


def _same_order(measured, predicted):
    """Every pair the measurement orders by more than 1% comes in the same order."""
    names = list(measured)
    return all((measured[a] - measured[b]) * (predicted[a] - predicted[b]) >= 0 or
               abs(measured[a] / measured[b] - 1) <= 0.01 for a in names for b in names)


def _cal(c):
    return ", ".join(f"{k.replace('_efficiency', '')} {v:.3f}" for k, v in sorted(c.items()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
