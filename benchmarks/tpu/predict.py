"""Predictions for the device check's variants (benchmarks/tpu/variants.py) from the deviceless v5e compile, on a
machine with no accelerator: per variant the aot report (fit, HBM, host bytes, predicted step) under
<out>/<variant>/aot_report.json, one aot process each (as a user runs it).

    python benchmarks/tpu/predict.py OUT_DIR [--target v5e --topology 1x1] [VARIANT ...]
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
VARIANTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants.py")  # asked as device_check.sh asks


def variants(*args):
    return subprocess.run([sys.executable, VARIANTS, *args], capture_output=True, text=True,
                          check=True).stdout.split()


def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload.cli import run

    return run(_main, argv)


def _main(argv):
    from MaxOffload import cli
    from MaxOffload.errors import ConfigError

    rest, options, _ = cli.parse(argv, __doc__, keys=(), options={"--target": "v5e", "--topology": "1x1"})
    if not rest:
        raise ConfigError("give OUT_DIR (and variants to run, default all); see --help")
    out, rest = rest[0], rest[1:]
    known = variants("names")
    unknown = [a for a in rest if a not in known]
    if unknown:
        raise ConfigError(f"unknown variant {unknown[0]!r}: one of {', '.join(known)}")
    target, topology = options["--target"], options["--topology"]
    names = rest or known
    for name in names:
        cmd = [sys.executable, "-m", "MaxOffload.aot", *variants("args", name), "--target", target,
               "--topology", topology, "--output_dir", os.path.join(out, name)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("verdict", "predicted", "HBM", "error"))]
        print(f"{name}: rc={done.returncode} " + " | ".join(lines) + (done.stderr.strip().splitlines() or [""])[-1]
              if done.returncode > 1 else f"{name}: rc={done.returncode} " + " | ".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
