"""The compiled-work audit: the matmul FLOPs a compiled step really executes, read from its optimized HLO text
(`Compiled.as_text()`), against the model FLOPs, per part of the model.

Counted, per device and step:
  - `dot` instructions, wherever they are: at the top level, inside fusions (Triton GEMM fusions included),
    calls and async computations; 2 x output elements x the product of the lhs contracting dimensions;
  - while loops: their body x the trip count (hlo.Module.trip_count: proved by XLA, or read off the loop's
    induction variable and its condition); a loop without one is counted
    once and listed in `unknown_trip_counts`;
  - cuBLAS GEMM custom calls (`__cublas$gemm`, `__cublas$lt$matmul...`), from their dot dimension numbers,
    and cuDNN's MXFP8 block-scaled dot (`__cudnn$blockScaledDot`: [B, M, K] x [B, N, K]);
  - tokamax kernels: from the shapes in tokamax's JSON of the op and its arguments (in the op name or
    metadata_payload; KERNEL_FLOPS), or else from the Triton kernel's name and operand shapes (TRITON_KERNELS):
    a grouped GEMM's over its whole buffer (an upper bound where it skips the rows past its groups), flash
    attention's over the (query, key) pairs a causal kernel visits;
  - conditionals: the most expensive branch.
Other kernels whose FLOPs the HLO cannot show (Triton / cuDNN / Mosaic custom calls) are listed by target.

Each matmul is attributed to the innermost models/components scope in its op name (attention scores,
projections, MLP, router, routed experts, unembedding; "other" when none), and to its phase: "recompute"
when JAX marked it `rematted_computation` (the forward redone in the backward pass) or when XLA's own HLO
rematerialization cloned it to save memory (an instruction named `*.remat*`, which keeps the original op
name), else forward/backward.
FP8 GEMMs (cuBLASLt's `$f8` matmul, cuDNN's block-scaled dot, tokamax's grouped GEMM on FP8 operands) are
marked as such: with `quantized` parts (quant.mode), the report's `fp8` says how many of those parts' GEMMs
(forward, backward, recomputed) became FP8 kernels and names the rest, apart from the routed experts' weight
gradient (tokamax's ragged-contracting grouped GEMM), BF16 by design (that kernel has no FP8 path).
A `dot` whose op name says `ragged_dot` is XLA's dense rewrite of a grouped matmul (its lhs expanded over
the experts): it is listed in `dense_ragged_dots`, a WARNING on its own.
"""
import dataclasses
import json
import math
import re

import numpy as np

from MaxOffload import expected_work, hlo
from MaxOffload.hlo import dims
from MaxOffload.models import components

GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
BLOCK_SCALED = "__cudnn$blockScaledDot"  # MXFP8: its operands [B, M, K], [B, N, K] (+ their scales)
FP8_KINDS = ("cublas-fp8", "cudnn-mxfp8")
KERNEL_HINTS = ("triton", "cudnn", "mosaic", "pallas", "cublas", "__gpu$")
# A part may take this much more than its expected FLOPs (plus what it recomputes) before a WARNING.
TOLERANCE = 1.15
# The multiple of its model FLOPs a part's matmuls take by construction, where the model's configuration does
# not say (audit's `multiples`). The model counts half of the causal score matrix (train/flops.py, MaxText's
# convention); attention without causal block skipping computes all of it and masks half: 2x. A training step
# knows its attention kernel and length (of_compiled: expected_work.py).
EXPECTED = {components.ATTENTION_SCORES: 2.0}


def _tokamax_op(op_name):
    """tokamax's {"op": ..., "arguments": ...} from an op name "...tokamax:{...}/...", or None."""
    start = op_name.find("tokamax:{")
    if start < 0:
        return None
    start += len("tokamax:")
    try:
        return json.loads(op_name[start:hlo.balanced(op_name, start)])
    except ValueError:
        return None


def _ragged_dot_flops(arguments):
    """2 x lhs elements x the rhs dimensions that are neither contracted, batch nor group dimensions (a quantized
    operand, a qwix QArray, by its quantized value's shape)."""
    # (jax spells FP8 types f8_e4m3fn, HLO f8e4m3fn)
    lhs, rhs = (dims((a["qvalue"] if isinstance(a, dict) else a).replace("_", ""))
                for a in (arguments["lhs"], arguments["rhs"]))
    numbers = arguments["ragged_dot_dimension_numbers"]
    (_, rhs_contracting), (_, rhs_batch) = numbers["dot_dimension_numbers"]
    skipped = set(rhs_contracting) | set(rhs_batch) | set(numbers["rhs_group_dimensions"])
    return 2 * math.prod(lhs) * math.prod(d for i, d in enumerate(rhs) if i not in skipped)


