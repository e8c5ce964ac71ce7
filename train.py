"""Train a model: python train.py CONFIG.py[:ARG] [key=value | --config.key=value ...] [--output_dir DIR]

Examples:
  python train.py configs/quickstart.py
  python train.py configs/llama3_1.py:405b run.dry_run=true
  python train.py configs/quickstart.py train.steps=50 --config.model.num_layers=2

Exit status: 0 done, 1 stopped on a non-finite step or a parity failure, 2 bad input, 42 preempted (saved;
the Slurm launcher requeues).
"""
import os
import sys

from MaxOffload.cli import tool


def print_help():
    from MaxOffload.config.defaults import docs

    print(__doc__)
    print("Keys (default: meaning):")
    for key, default, meaning in docs():
        print(f"  {key} = {default!r}\n      {meaning}")


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload.platform import pick_platform

    pick_platform()
    if argv and argv[0] in ("-h", "--help"):
        print_help()
        return 0
    from MaxOffload import cli
    from MaxOffload.config import load

    argv, _, _ = cli.parse(argv, __doc__)
    cfg = load(argv)
    from MaxOffload import xla

    if not cfg.run.dry_run:  # the preset must mean something on the platform pick_platform chose
        from MaxOffload.platform import chosen_platform

        xla.require_preset_for(cfg.xla.preset, chosen_platform(), f"this machine ({chosen_platform()})")
    flags = xla.apply(cfg)  # before JAX's backend starts
    if os.environ.get("SLURM_PROCID", "0") == "0":
        if flags:
            print(f"xla.extra_flags: XLA_FLAGS += {' '.join(flags)}", flush=True)
        if cfg.xla.preset != "baseline":
            print(f"xla.preset={cfg.xla.preset}: the step compiles with {' '.join(xla.preset_flags(cfg.xla.preset))}",
                  flush=True)
    from MaxOffload.offload.planner import plan_for

    devices = None
    if cfg.run.dry_run and cfg.remat.policy == "auto":
        # a dry run proves the launch: plan for the aot target, confirmed by its deviceless compile
        from MaxOffload import deviceless

        deviceless.require_plugin("remat.policy=auto with run.dry_run=true plans for aot.target", cfg.aot.target)
        print(f"remat.policy=auto: planning for aot.target={cfg.aot.target} aot.topology={cfg.aot.topology} "
              "(dry run: the launch's GPUs, compiled deviceless)", flush=True)
        plan = plan_for(cfg, cfg.aot.target, cfg.aot.topology)
        devices = deviceless.compile_only_devices(cfg.aot.target, cfg.aot.topology, cfg.aot.num_slices)
    else:
        plan = plan_for(cfg)  # the OffloadPlan; remat.policy=auto: planned once per config, cached
    from MaxOffload.train.trainer import run

    return run(cfg, plan, devices)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
