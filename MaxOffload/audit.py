"""The compiled-work audit: the matmul FLOPs a compiled step really executes, read from its optimized HLO text
(`Compiled.as_text()`), against the model FLOPs, per part of the model.

Counted, per device and step:
  - `dot` instructions, wherever they are: at the top level, inside fusions (Triton GEMM fusions included),
    calls and async computations; 2 x output elements x the product of the lhs contracting dimensions;
  - while loops: their body x the trip count XLA proved (`known_trip_count`); a loop without one is counted
    once and listed in `unknown_trip_counts`;
  - cuBLAS GEMM custom calls (`__cublas$gemm`, `__cublas$lt$matmul...`), from their dot dimension numbers;
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
A `dot` whose op name says `ragged_dot` is XLA's dense rewrite of a grouped matmul (its lhs expanded over
the experts): it is listed in `dense_ragged_dots`, a WARNING on its own.
"""
import dataclasses
import json
import math
import re

from MaxOffload.models import components

COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
KERNEL_HINTS = ("triton", "cudnn", "mosaic", "pallas", "cublas", "__gpu$")
# A part may take this much more than its expected FLOPs (plus what it recomputes) before a WARNING.
TOLERANCE = 1.15
# The multiple of its model FLOPs a part's matmuls take by construction, where the model's configuration does
# not say (audit's `multiples`). The model counts half of the causal score matrix (train/flops.py, MaxText's
# convention); attention without causal block skipping computes all of it and masks half: 2x. A training step
# knows its attention kernel and length (of_compiled: models/layers.attention_work_multiple).
EXPECTED = {components.ATTENTION_SCORES: 2.0}


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result type text: "bf16[8,16]{1,0}" or a tuple "(f32[2], s8[64]{0})"
    opcode: str
    operands: list  # operand names
    attributes: str  # everything after the operand list
    op_name: str
    payload: str = ""  # the metadata's metadata_payload (jax >= 0.12 puts tokamax's op JSON there)