def _attention_flops(q, v, causal, vjp):
    """Flash attention's matmuls, q [*B, T, N, d], v [*B, S, K, dv]: per visible (query, key) pair and head the
    forward's QK^T and PV (2 (d + dv)); the VJP's recomputed QK^T and its dV, dP, dQ, dK (2 (3 d + 2 dv)). Causal
    with T = S: T (T + 1) / 2 pairs (the kernel skips the key blocks above the diagonal)."""
    batch, length, heads, d = math.prod(q[:-3]), q[-3], q[-2], q[-1]
    keys, dv = v[-3], v[-1]
    pairs = length * (length + 1) // 2 if causal and length == keys else length * keys
    return 2 * batch * heads * pairs * ((3 * d + 2 * dv) if vjp else (d + dv))


def _flash_attention_flops(arguments, vjp=False):
    causal = bool((arguments.get("mask") or {}).get("is_causal"))
    return _attention_flops(dims(arguments["q"]), dims(arguments["v"]), causal, vjp)


# tokamax op class name (its last part, lowercased, containing; the first match counts) -> FLOPs of one call
KERNEL_FLOPS = {"raggeddot": _ragged_dot_flops,
                "flashattentionvjp": lambda arguments: _flash_attention_flops(arguments, vjp=True),
                "flashattention": _flash_attention_flops}
# Where the op JSON is not in the metadata (jax 0.12 drops it inside shard_map / loops), the Triton kernel's own
# name in the backend config says which it is: (tokamax op, FLOPs from (operand dims, output dims)). Both of
# tokamax's ragged_dot kernels take 2 x (first operand's elements) x the output's last dimension:
# [R, K] x [E, K, N] -> [R, N] and the weight gradient [R, K] x [R, N] -> [E, K, N].
def _triton_ragged_dot_flops(operands, out):
    return 2 * math.prod(operands[0]) * out[-1]


TRITON_KERNELS = {name: ("PallasTritonRaggedDot", _triton_ragged_dot_flops)
                  for name in ("_ragged_dot_kernel", "_ragged_contracting_dim_dot_kernel")}
# tokamax's flash attention: operands (q, k, v, ...); the model calls it causal only (models/attention/flash.py).
# Its forward comes as two kernels (without and with the residuals the VJP reads), both one forward pass.
def _triton_flash_forward_flops(operands, out):
    return _attention_flops(operands[0], operands[2], True, False)


def _triton_flash_vjp_flops(operands, out):
    return _attention_flops(operands[0], operands[2], True, True)


TRITON_KERNELS.update({name: ("PallasTritonFlashAttention", _triton_flash_forward_flops)
                       for name in ("pallas_flash_attention", "pallas_flash_attention_fwd_res")})
TRITON_KERNELS["pallas_flash_attention_vjp"] = ("PallasTritonFlashAttentionVjp", _triton_flash_vjp_flops)


def triton_kernel(ins):
    """The kernel name of a Triton custom call (from its backend config), or None."""
    name = re.search(r'[{,]\s*name = "([^"]+)"', ins.attributes)
    return name.group(1) if name else None


def kernel_operands(ins):
    """The operand shapes (with their dtypes) of a custom call's operand_layout_constraints, or None."""
    start = ins.attributes.find("operand_layout_constraints={")
    if start < 0:
        return None
    start += len("operand_layout_constraints=")
    return hlo.split_top(ins.attributes[start + 1:hlo.balanced(ins.attributes, start) - 1])


def triton_flops(ins):
    """(tokamax op, FLOPs of one call) of a Triton custom call by its kernel's name and operand shapes, or None."""
    name, operands = triton_kernel(ins), kernel_operands(ins)
    if name not in TRITON_KERNELS or operands is None:
        return None
    op, flops = TRITON_KERNELS[name]
    return op, flops([dims(p) for p in operands], dims(ins.shape))


