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


def bar_pair(path, labels, panels, title):
    """A chart of two bar panels over the same `labels`, written to `path`: `panels` is two (values, y label,
    color, options) tuples, options {"log": True, "ylim": (lo, hi), "line": y of a dashed reference line}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (values, label, color, options) in zip(axes, panels):
        ax.bar(labels, values, color=color)
        ax.set_ylabel(label)
        if options.get("log"):
            ax.set_yscale("log")
        if "ylim" in options:
            ax.set_ylim(*options["ylim"])
        if "line" in options:
            ax.axhline(options["line"], color="gray", linestyle="--", linewidth=1)
        ax.tick_params(axis="x", labelsize=7, labelrotation=options.get("rotation", 0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
