"""Step time before launch: one training step simulated from the optimized, scheduled HLO of the deviceless GPU
compile (read by MaxOffload/hlo.py; each kernel's matmul FLOPs counted as the compiled-work audit counts them).

The engines, each its own queue (seconds):
  compute     runs the scheduled instructions in order: the entry computation, a while loop's condition and body
              x its trip count, a conditional's dearest branch, called computations inline. A kernel (fusion,
              custom call, dot, copy, ...) costs the larger of its matmul FLOPs at the achievable matmul rate and
              its HBM bytes (operands + result from the shapes in the HLO, pinned-host buffers excluded; the slice a
              fused dynamic-slice reads, the update an in-place dynamic-update-slice writes) at the achievable HBM
              rate.
  d2h, h2d    transfers to and from pinned host memory (buffers in memory space S(5)), full duplex, at the host
              link's achievable rate. An async transfer (start ... done) queues behind the earlier ones of its
              direction when its start is reached; its done stalls compute until it has finished. A synchronous one
              stalls compute for all of it.
  collective  all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute over their replica
              groups' links: NVLink inside an NVLink domain (hardware.nvlink_domain GPUs of a slice), the network
              across. Of the gathered output (all-gather) or the input (reduce-scatter, all-to-all, a ragged
              all-to-all's first operand: what it may send; twice for all-reduce) a device moves (n - 1) / n: the
              share of members in other domains over the network, the rest over NVLink, both at once
              (hierarchical). A permute moves its operand. Async ones (start ...
              done) run beside compute, synchronous ones stall it.
What a stall waits for is exposed time: step = compute + exposed copy + exposed collective time (+ what is still in
flight when the last instruction ends). Each event keeps its instruction's name, its op name's models/components
part and its layer segment (layers_A_B), so the figures split per segment and the trace reads beside a profile.

Calibration: three constants, the achievable shares of the target's peaks (hardware.CALIBRATION: where they were
measured is said there; benchmarks/predict_vs_measured.py checks them against measured step times). Assumptions: kernels of
one stream never overlap each other; a kernel reaches the same share of the peak whatever its shape; async device
computations (not transfers, not collectives) run on the compute stream; replica-group device ids are taken as
global ids in slice-major order (the order MaxOffload/parallel/mesh.py builds).
"""
import bisect
import collections
import dataclasses
import itertools
import json
import math
import re

from MaxOffload import audit, hardware, hlo
from MaxOffload.models import components

COMPUTE, D2H, H2D, COLLECTIVE = "compute", "d2h", "h2d", "collective"
ENGINES = (COMPUTE, D2H, H2D, COLLECTIVE)
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
        "partition-id", "replica-id", "add-dependency", "domain", "get-dimension-size"}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute",
               "collective-broadcast")
NOT_KERNELS = ("annotate_device_placement", "MoveToHost", "MoveToDevice", "SetBound", "Sharding", "SPMDFullToShard",
               "SPMDShardToFull", "AllocateBuffer")
_SEGMENT = re.compile(r"layers_\d+_\d+")
TRACE_EVENTS = 1_000_000  # the most events timeline.json holds


@dataclasses.dataclass(frozen=True)
class Rates:
    """A target's achievable rates under a calibration (bytes or FLOPs per second)."""
    name: str
    peak_flops: float  # bf16 dense, for MFU
    matmul_flops: float
    hbm_bytes: float
    host_link: float  # per direction
    nvlink: float
    network: float
    domain: int  # GPUs per NVLink domain within a slice of the topology
    fp8_matmul_flops: float = None  # FP8 GEMMs (cuBLASLt f8, cuDNN block-scaled); None: twice matmul_flops

    @classmethod
    def of(cls, accelerator, topology="1x1x1", calibration=None):
        c = {**hardware.calibration_for(accelerator), **(calibration or {})}
        slice_devices = hardware.slice_devices(accelerator, topology)
        link = c["link_efficiency"]
        return cls(accelerator.name, accelerator.bf16_peak_flops, accelerator.bf16_peak_flops * c["matmul_efficiency"],
                   accelerator.hbm_bandwidth * c["hbm_efficiency"], accelerator.host_link_bandwidth * link,
                   accelerator.nvlink_bandwidth * link, accelerator.network_bandwidth * link,
                   max(1, min(accelerator.nvlink_domain, slice_devices)),
                   accelerator.fp8_peak_flops * c["matmul_efficiency"])


