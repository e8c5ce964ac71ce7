"""The simulated step as a Chrome / Perfetto trace (trace), and the files the aot tool writes of it
(write_pictures: timeline.json, and timeline.png from plot.py)."""
import json
import os

from MaxOffload.timeline import plot, summary
from MaxOffload.timeline.engines import ENGINES

TRACE_EVENTS = 1_000_000  # the most events timeline.json holds


def trace(sim, limit=TRACE_EVENTS):
    """The timeline as a Chrome / Perfetto trace (`traceEvents`): one track per engine, an event per kernel,
    transfer and collective, named after its HLO instruction, with its component, segment, FLOPs and bytes; the
    first `limit` of them in time (a trace viewer takes no more; the process's name says how many are left out).
    With pipeline stages, a `pipeline (stage 0)` track: each iteration of the stages' loops as stage 0 runs it, a
    micro-batch and repeat, or the bubble."""
    tids = {engine: i for i, engine in enumerate(ENGINES)}
    shown = sorted(sim.events, key=lambda e: e.start)[:limit]
    cut = f", its first {len(shown):,} of {len(sim.events):,} events" if len(shown) < len(sim.events) else ""
    events = [{"ph": "M", "pid": 0, "name": "process_name",
               "args": {"name": f"predicted step ({sim.rates.name}){cut}"}}]
    events += [{"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": engine}}
               for engine, tid in tids.items()]
    for e in shown:
        args = {"op_name": e.op_name, "component": e.component, "segment": e.segment}
        if e.flops:
            args["flops"] = e.flops
        if e.bytes:
            args["bytes"] = e.bytes
        if e.stall:
            args["exposed_us"] = e.stall * 1e6
        events.append({"ph": "X", "pid": 0, "tid": tids[e.engine], "name": e.name, "cat": e.component,
                       "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": args})
    schedule = getattr(sim, "pipeline", None)
    if schedule is not None:
        tid = len(tids)
        events.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": "pipeline (stage 0)"}})
        for label, direction, t, start, end in summary.pipeline_iterations(sim):
            work = schedule.work(t)
            name = "bubble" if work is None else f"micro-batch {work[0]} repeat {work[1]}"
            events.append({"ph": "X", "pid": 0, "tid": tid, "name": f"{name} ({direction})", "cat": "pipeline",
                           "ts": start * 1e6, "dur": (end - start) * 1e6, "args": {"loop": label, "iteration": t}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_pictures(sim, directory):
    """Writes DIRECTORY/timeline.json (the trace) and timeline.png (one layer's window, when matplotlib is
    installed); returns a line saying what was written."""
    path = os.path.join(directory, "timeline.json")
    with open(path, "w") as f:
        json.dump(trace(sim), f)
    try:
        plot.plot_window(sim, os.path.join(directory, "timeline.png"))
    except ImportError:
        return f"wrote {path} (open it in ui.perfetto.dev or chrome://tracing); no timeline.png: pip install matplotlib"
    return f"wrote {path} (open it in ui.perfetto.dev or chrome://tracing) and {directory}/timeline.png"
