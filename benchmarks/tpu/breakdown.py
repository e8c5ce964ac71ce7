"""Where a TPU step's device time goes, from an xprof trace (profile.mode=xprof; device_check.sh's profile stage):

    python benchmarks/tpu/breakdown.py PROFILE_DIR [--top 20]

Reads the `XLA Ops` line of the device's trace (*.trace.json.gz), leaves out the while loops that contain other ops,
and sums each op's device time by its JAX name scope, forward (FWD:) and backward (BWD:) apart, per step (the trace's
`XLA Modules` executions). For each of the largest: ms a step, share of the step, and, where XLA reports the op's
FLOPs, the TFLOP/s it ran at."""
import collections
import glob
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from MaxOffload.cli import ArgumentParser, tool  # noqa: E402  (after the path, like a tool run from a checkout)
from MaxOffload.errors import ConfigError  # noqa: E402


def load(profile_dir):
    files = glob.glob(os.path.join(profile_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise ConfigError(f"no *.trace.json.gz under {profile_dir}: give a run's profile directory (profile.mode=xprof)")
    events = json.load(gzip.open(sorted(files)[-1]))["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    return [e for e in events if e.get("ph") == "X"], names


def scope(op):
    name = op.replace("jit(train_step)/", "")
    name = re.sub(r"transpose\(jvp\(([\w.]+)\)\)", r"BWD:\1", name)
    return re.sub(r"jvp\(([\w.]+)\)", r"FWD:\1", name).rsplit("/", 1)[0] or "(unnamed)"


def breakdown(profile_dir):
    """(ms a step, [(scope, ms a step, TFLOP/s or None)], largest first)."""
    events, names = load(profile_dir)
    line = lambda e: names.get((e["pid"], e["tid"]))  # noqa: E731
    steps = [e for e in events if line(e) == "XLA Modules" and "train_step" in e["name"]]
    if not steps:
        raise ConfigError(f"no train_step executions in the trace under {profile_dir}: profile a training run")
    time, flops = collections.Counter(), collections.Counter()
    for e in events:
        if line(e) == "XLA Ops" and not e["name"].startswith("while"):
            key = scope(e.get("args", {}).get("tf_op", "") or e["name"])
            time[key] += e["dur"]
            flops[key] += float(e.get("args", {}).get("model_flops", 0) or 0)
    n = len(steps)
    rows = [(k, t / n / 1e3, flops[k] / t / 1e6 if flops[k] else None) for k, t in time.most_common()]
    return sum(e["dur"] for e in steps) / n / 1e3, rows


@tool
def main(argv):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile_dir")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    step, rows = breakdown(args.profile_dir)
    print(f"step {step:.1f} ms (device time of the train_step executions, mean)")
    for key, ms, rate in rows[:args.top]:
        print(f"{ms:8.2f} ms {100 * ms / step:5.1f}%  {f'{rate:6.1f} TFLOP/s' if rate else ' ' * 13}  {key[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