@dataclasses.dataclass
class Event:
    engine: str
    start: float
    end: float
    name: str  # the HLO instruction
    op_name: str = ""
    flops: float = 0.0
    bytes: float = 0.0
    stall: float = 0.0  # compute time lost waiting for this transfer or collective (its exposed time)
    fp8_flops: float = 0.0  # of `flops`, those of FP8 GEMMs
    kind: str = ""  # a collective's: all-gather, reduce-scatter, ragged-all-to-all, ...

    @property
    def component(self):
        tokens = re.findall(r"[A-Za-z_]\w*", self.op_name)
        return next((t for t in reversed(tokens) if t in components.ALL), "other")

    @property
    def segment(self):
        found = _SEGMENT.findall(self.op_name)
        return found[-1] if found else "outside the layers"


class Simulation:
    def __init__(self, module, rates, devices=1, work=None, domains=None):
        """`work`: {(computation, instruction): (FLOPs, bytes)} shared by simulations of the same module (the
        kernels' work does not depend on the rates); `domains`: the NVLink domain of each device of the program's
        device assignment (replica-group ids index it; default: consecutive blocks of rates.domain)."""
        self.module, self.rates, self.devices = module, rates, devices
        self.domains = domains
        self.counter = audit.Counter(module)
        self.work = {} if work is None else work
        self.clock = 0.0  # the compute stream
        self.free = {engine: 0.0 for engine in ENGINES[1:]}  # when each queue is next free
        self.pending = {}  # async start name -> its event
        self.events = []
        self.windows = []  # (loop instruction, iteration, start, end)
        self.unknown_trip_counts = []
        self._dones = {}

    # -- running computations ------------------------------------------------------------------
    def run(self, computation):
        for ins in self.module.computations.get(computation, ()):
            self.step(ins, computation)

    def step(self, ins, computation):
        op = ins.opcode
        if op in FREE or (op == "custom-call" and ins.target().startswith(NOT_KERNELS)):
            return
        if op == "while":
            trips = self.module.trip_count(ins)
            if trips is None:
                self.unknown_trip_counts.append(ins.op_name or ins.name)
            for i in range(trips or 1):
                started = self.clock
                self.run(ins.called("condition"))
                self.run(ins.called("body"))
                self.windows.append((_loop_label(ins), i, started, self.clock))
            return
        if op == "conditional":
            self.dearest(ins.branches())
            return
        if op == "call":
            self.run(ins.called("to_apply") or ins.called("calls"))
            return
        if op.endswith("-done"):
            self.wait(ins)
            return
        if op.endswith("-start"):
            self.start(ins, computation)
            return
        collective = _collective(op)
        if collective:
            self.stall_on(self.collective(ins, computation, collective, ins))
            return
        transfer = self.host_transfer(ins, computation, ins.shape)
        if transfer:
            self.stall_on(self.transfer(ins, *transfer))
            return
        self.kernel(ins, computation)

    def dearest(self, branches):
        """Runs the branch that ends last (the others are simulated on a copy and dropped)."""
        best = None
        for branch in branches:
            trial = self.fork()
            trial.run(branch)
            if best is None or trial.clock > best.clock:
                best = trial
        if best is not None:
            self.__dict__.update(best.__dict__)

    def fork(self):
        other = Simulation.__new__(Simulation)
        other.__dict__.update(self.__dict__)
        other.free, other.pending = dict(self.free), dict(self.pending)
        other.events, other.windows = list(self.events), list(self.windows)
        other.unknown_trip_counts = list(self.unknown_trip_counts)
        return other

    # -- work --------------------------------------------------------------------------------------
    def kernel(self, ins, computation):
        key = (computation, ins.name)
        if key not in self.work:
            matmuls = self.counter.instruction(ins, computation)
            self.work[key] = (sum(m.flops for m in matmuls if not m.fp8), sum(m.flops for m in matmuls if m.fp8),
                              kernel_bytes(self.module, computation, ins))
        flops, fp8_flops, moved = self.work[key]
        fp8_rate = self.rates.fp8_matmul_flops or 2 * self.rates.matmul_flops
        seconds = max(flops / self.rates.matmul_flops + fp8_flops / fp8_rate, moved / self.rates.hbm_bytes)
        self.events.append(Event(COMPUTE, self.clock, self.clock + seconds, ins.name, ins.op_name, flops + fp8_flops,
                                 moved, fp8_flops=fp8_flops))
        self.clock += seconds

    def start(self, ins, computation):
        done = self.done_of(ins, computation)
        result = done.shape if done is not None else ins.shape
        wrapped = self.wrapped(ins)
        collective = _collective(ins.opcode[:-len("-start")]) or _collective(wrapped.opcode if wrapped else "")
        if collective:
            self.pending[ins.name] = self.collective(ins, computation, collective, wrapped or ins, result)
            return
        transfer = self.host_transfer(ins, computation, result)
        if transfer:
            self.pending[ins.name] = self.transfer(ins, *transfer)
            return
        # an async computation on the device (a small fused update, say): run where it starts
        called = ins.called("calls")
        if called and ins.opcode == "async-start":
            self.run(called)
        else:
            self.kernel(ins, computation)

    def wait(self, ins):
        event = self.pending.pop(ins.operands[0], None) if ins.operands else None
        if event is not None:
            self.stall_on(event)

    def stall_on(self, event):
        """Compute waits until `event` (a transfer or collective) has finished: the wait is its exposed time."""
        if event.end > self.clock:
            event.stall += event.end - self.clock
            self.clock = event.end

    def queue(self, engine, ins, seconds, moved, flops=0.0, kind=""):
        start = max(self.clock, self.free[engine])
        event = Event(engine, start, start + seconds, ins.name, ins.op_name, flops, moved, kind=kind)
        self.free[engine] = event.end
        self.events.append(event)
        return event

    def transfer(self, ins, direction, moved):
        return self.queue(direction, ins, moved / self.rates.host_link, moved)

    def collective(self, ins, computation, kind, carrier, result=None):
        """The event of a collective `kind` whose replica groups `carrier` (the instruction or its wrapped op) says."""
        shapes = self.module.shapes(computation)
        operand_bytes = sum(hlo.nbytes(shapes.get(o, "")) for o in ins.operands)
        result_bytes = hlo.nbytes(result if result is not None else ins.shape)
        groups = replica_groups(carrier.attributes, self.devices)
        n = max((len(g) for g in groups), default=1)
        if n < 2:
            return self.queue(COLLECTIVE, ins, 0.0, 0.0, kind=kind)
        # members of the largest group outside the first member's NVLink domain
        group = max(groups, key=len)
        remote = sum(1 for d in group if self.domain_of(d) != self.domain_of(group[0]))
        if kind == "collective-permute":
            crosses = any(self.domain_of(a) != self.domain_of(b) for a, b in groups) if \
                all(len(g) == 2 for g in groups) else bool(remote)
            moved = operand_bytes
            seconds = moved / (self.rates.network if crosses else self.rates.nvlink)
            return self.queue(COLLECTIVE, ins, seconds, moved, kind=kind)
        size = result_bytes if kind == "all-gather" else operand_bytes
        if kind == "ragged-all-to-all":  # its input, not the output buffer and offsets it also takes: at most
            size = hlo.nbytes(shapes.get(ins.operands[0], ""))  # the rows it sends (an upper bound of what travels)
        rounds = 2 if kind == "all-reduce" else 1
        # hierarchically: the share from (or for) other domains over the network, the rest over NVLink, the two
        # at once (a flat ring across domains would be slower still: each of its links carries (n - 1) / n)
        inter, intra = rounds * size * remote / n, rounds * size * (n - remote - 1) / n
        seconds = max(inter / self.rates.network, intra / self.rates.nvlink)
        return self.queue(COLLECTIVE, ins, seconds, inter + intra, kind=kind)

    def domain_of(self, device):
        return self.domains[device] if self.domains else device // self.rates.domain

    def host_transfer(self, ins, computation, result):
        """(direction, bytes) when `ins` moves data between the device and pinned host memory, else None: into a
        host buffer (its result is host memory) the device operands' bytes (not the scalar offsets of a
        dynamic-update-slice), out of one the device result's."""
        shapes = self.module.shapes(computation)
        operands = [hlo.arrays(shapes.get(o, "")) for o in ins.operands]
        into_host = any(a.host for a in hlo.arrays(result))
        from_host = any(a.host for arrays in operands for a in arrays)
        if into_host:
            moved = sum(a.bytes for arrays in operands for a in arrays if not a.host and a.dims)
            return (D2H, moved) if moved else None
        if from_host:
            return H2D, hlo.nbytes(result, host=False)
        return None

    def done_of(self, start, computation):
        if computation not in self._dones:
            self._dones[computation] = {i.operands[0]: i for i in self.module.computations[computation]
                                        if i.opcode.endswith("-done") and i.operands}
        return self._dones[computation].get(start.name)

    def wrapped(self, start):
        """The root instruction of the computation an async start runs, or None."""
        called = start.called("calls")
        return self.module.root(called) if called else None

    def finish(self):
        """Waits for everything still in flight: the step ends when the last engine is idle."""
        for event in list(self.pending.values()):
            self.stall_on(event)
        self.pending.clear()
        end = max([self.clock, *self.free.values()])
        return end


