"""Imports point one way: down docs/architecture.md's table of layers, and no cycle among MaxOffload's modules,
counting imports inside functions too.

`from A import B` depends on the module A.B when B is a module, else on A; a package's __init__ depending on
its own submodules is the package's surface, not a cycle (a submodule does not import its package's
__init__ names here)."""
import ast
import os
import re

from conftest import ROOT


PACKAGE = "MaxOffload"


def modules():
    found = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module[:-len(".__init__")] if module.endswith(".__init__") else module] = path
    return found


def import_graph(found):
    def target(name):
        while name not in found and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in found else None

    graph = {}
    for module, path in found.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in found else node.module
                         for a in node.names]
            else:
                continue
            deps.update(t for t in map(target, names) if t and t != module and t.startswith(PACKAGE))
        graph[module] = deps
    return graph


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph(modules())
    found = cycles(graph)
    detail = ["; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c) for c in found]
    assert not found, "import cycles: " + " | ".join(detail)


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def layers(text):
    """[(layer name, [module or package prefix, ...])] from the table under "## Layers" in docs/architecture.md, top
    first: `aot.py` -> "MaxOffload.aot", `models/` -> "MaxOffload.models" (the package and every module in it)."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= set("-"):
            continue
        paths = re.findall(r"`([\w/]+(?:\.py|/))`", cells[1])
        out.append((cells[0], [PACKAGE + "." + p.removesuffix(".py").removesuffix("/").replace("/", ".")
                               for p in paths]))
    return out


def layer_of(module, table):
    """The index (0 = top) of the layer whose entry is the longest prefix of `module`, or None."""
    best = None
    for index, (_, entries) in enumerate(table):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > best[1]):
                best = (index, len(entry))
    return best[0] if best else None


def direction_problems(graph, table):
    """Modules the table does not place (an empty package __init__ aside), and imports that point up it."""
    problems = []
    for module in sorted(graph):
        here = layer_of(module, table)
        if here is None:
            is_package = any(m.startswith(module + ".") for m in graph)
            if graph[module] or not is_package:  # an empty package __init__ needs no place
                problems.append(f"{module} is in no layer of docs/architecture.md")
            continue
        for dep in sorted(graph[module]):
            there = layer_of(dep, table)
            if there is not None and there < here:
                problems.append(f"{module} ({table[here][0]}) imports {dep} ({table[there][0]}), a layer above it")
    return problems


def test_imports_point_down_the_architecture_layers():
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        table = layers(f.read())
    assert [name for name, _ in table][0] == "runs and tools" and len(table) >= 6
    problems = direction_problems(import_graph(modules()), table)
    assert not problems, "\n".join(problems)


def test_the_direction_check_finds_an_upward_import():
    table = layers("## Layers\n| layer | modules | job |\n|---|---|---|\n| top | `aot.py`, `train/` | x |\n"
                   "| bottom | `errors.py`, `train/flops.py` | y |\n\n## Next\n")
    assert table == [("top", ["MaxOffload.aot", "MaxOffload.train"]),
                     ("bottom", ["MaxOffload.errors", "MaxOffload.train.flops"])]
    graph = {"MaxOffload.aot": {"MaxOffload.errors"}, "MaxOffload.errors": set(),
             "MaxOffload.train.step": {"MaxOffload.train.flops"}, "MaxOffload.train.flops": {"MaxOffload.aot"},
             "MaxOffload.stray": set()}
    assert direction_problems(graph, table) == [
        "MaxOffload.stray is in no layer of docs/architecture.md",
        "MaxOffload.train.flops (bottom) imports MaxOffload.aot (top), a layer above it"]


def test_errors_is_a_leaf():
    """Every layer raises MaxOffload.errors' kinds: it imports nothing from the package and no JAX."""
    with open(os.path.join(ROOT, PACKAGE, "errors.py")) as f:
        tree = ast.parse(f.read())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + \
               [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m and (m.startswith(PACKAGE) or m.split(".")[0] in ("jax", "jaxlib"))]


def _source_reads(path, attribute):
    """Lines of a module that access `attribute` on anything (e.g. logical.active)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == attribute]


def test_models_never_read_the_active_mesh_nor_the_offload_config():
    """The models take the OffloadPlan and the ParallelLayout; the mesh and cfg.remat/cfg.offload stay outside
    (MaxOffload/from_config.py reads the config, TrainSetup the mesh)."""
    models_dir = os.path.join(ROOT, PACKAGE, "models")
    for name in sorted(os.listdir(models_dir)):
        if name.endswith(".py"):
            path = os.path.join(models_dir, name)
            for attribute in ("active", "remat", "offload"):
                assert not _source_reads(path, attribute), f"models/{name} reads .{attribute}"


def _python_files(relative):
    """The .py files under MaxOffload/`relative` (a directory, or one file)."""
    path = os.path.join(ROOT, PACKAGE, relative)
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, name) for d, _, files in os.walk(path) for name in files if name.endswith(".py"))


def test_models_state_structure_and_leave_the_audit_to_the_audit():
    """What a part of the compiled step computes by construction is the audit's arithmetic (expected_work.py): no
    file in models/ mentions the audit, docstrings and comments included."""
    mentions = []
    for path in _python_files("models"):
        with open(path) as f:
            mentions += [f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}" for n, line in enumerate(f, 1)
                         if "audit" in line.lower()]
    assert not mentions, "\n".join(mentions)


# Code that must never read this process's devices or backend: it is built for the devices it is handed (a mesh, a
# kernel chosen by models/kernels.for_platform), which for a deviceless compile are not this process's. Paths under
# MaxOffload/, a directory or one file.
NO_DEVICE_READS = ["models/", "train/step.py", "from_config.py"]
DEVICE_READS = ("jax.devices", "jax.local_devices", "jax.default_backend")


def device_reads(path):
    """['line: call'] of the calls in a module's code (comments and strings aside) that read the process's devices."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    calls = sorted((n.lineno, ast.unparse(n.func)) for n in ast.walk(tree) if isinstance(n, ast.Call))
    return [f"{line}: {name}(...)" for line, name in calls if name in DEVICE_READS]


def test_code_below_the_edge_never_reads_this_process_s_devices():
    found = {os.path.relpath(path, ROOT): reads for relative in NO_DEVICE_READS for path in _python_files(relative)
             if (reads := device_reads(path))}
    assert not found, found


def test_the_device_read_check_finds_a_call_and_not_a_comment(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""jax.devices() in a docstring"""\nimport jax\n# jax.default_backend()\n'
                      "x = jax.devices()[0]\ny = jax.local_devices(process_index=0)\n")
    assert device_reads(str(module)) == ["4: jax.devices(...)", "5: jax.local_devices(...)"]