def _weight_gradient(ins):
    """Whether a tokamax custom call is the grouped GEMM with a ragged contracting dimension (the routed experts'
    weight gradient): by its Triton kernel's name, or by its op's dimension numbers (no group dimension)."""
    return (triton_kernel(ins) == "_ragged_contracting_dim_dot_kernel"
            or '"rhs_group_dimensions":[]' in ins.op_name.replace(" ", ""))


def kernel_flops(op_name):
    """(kernel name, FLOPs of one call) of a tokamax op name, or None when it is none we can count."""
    op = _tokamax_op(op_name)
    if not op:
        return None
    kind = op.get("op", {}).get("__type", "").rsplit(".", 1)[-1]
    for key, flops in KERNEL_FLOPS.items():
        if key in kind.lower():
            try:
                return kind, flops(op["arguments"])
            except (KeyError, TypeError, ValueError):
                return None
    return None


@dataclasses.dataclass
class Matmul:
    flops: float  # per execution x how many times its enclosing loops run it
    op_name: str
    kind: str  # "dot" | "cublas" | "cublas-fp8" | "cudnn-mxfp8" | a tokamax kernel's op class
    cloned: bool = False  # inside an instruction XLA's rematerialization cloned (*.remat*)
    times: int = 1  # executions per step
    fp8_operands: bool = False  # a kernel (tokamax's grouped GEMM) whose operands are FP8
    weight_gradient: bool = False  # tokamax's ragged-contracting grouped GEMM: the routed experts' weight gradient
    # in a computation a recomputation calls (a loop body XLA shares between the forward pass and a rematerialized
    # forward carries the op names of one of them)
    rematted: bool = False

    @property
    def fp8(self):
        return self.kind in FP8_KINDS or self.fp8_operands

    @property
    def component(self):
        tokens = re.findall(r"[A-Za-z_][\w]*", self.op_name)
        if "ragged_dot" in self.op_name or self.kind == "ragged_dot":  # XLA:TPU's kernel may carry no op name
            return components.EXPERTS
        return next((t for t in reversed(tokens) if t in components.ALL), "other")

    @property
    def phase(self):
        if self.cloned or self.rematted or "rematted_computation" in self.op_name:
            return "recompute"
        return "backward" if "transpose(" in self.op_name else "forward"


@dataclasses.dataclass
class Count:
    matmuls: list = dataclasses.field(default_factory=list)
    kernels: dict = dataclasses.field(default_factory=dict)  # custom-call target -> executions (FLOPs unread)
    counted_kernels: dict = dataclasses.field(default_factory=dict)  # tokamax op -> executions (FLOPs counted)
    unknown_trip_counts: list = dataclasses.field(default_factory=list)  # while loops counted once
    dense_ragged_dots: list = dataclasses.field(default_factory=list)  # (op name, flops)

    @property
    def total(self):
        return sum(m.flops for m in self.matmuls)


