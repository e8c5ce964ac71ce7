"""Runs device-check variants (benchmarks/tpu/variants.py) one after another in this one process, so the TPU runtime
starts once (a train.py process per variant spends ~60 s of its ~80 s on the v5e starting and stopping it):

    python benchmarks/tpu/run_variants.py RUNS_DIR NAME [NAME ...] [--budget_s 540] [--tag @TAG] [-- OVERRIDE ...]

Each variant is `python train.py <its arguments> run.output_dir=RUNS_DIR/NAME [OVERRIDE ...]` called in-process
(train.main), its output in RUNS_DIR/NAME.log (NAME@TAG with --tag: the same variant under other libtpu flags,
device_check.sh's LIBTPU_SETS) and one line here (its exit status and train.py's `done:` line).
XLA flags are read once per process, when JAX's backend starts: variants must share their `xla.preset` (a variant
whose preset differs from the first's is refused; device_check.sh runs such a one in a process of its own). A
variant is skipped, not cut, once --budget_s seconds have passed since this process started. Exit status 0 when
every variant that ran exited 0.
"""
import contextlib
import gc
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def preset_of(arguments):
    return next((a.split("=", 1)[1] for a in arguments if a.startswith("xla.preset=")), "baseline")


def run_one(name, arguments, runs):
    """train.main(arguments) with its output in runs/NAME.log: (exit status, its `done:` line or '')."""
    import train

    log = os.path.join(runs, f"{name}.log")
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            code = train.main(arguments)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - a variant's crash is its own line; the next variant still runs
            traceback.print_exc()
            code = 1
    with open(log, errors="replace") as f:
        done = next((ln.strip() for ln in f if ln.startswith("done")), "")
    return code, done


def _option(argv, flag, default):
    """(the value after `flag` in argv, or `default`; argv without the two)."""
    if flag not in argv:
        return default, argv
    at = argv.index(flag)
    return argv[at + 1], argv[:at] + argv[at + 2:]


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    from benchmarks.tpu import variants

    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    budget, argv = _option(argv, "--budget_s", "540")
    budget = float(budget)
    tag, argv = _option(argv, "--tag", "")
    runs, names = argv[0], argv[1:]
    unknown = [n for n in names if n not in variants.VARIANTS]
    if unknown or not names:
        print(f"error: give RUNS_DIR and variants of benchmarks/tpu/variants.py (one of {', '.join(variants.VARIANTS)})"
              f"{f'; unknown: {unknown[0]}' if unknown else ''}", file=sys.stderr)
        return 2
    presets = {preset_of(variants.arguments(n) + extra) for n in names}
    if len(presets) > 1:
        print(f"error: these variants need different xla.preset values ({', '.join(sorted(presets))}); XLA reads its "
              "flags once per process: run each preset's variants in a process of their own", file=sys.stderr)
        return 2
    os.makedirs(runs, exist_ok=True)
    started, failed = time.perf_counter(), 0
    for name in names:
        elapsed = time.perf_counter() - started
        if elapsed > budget:
            print(f"{name} skipped: {elapsed:.0f} s gone", flush=True)
            continue
        arguments = [*variants.arguments(name), f"run.output_dir={os.path.join(runs, name + tag)}", *extra]
        code, done = run_one(name + tag, arguments, runs)
        failed += code != 0
        print(f"{name}{tag} rc={code} at {time.perf_counter() - started:.0f} s: {done[:160]}", flush=True)
        import jax

        jax.clear_caches()  # the last variant's executables and arrays go before the next one compiles
        gc.collect()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
