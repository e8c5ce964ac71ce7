"""Policy x XLA-preset sweep: python benchmarks/offload_sweep.py CONFIG [overrides] [--output_dir DIR]
                                   [--target gb200 --topology 2x16x4] [--steps 5] [--variants remat,auto]

Needs matplotlib for its chart: pip install -e '.[bench]' (the test extra includes it).
--output_dir/--target/--topology are run.output_dir/aot.target/aot.topology (MaxOffload/cli.py). The sweep
compiles deviceless when aot.target is given on the command line (--target X or aot.target=X).

Variants (each in its own process: XLA_FLAGS must be set before the backend starts):
  remat                      remat.policy=full (and every remat.groups.G.policy), xla.preset=baseline
  offload                    the config's own policy if it offloads, else minimal_offloaded, baseline
  offload+lhs                same,                       xla.preset=lhs
  offload+lhs+pipelined      same,                       xla.preset=lhs_pipelined_offload
  auto                       remat.policy=auto (the planner), xla.preset=lhs_pipelined_offload
On a GPU: measured step time (median of --steps after one warm-up), TFLOP/s per device and peak memory.
On a CPU machine with --target: the deviceless compile's HBM/host figures per device and the step time its
compiled timeline predicts (MaxOffload/timeline/: step, exposed copy time, TFLOP/s; no measurement: XLA:CPU
ignores the GPU presets and keeps offloaded tensors). The auto row runs under the preset the planner chose.
On a CPU machine without --target: measured CPU step times (presets have no effect there).
Prints a table (TFLOP/s/device and speed-up over remat), writes DIR/offload_sweep.csv and .png.
"""
import csv
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)

VARIANTS = {
    "remat": ("full", "baseline"),
    "offload": ("OFFLOAD", "baseline"),
    "offload+lhs": ("OFFLOAD", "lhs"),
    "offload+lhs+pipelined": ("OFFLOAD", "lhs_pipelined_offload"),
    "auto": ("auto", "lhs_pipelined_offload"),
}

# One variant, in a child process: prints one JSON line.
_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
argv, deviceless, steps = json.loads(sys.argv[1])
from MaxOffload import xla
from MaxOffload.config import load
cfg = load(argv)
xla.apply(cfg)
target, topology = (cfg.aot.target, cfg.aot.topology) if deviceless else (None, None)
from MaxOffload.offload import planner
from MaxOffload import models, from_config
from MaxOffload.train import flops
row = {}
if target:
    from MaxOffload import hardware
    from MaxOffload.memory import compiled_bytes
    from MaxOffload.timeline import engines, simulate
    plan = planner.plan_for(cfg, target, topology, log=lambda *a: None)
    setup = from_config.train_setup(cfg, planner._target_devices(target, topology), plan)
    compiled = setup.compile_train_step()
    hbm, host = compiled_bytes(compiled.memory_analysis())
    predicted = simulate.of_compiled(compiled, setup, engines.Rates.of(hardware.ACCELERATORS[target], topology))[0]
    row.update(mode="deviceless", hbm_gib=hbm / 2**30, host_gib=host / 2**30, measured=False,
               tflops_per_device=predicted["model_tflops_per_device"], step_s=predicted["step_s"],
               exposed_copy_s=predicted["exposed_copy_s"], exposed_collective_s=predicted["exposed_collective_s"],
               xla_preset=plan.xla_preset)
