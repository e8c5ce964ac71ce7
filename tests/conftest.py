"""Shared test helpers. Tests run on CPU; a subprocess gets its own XLA_FLAGS when it needs
several simulated devices."""
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# LLVM's optimizations off in the programs the tests compile: here, and in the processes they start with
# process_env or this environment (a process whose XLA_FLAGS a test writes itself keeps exactly those). XLA's HLO
# passes, whose optimized program the tests read, are unchanged (the same optimized HLO text); only the machine code
# is less tuned. The tests' programs are tiny, so their compiles, not their steps, take the time: tests/test_mtp.py
# 138 -> 88 s, tests/test_training.py 48 -> 33 s, one deviceless GB200 compile 28 -> 26 s (2026-12-07). Every
# equality a test checks is between programs compiled alike.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def cpu_devices(count):
    """The environment of a process that runs on `count` CPU devices (process_env and run_cli add FAST_COMPILE)."""
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}"}


EIGHT_CPUS = cpu_devices(8)


def with_fast_compile(flags):
    """XLA_FLAGS `flags` with FAST_COMPILE, unless they set the optimization level themselves."""
    return flags if "--xla_backend_optimization_level" in flags else f"{flags} {FAST_COMPILE}".strip()


os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))


# The stacks CI tests on, in .ci/run's order (docs/testing.md). A run tests the stack of its interpreter (Python 3.12+:
# py312, else py311): the tests whose `stack` marker names it, as CI does there with the README's command; a test
# without the marker is py311's, the CPU development stack's. `--stack NAME` picks another, `--stack all` runs every
# test.
STACKS = ("py312", "py311")
UNMARKED = ("py311",)


def this_stack():
    return "py312" if sys.version_info >= (3, 12) else "py311"


def pytest_addoption(parser):
    parser.addoption("--stack", choices=STACKS + ("all",), default=None,
                     help="run the tests CI runs on this stack: unmarked ones and those marked stack(NAME) (default: "
                          "this interpreter's, py312 on Python 3.12+, else py311; all: every test)")


def selected_stack(config):
    return config.getoption("stack") or this_stack()


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", None):  # xdist would order the files by their number of tests
        config.option.loadscopereorder = False  # LONGEST_FIRST's order instead
    config.addinivalue_line("markers", "stack(*names): CI runs the test on these stacks (py311: Python 3.11, jax "
                                       "0.10.2; py312: Python 3.12, the newest jax); unmarked: on py311 only")


# The test files, longest first (their summed test times on the py311 stack): `pytest -n 2 --dist loadfile` hands
# whole files to the two workers in collection order (pytest_configure turns off xdist's own reordering, by the
# number of tests in a file), so the long files start first and the workers can finish together instead of one
# running the last long file alone. Unlisted files come after, in name order.
LONGEST_FIRST = ["test_deepseek.py", "test_resilience.py", "test_pipeline.py", "test_planner.py", "test_fp8.py",
                 "test_tpu.py", "test_grad_accum.py", "test_checkpoint.py", "test_offload.py", "test_aot.py",
                 "test_pipeline_deepseek.py", "test_mtp.py", "test_parallel.py", "test_documents.py", "test_model.py",
                 "test_pipeline_runs.py", "test_cross_entropy.py", "test_slurm.py", "test_planner_hbm.py",
                 "test_convert_hf.py", "test_moe_parts.py", "test_cli.py", "test_training.py", "test_timeline.py",
                 "test_convert.py", "test_family.py", "test_profile.py", "test_data.py", "test_rundir.py"]
# (2026-12-07: test_resilience.py and test_tpu.py, ~4 and ~2.5 minutes, had run last, unlisted, in name order: one
# worker ran them alone at the end)
# The py312 stack runs fewer tests, and its longest files are others (jax 0.12's GPU compiles take two to three times
# as long; results/ci_2026-12-07/run8_py312_slowest.txt): its own order first, then LONGEST_FIRST's
LONGEST_FIRST_PY312 = ["test_fp8.py", "test_aot.py", "test_checkpoint.py", "test_training.py",
                       "test_convert.py", "test_documents.py", "test_profile.py", "test_offload.py", "test_timeline.py"]


