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
    from MaxOffload.config import load
    from MaxOffload.deviceless import compile_only_devices, require_plugin

    counts = [cli.whole_number("--tokens", t) for t in options["--tokens"].split(",")]
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


def cpu_table(title, seconds, base):
    """Markdown lines: each implementation's CPU time and its ratio to `base`'s, measured side by side."""
    return (["", title, "", f"| implementation | ms | vs {base} |", "|---|---|---|"]
            + [f"| {impl} | {t * 1e3:.2f} | {t / seconds[base]:.2f}x |" for impl, t in seconds.items()])


def write(out, name, lines, record):
    """Prints `lines`, writes them to OUT/NAME.md and `record` to OUT/NAME.json; returns the .md path."""
    import json
    import os

    print("\n".join(lines))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    return os.path.join(out, f"{name}.md")
