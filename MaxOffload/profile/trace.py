"""Reads a jax.profiler trace (XPlane, `<dir>/plugins/profile/<run>/<host>.xplane.pb`) into timeline events.

Device work is found where each backend puts it:
  GPU: planes `/device:GPU:N`, lines `Stream #N(...)` (kernels, memcpys carrying their bytes in stats);
  CPU: the host plane's runtime threads, events carrying an `hlo_op` stat (one per XLA op / thunk),
       tagged with `device_ordinal` and `run_id` (one id per execution of a program);
  TPU: planes `/device:TPU:N`, lines `XLA Ops` (each op, named by its HLO instruction text) and `Async XLA Ops`
       (an async op from its start to its done: host offload is a dynamic-update-slice into / dynamic-slice
       out of a buffer in host memory, S(5), or a copy-start between the two; collectives), executions told
       apart by the `XLA Modules` line's events (name and run_id), which span their ops (tpu_event).
Only the program with the most device time in the window (the training step) is kept, one device.
"""
import collections
import glob
import os
import re

from MaxOffload.errors import ConfigError
from MaxOffload.offload.names import VOCABULARY
from MaxOffload.profile.intervals import COLLECTIVE, COMPUTE, D2H, H2D, OTHER, Event

_COLLECTIVE = re.compile(r"all[-_]?gather|reduce[-_]?scatter|all[-_]?reduce|all[-_]?to[-_]?all|"
                         r"collective[-_]?permute|nccl|send|recv", re.I)
_D2H = re.compile(r"d2h|dtoh|device.?to.?host|memcpyd2h", re.I)
_H2D = re.compile(r"h2d|htod|host.?to.?device|memcpyh2d", re.I)
_BYTES = re.compile(r"(?:size|num_bytes|bytes)[:=]\s*(\d+)")
_TENSOR = re.compile("|".join(sorted(VOCABULARY, key=len, reverse=True)))


def find_xplanes(trace_dir):
    """The .xplane.pb files of the newest capture under trace_dir (a run dir, or a parent of plugins/)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return []
    newest = max(os.path.dirname(f) for f in files)  # run dirs are named by timestamp
    return sorted(f for f in files if os.path.dirname(f) == newest)


def classify(name, op="", details=""):
    """compute | d2h | h2d | collective | other, from one event alone: its name (a kernel or a CUPTI
    memcpy such as MemcpyD2H), its HLO op (e.g. copy-start.3; a command_buffer_N for everything XLA
    launched as one CUDA graph) and its memcpy details ("kind_src:device kind_dst:pinned ...").

    Never from the stream's line name: XPlane names a stream after every kind of work it carried
    ("Stream #13(Compute,MemcpyD2H)"), so one D2H copy on a stream would make all its kernels copies
    (seen on an H200 with command buffers)."""
    text = f"{name} {details}"
    if "memcpy" in text.lower() or "copy-start" in op or "copy-done" in op or "copy-start" in name:
        source, _, dest = _memory_kinds(details)
        if _D2H.search(name) or (source == "device" and dest in ("pinned", "host", "pageable")):
            return D2H
        if _H2D.search(name) or (dest == "device" and source in ("pinned", "host", "pageable")):
            return H2D
        return OTHER if "memcpy" in text.lower() else COMPUTE
    if _COLLECTIVE.search(name) or _COLLECTIVE.search(op):
        return COLLECTIVE
    return COMPUTE


def _memory_kinds(details):
    """(source, "->", destination) memory kinds from a memcpy_details stat, lower case ('' if absent)."""
    found = dict(re.findall(r"kind_(src|dst)[:=]\s*(\w+)", details or "", re.I))
    return found.get("src", "").lower(), "->", found.get("dst", "").lower()


def _bytes(stats):
    for key, value in stats.items():
        if key in ("bytes", "num_bytes", "bytes_transferred", "memcpy_bytes") and isinstance(value, (int, float)):
            return int(value)
        if isinstance(value, str) and ("memcpy" in key or "details" in key):
            match = _BYTES.search(value)
            if match:
                return int(match.group(1))
    return 0


def _label(name, stats):
    """The HLO op name, with the offloaded tensor's name when any stat mentions one."""
    op = stats.get("hlo_op") or name
    for value in stats.values():
        match = isinstance(value, str) and _TENSOR.search(value)
        if match:
            return f"{match.group(0)} ({op})"
    return str(op)


_TPU_LINES = ("XLA Ops", "Async XLA Ops")
_ASYNC = re.compile(r"-(start|done)(\.\d+)?$")


def tpu_event(line, text):
    """(kind, bytes) of an op on a TPU plane's `line` ('XLA Ops' | 'Async XLA Ops'), from its HLO instruction
    `text` ("%name = shape op(operands), attributes": the event's name there). On the async line: a
    dynamic-update-slice into host memory (S(5)) is device -> host, its update's bytes; a dynamic-slice or slice
    out of it host -> device, the slice's bytes; a copy-start by where its destination (the first array of its
    result) and source lie; collectives; other async ops (slices and copies within the chip's memories) 'other'. On
    the ops line an async op's start / done marks its issue (its transfer is on the async line): 'other', as are
    buffer allocations; the rest is compute, or a collective."""
    from MaxOffload import hlo

    name, _, rest = text.partition(" = ")
    name = name.strip().lstrip("%")
    op = re.search(r"\s([\w\-]+)\(", " " + rest)
    op = op.group(1) if op else ""
    if line == "XLA Ops":
        if _ASYNC.search(name) or "AllocateBuffer" in rest:
            return OTHER, 0
        return (COLLECTIVE, 0) if _COLLECTIVE.search(op) else (COMPUTE, 0)
    arrays = [a for a in hlo.arrays(rest.split(f" {op}(")[0] if op else rest) if a.dims]  # the result's arrays
    if any(a.host for a in arrays) or hlo.HOST_MEMORY_SPACE in rest:
        device = [a for a in arrays if not a.host]
        moved = max((a.bytes for a in device), default=0)  # the update (into host) or the slice (out of it)
        if name.startswith("copy-start") and arrays:
            return (D2H if arrays[0].host else H2D), arrays[0].bytes
        if "update-slice" in name:
            return D2H, moved
        if "slice" in name:
            return H2D, moved
    if _COLLECTIVE.search(name):
        return COLLECTIVE, 0
    return OTHER, 0


