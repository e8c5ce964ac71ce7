"""CPU MFU: the quickstart training step's model FLOP/s over this machine's matmul peak, measured
side by side in one run (rounds alternate between the two, medians reported).

    python benchmarks/cpu_efficiency.py [CONFIG.py] [overrides...] [--rounds N] [--steps_per_round N]
                                        [--matmul_size N]

CONFIG defaults to configs/quickstart.py; --matmul_size is at most MAX_MATMUL (three N x N matrices in memory).
"""
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)

MAX_MATMUL = 16384


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli

    argv, options, _ = cli.parse(argv, __doc__, keys=(), options={"--rounds": 5, "--steps_per_round": 5,
                                                                 "--matmul_size": 2048})
    args = types.SimpleNamespace(**{name[2:]: value for name, value in options.items()})
    if args.matmul_size > MAX_MATMUL:
        raise cli.ConfigError(f"--matmul_size {args.matmul_size} is above {MAX_MATMUL} (three N x N matrices in "
                              "memory); give a smaller size")
    from MaxOffload.platform import pick_platform

    pick_platform()
    from MaxOffload.config import load

    cfg = load(argv if argv and "=" not in argv[0] else ["configs/quickstart.py", *argv])

    import jax
    import jax.numpy as jnp

    from MaxOffload import data as data_lib
    from MaxOffload.train.flops import train_flops_per_step
    from MaxOffload import from_config

    devices = jax.devices()
    setup = from_config.train_setup(cfg, devices)
    data = data_lib.build(cfg)
    global_batch = cfg.train.per_device_batch_size * len(devices)
    flops_per_step = train_flops_per_step(setup.model_config, global_batch, cfg.train.seq_len)
    batch = setup.put_batch(data.train_batch(0))
    step = setup.compile_train_step()
    state = setup.init_state()

    n, dtype = args.matmul_size, jnp.dtype(cfg.model.compute_dtype)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
    reps = max(1, int(2e10 // (2 * n ** 3)))  # ~20 GFLOP per timing

    def time_steps():
        nonlocal state
        state, metrics = step(state, batch)  # not timed: settles the pipeline
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(args.steps_per_round):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        return flops_per_step / len(devices) * args.steps_per_round / (time.perf_counter() - start)

    def time_matmul():
        jax.block_until_ready(matmul(a, b))
        start = time.perf_counter()
        out = [matmul(a, b) for _ in range(reps)]
        jax.block_until_ready(out)
        return 2 * n ** 3 * reps / len(devices) / (time.perf_counter() - start)

    step_rates, peak_rates = [], []
    print(f"{cfg.model.family} {setup.params_total() / 1e6:.2f}M params, batch {global_batch} x {cfg.train.seq_len}, "
          f"{dtype.name} compute, remat {cfg.remat.policy}; matmul {n}x{n} {dtype.name}; {len(devices)} device(s)")
    for r in range(args.rounds):
        peak_rates.append(time_matmul())
        step_rates.append(time_steps())
        print(f"round {r + 1}/{args.rounds}: step {step_rates[-1] / 1e9:7.2f} GFLOP/s/dev | "
              f"matmul {peak_rates[-1] / 1e9:7.2f} GFLOP/s/dev | ratio {step_rates[-1] / peak_rates[-1]:.1%}", flush=True)
    achieved, peak = statistics.median(step_rates), statistics.median(peak_rates)
    ratio = statistics.median(s / p for s, p in zip(step_rates, peak_rates))  # per round: same noise on both
    print(f"median: training step {achieved / 1e9:.2f} GFLOP/s/dev (model FLOPs) | matmul peak "
          f"{peak / 1e9:.2f} GFLOP/s/dev | CPU MFU {ratio:.1%} (median of per-round ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