class Counter:
    """Walks a parsed module (MaxOffload/hlo.py) for its matmuls, into a Count. `instruction` counts one
    instruction as one execution (a fusion or a kernel, with what it calls): the timeline prices each scheduled
    kernel by it."""

    def __init__(self, module, out=None):
        self.module, self.out = module, out if out is not None else Count()

    def computation(self, name, times=1, stack=(), cloned=False, rematted=False):
        """[Matmul] of computation `name` run `times` times (`cloned`: by XLA's rematerialization; `rematted`: called
        by a rematerialized forward pass's instruction)."""
        if name not in self.module.computations or name in stack:
            return []
        found = []
        for ins in self.module.computations[name]:
            found += self.instruction(ins, name, times, stack + (name,), cloned, rematted)
        for m in found if rematted else ():
            m.rematted = True
        return found

    def masked_groups(self, computation):
        """E when `computation` is XLA:TPU's masked grouped convolution (a fusion named convolution_select_fusion*
        with a parameter output_mask pred[E, rows]: `jax.lax.ragged_dot`'s gradient for its rhs, the expert weights,
        rows sorted by expert): its convolution is written dense over E experts x every row, but the chip skips
        the masked rows (DeepSeek small on the v5e stepped in 0.195 s where the dense count alone needs 0.14 s at
        the chip's peak: benchmarks/results/tpu_v5e_2026-12-06), so the audit counts each row once: the dense
        count / E. Else 0."""
        if not computation.startswith("convolution_select_fusion"):
            return 0
        mask = next((i for i in self.module.computations.get(computation, ())
                     if i.opcode == "parameter" and i.name.startswith("output_mask")), None)
        shape = dims(mask.shape) if mask is not None else []
        return shape[0] if len(shape) == 2 else 0

    def instruction(self, ins, computation, times=1, stack=(), cloned=False, rematted=False):
        """[Matmul] of one instruction of `computation` run `times` times."""
        out, shapes, here = self.out, self.module.shapes(computation), cloned or ".remat" in ins.name
        rematted = rematted or "rematted_computation" in ins.op_name
        if ins.opcode == "dot":
            found = [_matmul(ins, shapes, "dot", ins.int_list("lhs_contracting_dims"), times, here)]
            if "ragged_dot" in ins.op_name:
                out.dense_ragged_dots.append((ins.op_name, found[-1].flops))
            return found
        if ins.opcode == "convolution":  # XLA:TPU writes a matmul as a convolution (dim_labels, a window)
            groups = self.masked_groups(computation)
            if groups:  # the routed experts' weight gradient: each row meets its own expert's block
                return [Matmul(convolution_flops(ins, shapes) / groups * times, MASKED_GROUPED_CONVOLUTION, "dot",
                               here, times, weight_gradient=True)]
            return [Matmul(convolution_flops(ins, shapes) * times, ins.op_name, "dot", here, times)]
        if ins.opcode == "custom-call" and ins.target() == "tpu_custom_call":
            kind, flops = tpu_kernel_flops(ins)  # 0 for the metadata kernels (ragged-dot-metadata)
            if flops:
                out.counted_kernels[kind] = out.counted_kernels.get(kind, 0) + times
            return [Matmul(flops * times, ins.op_name, kind, here, times)] if flops else []
        if ins.opcode == "custom-call":
            target = ins.target() or "?"
            if target.startswith(GEMM_TARGETS):
                axes = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attributes)
                axes = [int(a.strip('" ')) for a in axes.group(1).split(",") if a.strip('" ')] if axes else []
                return [_matmul(ins, shapes, "cublas-fp8" if target.endswith("$f8") else "cublas", axes, times, here)]
            if target == BLOCK_SCALED:
                return [_matmul(ins, shapes, "cudnn-mxfp8", [2], times, here)]
            kernel = kernel_flops(ins.payload) or kernel_flops(ins.op_name) or triton_flops(ins)
            if kernel:
                out.counted_kernels[kernel[0]] = out.counted_kernels.get(kernel[0], 0) + times
                operands = kernel_operands(ins) or []
                return [Matmul(kernel[1] * times, ins.op_name, kernel[0], here, times,
                               fp8_operands=any(o.startswith("f8") for o in operands[:3]),
                               weight_gradient=_weight_gradient(ins))]
            if any(h in target.lower() for h in KERNEL_HINTS):
                out.kernels[target] = out.kernels.get(target, 0) + times
            return []
        if ins.opcode == "while":
            trips = self.module.trip_count(ins)
            if trips is None:
                out.unknown_trip_counts.append(ins.op_name or ins.name)
            return self.computation(ins.called("body"), times * (trips or 1), stack, here, rematted)
        if ins.opcode == "conditional":
            return max((self.computation(b, times, stack, here, rematted) for b in ins.branches()),
                       key=lambda ms: sum(m.flops for m in ms), default=[])
        found = []
        for key in ("calls", "to_apply") if ins.opcode == "call" else ("calls",):
            if ins.called(key):
                found += self.computation(ins.called(key), times, stack, here, rematted)
        return found


def _tpu_operands(ins):
    """The operand dims of a Mosaic `tpu_custom_call`, from its operand layout constraints."""
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, \w+=", ins.attributes)
    return [dims(t) for t in re.findall(r"\w+\[[\d,]*\]", layouts.group(1))] if layouts else []


def tpu_ragged_dot_flops(ins):
    """2 x rows x K x N of XLA:TPU's native ragged_dot, a Mosaic `tpu_custom_call` named ragged-dot-*: its operand
    layouts list the group metadata, then lhs [rows, K] and rhs [groups, K, N]; each row meets one group's matrix."""
    lhs = next((d for d in _tpu_operands(ins) if len(d) == 2 and d[0] == (dims(ins.shape) or [0])[0]), None)
    return 2 * math.prod(dims(ins.shape)) * lhs[1] if lhs else 0


