"""What the kernel benchmarks share: their start (options, config, compile-only devices) and side-by-side
timing (one process, one warm-up, the median of a few runs)."""
import statistics
import time


def start(argv, doc, config, tokens):
    """(cfg, [token counts], compile-only devices of aot.target, 1x1x1) for a deviceless benchmark's main:
    `--target`/`--topology`/`--output_dir` and `--tokens N,M` (default `tokens`) on top of `config`."""
    from MaxOffload import cli

    argv, options, _ = cli.parse(argv, doc, keys=cli.TARGET_KEYS, options={"--tokens": tokens})
    from MaxOffload.platform import use_cpu_runtime

    use_cpu_runtime()
    from MaxOffload.config import ConfigError, load
    from MaxOffload.deviceless import compile_only_devices, require_plugin

    try:
        counts = [int(t) for t in options["--tokens"].split(",")]
    except ValueError:
        raise ConfigError(f"--tokens takes comma-separated integers, got {options['--tokens']!r}") from None
    cfg = load([config, *argv])
    require_plugin()
    return cfg, counts, compile_only_devices(cfg.aot.target, "1x1x1")


def median_seconds(fn, *args, repeats=5):
    """Median wall time of fn(*args) (a jitted function: its result waited for) after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
