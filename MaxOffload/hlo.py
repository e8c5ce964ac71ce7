"""The one reader of XLA's optimized HLO text (`Compiled.as_text()`, or a `*after_optimizations.txt` dump).

A GPU compile's module is printed in schedule order (`is_scheduled=true`): each computation's instructions in
the order the GPU runs them. The compiled-work audit (audit.py) counts matmuls on what this reads, the step-time
timeline (timeline/) simulates it.

Read per instruction: its name, result type (an array type `bf16[8,16]{1,0}` or a tuple of them), opcode,
operand names, the attribute text after the operand list, and the metadata's `op_name` and
`metadata_payload`. Array types say their dimensions, element size and memory space: `S(5)` in the layout is
pinned host memory (an offloaded buffer).
"""
import dataclasses
import functools
import math
import re

COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
HOST_MEMORY_SPACE = "S(5)"  # XLA's memory space of pinned host buffers on GPUs
# bits per element; a type not listed (token, opaque) holds no bytes
ELEMENT_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
                "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
                "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8,
                "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4, "f6e2m3fn": 6, "f6e3m2fn": 6}


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple
    host: bool  # in pinned host memory (memory space S(5))

    @property
    def bytes(self):
        return math.prod(self.dims) * ELEMENT_BITS.get(self.dtype, 0) // 8


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result type text: "bf16[8,16]{1,0}" or a tuple "(f32[2], s8[64]{0})"
    opcode: str
    operands: list  # operand names
    attributes: str  # everything after the operand list
    op_name: str
    payload: str = ""  # the metadata's metadata_payload (jax >= 0.12 puts tokamax's op JSON there)

    def called(self, key):
        """The computation an attribute names (`calls`, `body`, `condition`, `to_apply`, ...), or None."""
        return _called(self.attributes, key)

    def branches(self):
        """A conditional's branch computations."""
        match = re.search(r"branch_computations=\{([^}]*)\}", self.attributes)
        if match:
            return [b.strip().lstrip("%") for b in match.group(1).split(",")]
        return [b for b in (self.called("true_computation"), self.called("false_computation")) if b]

    def trip_count(self):
        """A while loop's trip count as XLA proved it (`known_trip_count`), or None."""
        match = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', self.attributes)
        return int(match.group(1)) if match else None

    def int_list(self, key):
        return _int_list(self.attributes, key)

    def target(self):
        """A custom call's target, or ''."""
        match = re.search(r'custom_call_target="([^"]+)"', self.attributes)
        return match.group(1) if match else ""

    @property
    def arrays(self):
        return arrays(self.shape)