# the op name the audit gives XLA:TPU's masked grouped convolution (Counter.masked_groups), which carries none: a
# backward ragged_dot (the routed experts' component, the backward phase)
MASKED_GROUPED_CONVOLUTION = "transpose(ragged_dot): the expert weights' gradient (XLA:TPU masked grouped convolution)"


def tpu_splash_flops(ins):
    """Splash attention's matmuls (models/attention/splash.py), its operands (after two mask operands, the block
    tables [heads, T / block, S / block]) q [b, heads, T, d], k, v [b, kv_heads, S, dv]: the blocks on and below
    the diagonal, n (n + 1) / 2 of block^2 pairs (S = T; over context shards S > T, the shard's share), at 2 (d + dv) per pair forward (splash_mha_fwd*) and 2 (3 d + 2 dv) for the fused
    backward (splash_mha_dkv*: QK^T recomputed, dV, dP, dQ, dK)."""
    from MaxOffload.models.kernels import splash_block

    operands = _tpu_operands(ins)
    if len(operands) < 5 or len(operands[2]) != 4:
        return 0
    (batch, heads, length, d), keys, dv = operands[2], operands[3][-2], operands[4][-1]
    tables = operands[0]  # the mask's block tables [heads, query blocks, key blocks]: the kernel's block
    block = length // tables[1] if len(tables) == 3 and tables[1] and length % tables[1] == 0 else (
        splash_block(length) or length)
    blocks = length // block
    pairs = blocks * (blocks + 1) // 2 * block * block
    if keys > length:  # a context shard's rows against the whole sequence's keys (splash.context_splash_attention):
        #                its share of the causal blocks, on average over the shards (in sequence order the later
        #                shards compute more; load-balanced each the same), length (keys + block) / 2 pairs
        pairs = length * (keys + block) // 2
    per_pair = (3 * d + 2 * dv) if "_dkv" in ins.name else (d + dv)
    return 2 * batch * heads * pairs * per_pair


def tpu_kernel_flops(ins):
    """(kind, FLOPs) of an XLA:TPU Mosaic kernel we can count, else (None, 0)."""
    if ins.name.startswith("ragged-dot"):
        return "ragged_dot", tpu_ragged_dot_flops(ins)
    if ins.name.startswith("splash_mha"):
        return "splash", tpu_splash_flops(ins)
    return None, 0


