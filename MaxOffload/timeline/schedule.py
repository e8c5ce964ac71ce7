"""Reading a compiled schedule for the simulation (simulate.py): what an instruction is (free, a kernel, a host
transfer, a collective, an async start and its done), the FLOPs and bytes it computes or moves, and a collective's
replica groups. Nothing here knows a target's rates."""
import math
import re

from MaxOffload import audit, hlo
from MaxOffload.timeline.engines import D2H, H2D, SEGMENT, pipeline_pass

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
        "partition-id", "replica-id", "add-dependency", "domain", "get-dimension-size"}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute",
               "collective-broadcast")
NOT_KERNELS = ("annotate_device_placement", "MoveToHost", "MoveToDevice", "SetBound", "Sharding", "SPMDFullToShard",
               "SPMDShardToFull", "AllocateBuffer")
_SLICING = ("dynamic-slice", "slice", "gather")


class Schedule:
    """A parsed module (hlo.Module) read instruction by instruction, what it reads kept: the kernels' work in
    `work` ({(computation, instruction): (FLOPs, FP8 FLOPs, bytes)}, shareable by simulations of the same module:
    it does not depend on the rates) and each computation's async dones."""

    def __init__(self, module, work=None):
        self.module = module
        self.counter = audit.Counter(module)
        self.work = {} if work is None else work
        self._dones = {}

    def kernel_work(self, ins, computation):
        """(FLOPs of BF16 and other non-FP8 matmuls, FLOPs of FP8 GEMMs, HBM bytes) of one kernel."""
        key = (computation, ins.name)
        if key not in self.work:
            matmuls = self.counter.instruction(ins, computation)
            self.work[key] = (sum(m.flops for m in matmuls if not m.fp8), sum(m.flops for m in matmuls if m.fp8),
                              kernel_bytes(self.module, computation, ins))
        return self.work[key]

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

    def collective_bytes(self, ins, computation, kind, result=None):
        """The bytes a collective `kind` is sized by: an all-gather's gathered output (`result`, else its own
        shape); a ragged all-to-all's input, not the output buffer and offsets it also takes (at most the rows it
        sends: an upper bound of what travels); any other's operands."""
        shapes = self.module.shapes(computation)
        if kind == "all-gather":
            return hlo.nbytes(result if result is not None else ins.shape)
        if kind == "ragged-all-to-all":
            return hlo.nbytes(shapes.get(ins.operands[0], ""))
        return sum(hlo.nbytes(shapes.get(o, "")) for o in ins.operands)

    def done_of(self, start, computation):
        """The done instruction of an async start, or None."""
        if computation not in self._dones:
            self._dones[computation] = {i.operands[0]: i for i in self.module.computations[computation]
                                        if i.opcode.endswith("-done") and i.operands}
        return self._dones[computation].get(start.name)

    def wrapped(self, start):
        """The root instruction of the computation an async start runs, or None."""
        called = start.called("calls")
        return self.module.root(called) if called else None


def is_free(ins):
    """Whether `ins` costs no time: bookkeeping, or a custom call that only annotates (placement, sharding)."""
    return ins.opcode in FREE or (ins.opcode == "custom-call" and ins.target().startswith(NOT_KERNELS))


def collective_kind(opcode):
    """The collective an opcode (or its async start) is, or None."""
    for kind in COLLECTIVES:
        if opcode in (kind, f"{kind}-start"):
            return kind
    return None


PIPELINE = "pipeline"  # loop_label's first word for the pipeline stages' loops


def loop_label(ins, module=None):
    """A while loop's name for people: its layer segment and pass (jax's scan over layers), the pipeline stages'
    iterations and pass, else its HLO name. A loop XLA rebuilt (unrolled, double-buffered) has no op name: with the
    module, its body's instructions name the pipeline's loop."""
    stages = pipeline_pass(ins.op_name) or (not ins.op_name and module is not None and next(
        (p for p in (pipeline_pass(i.op_name, body=True) for i in module.computations.get(ins.called("body"), ()))
         if p), None))
    if stages:
        return f"{PIPELINE} {stages} ({ins.name})"
    segment = SEGMENT.findall(ins.op_name)
    if not segment:
        return ins.name
    return f"{segment[-1]} {'backward' if 'transpose(' in ins.op_name else 'forward'} ({ins.name})"


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


def kernel_bytes(module, computation, ins):
    """HBM bytes one kernel reads and writes: its device-memory operands and result. Inside a fusion (and the
    fusions it nests), a parameter only sliced (dynamic-slice, slice, gather) reads the slices, and the buffer an
    in-place dynamic-update-slice writes into costs the update, not the whole buffer (XLA aliases it)."""
    shapes = module.shapes(computation)
    fused = ins.called("calls") if ins.opcode in ("fusion", "fusion-start", "async-start") else None
    if not fused or fused not in module.computations:
        return sum(hlo.nbytes(shapes.get(o, ""), host=False) for o in ins.operands) + hlo.nbytes(ins.shape, host=False)
    body = module.computations[fused]
    inner = module.shapes(fused)
    root = body[-1]
    outputs = [module.computations[fused][-1]] if root.opcode != "tuple" else \
        [next(i for i in body if i.name == o) for o in root.operands if any(i.name == o for i in body)]
    in_place = {o.operands[0] for o in outputs if o.opcode == "dynamic-update-slice" and o.operands}
    moved = sum(0 if i.name in in_place else _read(module, fused, i.name) for i in body if i.opcode == "parameter")
    for out in outputs:
        if out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
            moved += hlo.nbytes(inner.get(out.operands[1], ""), host=False)
        else:
            moved += hlo.nbytes(out.shape, host=False)
    return moved


def _read(module, computation, name):
    """Bytes a fused computation reads of its value `name` (a parameter): through bitcasts and into the fusions
    it nests, the slices taken when it is only sliced, else the whole value."""
    body, shapes = module.computations[computation], module.shapes(computation)
    uses = [(i, position) for i in body for position, operand in enumerate(i.operands) if operand == name]
    if uses and all(u.opcode == "bitcast" for u, _ in uses):
        return sum(_read(module, computation, u.name) for u, _ in uses)
    if uses and all(u.opcode in _SLICING and position == 0 for u, position in uses):
        return sum(hlo.nbytes(u.shape, host=False) for u, _ in uses)
    if uses and all(u.opcode == "fusion" and u.called("calls") in module.computations for u, _ in uses):
        return sum(_read(module, u.called("calls"), _parameter(module.computations[u.called("calls")], position))
                   for u, position in uses)
    return hlo.nbytes(shapes.get(name, ""), host=False)


def _parameter(body, index):
    """The name of a computation's parameter number `index`."""
    return next(i.name for i in body if i.opcode == "parameter" and i.operands == [str(index)])