else:
    import jax
    setup = from_config.train_setup(cfg, plan=planner.plan_for(cfg, log=lambda *a: None))
    state = setup.init_state()
    batch = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), setup.abstract_batch())
    step = compiled = setup.compile_train_step()  # with the plan's XLA preset
    state, m = step(state, batch); jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t = time.perf_counter(); state, m = step(state, batch); jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    step_s = sorted(times)[len(times) // 2]
    n = setup.mesh.size
    f = flops.train_flops_per_step(models.model_config(cfg.model), cfg.train.per_device_batch_size * n, cfg.train.seq_len)
    from MaxOffload.memory import compiled_bytes
    hbm, host = compiled_bytes(compiled.memory_analysis())
    stats = jax.devices()[0].memory_stats() or {}
    row.update(mode=jax.devices()[0].platform, step_s=step_s, tflops_per_device=f / n / step_s / 1e12,
               hbm_gib=(stats.get("peak_bytes_in_use") or hbm) / 2**30, host_gib=host / 2**30, measured=True)
row["policy"] = cfg.remat.policy
print("ROW " + json.dumps(row))
"""


def offload_policy(argv):
    """The config's own policy if it offloads anything, else minimal_offloaded."""
    from MaxOffload.config import load

    cfg = load(argv)
    if cfg.remat.policy not in ("auto",):
        from MaxOffload import from_config

        if from_config.static_plan(cfg).offloads_activations:
            return []
    return ["remat.policy=minimal_offloaded"] + [f"remat.tensors.{n}=" for n, v in cfg.remat.tensors.items() if v]


def variant_argv(argv, name):
    policy, preset = VARIANTS[name]
    extra = offload_policy(argv) if policy == "OFFLOAD" else [f"remat.policy={policy}"]
    if policy in ("full", "auto"):
        from MaxOffload.config import load

        cfg = load(argv)
        extra += [f"remat.tensors.{n}=" for n, v in cfg.remat.tensors.items() if v]
        if policy == "full":  # the config's layer groups recompute everything too (auto replaces them itself)
            for g, group in cfg.remat.groups.items():
                extra += [f"remat.groups.{g}.policy=full"] + [f"remat.groups.{g}.tensors.{n}=" for n, v in
                                                               group.tensors.items() if v]
    return argv + extra + [f"xla.preset={preset}"]


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli

    argv, options, _ = cli.parse(argv, __doc__, keys=cli.TARGET_KEYS,
                                 options={"--steps": 5, "--variants": ",".join(VARIANTS)})  # before JAX
    from MaxOffload.config import ConfigError, load
    from MaxOffload.platform import pick_platform

    pick_platform()  # this process only reads configs: no CUDA plugin traceback on a machine without a GPU
    cfg = load(argv)
    output_dir, target = cfg.run.output_dir, cfg.aot.target
    deviceless = any(a.startswith(("aot.target=", "--config.aot.target=")) for a in argv[1:])
    names = options["--variants"].split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ConfigError(f"--variants: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    steps = options["--steps"]
    rows = []
    plans = {name: variant_argv(argv, name) for name in names}
    env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if deviceless else {}))
    for name, child_argv in plans.items():
        print(f"{name}: {' '.join(child_argv[1:])}", flush=True)
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([child_argv, deviceless, steps])],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
        if line is None:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"  failed: {tail}", flush=True)
            rows.append({"variant": name, "error": tail})
            continue
        rows.append({"variant": name, **json.loads(line[4:])})
    base = next((r for r in rows if r["variant"] == "remat" and "error" not in r), None)
    for r in rows:
        if "error" not in r and base:
            r["speedup_vs_remat"] = r["tflops_per_device"] / base["tflops_per_device"]
    os.makedirs(output_dir, exist_ok=True)
    target = target if deviceless else None
    print(format_table(rows, target))
    write_csv(rows, os.path.join(output_dir, "offload_sweep.csv"))
    plot(rows, os.path.join(output_dir, "offload_sweep.png"), target)
    print(f"wrote {output_dir}/offload_sweep.csv and offload_sweep.png")
    return 0 if all("error" not in r for r in rows) else 1


def format_table(rows, target):
    kind = "predicted (the compiled timelines), memory from the deviceless compile" if target else "measured"
    lines = [f"TFLOP/s per device: {kind}",
             f"  {'variant':<24} {'TFLOP/s/dev':>12} {'vs remat':>9} {'step':>10} {'HBM GiB':>9} {'host GiB':>9}"
             + (f" {'exposed copy':>12} {'exposed coll.':>13}  xla.preset" if target else "")]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['variant']:<24} failed: {r['error']}")
            continue
        exposed = (f" {r['exposed_copy_s'] * 1e3:>10.1f}ms {r['exposed_collective_s'] * 1e3:>11.1f}ms  {r['xla_preset']}"
                   if "exposed_copy_s" in r else "")
        lines.append(f"  {r['variant']:<24} {r['tflops_per_device']:>12,.3f} {r.get('speedup_vs_remat', 0):>8.2f}x "
                     f"{r['step_s'] * 1e3:>8.1f}ms {r['hbm_gib']:>9.2f} {r['host_gib']:>9.2f}{exposed}")
    return "\n".join(lines)


FIELDS = ["variant", "policy", "mode", "measured", "step_s", "tflops_per_device", "speedup_vs_remat", "hbm_gib",
          "host_gib", "exposed_copy_s", "exposed_collective_s", "xla_preset", "error"]


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot(rows, path, target):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar([r["variant"] for r in ok], [r["tflops_per_device"] for r in ok], color="tab:blue")
    for bar, r in zip(bars, ok):
        ax.annotate(f"{r.get('speedup_vs_remat', 1):.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    ax.set_ylabel("TFLOP/s per device" + (" (predicted)" if target else ""))
    ax.set_title("offload sweep" + (f" ({target}, deviceless)" if target else ""))
    plt.setp(ax.get_xticklabels(), rotation=15)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