def _loop_label(ins):
    """A while loop's name for people: its layer segment and pass (jax's scan over layers), else its HLO name."""
    segment = _SEGMENT.findall(ins.op_name)
    if not segment:
        return ins.name
    return f"{segment[-1]} {'backward' if 'transpose(' in ins.op_name else 'forward'} ({ins.name})"


def _collective(opcode):
    for kind in COLLECTIVES:
        if opcode in (kind, f"{kind}-start"):
            return kind
    return None


def replica_groups(attributes, devices):
    """[[device ids]] of a collective: explicit `{{0,1},{2,3}}`, the iota form `[G,S]<=[dims]T(perm)`, the mesh form
    `mesh['axis_0'=64,'axis_1'=2], device_ids=([2,64]T(1,0)) {'axis_0'}` (XLA 2026: the groups run along the axes
    in braces), a permute's source-target pairs, or one group of every device when empty."""
    pairs = re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", attributes)
    if pairs:
        return [[int(x) for x in p.split(",") if x] for p in re.findall(r"\{([0-9,]*)\}", pairs.group(1))]
    on_mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?"
                        r" \{([^}]*)\}", attributes)
    if on_mesh:  # mesh['axis_0'=64,'axis_1'=2], device_ids=([2,64]T(1,0)) {'axis_0'}: groups along the named axes
        import numpy as np

        axes = re.findall(r"'([^']+)'=([0-9]+)", on_mesh.group(1))
        sizes = [int(n) for _, n in axes]
        ids = np.arange(math.prod(sizes))
        if on_mesh.group(2):
            ids = ids.reshape([int(x) for x in on_mesh.group(2).split(",")])
            if on_mesh.group(3):
                ids = ids.transpose([int(x) for x in on_mesh.group(3).split(",")])
        ids = ids.reshape(sizes)
        over = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in on_mesh.group(4)]
        rest = [i for i in range(len(axes)) if i not in over]
        return ids.transpose(rest + over).reshape(-1, math.prod(sizes[i] for i in over)).tolist()
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attributes)
    if iota:
        import numpy as np

        shape = [int(x) for x in iota.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in iota.group(2).split(","))).reshape(
            [int(x) for x in iota.group(2).split(",")])
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    explicit = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attributes)
    if explicit and explicit.group(1):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", explicit.group(1))]
    return [list(range(devices))]


