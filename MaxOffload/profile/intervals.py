"""Interval arithmetic on a device timeline: how much copy and collective time hides under compute.

Pure functions on plain events, independent of any trace format (MaxOffload/profile/trace.py reads
XPlane files into these events). Times are in nanoseconds.

An event belongs to one line (a GPU stream, a CPU thread). Events on one line may nest (a while-loop
thunk around its body): a parent only owns the time its children do not cover, so a copy nested in a
loop is not "hidden" by its own loop. Across lines, overlap is concurrency.
"""
import collections
import dataclasses

COMPUTE, D2H, H2D, COLLECTIVE, OTHER = "compute", "d2h", "h2d", "collective", "other"
COPIES = (D2H, H2D)


@dataclasses.dataclass(frozen=True)
class Event:
    line: str
    start: float
    end: float
    kind: str
    name: str = ""
    bytes: int = 0


def union(intervals):
    """Sorted, disjoint, merged copy of [(start, end)]; empty intervals dropped."""
    merged = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def measure(intervals):
    return sum(end - start for start, end in union(intervals))


def intersect(a, b):
    """Intersection of two interval sets (any order, may overlap)."""
    a, b, out, i, j = union(a), union(b), [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b):
    """a minus b."""
    out = []
    b = union(b)
    for start, end in union(a):
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def own_time(events):
    """[(event, intervals it owns)]: on each line, an event minus the events nested inside it."""
    owned = []
    by_line = collections.defaultdict(list)
    for event in events:
        by_line[event.line].append(event)
    for line_events in by_line.values():
        line_events.sort(key=lambda e: (e.start, -e.end))
        stack, children = [], collections.defaultdict(list)
        for event in line_events:
            while stack and stack[-1].end <= event.start:
                stack.pop()
            if stack and event.end <= stack[-1].end:  # nested in the innermost open event
                children[id(stack[-1])].append((event.start, event.end))
            stack.append(event)
        owned += [(e, subtract([(e.start, e.end)], children[id(e)])) for e in line_events]
    return owned


def analyse(events, top=5):
    """Overlap figures of one step (or window) of device events.

    compute_s: time the device computes (union over lines); copy time per direction: time a copy of that
    direction runs (union), its bytes, how much of it runs under compute (hidden) and outside (exposed);
    the same for collectives; exposed_s: time copies or collectives run while nothing computes;
    largest_exposed: the copies with the most exposed time, by name."""
    owned = own_time(events)
    kind_time = collections.defaultdict(list)
    for event, intervals in owned:
        kind_time[event.kind] += intervals
    compute = union(kind_time[COMPUTE])
    report = {"span_s": (max(e.end for e in events) - min(e.start for e in events)) * 1e-9 if events else 0.0,
              "compute_s": measure(compute) * 1e-9}
    for kind in (D2H, H2D, COLLECTIVE):
        busy = union(kind_time[kind])
        hidden = measure(intersect(busy, compute))
        total = measure(busy)
        report[kind] = {"time_s": total * 1e-9, "hidden_s": hidden * 1e-9, "exposed_s": (total - hidden) * 1e-9,
                        "hidden_fraction": hidden / total if total else None, "count": 0,
                        "bytes": 0}
    for event in events:
        if event.kind in report and isinstance(report[event.kind], dict):
            report[event.kind]["count"] += 1
            report[event.kind]["bytes"] += event.bytes
    copies = union(kind_time[D2H] + kind_time[H2D])
    hidden = measure(intersect(copies, compute))
    report["copy"] = {"time_s": measure(copies) * 1e-9, "hidden_s": hidden * 1e-9,
                      "exposed_s": (measure(copies) - hidden) * 1e-9,
                      "hidden_fraction": hidden / measure(copies) if copies else None,
                      "bytes": report[D2H]["bytes"] + report[H2D]["bytes"]}
    report["exposed_s"] = measure(subtract(copies + union(kind_time[COLLECTIVE]), compute)) * 1e-9
    exposed_by_name = collections.Counter()
    for event, intervals in owned:
        if event.kind in COPIES:
            exposed_by_name[(event.name, event.kind)] += measure(subtract(intervals, compute)) * 1e-9
    report["largest_exposed"] = [{"name": name, "kind": kind, "exposed_s": seconds}
                                 for (name, kind), seconds in exposed_by_name.most_common(top) if seconds > 0]
    return report