@dataclasses.dataclass
class Module:
    computations: dict  # name -> [Instruction] in schedule order
    entry: str

    @functools.cached_property
    def _shapes(self):
        return {name: {i.name: i.shape for i in body} for name, body in self.computations.items()}

    def shapes(self, computation):
        """{instruction name: result type text} of one computation (operands are named, not typed, in the text)."""
        return self._shapes.get(computation, {})

    def root(self, computation):
        body = self.computations.get(computation) or [None]
        return body[-1]

    def trip_count(self, loop):
        """A while loop's trip count: the one XLA proved (`known_trip_count`), else from its induction variable
        (backend_config's `known_induction_variable` with its `init` and `step`, or, where the backend writes no such
        config (TPU), the variable's initial constant in the loop's input tuple and its constant increment in the
        body) and the bound its condition compares it with (`i < N`); XLA's loop pipelining leaves the latter form
        (one iteration peeled out of the loop, the rest counted here). None when neither is readable."""
        known = loop.trip_count()
        if known is not None:
            return known
        condition = loop.called("condition")
        compared = self._compared(condition, self.root(condition)) if condition else None  # (i, N) of `i < N`
        if not compared or not compared[0] or compared[0][0] != "element":
            return None
        index = compared[0][1]
        variable = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}', loop.attributes)
        if variable:
            if int(variable.group(1)) != index:
                return None
            steps = re.search(r'\{"tuple_index":"%s","init":"(-?\d+)","step":"(-?\d+)"\}' % index, loop.attributes)
            init, step = (int(g) for g in steps.groups()) if steps else (None, None)
        if not variable or init is None:  # no config, or one naming the variable only (XLA:GPU after loop
            #                                pipelining: {"tuple_index":"0"}): read the variable itself
            init, step = self._initial(loop, index), self._increment(loop.called("body"), index)
        bound = compared[1][1] if compared[1] and compared[1][0] == "constant" else None
        if bound is None or init is None or step is None or step <= 0:
            return None
        return max(0, -(-(bound - init) // step))

    @functools.cached_property
    def _home(self):
        """{instruction name: the computation holding it}."""
        return {i.name: c for c, body in self.computations.items() for i in body}

    def _containing(self, ins):
        return self._home.get(ins.name)

    def _initial(self, loop, index):
        """The constant the loop's input tuple holds at `index`, or None."""
        home = self._containing(loop)
        start = self._find(home, loop.operands[0]) if home and loop.operands else None
        if start is None or start.opcode != "tuple" or index >= len(start.operands):
            return None
        value = self._resolve(home, start.operands[index], None)
        return value[1] if value and value[0] == "constant" else None

    def _increment(self, body, index):
        """c of a body whose root tuple holds `tuple[index] + c` at `index` (c a constant; the add through one
        fusion, as XLA:GPU fuses it after loop pipelining), or None."""
        root = self.root(body)
        if root is None or root.opcode != "tuple" or index >= len(root.operands):
            return None
        return self._added(body, self._through_copies(body, self._find(body, root.operands[index])), index)

    def _added(self, computation, add, index, params=None):
        if add is not None and add.opcode == "fusion" and params is None:
            fused = add.called("calls")
            return self._added(fused, self._through_copies(fused, self.root(fused)), index,
                               params=self._params(computation, add))
        if add is None or add.opcode != "add" or len(add.operands) != 2:
            return None
        a, b = (self._resolve(computation, name, params) for name in add.operands)
        for x, y in ((a, b), (b, a)):
            if x == ("element", index) and y and y[0] == "constant":
                return y[1]
        return None

    def _params(self, computation, fusion):
        """The instructions (through copies) that feed a fusion's parameters, in order."""
        return [self._through_copies(computation, self._find(computation, name)) for name in fusion.operands]

    def _through_copies(self, computation, ins):
        while ins is not None and ins.opcode in ("copy", "bitcast") and ins.operands:
            ins = self._find(computation, ins.operands[0])
        return ins

    def _compared(self, computation, compare, params=None):
        """The resolved (left, right) operands of a condition's `a < b` rooted at `compare` (through one fusion),
        or None."""
        if compare is None:
            return None
        if compare.opcode == "fusion":
            fused = compare.called("calls")
            return self._compared(fused, self.root(fused), params=self._params(computation, compare))
        if compare.opcode != "compare" or "direction=LT" not in compare.attributes or len(compare.operands) != 2:
            return None
        return tuple(self._resolve(computation, name, params) for name in compare.operands)

    def gathered_bytes(self, computation, times=1):
        """Bytes of floating-point data all-gathers produce (their results: weights and activations, not the
        integer indices a sharded lookup gathers) when `computation` runs `times` times: through while loops
        (x their trip count, 1 when unknown), calls and conditionals (their dearest branch)."""
        return self.collective_bytes(computation, ("all-gather",), times)

    def reduced_bytes(self, computation, times=1):
        """Bytes of floating-point results all-reduces and reduce-scatters deliver (gradients, mostly; a combined
        reduction's tuple summed), counted as gathered_bytes counts."""
        return self.collective_bytes(computation, ("all-reduce", "reduce-scatter"), times, combined=True)

    def collective_bytes(self, computation, kinds, times=1, combined=False):
        """Bytes of floating-point data of each collective of `kinds`, summed as `computation` runs `times` times:
        its largest array (a start's tuple holds input and output: an all-gather's result), or with `combined` the
        sum of its result's arrays (a combined collective's tuple)."""
        total = 0
        for ins in self.computations.get(computation, ()):
            if ins.opcode in kinds or ins.opcode in (f"{k}-start" for k in kinds):
                floats = [a.bytes for a in ins.arrays if a.dtype[0] in "fb"]
                total += times * (sum(floats) if combined else max(floats, default=0))
            elif ins.opcode == "while":
                total += self.collective_bytes(ins.called("body"), kinds, times * (self.trip_count(ins) or 1),
                                               combined)
            elif ins.opcode == "call":
                total += self.collective_bytes(ins.called("to_apply") or ins.called("calls"), kinds, times, combined)
            elif ins.opcode == "conditional":
                total += max((self.collective_bytes(b, kinds, times, combined) for b in ins.branches()), default=0)
        return total

    def _find(self, computation, name):
        return next((i for i in self.computations.get(computation, ()) if i.name == name), None)

    def _resolve(self, computation, name, params):
        """("element", i) for get-tuple-element(parameter, index=i), ("constant", n) for an integer constant,
        following copies and a fusion's parameters to the instructions that feed them; else None."""
        ins = self._through_copies(computation, self._find(computation, name))
        if ins is None:
            return None
        if ins.opcode == "parameter" and params is not None:
            number = int(ins.operands[0]) if ins.operands and ins.operands[0].isdigit() else None
            outer = params[number] if number is not None and number < len(params) else None
            return self._resolve_outer(outer)
        return self._resolve_outer(ins)

    @staticmethod
    def _resolve_outer(ins):
        if ins is None:
            return None
        if ins.opcode == "constant" and ins.operands and re.fullmatch(r"-?\d+", ins.operands[0]):
            return ("constant", int(ins.operands[0]))
        element = re.search(r"\bindex=(\d+)", ins.attributes)
        if ins.opcode == "get-tuple-element" and element:
            return ("element", int(element.group(1)))
        return None


def _string_end(text, i):
    """Index just past the string literal opening at text[i]."""
    j = i + 1
    while j < len(text) and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    return j + 1


def balanced(text, start):
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


def split_top(text):
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
        end = balanced(rest, 0)
    else:
        end = rest.index(" ") if " " in rest else len(rest)
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = balanced(rest, op.end() - 1)
    operands = [p.strip().split()[-1].lstrip("%") for p in split_top(rest[op.end():close - 1]) if p.strip()]
    attributes = rest[close:]
    return Instruction(name, shape, op.group(1), operands, attributes, metadata(attributes, "op_name"),
                       metadata(attributes, "metadata_payload"))


def metadata(attributes, key):
    """A string field of the metadata, unescaped (tokamax's hold JSON with quotes)."""
    start = attributes.find(f' {key}="') + 1 or attributes.find(f'{{{key}="') + 1
    if start <= 0:
        return ""
    start += len(key) + 1
    return attributes[start + 1:_string_end(attributes, start) - 1].replace('\\"', '"').replace("\\\\", "\\")


_INSTRUCTION_START = re.compile(r"^\s+(ROOT\s+)?%")


def _logical_lines(text):
    """The lines of an HLO text with each instruction on one: XLA:TPU writes a Mosaic kernel's metadata (a
    frontend attribute) over several lines, its op name on the last; a line that starts no instruction, header or
    closing brace, or a brace while the instruction's braces are still open, continues the one before."""
    pending = None
    for line in text.splitlines():
        starts = _INSTRUCTION_START.match(line) or COMPUTATION.match(line)
        closes = line.strip() == "}" and (pending is None or pending.count("{") <= pending.count("}"))
        if pending is not None and not starts and not closes and line.strip():
            pending += " " + line.strip()
            continue
        if pending is not None:
            yield pending
            pending = None
        if _INSTRUCTION_START.match(line):
            pending = line
        else:
            yield line
    if pending is not None:
        yield pending


def parse(text):
    """The Module of an HLO text; ValueError when it has no ENTRY computation."""
    computations, entry, current = {}, None, None
    for line in _logical_lines(text):
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
    if entry is None:
        raise ValueError("not an HLO module: no ENTRY computation")
    return Module(computations, entry)


def arrays(type_text):
    """The arrays of a type text (one, or a tuple's in order)."""
    return [Array(dtype, tuple(int(d) for d in dims.split(",") if d), HOST_MEMORY_SPACE in (layout or ""))
            for dtype, dims, layout in ARRAY.findall(type_text)]


def dims(type_text):
    """The dimensions of an array type text (the first array of a tuple)."""
    found = arrays(type_text)
    return list(found[0].dims) if found else []


def nbytes(type_text, host=None):
    """Bytes of a type text; host=True / False: only its arrays in pinned host / device memory."""
    return sum(a.bytes for a in arrays(type_text) if host is None or a.host == host)


def _int_list(attributes, key):
    match = re.search(key + r"=\{([0-9,]*)\}", attributes)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _called(attributes, key):
    match = re.search(r"\b" + key + r"=%?([^\s,}]+)", attributes)
    return match.group(1) if match else None