_SLICING = ("dynamic-slice", "slice", "gather")


def kernel_bytes(module, computation, ins):
    """HBM bytes one kernel reads and writes: its device-memory operands and result. Inside a fusion, a parameter
    only sliced (dynamic-slice, slice, gather) reads the slices, and the buffer an in-place dynamic-update-slice
    writes into costs the update, not the whole buffer (XLA aliases it)."""
    shapes = module.shapes(computation)
    fused = ins.called("calls") if ins.opcode in ("fusion", "fusion-start", "async-start") else None
    if not fused or fused not in module.computations:
        return sum(hlo.nbytes(shapes.get(o, ""), host=False) for o in ins.operands) + hlo.nbytes(ins.shape, host=False)
    body = module.computations[fused]
    inner = module.shapes(fused)
    users = collections.defaultdict(list)
    for i in body:
        for position, operand in enumerate(i.operands):
            users[operand].append((i, position))
    root = body[-1]
    outputs = [module.computations[fused][-1]] if root.opcode != "tuple" else \
        [next(i for i in body if i.name == o) for o in root.operands if any(i.name == o for i in body)]
    in_place = {o.operands[0] for o in outputs if o.opcode == "dynamic-update-slice" and o.operands}

    def read(name):
        """Bytes read of a fused parameter, through bitcasts."""
        if name in in_place:
            return 0
        uses = users.get(name, [])
        if uses and all(u.opcode == "bitcast" for u, _ in uses):
            return sum(read(u.name) for u, _ in uses)
        if uses and all(u.opcode in _SLICING and position == 0 for u, position in uses):
            return sum(hlo.nbytes(u.shape, host=False) for u, _ in uses)
        return hlo.nbytes(inner.get(name, ""), host=False)

    moved = sum(read(i.name) for i in body if i.opcode == "parameter")
    for out in outputs:
        if out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
            moved += hlo.nbytes(inner.get(out.operands[1], ""), host=False)
        else:
            moved += hlo.nbytes(out.shape, host=False)
    return moved