def _string_end(text, i):
    """Index just past the string literal opening at text[i]."""
    j = i + 1
    while j < len(text) and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _balanced(text, start):
    """Index just past the bracket group opening at text[start] (string literals skipped)."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == '"':
            i = _string_end(text, i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def _split_top(text):
    """Splits an operand list on the commas outside brackets."""
    parts, depth, current = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def parse_instruction(line):
    match = INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.groups()
    rest = rest.strip()
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.index(" ") if " " in rest else len(rest)
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _balanced(rest, op.end() - 1)
    operands = [p.strip().split()[-1].lstrip("%") for p in _split_top(rest[op.end():close - 1]) if p.strip()]
    attributes = rest[close:]
    return Instruction(name, shape, op.group(1), operands, attributes, _metadata(attributes, "op_name"),
                       _metadata(attributes, "metadata_payload"))


def _metadata(attributes, key):
    """A string field of the metadata, unescaped (tokamax's hold JSON with quotes)."""
    start = attributes.find(f' {key}="') + 1 or attributes.find(f'{{{key}="') + 1
    if start <= 0:
        return ""
    start += len(key) + 1
    return attributes[start + 1:_string_end(attributes, start) - 1].replace('\\"', '"').replace("\\\\", "\\")


def _tokamax_op(op_name):
    """tokamax's {"op": ..., "arguments": ...} from an op name "...tokamax:{...}/...", or None."""
    start = op_name.find("tokamax:{")
    if start < 0:
        return None
    start += len("tokamax:")
    try:
        return json.loads(op_name[start:_balanced(op_name, start)])
    except ValueError:
        return None


def _ragged_dot_flops(arguments):
    """2 x lhs elements x the rhs dimensions that are neither contracted, batch nor group dimensions."""
    lhs, rhs = dims(arguments["lhs"]), dims(arguments["rhs"])
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
# tokamax's flash attention: operands (q, k, v, ...); the model calls it causal only (models/layers.attention).
# Its forward comes as two kernels (without and with the residuals the VJP reads), both one forward pass.
def _triton_flash_forward_flops(operands, out):
    return _attention_flops(operands[0], operands[2], True, False)


def _triton_flash_vjp_flops(operands, out):
    return _attention_flops(operands[0], operands[2], True, True)


TRITON_KERNELS.update({name: ("PallasTritonFlashAttention", _triton_flash_forward_flops)
                       for name in ("pallas_flash_attention", "pallas_flash_attention_fwd_res")})
TRITON_KERNELS["pallas_flash_attention_vjp"] = ("PallasTritonFlashAttentionVjp", _triton_flash_vjp_flops)


def triton_flops(ins):
    """(tokamax op, FLOPs of one call) of a Triton custom call by its kernel's name and operand shapes, or None."""
    name = re.search(r'[{,]\s*name = "([^"]+)"', ins.attributes)
    start = ins.attributes.find("operand_layout_constraints={")
    if not name or name.group(1) not in TRITON_KERNELS or start < 0:
        return None
    start += len("operand_layout_constraints=")
    operands = [dims(p) for p in _split_top(ins.attributes[start + 1:_balanced(ins.attributes, start) - 1])]
    op, flops = TRITON_KERNELS[name.group(1)]
    return op, flops(operands, dims(ins.shape))


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


def parse_module(text):
    """{computation name: [Instruction]} and the entry computation's name."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        header = COMPUTATION.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None:
            instruction = parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    return computations, entry


def dims(shape_text):
    """The dimensions of an array type text (the first array of a tuple)."""
    match = SHAPE.search(shape_text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def _int_list(attributes, key):
    match = re.search(key + r"=\{([0-9,]*)\}", attributes)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _called(attributes, key):
    match = re.search(key + r"=%?([^\s,}]+)", attributes)
    return match.group(1) if match else None


@dataclasses.dataclass
class Matmul:
    flops: float  # per execution x how many times its enclosing loops run it
    op_name: str
    kind: str  # "dot" | "cublas" | a tokamax kernel's op class
    cloned: bool = False  # inside an instruction XLA's rematerialization cloned (*.remat*)

    @property
    def component(self):
        tokens = re.findall(r"[A-Za-z_][\w]*", self.op_name)
        if "ragged_dot" in self.op_name:
            return components.EXPERTS
        return next((t for t in reversed(tokens) if t in components.ALL), "other")

    @property
    def phase(self):
        if self.cloned or "rematted_computation" in self.op_name:
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


def count(text):
    """Count: every matmul of the module (scaled by its loops' trip counts), the unreadable kernels."""
    computations, entry = parse_module(text)
    if entry is None:
        raise ValueError("not an HLO module: no ENTRY computation")
    out = Count()

    def matmul(ins, shapes, kind, contracting, times, cloned):
        lhs = dims(shapes.get(ins.operands[0], "")) if ins.operands else []
        flops = 2 * math.prod(dims(ins.shape)) * math.prod(lhs[d] for d in contracting if d < len(lhs))
        return Matmul(flops * times, ins.op_name, kind, cloned)

    def walk(name, times, stack=(), cloned=False):
        """[Matmul] of computation `name` run `times` times (`cloned`: by XLA's rematerialization)."""
        if name not in computations or name in stack:
            return []
        body, stack, found = computations[name], stack + (name,), []
        shapes = {i.name: i.shape for i in body}
        for ins in body:
            here = cloned or ".remat" in ins.name
            if ins.opcode == "dot":
                found.append(matmul(ins, shapes, "dot", _int_list(ins.attributes, "lhs_contracting_dims"), times,
                                    here))
                if "ragged_dot" in ins.op_name:
                    out.dense_ragged_dots.append((ins.op_name, found[-1].flops))
            elif ins.opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', ins.attributes)
                target = target.group(1) if target else "?"
                kernel = kernel_flops(ins.payload) or kernel_flops(ins.op_name) or triton_flops(ins)
                if target.startswith(GEMM_TARGETS):
                    axes = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attributes)
                    axes = [int(a.strip('" ')) for a in axes.group(1).split(",") if a.strip('" ')] if axes else []
                    found.append(matmul(ins, shapes, "cublas", axes, times, here))
                elif kernel:
                    found.append(Matmul(kernel[1] * times, ins.op_name, kernel[0], here))
                    out.counted_kernels[kernel[0]] = out.counted_kernels.get(kernel[0], 0) + times
                elif any(h in target.lower() for h in KERNEL_HINTS):
                    out.kernels[target] = out.kernels.get(target, 0) + times
            elif ins.opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attributes)
                if not trips:
                    out.unknown_trip_counts.append(ins.op_name or ins.name)
                found += walk(_called(ins.attributes, "body"), times * (int(trips.group(1)) if trips else 1), stack,
                              here)
            elif ins.opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attributes)
                names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else
                         [_called(ins.attributes, "true_computation"), _called(ins.attributes, "false_computation")])
                found += max((walk(b, times, stack, here) for b in names),
                             key=lambda ms: sum(m.flops for m in ms), default=[])
            else:
                for key in ("calls", "to_apply") if ins.opcode == "call" else ("calls",):
                    if _called(ins.attributes, key):
                        found += walk(_called(ins.attributes, key), times, stack, here)
        return found

    out.matmuls = walk(entry, 1)
    return out


