"""GPU check of the offload path on one GPU (sized for an H200, 141 GB): remat vs offload vs
offload + LHS vs offload + LHS + pipelined transfers, measured side by side in one run.

    python benchmarks/gpu/offload_check.py [--output_dir DIR] [--steps 12] [overrides...]

Each variant is a `train.py` run in its own process (XLA flags must be set before the backend
starts) on the same seed and synthetic data. Prints per variant: step time, TFLOP/s per device,
the runtime's peak HBM, XLA's host buffers (offloaded bytes), and the per-step losses against
remat (same data, same seed: they must agree to bf16 rounding). Each variant also profiles a 2-step
window (profile.mode=xprof) and the copy/compute overlap verdict of each is printed. Then runs the parity gate
(python -m MaxOffload.offload.parity) for the offload policy, which exercises XLA's real
host-offload passes. Designed to finish within 10 minutes; a variant that runs out of memory is
reported as OOM, not a crash.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A Llama-style model whose saved activations do not fit next to its state on 141 GB, while the
# offloaded ones do: ~3.8B parameters (45 GB of fp32 params + Adam), 32k tokens per step.
MODEL = ["configs/llama3_1.py:8b", "model.num_layers=16", "model.vocab_size=32768", "train.seq_len=2048",
         "train.per_device_batch_size=16", "data.source=synthetic", "train.eval_every=0", "train.warmup_steps=2",
         "run.log_every=1", "checkpoint.keep=1"]
OFFLOAD = ["remat.policy=custom"] + [f"remat.tensors.{n}=offload" for n in
                                      ("query_proj", "key_proj", "value_proj", "mlpwi_0", "mlpwi_1")]
VARIANTS = {
    "remat": ["remat.policy=full", "xla.preset=baseline"],
    "offload": OFFLOAD + ["xla.preset=baseline"],
    "offload+lhs": OFFLOAD + ["xla.preset=lhs"],
    "offload+lhs+pipelined": OFFLOAD + ["xla.preset=lhs_pipelined_offload"],
}



def profile_window(steps):
    """A 2-step xprof window late in the run (after warmup), analysed by MaxOffload.profile.overlap."""
    start = max(2, steps - 3)
    return ["profile.mode=xprof", f"profile.start_step={start}", f"profile.num_steps={min(2, steps - start + 1)}"]


def run_variant(name, overrides, args):
    out = os.path.join(args.output_dir, name.replace("+", "_"))
    cmd = [sys.executable, "train.py", *MODEL, *overrides, *profile_window(args.steps), *args.overrides,
           f"train.steps={args.steps}", f"run.output_dir={out}", "checkpoint.resume=false"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    result = {"name": name, "wall_s": time.perf_counter() - started, "returncode": proc.returncode}
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        result["status"] = "OOM" if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() else "FAILED"
        result["tail"] = text[-1500:]
        return result
    summary = json.load(open(os.path.join(out, "summary.json")))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    memory = summary.get("compiled_memory") or {}
    result.update(status="ok", step_time_s=summary["mean_step_time_s"],
                  tflops=summary["tflops_per_sec_per_device"], mfu=summary.get("mfu"),
                  peak_hbm_gb=(summary.get("device_peak_bytes") or 0) / 1e9,
                  host_temp_gb=memory.get("host_temp_size_in_bytes", 0) / 1e9,
                  hbm_temp_gb=memory.get("temp_size_in_bytes", 0) / 1e9, losses=losses,
                  overlap=(summary.get("overlap") or {}).get("verdict", "no overlap report"))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every variant")
    parser.add_argument("--output_dir", default=os.environ.get("OUT", "runs/gpu_offload_check"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    results = []
    for name, overrides in VARIANTS.items():
        print(f"== {name}", flush=True)
        try:
            results.append(run_variant(name, overrides, args))
        except subprocess.TimeoutExpired:
            results.append({"name": name, "status": "TIMEOUT"})
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("losses", "tail")}), flush=True)
        if results[-1]["status"] != "ok" and "tail" in results[-1]:
            print(results[-1]["tail"], flush=True)
    base = next((r for r in results if r["name"] == "remat" and r["status"] == "ok"), None)
    print(f"\n{'variant':<24} {'status':<7} {'s/step':>8} {'TFLOP/s':>8} {'vs remat':>9} {'peak HBM':>9} "
          f"{'host buf':>9} {'max loss diff':>14}")
    for r in results:
        if r["status"] != "ok":
            print(f"{r['name']:<24} {r['status']:<7}")
            continue
        speedup = f"{r['tflops'] / base['tflops']:.2f}x" if base else "-"
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])) if base else float("nan")
        print(f"{r['name']:<24} {'ok':<7} {r['step_time_s']:>8.3f} {r['tflops']:>8.1f} {speedup:>9} "
              f"{r['peak_hbm_gb']:>8.1f}G {r['host_temp_gb']:>8.1f}G {diff:>14.2e}")
    print("\ncopy/compute overlap (2 profiled steps per variant; traces in <variant>/profile):")
    for r in results:
        print(f"  {r['name']}: {r.get('overlap', r['status'])}")
    print("\nparity gate (real XLA host offload): python -m MaxOffload.offload.parity", flush=True)
    parity = subprocess.run([sys.executable, "-m", "MaxOffload.offload.parity", *MODEL, *OFFLOAD, *args.overrides,
                             "model.num_layers=4", "train.per_device_batch_size=4"], cwd=ROOT, capture_output=True,
                            text=True, timeout=args.timeout)
    print(parity.stdout[-2000:] + parity.stderr[-1000:])
    with open(os.path.join(args.output_dir, "offload_check.json"), "w") as f:
        json.dump({"variants": results, "parity_returncode": parity.returncode, "parity": parity.stdout}, f, indent=1)
    return 0 if base and parity.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