def simulate(text, rates, devices=1, model_flops_per_device=None, work=None, domains=None):
    """The predicted timeline of a compiled step (its optimized HLO text, or a parsed hlo.Module) on `rates`:
    (report dict, Simulation with its events). `work`, `domains`: see Simulation."""
    module = hlo.parse(text) if isinstance(text, str) else text
    sim = Simulation(module, rates, devices, work, domains)
    sim.run(module.entry)
    step = sim.finish()
    return summarize(sim, step, model_flops_per_device), sim


def summarize(sim, step, model_flops_per_device=None):
    busy = collections.Counter()
    stalls = collections.Counter()
    moved = collections.Counter()
    groups = {}
    parts, kinds = collections.Counter(), {}  # compute per model part; collectives per kind
    for e in sim.events:
        busy[e.engine] += e.end - e.start
        if e.engine == COMPUTE:
            parts[e.component] += e.end - e.start
        elif e.engine == COLLECTIVE:
            kinds.setdefault(e.kind, collections.Counter()).update(s=e.end - e.start, exposed_s=e.stall, bytes=e.bytes)
        moved[e.engine] += e.bytes
        kind = "copy" if e.engine in (D2H, H2D) else e.engine
        stalls[kind] += e.stall
        g = groups.setdefault(e.segment, collections.Counter())
        g[f"{e.engine}_s"] += e.end - e.start
        if e.engine != COMPUTE:
            g[f"exposed_{kind}_s"] += e.stall
    copy_s = busy[D2H] + busy[H2D]
    report = {
        "target": sim.rates.name, "step_s": step, "compute_s": busy[COMPUTE],
        "exposed_copy_s": stalls["copy"], "exposed_collective_s": stalls[COLLECTIVE],
        "d2h_s": busy[D2H], "h2d_s": busy[H2D], "copy_s": copy_s, "collective_s": busy[COLLECTIVE],
        "d2h_bytes": moved[D2H], "h2d_bytes": moved[H2D], "collective_bytes": moved[COLLECTIVE],
        "copy_hidden_fraction": 1 - stalls["copy"] / copy_s if copy_s else None,
        "collective_hidden_fraction": 1 - stalls[COLLECTIVE] / busy[COLLECTIVE] if busy[COLLECTIVE] else None,
        "compiled_matmul_flops": sum(e.flops for e in sim.events),
        "fp8_matmul_flops": sum(e.fp8_flops for e in sim.events),
        "kernels": sum(1 for e in sim.events if e.engine == COMPUTE),
        "unknown_trip_counts": sim.unknown_trip_counts,
        "calibration": {"matmul_flops": sim.rates.matmul_flops, "hbm_bytes_per_s": sim.rates.hbm_bytes,
                        "host_link_bytes_per_s": sim.rates.host_link, "nvlink_bytes_per_s": sim.rates.nvlink,
                        "network_bytes_per_s": sim.rates.network},
        "groups": {name: {k: v for k, v in sorted(g.items())} for name, g in sorted(groups.items())},
        "compute_by_part_s": dict(parts.most_common()),
        "collectives_by_kind": {k: {key: c[key] for key in ("s", "exposed_s", "bytes")}
                                for k, c in sorted(kinds.items(), key=lambda kc: -kc[1]["s"])},
        "model_tflops_per_device": None, "mfu": None,
    }
    if model_flops_per_device:
        report["model_tflops_per_device"] = model_flops_per_device / step / 1e12
        report["mfu"] = model_flops_per_device / step / mixed_peak(sim.rates, report)
    return report


