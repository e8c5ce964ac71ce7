"""Predictions for the device check's variants (benchmarks/tpu/variants.py) from the deviceless v5e compile, on a
machine with no accelerator: per variant the aot report (fit, HBM, host bytes, predicted step) under
<out>/<variant>/aot_report.json, one aot process each (as a user runs it).

    python benchmarks/tpu/predict.py OUT_DIR [--target v5e --topology 1x1] [VARIANT ...]
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants  # noqa: E402  (benchmarks/tpu/variants.py, beside this file)


def main(argv):
    out, rest = argv[0], argv[1:]
    target = rest[rest.index("--target") + 1] if "--target" in rest else "v5e"
    topology = rest[rest.index("--topology") + 1] if "--topology" in rest else "1x1"
    names = [a for a in rest if a in variants.VARIANTS] or list(variants.VARIANTS)
    for name in names:
        cmd = [sys.executable, "-m", "MaxOffload.aot", variants.CONFIG, *variants.overrides(name), "--target", target,
               "--topology", topology, "--output_dir", os.path.join(out, name)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("verdict", "predicted", "HBM", "error"))]
        print(f"{name}: rc={done.returncode} " + " | ".join(lines) + (done.stderr.strip().splitlines() or [""])[-1]
              if done.returncode > 1 else f"{name}: rc={done.returncode} " + " | ".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
