"""The command line every tool shares (MaxOffload/cli.py): --help everywhere, one spelling per option,
one line and exit 2 for a mistake; the missing-CUDA-plugin message; the guard for the known XLA offload
miscompile (MaxOffload/offload/xla_bugs.py)."""
import glob
import os
import sys

import pytest

from conftest import ROOT, run_cli
from MaxOffload import cli
from MaxOffload.errors import ConfigError


TINY = ["configs/llama3_1.py:tiny", "train.seq_len=32", "train.per_device_batch_size=2", "data.source=synthetic",
        "model.compute_dtype=float32"]


def tools():
    """Every file of the repository with a `__main__` block: each is a command-line tool."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        if rel.startswith(("tests", "build", ".")) or "site-packages" in rel:
            continue
        with open(path) as f:
            if 'if __name__ == "__main__":' not in f.read():
                continue
        found.append(["-m", rel[:-3].replace("/", ".")] if rel.startswith("MaxOffload/") else [rel])
    return found


TOOLS = tools()


def test_the_tool_list_is_found():
    names = [" ".join(t) for t in TOOLS]
    for expected in ("train.py", "-m MaxOffload.aot", "-m MaxOffload.offload.inspect", "-m MaxOffload.offload.parity",
                     "-m MaxOffload.offload.planner", "-m MaxOffload.parallel.launch_env",
                     "benchmarks/offload_sweep.py", "benchmarks/planner_order.py"):
        assert expected in names, names


@pytest.mark.parametrize("tool", TOOLS, ids=[" ".join(t) for t in TOOLS])
def test_every_tool_answers_help(tool):
    result = run_cli([*tool, "--help"], timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout.lower()
    assert "usage" in out or "python" in out, result.stdout[:300]
    assert "first argument must be" not in out + result.stderr.lower()
    assert "Traceback" not in result.stderr


def test_key_options_are_the_config_keys_and_the_last_one_wins():
    argv, values, flags = cli.parse(["c.py", "aot.target=h200", "--target", "gb200", "--topology=1x2x4",
                                     "--no_confirm", "--output_dir", "runs/x"],
                                    "doc", keys=("--target", "--topology", "--output_dir"), flags=("--no_confirm",))
    assert argv == ["c.py", "aot.target=h200", "aot.target=gb200", "aot.topology=1x2x4", "run.output_dir=runs/x"]
    assert flags == {"--no_confirm": True} and values == {}
    argv, _, _ = cli.parse(["c.py", "--target", "gb200", "aot.target=h200"], "doc", keys=("--target",))
    from MaxOffload.config import load

    assert load(["configs/llama3_1.py:tiny", *argv[1:]]).aot.target == "h200"  # the last one given wins


@pytest.mark.parametrize("argv, words", [
    (["c.py", "--target"], ["--target needs a value"]),
    (["c.py", "--target", "--no_confirm"], ["--target needs a value"]),
    (["c.py", "--target="], ["--target needs a non-empty value"]),
    (["c.py", "--taget", "gb200"], ["unknown option --taget", "--target"]),
])
def test_option_mistakes_are_config_errors(argv, words):
    with pytest.raises(ConfigError) as e:
        cli.parse(argv, "doc", keys=("--target",), flags=("--no_confirm",))
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("tool", [["-m", "MaxOffload.aot"], ["-m", "MaxOffload.offload.planner"]])
def test_a_target_option_without_value_is_one_line_exit_2(tool):
    result = run_cli([*tool, *TINY, "--topology"], timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["error: --topology needs a value: --topology VALUE or --topology=VALUE"]


def test_an_unknown_option_is_one_line_exit_2(tmp_path):
    result = run_cli(["-m", "MaxOffload.offload.inspect", *TINY, f"run.output_dir={tmp_path}", "--no_cpu_mem"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown option --no_cpu_mem" in lines[0] and "--no_cpu_memory" in lines[0], lines


# Runs a tool as __main__ with the `jax_plugins` namespace unimportable, as on a machine without the plugin.
NO_PLUGIN = ("import runpy, sys; sys.modules['jax_plugins'] = None; sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__') if sys.argv[0].endswith('.py') else "
             "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


@pytest.mark.parametrize("args", [["MaxOffload.aot", *TINY],
                                  ["train.py", *TINY, "remat.policy=auto", "run.dry_run=true"]])
def test_without_the_cuda_plugin_the_tools_print_the_pip_line(args, tmp_path):
    import jaxlib

    result = run_cli(["-c", NO_PLUGIN, *args, f"run.output_dir={tmp_path}"], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    v = jaxlib.__version__
    assert f"pip install 'jax-cuda13-plugin=={v}' 'jax-cuda13-pjrt=={v}'" in lines[0], lines[0]


# --- the known XLA offload miscompile (openxla/xla#46231): jaxlib 0.10.1 - 0.11.0 on GPUs

@pytest.mark.parametrize("version, affected", [("0.10.0", False), ("0.10.1", True), ("0.10.2", True),
                                               ("0.11.0", True), ("0.11.1", False), ("0.11.2", False),
                                               ("0.12.0.1", False), ("0.10.2.dev20260601", True)])
def test_the_miscompile_is_named_for_the_affected_jaxlibs(version, affected):
    from MaxOffload.offload import xla_bugs

    line = xla_bugs.offload_miscompile(version)
    assert (line is not None) == affected
    if affected:
        assert "openxla/xla#46231" in line and ">= 0.11.1" in line and version in line


@pytest.mark.parametrize("version, gated", [("0.10.2", True), ("0.11.2", False)])
def test_offloading_on_a_gpu_with_an_affected_jaxlib_turns_the_parity_gate_on(version, gated, tmp_path,
                                                                              monkeypatch, capsys):
    """Faked: the jaxlib version and the devices' platform; the parity check itself is replaced by a recorder
    (it is tested in test_offload.py)."""
    import jaxlib

    from MaxOffload.offload import parity
    from MaxOffload.train import trainer

    sys.path.insert(0, ROOT)
    import train

    calls = []
    monkeypatch.setattr(jaxlib, "__version__", version)
    monkeypatch.setattr(trainer, "platform_of", lambda setup: "gpu")
    monkeypatch.setattr(parity, "compare", lambda cfg, presets=(): calls.append(cfg) or (2.0, 1e-5, [
        ("this config", 2.0, 0.0, 0.0, True)]))
    argv = TINY + [f"run.output_dir={tmp_path}", "train.steps=1", "train.warmup_steps=0", "checkpoint.enabled=false"]
    assert train.main(argv + ["remat.tensors.mlpwi_0=offload"]) == 0
    out = capsys.readouterr().out
    assert ("openxla/xla#46231" in out) == gated and bool(calls) == gated, out[-3000:]
    if gated:
        assert "turning the parity gate (offload.verify_parity) on" in out
    calls.clear()
    assert train.main(argv + ["remat.policy=minimal", f"run.output_dir={tmp_path}/2"]) == 0  # nothing offloaded
    assert not calls and "openxla/xla#46231" not in capsys.readouterr().out


# --- hostile arguments: one line and exit 2 from every tool, before any JAX work where the tool allows it

def assert_one_line(result, *words):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr.lower(), result.stderr[-3000:]
    assert all(w in lines[0] for w in words), (words, lines[0])


@pytest.mark.parametrize("tool", TOOLS, ids=[" ".join(t) for t in TOOLS])
def test_every_tool_answers_a_bad_option_with_one_line(tool):
    assert_one_line(run_cli([*tool, "--no_such_option"], timeout=120))


@pytest.mark.parametrize("argv, words", [
    (["-m", "MaxOffload.profile.overlap"], ["give one trace directory, got 0"]),
    (["-m", "MaxOffload.profile.overlap", "a", "b"], ["give one trace directory, got 2"]),
    (["-m", "MaxOffload.convert"], ["no command given", "from-hf or to-hf"]),
    (["-m", "MaxOffload.data.prepare", "x.txt", "--out", "o", "--eval_fraction", "nan"], ["--eval_fraction", "nan"]),
    (["benchmarks/cpu_efficiency.py", "--rounds", "many"], ["--rounds takes a whole number", "'many'"]),
    (["benchmarks/cpu_efficiency.py", "--matmul_size", "100000"], ["--matmul_size 100000 is above 16384"]),
    (["benchmarks/planner_order.py", "--rounds", "0"], ["--rounds takes a whole number from 1"]),
    (["benchmarks/offload_sweep.py", "--steps", "1e3"], ["--steps", "'1e3'"]),
    (["benchmarks/convert_memory.py", "--shard_size", "inf"], ["--shard_size inf"]),
    (["benchmarks/convert_memory.py", "--layers", "-2"], ["--layers", "'-2'"]),
    (["benchmarks/attention.py", "--tokens", "8192,0"], ["--tokens", "'0'"]),
    (["benchmarks/gpu/offload_check.py", "--steps", "1"], ["--steps 1", "at least 2"]),
    (["benchmarks/gpu/offload_check.py", "--variants", "remat,ofload"], ["--variants", "'ofload'"]),
])
def test_bad_option_values_are_one_line(argv, words):
    assert_one_line(run_cli(argv, timeout=120), *words)


def test_an_empty_trace_is_one_line(tmp_path):
    """A capture whose .xplane.pb holds nothing (the window saw no XLA program) is refused, not reported as 0 s."""
    run = tmp_path / "plugins" / "profile" / "2026_01_01"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(b"")
    assert_one_line(run_cli(["-m", "MaxOffload.profile.overlap", str(tmp_path)], timeout=120), "no device ops",
                    str(tmp_path))
    assert_one_line(run_cli(["-m", "MaxOffload.profile.overlap", str(tmp_path / "plugins" / "nothing")],
                            timeout=120), "no .xplane.pb")


@pytest.mark.parametrize("value", ["x", "0", "-3", "1.5", "2147483648"])
def test_whole_number_options_refuse_what_is_not_one(value):
    with pytest.raises(ConfigError, match=r"--rounds takes a whole number from 1 to 2,147,483,647"):
        cli.parse([f"--rounds={value}"], "doc", options={"--rounds": 5})


def test_whole_number_options_are_ints_and_others_stay_text():
    _, values, _ = cli.parse(["--rounds", "1_000", "--name", "7"], "doc", options={"--rounds": 5, "--name": "a"})
    assert values == {"--rounds": 1000, "--name": "7"}
    assert cli.parse([], "doc", options={"--rounds": 5})[1] == {"--rounds": 5}


def test_the_shared_argument_parser_and_finite_numbers():
    parser = cli.ArgumentParser(prog="python -m some.tool")
    parser.add_argument("--fraction", type=cli.number)
    assert parser.parse_args(["--fraction", "0.5"]).fraction == 0.5
    for bad in (["--fraction", "inf"], ["--fraction", "nan"], ["--other"]):
        with pytest.raises(ConfigError, match=r"\(python -m some.tool --help\)$"):
            parser.parse_args(bad)