def audit(text, model_flops, multiples=None):
    """The audit report (a dict) of a compiled module's text against {component: model FLOPs per device}
    (train/flops.by_component divided by the devices; None: totals only); `multiples` {component: x}: what
    the model's own configuration makes a part take by construction (on top of EXPECTED), e.g. a capacity
    factor's padded expert rows."""
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
            "components": parts, "unreadable_kernels": c.kernels, "counted_kernels": c.counted_kernels,
            "unknown_trip_counts": c.unknown_trip_counts,
            "dense_ragged_dots": len(c.dense_ragged_dots), "warnings": warnings}


def model_flops_per_device(setup):
    """{component: model FLOPs per device per step} of a TrainSetup (train/flops.by_component over its
    devices); {"model": total} when the family does not split its parameters by component."""
    from MaxOffload.train import flops

    n, c = setup.mesh.size, setup.model_config
    batch, seq_len = setup.cfg.train.per_device_batch_size * n, setup.cfg.train.seq_len
    try:
        return {k: v / n for k, v in flops.by_component(c, batch, seq_len).items()}
    except NotImplementedError:
        return {"model": flops.train_flops_per_step(c, batch, seq_len) / n}


def work_multiples(setup):
    """{component: x} a TrainSetup's step takes by construction: its model configuration's, and its attention
    kernel's at its sequence length."""
    from MaxOffload.models import layers

    c = setup.model_config
    multiples = dict(c.compiled_work_multiples())
    if hasattr(c, "attention") and hasattr(c, "attention_dims"):
        _, _, qk_dim, v_dim = c.attention_dims()
        multiples[components.ATTENTION_SCORES] = layers.attention_work_multiple(c.attention, setup.cfg.train.seq_len,
                                                                                qk_dim, v_dim)
    return multiples


def of_compiled(compiled, setup):
    """The audit of a TrainSetup's compiled step."""
    return audit(compiled.as_text(), model_flops_per_device(setup), work_multiples(setup))


def _pflop(n):
    return f"{n / 1e15:,.3g} PFLOP" if n >= 1e14 else f"{n / 1e12:,.3g} TFLOP" if n >= 1e11 else f"{n / 1e9:,.3g} GFLOP"


def format_audit(report):
    """Lines for the aot tool: total, per component, unreadable kernels, warnings."""
    ratio = f" = {report['ratio']:.2f}x the model FLOPs ({_pflop(report['model_flops'])})" if report["ratio"] else ""
    lines = [f"compiled matmul work per device per step: {_pflop(report['compiled_matmul_flops'])}{ratio}, "
             f"{_pflop(report['recompute_flops'])} of it recomputation"]
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
    lines += [f"WARNING: compiled work: {w}" for w in report["warnings"]]
    return lines
