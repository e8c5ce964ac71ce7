"""What a fresh machine installs is what the code imports: every third-party module imported by the package,
train.py, the benchmarks and the tests is declared by setup.py — by the install requirements, or (for what
only tests, benchmarks or optional paths import) by the `test` extra. CI builds clean virtual environments,
so a missing declaration fails there too; this test names it on any machine."""
import ast
import glob
import importlib.metadata
import os
import re
import sys

from conftest import ROOT


# the project's own modules, the test modules that other tests import from (tests/ is on their path), and the
# helper scripts that import each other (a script's own folder, tests/helpers/, is on its path)
LOCAL = {"MaxOffload", "benchmarks", "conftest", "train", "helpers"} | {
    os.path.basename(p)[:-3] for pattern in ("test_*.py", "helpers/*.py")
    for p in glob.glob(os.path.join(ROOT, "tests", pattern))}


def imported_modules(paths):
    """{top-level module: first file importing it} over the given files (imports inside functions too)."""
    found = {}
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], os.path.relpath(path, ROOT))
    return {m: p for m, p in found.items() if m not in sys.stdlib_module_names and m not in LOCAL}


def declared(extra=None):
    """Normalised distribution names that MaxOffload declares (with `extra`: the install requirements plus it)."""
    names = set()
    for req in importlib.metadata.requires("MaxOffload") or []:
        name, _, marker = req.partition(";")
        if "extra ==" in marker and (extra is None or f'extra == "{extra}"' not in marker):
            continue
        names.add(_norm(re.split(r"[\s<>=!~\[]", name.strip(), maxsplit=1)[0]))
    return names


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions_of(module):
    return {_norm(d) for d in importlib.metadata.packages_distributions().get(module, [])}


# Distributions that come through a declared one: jax's `cuda13-local` extra brings the CUDA plugin.
PROVIDED_BY = {"jax-cuda13-plugin": "jax", "jax-cuda13-pjrt": "jax"}
# Modules only a GPU machine has, imported under `except ImportError` (profile/window.py: the CUDA runtime
# wheel of a GPU install of jax, for cudaProfilerStart/Stop).
OPTIONAL = {"nvidia"}


def _check(paths, allowed):
    missing = []
    for module, where in sorted(imported_modules(paths).items()):
        if module in OPTIONAL:
            continue
        dists = distributions_of(module)
        if not dists:
            missing.append(f"{module} (imported by {where}) is not installed at all")
        elif not any(d in allowed or PROVIDED_BY.get(d) in allowed for d in dists):
            missing.append(f"{module} (imported by {where}; distribution {', '.join(sorted(dists))})")
    return missing


def _files(*patterns):
    return [p for pat in patterns for p in glob.glob(os.path.join(ROOT, pat), recursive=True)]


def test_the_package_imports_only_what_it_declares():
    """MaxOffload/ and train.py: the install requirements, plus the optional extras for the optional paths
    (tokenizers, the CUDA plugin), all of which the test extra holds."""
    missing = _check(_files("MaxOffload/**/*.py", "train.py"), declared("test"))
    assert not missing, "declare in setup.py/requirements.txt: " + "; ".join(missing)


def test_the_tests_and_benchmarks_import_only_what_the_test_extra_declares():
    missing = _check(_files("tests/**/*.py", "benchmarks/**/*.py"), declared("test"))
    assert not missing, "add to the test extra in setup.py: " + "; ".join(missing)


def test_the_check_catches_an_undeclared_import():
    """The check is not vacuous: matplotlib (the sweep's chart) is outside the install requirements."""
    assert _check(_files("benchmarks/offload_sweep.py"), declared()) != []
    assert "matplotlib" in declared("test") and "matplotlib" not in declared()
