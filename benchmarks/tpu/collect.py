"""Gathers the device check's runs into one JSON: per run its summary.json (step time, MFU, memory, losses) and the
lines of its log that say where it ran and what it compiled.

    python benchmarks/tpu/collect.py RUNS_DIR OUT.json
"""
import json
import os
import sys


def main(runs, out):
    results = {}
    for name in sorted(os.listdir(runs)):
        path = os.path.join(runs, name)
        if not os.path.isdir(path):
            continue
        entry = {}
        summary = os.path.join(path, "summary.json")
        if os.path.exists(summary):
            with open(summary) as f:
                entry["summary"] = json.load(f)
        log = os.path.join(runs, f"{name}.log")
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                lines = f.read().splitlines()
            entry["log"] = [ln for ln in lines if ln.startswith(("model ", "compiled", "done", "remat.policy=auto",
                                                                 "planner:", "xla"))][:40]
            entry["tail"] = lines[-5:]
        results[name] = entry
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}: {len(results)} runs")


def cli_main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    if len(argv) != 2 or argv[0].startswith("-") or not os.path.isdir(argv[0]):
        print(f"error: give RUNS_DIR (a directory) and OUT.json, got {' '.join(argv) or 'nothing'}", file=sys.stderr)
        return 2
    main(*argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
