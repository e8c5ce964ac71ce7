"""How much of the offload copies hide under compute, per step of a captured trace.

    python -m MaxOffload.profile.overlap TRACE_DIR [--json] [--device NAME]

TRACE_DIR: a run's profile directory (<run.output_dir>/profile, written by profile.mode=xprof) or any
jax.profiler trace directory. Prints per step: compute time, device->host and host->device copy time
and bytes, the fraction of copy time hidden under compute, collectives and their overlap, the exposed
(un-hidden) time and the largest exposed copies; then a one-paragraph verdict. --json prints the same
as JSON. Exit status: 0 a report, 2 no trace there, an empty or damaged one, or a bad argument (one line).
"""
import json
import sys

from MaxOffload.cli import tool
from MaxOffload.errors import ConfigError
from MaxOffload.profile import intervals


def report(trace_dir, device=None):
    """{"module", "device", "markers", "steps": [analysis per step], "mean": analysis averaged over steps}."""
    from MaxOffload.profile import trace  # JAX's trace reader: after the arguments are checked

    found = trace.read_steps(trace_dir, device)
    steps = [intervals.analyse(events) for events in found["steps"]]
    result = {"trace_dir": trace_dir, "module": found["module"], "device": found["device"],
              "markers": found["markers"], "steps": steps, "window_steps": len(steps), "mean": mean(steps)}
    if len(steps) == 1 and len(found["markers"]) > 1:
        # the device events carry no per-execution id (seen on an H200): one window of several steps
        result["window_steps"] = len(found["markers"])
        result["mean"] = per_step(steps[0], len(found["markers"]))
    return result


def per_step(window, n):
    """The analysis of a window of n steps as per-step figures: times and bytes / n, fractions kept."""
    out = {key: window[key] / n for key in ("span_s", "compute_s", "exposed_s")}
    for kind in ("d2h", "h2d", "collective", "copy"):
        out[kind] = {key: (value / n if key in ("time_s", "hidden_s", "exposed_s", "bytes", "count") else value)
                     for key, value in window[kind].items()}
    out["largest_exposed"] = [{**e, "exposed_s": e["exposed_s"] / n} for e in window["largest_exposed"]]
    return out


def mean(steps):
    """Average of step analyses (numbers averaged, fractions recomputed, exposed copies pooled)."""
    if not steps:
        return None

    def avg(values):
        return sum(values) / len(steps)

    out = {"span_s": avg(s["span_s"] for s in steps), "compute_s": avg(s["compute_s"] for s in steps),
           "exposed_s": avg(s["exposed_s"] for s in steps)}
    for kind in ("d2h", "h2d", "collective", "copy"):
        part = {key: avg(s[kind][key] for s in steps) for key in ("time_s", "hidden_s", "exposed_s", "bytes")}
        part["hidden_fraction"] = part["hidden_s"] / part["time_s"] if part["time_s"] else None
        out[kind] = part
    pooled = {}
    for s in steps:
        for item in s["largest_exposed"]:
            key = (item["name"], item["kind"])
            pooled[key] = pooled.get(key, 0.0) + item["exposed_s"] / len(steps)
    out["largest_exposed"] = [{"name": n, "kind": k, "exposed_s": v}
                              for (n, k), v in sorted(pooled.items(), key=lambda kv: -kv[1])[:5]]
    return out


def _ms(seconds):
    return f"{seconds * 1e3:.2f} ms"


def _gb(n):
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def _pct(fraction):
    return "-" if fraction is None else f"{fraction * 100:.0f}%"


def verdict(result):
    """One paragraph: how much of the offload copies (and collectives) hide, and what is exposed."""
    m = result["mean"]
    if m is None:
        return (f"overlap: no device ops of an XLA program found in {result['trace_dir']} (was the window empty, "
                "or the trace taken on a backend this reader does not know?)")
    steps = f"{result.get('window_steps', len(result['steps']))} step(s) of {result['module']} on {result['device']}"
    copy, coll = m["copy"], m["collective"]
    if copy["time_s"] == 0:
        text = (f"overlap ({steps}): no host<->device copies in the trace (on CPU offloaded tensors are simply kept; "
                f"copies show on a GPU); compute {_ms(m['compute_s'])}/step of {_ms(m['span_s'])}")
    else:
        text = (f"overlap ({steps}): {_pct(copy['hidden_fraction'])} of {_gb(copy['bytes'])}/step of offload "
                f"copies hidden (d2h {_ms(m['d2h']['time_s'])}, h2d {_ms(m['h2d']['time_s'])} per step); "
                f"exposed {_ms(m['exposed_s'])}/step")
        if m["largest_exposed"]:
            text += ", mostly " + ", ".join(f"{e['name']} ({e['kind']}, {_ms(e['exposed_s'])})"
                                             for e in m["largest_exposed"][:2])
    if coll["time_s"]:
        text += f"; collectives {_ms(coll['time_s'])}/step, {_pct(coll['hidden_fraction'])} under compute"
    return text + "."


def format_table(result):
    rows = [f"{'step':>4} {'span':>10} {'compute':>10} {'d2h':>10} {'d2h bytes':>10} {'h2d':>10} {'h2d bytes':>10} "
            f"{'copy hid':>8} {'coll':>10} {'coll hid':>8} {'exposed':>10}"]
    labels = result["markers"] if len(result["markers"]) == len(result["steps"]) else \
        range(1, len(result["steps"]) + 1)
    for label, s in zip(labels, result["steps"]):
        rows.append(f"{label:>4} {_ms(s['span_s']):>10} {_ms(s['compute_s']):>10} {_ms(s['d2h']['time_s']):>10} "
                    f"{_gb(s['d2h']['bytes']):>10} {_ms(s['h2d']['time_s']):>10} {_gb(s['h2d']['bytes']):>10} "
                    f"{_pct(s['copy']['hidden_fraction']):>8} {_ms(s['collective']['time_s']):>10} "
                    f"{_pct(s['collective']['hidden_fraction']):>8} {_ms(s['exposed_s']):>10}")
    if result["mean"] and result["mean"]["largest_exposed"]:
        rows.append("largest exposed copies (per step): " + "; ".join(
            f"{e['name']} {e['kind']} {_ms(e['exposed_s'])}" for e in result["mean"]["largest_exposed"]))
    return "\n".join(rows)


@tool
def main(argv):
    """Exit status; a mistake, or a trace with nothing to report, prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli

    rest, options, flags = cli.parse(argv, __doc__, keys=(), options={"--device": None}, flags=("--json",))
    if len(rest) != 1:
        raise ConfigError(f"give one trace directory, got {len(rest)} arguments: python -m "
                          "MaxOffload.profile.overlap TRACE_DIR [--json] [--device NAME] (see --help)")
    result = report(rest[0], options["--device"])
    if result["mean"] is None:  # an empty trace: no device ops of an XLA program
        raise ConfigError(verdict(result).removeprefix("overlap: "))
    if flags["--json"]:
        print(json.dumps({**result, "verdict": verdict(result)}, indent=1))
    else:
        print(format_table(result))
        print(verdict(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
