"""Proof of placement: what the real training step does with every named activation.

    python -m MaxOffload.offload.inspect CONFIG.py[:ARG] [overrides...] [--no_cpu_memory] [--output_dir DIR]

Traces the same training step as train.py and reads, per scan segment (layer group), what
the backward pass gets for each tagged name: a residual moved to pinned host ("offload"),
a residual kept in device memory ("device"), or a recomputation ("remat"). It then lowers
the step for CUDA on this machine (`jax.export`, platforms=["cuda"]) and checks that the
lowered program holds exactly one pinned_host placement per offloaded tensor. Writes
<run.output_dir>/offload_report.json. Exit status: 0 all as requested, 1 a requested setting
did not take effect, 2 a configuration error.
"""
import os
import sys

from MaxOffload.cli import tool
from MaxOffload.offload.placement import build_report


def _mb(n):
    return f"{n / 2**20:,.2f} MiB"


def format_report(report):
    # offloaded activations live for one micro-batch's forward and backward: per step when it is the whole step
    per = "per device per micro-batch" if report.get("micro_batches", 1) > 1 else "per device per step"
    lines = []
    for label, g in report["groups"].items():
        who = f"remat.groups.{g['remat_group']}" if g["remat_group"] else "remat.policy / remat.tensors"
        lines.append(f"layers {g['layers'][0]}-{g['layers'][1]} ({g['model_group']}; {who}): "
                     f"offloaded {_mb(g['offload_bytes_per_device'])} {per}")
        if g.get("note"):
            lines.append(f"  ({g['note']})")
        lines.append(f"  {'tensor':<20} {'requested':<9} {'result':<8} {'shape per layer':<22} {'dtype':<9} "
                     f"size/device/step")
        for name, t in g["tensors"].items():
            lines.append(f"  {name:<20} {t['requested']:<9} {t['result']:<8} {'x'.join(map(str, t['shape'])):<22} "
                         f"{t['dtype']:<9} {_mb(t['bytes_per_device_per_step'])}")
        lines.append(f"  on host: {', '.join(g['offloaded']) or '-'} | in HBM: {', '.join(g['saved']) or '-'} | "
                     f"recomputed: {', '.join(g['remat']) or '-'} | not needed: {', '.join(g['unused']) or '-'} | "
                     f"missing: {', '.join(g['missing']) or 'none'}")
    lines.append(f"CUDA lowering: {report['cuda_pinned_host_placements']} pinned_host placements; "
                 f"offloaded in total {_mb(report['offload_bytes_per_device'])} {per} "
                 f"(split by the sharding rules over mesh {report['mesh']})")
    lines.append(f"parameters + optimizer state per device: {_mb(report['state_device_bytes_per_device'])} in HBM, "
                 f"{_mb(report['state_host_bytes_per_device'])} in pinned host memory "
                 f"({report['state_host_arrays']} host-resident arrays in the CUDA lowering)")
    if "cpu_temp_bytes" in report:
        lines.append("XLA:CPU compiled temp bytes (a saved or offloaded tensor is kept in memory on CPU): "
                     + " | ".join(f"{k} {_mb(v)}" for k, v in report["cpu_temp_bytes"].items()))
    lines.append("all requested placements confirmed" if not report["problems"] else
                 "PROBLEMS:\n  " + "\n  ".join(report["problems"]))
    return "\n".join(lines)


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli
    from MaxOffload.platform import pick_platform
    from MaxOffload.reports import publish

    argv, _, flags = cli.parse(argv, __doc__, flags=("--no_cpu_memory",))
    pick_platform()
    from MaxOffload import from_config
    from MaxOffload.config import ConfigError, load

    cpu_memory = not flags["--no_cpu_memory"]
    from MaxOffload.offload import planner

    cfg = load(argv)
    if not cfg.model.scan_layers:
        raise ConfigError("inspect reads the scanned layer segments; drop model.scan_layers=false")
    setup = from_config.train_setup(cfg, plan=planner.plan_for(cfg))  # remat.policy=auto: planned for these devices
    try:
        os.makedirs(cfg.run.output_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run.output_dir={cfg.run.output_dir}: {e.strerror}; choose a writable directory") from None
    print(f"lowering the training step of {argv[0]} for CUDA ...", flush=True)
    report = build_report(cfg, setup, cpu_memory=cpu_memory and setup.params_total() < 200_000_000)
    publish(cfg, "offload_report.json", report, format_report(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