def _tpu_events(plane):
    """(step key, module, Event) of a TPU plane's ops, each in the execution (`XLA Modules` event) that holds it."""
    lines = {line.name: list(line.events) for line in plane.lines}
    runs = sorted((float(e.start_ns), float(e.start_ns) + float(e.duration_ns), e.name,
                   dict(e.stats).get("run_id")) for e in lines.get("XLA Modules", []))
    for line_name in _TPU_LINES:
        for event in lines.get(line_name, []):
            start = float(event.start_ns)
            run = next((r for r in runs if r[0] <= start <= r[1]), None)
            if run is None:
                continue  # outside every execution of a program
            kind, moved = tpu_event(line_name, event.name)
            yield run[3], run[2].split("(")[0], Event(
                line=f"{plane.name}/{line_name}", start=start, end=start + float(event.duration_ns), kind=kind,
                name=event.name.split(" = ")[0].lstrip("%"), bytes=moved)


def _planes(path):
    """The planes of one .xplane.pb; ConfigError (one line) when it is not a readable trace."""
    from jax.profiler import ProfileData

    try:
        return list(ProfileData.from_file(path).planes)
    except Exception as e:  # noqa: BLE001 - the reader's C++ errors come as several kinds
        raise ConfigError(f"{path} is not a readable XPlane trace ({type(e).__name__}: {str(e)[:120]}); it may be "
                          "truncated: capture it again (profile.mode=xprof)") from None


def _raw_events(xplane_files):
    """(device, step key, module, Event) for every device event; step key: run_id / group_id or None."""
    for path in xplane_files:
        host = os.path.basename(path).split(".xplane.pb")[0]
        for plane in _planes(path):
            if plane.name.startswith("/device:TPU"):
                for step, module, event in _tpu_events(plane):
                    yield plane.name, step, module, event
                continue
            gpu = plane.name.startswith("/device:GPU")
            if not gpu and not plane.name.startswith("/host:CPU"):
                continue
            lines = list(plane.lines)
            if gpu and any(line.name.startswith("Stream #") for line in lines):
                lines = [line for line in lines if line.name.startswith("Stream #")]
            for line in lines:
                for event in line.events:
                    stats = dict(event.stats)
                    if not gpu and "hlo_op" not in stats:
                        continue  # host-side runtime work, not an XLA op
                    device = plane.name if gpu else f"{host}/cpu:{stats.get('device_ordinal', 0)}"
                    step = stats.get("run_id", stats.get("group_id"))
                    start = float(event.start_ns)
                    yield device, step, stats.get("hlo_module", ""), Event(
                        line=f"{plane.name}/{line.name}", start=start, end=start + float(event.duration_ns),
                        kind=classify(event.name, str(stats.get("hlo_op") or ""),
                                      str(stats.get("memcpy_details") or "")),
                        name=_label(event.name, stats), bytes=_bytes(stats))


def step_markers(xplane_files, name="train"):
    """Step numbers of the StepTraceAnnotation(name, step_num=N) markers in the trace, in order."""
    steps = []
    for path in xplane_files:
        for plane in _planes(path):
            for line in plane.lines:
                for event in line.events:
                    if event.name == name:
                        stats = dict(event.stats)
                        if "step_num" in stats:
                            steps.append(int(stats["step_num"]))
    return sorted(set(steps))


def read_steps(trace_dir, device=None):
    """{"module", "device", "steps": [[Event] per execution of the step program]} of one device.

    Executions are told apart by run_id / group_id; without either, the window is one group."""
    files = find_xplanes(trace_dir)
    if not files:
        raise ConfigError(f"no .xplane.pb under {trace_dir}; capture one with profile.mode=xprof")
    raw = list(_raw_events(files))
    if not raw:
        return {"module": None, "device": None, "steps": [], "markers": step_markers(files)}
    devices = sorted({d for d, *_ in raw})
    if device is not None and device not in devices:
        raise ConfigError(f"--device {device} is not in the trace {trace_dir}; its devices: {', '.join(devices)}")
    device = device if device is not None else devices[0]
    raw = [r for r in raw if r[0] == device]
    time_by_module = collections.Counter()
    for _, _, module, event in raw:
        time_by_module[module] += event.end - event.start
    module = time_by_module.most_common(1)[0][0]
    groups = collections.defaultdict(list)
    for _, step, event_module, event in raw:
        if event_module == module or not event_module:
            groups[step].append(event)
    if None in groups and len(groups) > 1:  # events without an id: to the execution whose span holds them
        loose = groups.pop(None)
        spans = {key: (min(e.start for e in g), max(e.end for e in g)) for key, g in groups.items()}
        for event in loose:
            key = min(spans, key=lambda k: 0 if spans[k][0] <= event.start <= spans[k][1]
                      else min(abs(event.start - spans[k][0]), abs(event.start - spans[k][1])))
            groups[key].append(event)
    steps = sorted(groups.values(), key=lambda g: min(e.start for e in g))
    return {"module": module, "device": device, "steps": steps, "markers": step_markers(files)}