def pytest_collection_modifyitems(session, config, items):
    stack, keep, drop = selected_stack(config), [], []
    order = LONGEST_FIRST if stack != "py312" else \
        LONGEST_FIRST_PY312 + [name for name in LONGEST_FIRST if name not in LONGEST_FIRST_PY312]
    rank = {name: i for i, name in enumerate(order)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), item.path.name))  # stable within a file
    for item in items:
        marker = item.get_closest_marker("stack")
        named = marker.args if marker else UNMARKED
        if not named or set(named) - set(STACKS):
            raise pytest.UsageError(f"{item.nodeid}: stack{named} names no stack or an unknown one; "
                                    f"name some of {', '.join(STACKS)}")
        (keep if stack == "all" or stack in named else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# One persistent JAX compilation cache per test run (the xdist workers share it) for the train.py processes the
# tests start: dozens of them compile the same tiny steps, and a hit loads the executable instead (a 40-step tiny
# Llama run: 18.9 s -> 6.4 s). Also for the helpers that train one model under several meshes, batch layouts or
# quant modes in one process: the cache is keyed by the compiled program, so runs whose state has the same
# sharding load the first one's init (a tiny DeepSeek's on 8 CPU devices: 13.4 s -> 1.0 s; fp8_check.py's bf16
# and FP8 runs share theirs), and a job loads a reference run that an earlier job compiled (tests/test_deepseek.py's
# single_mtp); pipeline_check.py's cases load the inits of a model or mesh an earlier case compiled. Not the other
# tools: their deviceless GPU compiles are each made once (the cache does not hold them).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
TRAIN_CACHE = {"JAX_COMPILATION_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"maxoffload-tests-jax-cache-{_RUN}"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
CACHED = {"train.py", "tests/helpers/deepseek_mesh_losses.py", "tests/helpers/mesh_losses.py",
          "tests/helpers/grad_accum_check.py", "tests/helpers/fp8_check.py", "tests/helpers/pipeline_check.py"}


def process_env(args, env=None):
    """The environment of a `python ARGS...` process a test starts: this one's, `env`, the compilation cache for
    train.py and the CACHED helpers (a path relative to the repository root or absolute), FAST_COMPILE."""
    script = os.path.relpath(os.path.join(ROOT, args[0]), ROOT) if args else ""
    full = dict(os.environ, **(TRAIN_CACHE if script in CACHED else {}), **(env or {}))
    return dict(full, XLA_FLAGS=with_fast_compile(full.get("XLA_FLAGS", "")))


def predicted_steps(programs, names, rates):
    """{name: the step time MaxOffload/timeline/ predicts under `rates`} of recorded compiled programs,
    tests/data/<programs>/<name>.hlo.gz (written by benchmarks/predict_vs_measured.py --save_programs)."""
    import gzip

    from MaxOffload.timeline import simulate

    predicted = {}
    for name in names:
        with gzip.open(os.path.join(ROOT, "tests", "data", programs, f"{name}.hlo.gz"), "rt") as f:
            predicted[name] = simulate.simulate(f.read(), rates)[0]["step_s"]
    return predicted


def run_cli(args, env=None, timeout=600):
    """Runs `python ARGS...` from the repository root; returns the CompletedProcess (text)."""
    full_env = process_env(args, env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


@contextlib.contextmanager
def small_filesystem(path, size="256k", read_only=False):
    """A real tmpfs of `size` at `path` (created), mounted read-only if asked, unmounted after: a full disk or a
    read-only filesystem for a test to write into. Needs root, as CI has; elsewhere the test is skipped unless
    CI=true says it must run."""
    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, text=True)
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs ({mounted.stderr.strip() or 'mount failed'}): needs root"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}, but CI=true requires this test")
        pytest.skip(reason)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


# -- Slurm (tests/test_slurm.py, tests/test_resilience.py) ----------------------------------------------------
_SLURM_PROBLEM = []  # memo: [reason or None]


def slurm_problem():
    """Why Slurm cannot be used here (tools missing, controller down), or None."""
    if not _SLURM_PROBLEM:
        missing = [tool for tool in ("sinfo", "sbatch", "scontrol") if shutil.which(tool) is None]
        if missing:
            reason = f"Slurm not installed ({', '.join(missing)} not found)"
        else:
            ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60)
            said = (ping.stdout + ping.stderr).strip().splitlines() or ["scontrol ping failed"]
            reason = None if ping.returncode == 0 else f"slurmctld not responding ({said[0]})"
        _SLURM_PROBLEM.append(reason)
    return _SLURM_PROBLEM[0]


def require_slurm():
    reason = slurm_problem()
    if reason is None:
        return
    reason += "; `bash .ci/slurm.sh up` (root, Debian) starts a single-node Slurm"
    if os.environ.get("CI") == "true" or os.environ.get("MAXOFFLOAD_SLURM") == "1":
        pytest.fail(f"{reason}, but CI=true or MAXOFFLOAD_SLURM=1 requires it")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm():
    """Skips (or fails, in CI) before the other fixtures do any work."""
    require_slurm()


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A JAX compilation cache shared by the two 2-process runs (same program): the second skips ~15 s of
    compiling on a 2-core machine; its losses are checked all the same."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