def convolution_flops(ins, shapes):
    """Multiply-adds x 2 of a convolution: batch x output features x input features (per group) x, per spatial
    dimension, the (output position, window position) pairs that land inside the input (padding excluded; how XLA's
    cost analysis counts them). XLA:TPU lowers dots to convolutions whose window runs over a broadcast dimension,
    padded so each output position sees one input position: this counts such a dot's FLOPs exactly."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attributes)
    lhs = dims(shapes.get(ins.operands[0], "")) if ins.operands else []
    rhs = dims(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
    if not labels or not lhs or not rhs:
        return 0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    out = dims(ins.shape)
    window = re.search(r"window=\{([^}]*)\}", ins.attributes)
    fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}

    def per_spatial(key, default):
        return [int(v) for v in fields[key].split("x")] if key in fields else default

    spatial = sorted(c for c in lhs_labels if c.isdigit())  # the window lists them 0, 1, ...; the labels may not
    ones = [1] * len(spatial)
    sizes, strides = per_spatial("size", [rhs[rhs_labels.index(c)] for c in spatial]), per_spatial("stride", ones)
    lhs_dilate, rhs_dilate = per_spatial("lhs_dilate", ones), per_spatial("rhs_dilate", ones)
    pads = [[int(p) for p in pair.split("_")] for pair in fields["pad"].split("x")] if "pad" in fields else \
        [[0, 0]] * len(spatial)
    pairs = 1
    for k, c in enumerate(spatial):
        # window position w of output position o reads x = o * stride - pad_lo + w * rhs_dilate of the input dilated
        # by lhs_dilate: a real element when 0 <= x <= (length - 1) * lhs_dilate and x is a multiple of lhs_dilate
        length, dilated = lhs[lhs_labels.index(c)], lhs_dilate[k]
        base = np.arange(out[out_labels.index(c)], dtype=np.int64) * strides[k] - pads[k][0]
        x = base[:, None] + np.arange(sizes[k], dtype=np.int64)[None, :] * rhs_dilate[k]
        pairs *= int(((x >= 0) & (x <= (length - 1) * dilated) & (x % dilated == 0)).sum())
    return 2 * lhs[lhs_labels.index("b")] * rhs[rhs_labels.index("o")] * rhs[rhs_labels.index("i")] * pairs


def _matmul(ins, shapes, kind, contracting, times, cloned):
    lhs = dims(shapes.get(ins.operands[0], "")) if ins.operands else []
    flops = 2 * math.prod(dims(ins.shape)) * math.prod(lhs[d] for d in contracting if d < len(lhs))
    return Matmul(flops * times, ins.op_name, kind, cloned, times)


def count(text):
    """Count: every matmul of the module (an HLO text or a parsed hlo.Module; scaled by its loops' trip counts),
    the unreadable kernels."""
    module = hlo.parse(text) if isinstance(text, str) else text
    counter = Counter(module)
    counter.out.matmuls = counter.computation(module.entry)
    return counter.out


def fp8_share(matmuls, quantized):
    """{"asked", "fp8", "asked_flops", "fp8_flops", "kernels": {component: {kernel: executions}} of the FP8 ones,
    "not_fp8": [(component, kind, op name), ...],
    "bf16_by_design": executions}: the GEMM executions of the `quantized` parts, how many ran as FP8 kernels,
    and the others (the routed experts' weight gradient in tokamax's grouped GEMM counted apart: BF16 by design,
    its ragged-contracting kernel has no FP8 path)."""
    parts = [m for m in matmuls if m.component in quantized]
    by_design = [m for m in parts if m.weight_gradient and not m.fp8]
    asked = [m for m in parts if not (m.weight_gradient and not m.fp8)]
    fp8 = [m for m in asked if m.fp8]
    missed = list(dict.fromkeys((m.component, m.kind, m.op_name) for m in asked if not m.fp8))
    kernels = {}
    for m in fp8:
        kernels.setdefault(m.component, {}).setdefault(m.kind, 0)
        kernels[m.component][m.kind] += m.times
    return {"asked": sum(m.times for m in asked), "fp8": sum(m.times for m in fp8),
            "asked_flops": sum(m.flops for m in asked), "fp8_flops": sum(m.flops for m in fp8),
            "kernels": kernels, "not_fp8": [list(k) for k in missed], "bf16_by_design": sum(m.times for m in by_design)}


def audit(text, model_flops, multiples=None, quantized=()):
    """The audit report (a dict) of a compiled module's text against {component: model FLOPs per device}
    (train/flops.by_component divided by the devices; None: totals only); `multiples` {component: x}: what
    the model's own configuration makes a part take by construction (on top of EXPECTED), e.g. a capacity
    factor's padded expert rows; `quantized`: the parts quant.mode runs in FP8 (the report's `fp8`)."""
    expected_of = {**EXPECTED, **(multiples or {})}
    c = count(text)
    parts = {}
    for m in c.matmuls:
        entry = parts.setdefault(m.component, {"compiled_flops": 0.0, "recompute_flops": 0.0})
        entry["compiled_flops"] += m.flops
        if m.phase == "recompute":
            entry["recompute_flops"] += m.flops
    model_total = sum(model_flops.values()) if model_flops else None
    warnings = []
    for name, entry in parts.items():
        model = (model_flops or {}).get(name)
        entry["model_flops"] = model
        entry["ratio"] = entry["compiled_flops"] / model if model else None
        expected = expected_of.get(name, 1.0)
        if model and entry["compiled_flops"] - entry["recompute_flops"] > TOLERANCE * expected * model:
            warnings.append(f"{name}: {entry['compiled_flops'] / model:.2f}x its model FLOPs (expected "
                            f"{expected:g}x + recomputation: {_pflop(entry['compiled_flops'])} compiled, "
                            f"{_pflop(entry['recompute_flops'])} of it recomputed, against {_pflop(model)})")
    for op_name, flops in c.dense_ragged_dots[:1]:
        warnings.append(f"XLA lowered ragged_dot to a dense dot over every expert ({len(c.dense_ragged_dots)} "
                        f"dot(s), {_pflop(sum(f for _, f in c.dense_ragged_dots))}; e.g. {op_name})")
    return {"compiled_matmul_flops": c.total, "model_flops": model_total,
            "ratio": c.total / model_total if model_total else None,
            "recompute_flops": sum(e["recompute_flops"] for e in parts.values()),
            "xla_remat_flops": sum(m.flops for m in c.matmuls if m.cloned),
            "components": parts, "unreadable_kernels": c.kernels, "counted_kernels": c.counted_kernels,
            "unknown_trip_counts": c.unknown_trip_counts,
            "dense_ragged_dots": len(c.dense_ragged_dots), "warnings": warnings,
            **({"fp8": fp8_share(c.matmuls, quantized)} if quantized else {})}


def model_flops_per_device(setup):
    """{component: model FLOPs per device per step} of a TrainSetup (train/flops.by_component over its
    devices); {"model": total} when the family does not split its parameters by component."""
    from MaxOffload.train import flops

    n, c = setup.mesh.size, setup.model_config
    batch, seq_len = setup.batch_rows * setup.micro_batches, setup.seq_len  # the step's
    try:
        return {k: v / n for k, v in flops.by_component(c, batch, seq_len).items()}
    except NotImplementedError:
        return {"model": flops.train_flops_per_step(c, batch, seq_len) / n}


def of_compiled(compiled, setup):
    """The audit of a TrainSetup's compiled step (a jax Compiled, or its parsed hlo.Module)."""
    module = compiled if isinstance(compiled, hlo.Module) else hlo.parse(compiled.as_text())
    numerics = setup.numerics
    return audit(module, model_flops_per_device(setup), expected_work.work_multiples(setup),
                 numerics.parts if numerics.mode != "bf16" else ())