def mixed_peak(rates, report):
    """The peak FLOP/s MFU counts against: BF16's for the step's BF16 GEMMs, FP8's (fp8_matmul_flops over
    matmul_flops times BF16's) for its FP8 GEMMs, weighted by their FLOPs; BF16's when it has no FP8 GEMM."""
    fp8_peak = rates.peak_flops * (rates.fp8_matmul_flops or 2 * rates.matmul_flops) / rates.matmul_flops
    return hardware.mixed_peak(rates.peak_flops, fp8_peak, report["compiled_matmul_flops"], report["fp8_matmul_flops"])


def of_compiled(compiled, setup, rates):
    """(report, Simulation) of a TrainSetup's compiled step (a jax Compiled, or its parsed hlo.Module)."""
    module = compiled if isinstance(compiled, hlo.Module) else hlo.parse(compiled.as_text())
    domains = [d.id // rates.domain for d in setup.mesh.devices.flat]  # the device assignment's order
    return simulate(module, rates, setup.mesh.size, sum(audit.model_flops_per_device(setup).values()),
                    domains=domains)


def format_report(r):
    """Lines for the aot tool and the planner."""
    hidden = "n/a" if r["copy_hidden_fraction"] is None else f"{r['copy_hidden_fraction']:.0%}"
    lines = [f"predicted step time on {r['target']}: {_ms(r['step_s'])} = compute {_ms(r['compute_s'])} "
             f"+ exposed copies {_ms(r['exposed_copy_s'])} + exposed collectives {_ms(r['exposed_collective_s'])}",
             f"  host copies: D2H {_gb(r['d2h_bytes'])} in {_ms(r['d2h_s'])}, H2D {_gb(r['h2d_bytes'])} in "
             f"{_ms(r['h2d_s'])}, {hidden} hidden under compute; collectives {_gb(r['collective_bytes'])} in "
             f"{_ms(r['collective_s'])}"]
    if r["model_tflops_per_device"]:
        lines.append(f"  predicted {r['model_tflops_per_device']:,.1f} model TFLOP/s per device, MFU "
                     f"{r['mfu']:.1%}")
    if r.get("compute_by_part_s"):
        lines.append("  compute by part: " + ", ".join(f"{part} {_ms(t)}" for part, t in
                                                      list(r["compute_by_part_s"].items())[:6]))
    if r.get("collectives_by_kind"):
        lines.append("  collectives by kind: " + ", ".join(
            f"{kind} {_gb(c['bytes'])} in {_ms(c['s'])} ({_ms(c['exposed_s'])} exposed)"
            for kind, c in r["collectives_by_kind"].items()))
    if r["unknown_trip_counts"]:
        lines.append(f"  WARNING: {len(r['unknown_trip_counts'])} loop(s) without a known trip count were run once")
    return lines


def _gb(n):
    return f"{n / 1e9:,.3g} GB"


def _ms(seconds):
    return f"{seconds * 1e3:,.4g} ms"


# -- pictures ----------------------------------------------------------------------------------------------


def trace(sim, limit=TRACE_EVENTS):
    """The timeline as a Chrome / Perfetto trace (`traceEvents`): one track per engine, an event per kernel,
    transfer and collective, named after its HLO instruction, with its component, segment, FLOPs and bytes; the
    first `limit` of them in time (a trace viewer takes no more; the process's name says how many are left out)."""
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
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_pictures(sim, directory):
    """Writes DIRECTORY/timeline.json (the trace) and timeline.png (one layer's window, when matplotlib is
    installed); returns a line saying what was written."""
    import os

    path = os.path.join(directory, "timeline.json")
    with open(path, "w") as f:
        json.dump(trace(sim), f)
    try:
        plot_window(sim, os.path.join(directory, "timeline.png"))
    except ImportError:
        return f"wrote {path} (open it in ui.perfetto.dev or chrome://tracing); no timeline.png: pip install matplotlib"
    return f"wrote {path} (open it in ui.perfetto.dev or chrome://tracing) and {directory}/timeline.png"


def layer_window(sim):
    """(start, end, label) of one layer's iteration: the middle iteration of the loop that moves the most bytes to
    and from the host (else the longest loop), or the whole step when there is no loop."""
    if not sim.windows:
        return 0.0, max((e.end for e in sim.events), default=0.0), "the whole step"
    by_loop = collections.defaultdict(list)
    for loop, i, start, end in sim.windows:
        by_loop[loop].append((start, end, i))
    host = sorted((e.start, e.bytes) for e in sim.events if e.engine in (D2H, H2D))
    starts, total = [s for s, _ in host], list(itertools.accumulate((b for _, b in host), initial=0))

    def weight(loop):  # (host bytes whose transfers start in the loop's iterations, the iterations' time)
        spans = by_loop[loop]
        moved = sum(total[bisect.bisect_left(starts, t)] - total[bisect.bisect_left(starts, s)] for s, t, _ in spans)
        return moved, sum(t - s for s, t, _ in spans)

    loop = max(by_loop, key=weight)
    start, end, i = by_loop[loop][len(by_loop[loop]) // 2]
    return start, end, f"{loop}, iteration {i + 1} of {len(by_loop[loop])}"


def plot_window(sim, path):
    """A PNG of one layer's window (layer_window): compute, D2H, H2D and collectives as lanes. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end, label = layer_window(sim)
    colors = {COMPUTE: "tab:blue", D2H: "tab:orange", H2D: "tab:green", COLLECTIVE: "tab:purple"}
    fig, ax = plt.subplots(figsize=(10, 3))
    rows = {engine: len(ENGINES) - 1 - i for i, engine in enumerate(ENGINES)}
    for engine, row in rows.items():
        spans = [((max(e.start, start) - start) * 1e3, (min(e.end, end) - max(e.start, start)) * 1e3)
                 for e in sim.events if e.engine == engine and e.end > start and e.start < end]
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolor=colors[engine], edgecolor="white", linewidth=0.3)
    # the compute stream's waits, on its own lane: what each wait is for is the transfer or collective ending then
    stalls = [((e.end - e.stall - start) * 1e3, e.stall * 1e3) for e in sim.events if e.stall and start < e.end <= end]
    ax.broken_barh(stalls, (rows[COMPUTE] - 0.4, 0.8), facecolor="none", edgecolor="red", hatch="//")
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlabel("ms (red hatching on compute: waiting for a copy or collective)")
    ax.set_title(f"predicted, {sim.rates.name}: {label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
