"""GPU check of the offload path on one GPU (sized for an H200, 141 GB): does offloading really move the
tensors to pinned host memory, does it leave the numbers alone, and what does it cost or gain?

    python benchmarks/gpu/offload_check.py [--output_dir DIR] [--steps 8] [--variants remat,offload] [overrides...]

Each variant (named as in benchmarks/offload_sweep.py) is a `train.py` run in its own process (XLA flags
must be set before the backend starts) on the same seed and synthetic data. Per variant: step time,
TFLOP/s per device, the runtime's peak HBM, XLA's host buffers (the offloaded bytes), the process's peak
resident host memory (pinned host buffers are resident, so offloading shows up here), the per-step losses
against remat (same data and seed: they must agree to bf16 rounding) and the copy/compute overlap verdict
of a 2-step xprof window. Then the parity gate (python -m MaxOffload.offload.parity: loss and gradients of
the offload policy against full remat), which exercises XLA's real host-offload passes. The XLA-preset
sweep (LHS, pipelined offload, the planner) is benchmarks/offload_sweep.py on the same MODEL.
"""
import json
import os
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from MaxOffload.cli import tool  # noqa: E402
from benchmarks.offload_sweep import VARIANTS, variant_argv  # noqa: E402

# Llama-3.1-8B layers (8 of them, 2.1B parameters: 33 GB of fp32 parameters + Adam), 32k tokens a step.
# Saving the offloaded tensors takes 2.3 GB a layer; full remat keeps only the 0.27 GB layer input.
MODEL = ["configs/llama3_1.py:8b", "model.num_layers=8", "model.vocab_size=32768", "train.seq_len=2048",
         "train.per_device_batch_size=16", "data.source=synthetic", "train.eval_every=0", "train.warmup_steps=2",
         "run.log_every=1", "checkpoint.enabled=false"]
OFFLOAD = ["remat.policy=custom"] + [f"remat.tensors.{n}=offload" for n in
                                      ("query_proj", "key_proj", "value_proj", "mlpwi_0", "mlpwi_1")]


def profile_window(steps):
    """A 2-step xprof window late in the run (after warmup), analysed by MaxOffload.profile.overlap."""
    start = max(2, steps - 2)
    return ["profile.mode=xprof", f"profile.start_step={start}", f"profile.num_steps={min(2, steps - start + 1)}"]


def run_variant(name, argv, args):
    out = os.path.join(args.output_dir, name.replace("+", "_"))
    cmd = [sys.executable, "train.py", *argv, *profile_window(args.steps), f"train.steps={args.steps}",
           f"run.output_dir={out}", "checkpoint.resume=false", "run.overwrite=true"]
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "log.txt")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak RSS, not the sum of all children
        except BaseException:
            proc.kill()
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    result = {"name": name, "wall_s": time.perf_counter() - started, "returncode": proc.returncode,
              "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9}
    text = open(log_path).read()
    if proc.returncode != 0:
        result["status"] = "OOM" if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() else "FAILED"
        result["tail"] = text[-3000:]
        return result
    summary = json.load(open(os.path.join(out, "summary.json")))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    memory = summary.get("compiled_memory") or {}
    result.update(status="ok", step_time_s=summary["mean_step_time_s"],
                  tflops=summary["tflops_per_sec_per_device"], mfu=summary.get("mfu"),
                  compile_s=summary.get("compile_time_s"),
                  peak_hbm_gb=(summary.get("device_peak_bytes") or 0) / 1e9,
                  host_temp_gb=memory.get("host_temp_size_in_bytes", 0) / 1e9,
                  hbm_temp_gb=memory.get("temp_size_in_bytes", 0) / 1e9, losses=losses,
                  overlap=(summary.get("overlap") or {}).get("verdict", "no overlap report"))
    return result


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli

    overrides, options, flags = cli.parse(argv, __doc__, keys=(), flags=("--no_parity",), options={
        "--output_dir": os.environ.get("OUT", "runs/gpu_offload_check"), "--steps": 8, "--variants": "remat,offload"})
    args = types.SimpleNamespace(overrides=overrides, output_dir=options["--output_dir"], steps=options["--steps"],
                                 no_parity=flags["--no_parity"])
    if args.steps < 2:
        raise cli.ConfigError(f"--steps {args.steps}: give at least 2 (the profiled window is 2 steps)")
    unknown = [n for n in options["--variants"].split(",") if n not in VARIANTS]
    if unknown:
        raise cli.ConfigError(f"--variants: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    plans = {name: variant_argv([*MODEL, *OFFLOAD, *overrides], name) for name in options["--variants"].split(",")}
    os.makedirs(args.output_dir, exist_ok=True)
    results = []
    for name, argv in plans.items():
        print(f"== {name}", flush=True)
        results.append(run_variant(name, argv, args))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("losses", "tail")}), flush=True)
        if results[-1]["status"] != "ok":
            print(results[-1]["tail"], flush=True)
    base = next((r for r in results if r["name"] == "remat" and r["status"] == "ok"), None)
    print(f"\n{'variant':<24} {'status':<7} {'s/step':>8} {'TFLOP/s':>8} {'vs remat':>9} {'peak HBM':>9} "
          f"{'XLA host':>9} {'peak RSS':>9} {'max loss diff':>14}")
    for r in results:
        if r["status"] != "ok":
            print(f"{r['name']:<24} {r['status']:<7}")
            continue
        speedup = f"{r['tflops'] / base['tflops']:.2f}x" if base else "-"
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])) if base else float("nan")
        r["max_loss_rel_diff_vs_remat"] = diff
        print(f"{r['name']:<24} {'ok':<7} {r['step_time_s']:>8.3f} {r['tflops']:>8.1f} {speedup:>9} "
              f"{r['peak_hbm_gb']:>8.1f}G {r['host_temp_gb']:>8.1f}G {r['peak_rss_gb']:>8.1f}G {diff:>14.2e}")
    print("\ncopy/compute overlap (2 profiled steps per variant; traces in <variant>/profile):")
    for r in results:
        print(f"  {r['name']}: {r.get('overlap', r['status'])}")
    parity = None
    if not args.no_parity:
        print("\nparity gate (real XLA host offload): python -m MaxOffload.offload.parity", flush=True)
        parity = subprocess.run([sys.executable, "-m", "MaxOffload.offload.parity", *MODEL, *OFFLOAD,
                                 *args.overrides, "model.num_layers=4", "train.per_device_batch_size=4"], cwd=ROOT,
                                capture_output=True, text=True)
        print(parity.stdout[-2000:] + parity.stderr[-2000:], flush=True)
    with open(os.path.join(args.output_dir, "offload_check.json"), "w") as f:
        json.dump({"variants": results, "parity_returncode": parity and parity.returncode,
                   "parity": parity and parity.stdout}, f, indent=1)
    return 0 if base and (parity is None or parity.returncode == 0) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