def _pflop(n):
    return f"{n / 1e15:,.3g} PFLOP" if n >= 1e14 else f"{n / 1e12:,.3g} TFLOP" if n >= 1e11 else f"{n / 1e9:,.3g} GFLOP"


def format_audit(report):
    """Lines for the aot tool: total, per component, unreadable kernels, warnings."""
    ratio = f" = {report['ratio']:.2f}x the model FLOPs ({_pflop(report['model_flops'])})" if report["ratio"] else ""
    lines = [f"compiled matmul work per device per step: {_pflop(report['compiled_matmul_flops'])}{ratio}, "
             f"{_pflop(report['recompute_flops'])} of it recomputation"]
    if report.get("xla_remat_flops"):
        lines.append(f"  of that, {_pflop(report['xla_remat_flops'])} recomputed by XLA's own rematerialization "
                     "(instructions it cloned, *.remat: its estimate of the peak memory was over its limit); "
                     "xla.hlo_rematerialization=false leaves recomputation to the plan")
    for name, e in sorted(report["components"].items(), key=lambda kv: -kv[1]["compiled_flops"]):
        against = f" ({e['ratio']:.2f}x model)" if e["ratio"] else ""
        lines.append(f"  {name:<17} {_pflop(e['compiled_flops']):>14}{against}, recompute "
                     f"{_pflop(e['recompute_flops'])}")
    if report.get("counted_kernels"):
        bound = " (a grouped GEMM over its whole buffer: an upper bound)" if any(
            "RaggedDot" in k for k in report["counted_kernels"]) else ""
        lines.append(f"  kernels counted from their shapes{bound}: " + ", ".join(
            f"{k} x{v}" for k, v in sorted(report["counted_kernels"].items())))
    if report["unreadable_kernels"]:
        lines.append("  kernels whose FLOPs the HLO does not show: " + ", ".join(
            f"{k} x{v}" for k, v in sorted(report["unreadable_kernels"].items())))
    share = report.get("fp8")
    if share:
        by_design = f"; the routed experts' weight gradient x{share['bf16_by_design']} in BF16 by design " \
            "(tokamax's ragged-contracting grouped GEMM has no FP8 path)" if share["bf16_by_design"] else ""
        lines.append(f"FP8 GEMMs: {share['fp8']} of {share['asked']} asked ({_pflop(share['fp8_flops'])} of "
                     f"{_pflop(share['asked_flops'])}){by_design}")
        lines += [f"  FP8 {component}: " + ", ".join(f"{kind} x{n}" for kind, n in sorted(kinds.items()))
                  for component, kinds in sorted(share.get("kernels", {}).items())]
        lines += [f"  not FP8: {component} {kind} ({op_name})" for component, kind, op_name in share["not_fp8"][:8]]
    lines += [f"WARNING: compiled work: {w}" for w in report["warnings"]]
    return lines
