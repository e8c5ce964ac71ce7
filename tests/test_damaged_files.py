"""A JSON file the project reads back (or a user hands it), cut short, of the wrong type or missing a key: one line
naming the file and what is wrong (MaxOffload/jsonfile.py), never a traceback, nothing written; a cache or a
derived file is said to be damaged and made again. (to-hf's run files: tests/test_convert.py.)"""
import fcntl
import json
import os

import pytest

from conftest import run_cli
from MaxOffload.errors import ConfigError
from MaxOffload.train import integrity


def _weights_reader(directory):
    from MaxOffload.convert.orbax_files import WeightsReader

    WeightsReader(str(directory))


def _read_meta(directory):
    from MaxOffload.data import tokenized

    tokenized.read_meta(str(directory))


def _verify(directory):
    integrity.verify(str(directory), {}, 0, 1)


MANIFEST = "integrity.process_0.json"
# (reader of a directory, the file it reads there, what the file holds, the error, words of its one line)
READERS = {
    "orbax_metadata_cut_short": (_weights_reader, "state/_METADATA", '{"tree_metadata": {', ConfigError,
                                 ["not valid JSON", "export another step"]),
    "orbax_metadata_wrong_type": (_weights_reader, "state/_METADATA", '{"use_ocdbt": "yes"}', ConfigError,
                                  ["'use_ocdbt' should be true or false, got a string (\"yes\")"]),
    "prepared_meta_cut_short": (_read_meta, "meta.json", '{"format_version": 1, "vo', ConfigError,
                                ["not valid JSON", "prepare the directory again"]),
    "manifest_cut_short": (_verify, MANIFEST, '{"process": 0, "files": {"a": [1, "', integrity.Damaged,
                           [f"its integrity manifest {MANIFEST} is unreadable: not valid JSON"]),
    "manifest_without_files": (_verify, MANIFEST, '{"process": 0}', integrity.Damaged, ["missing key 'files'"]),
    "manifest_files_of_the_wrong_type": (_verify, MANIFEST, '{"process": 0, "files": {"a": 3}}', integrity.Damaged,
                                         ["'files' should be an object of [size, SHA-256] pairs, got an object"]),
    "manifest_a_list": (_verify, MANIFEST, "[]", integrity.Damaged, ["the file should be an object, got an array"]),
}


@pytest.mark.parametrize("case", list(READERS))
def test_a_damaged_file_is_one_line_naming_it(tmp_path, case):
    reader, name, text, error, words = READERS[case]
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    with pytest.raises(error) as raised:
        reader(tmp_path)
    line = str(raised.value)
    assert "\n" not in line and os.path.basename(name) in line and all(w in line for w in words), line
    assert path.read_text() == text and sorted(os.listdir(path.parent)) == [os.path.basename(name)]


AOT_REPORTS = {"cut_short": ('{"host_bytes_per_device": 4', "not valid JSON"),
               "a_string": ('{"host_bytes_per_device": "4e9"}', "'host_bytes_per_device' should be a number of bytes"),
               "missing": ("{}", "missing key 'host_bytes_per_device'")}


@pytest.mark.parametrize("case", list(AOT_REPORTS))
def test_launch_env_from_a_damaged_aot_report_is_one_line_and_prints_no_exports(tmp_path, case):
    text, words = AOT_REPORTS[case]
    report = tmp_path / "aot_report.json"
    report.write_text(text)
    result = run_cli(["-m", "MaxOffload.parallel.launch_env", "configs/llama3_1.py:tiny",
                      f"run.output_dir={tmp_path}"], env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    err = result.stderr.strip()
    assert result.returncode == 2 and not result.stdout and "Traceback" not in err, (result.stdout, err)
    assert err.startswith(f"error: {report}: {words}") and "python -m MaxOffload.aot" in err, err
    assert len(err.splitlines()) == 1 and report.read_text() == text


def test_a_damaged_run_config_is_named_and_written_again(tmp_path):
    from MaxOffload.train import rundir

    (tmp_path / "config.json").write_text('{"model": {"fam')
    said = []
    rundir.write_config(str(tmp_path), {"model": {"family": "llama"}}, said.append)
    assert said == [f"{tmp_path / 'config.json'}: not valid JSON (Unterminated string starting at: line 1 column 12 "
                    "(char 11)); this run writes its config over it"], said
    assert json.loads((tmp_path / "config.json").read_text()) == {"model": {"family": "llama"}}


def test_lines_of_metrics_jsonl_without_a_step_are_dropped_and_counted(tmp_path):
    from MaxOffload.train.metrics import _lines_up_to

    path = tmp_path / "metrics.jsonl"
    rows = ['{"step": 1, "loss": 2.0}', '{"step": "2"}', "[3]", '{"loss": 1.0}', '{"step": -1}', '{"step": 3, "lo']
    path.write_bytes(("\n".join(rows) + "\n").encode() + b'{"step": 4, "loss": "\xff"}\n')
    said = []
    assert _lines_up_to(str(path), 10, said.append) == ['{"step": 1, "loss": 2.0}\n', '{"step": 4, "loss": "\ufffd"}\n']
    assert said == [f"{path}: dropped 5 unreadable line(s) (cut short by an earlier crash or a full disk, or edited)"]


def test_a_lock_holding_garbage_names_its_first_line(tmp_path):
    from MaxOffload.train.rundir import LOCK, Lock

    (tmp_path / LOCK).write_bytes(b"pid 7 \xff\xfe on host\nand more\n")
    with open(tmp_path / LOCK) as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run holds it
        with pytest.raises(ConfigError) as raised:
            Lock(str(tmp_path))
    assert str(raised.value) == (f"run.output_dir={tmp_path} is in use by a running job (pid 7 \ufffd\ufffd on host); "
                                 "wait for it to end, or give this run its own run.output_dir")


def test_a_damaged_cache_is_made_again(tmp_path, monkeypatch):
    """The planner's cached plan and the XLA flag cache are derived data: damaged, each is computed again (the
    plan says so in one line) and written whole."""
    import jax

    from MaxOffload import xla
    from MaxOffload.config import load
    from MaxOffload.offload import planner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    os.makedirs(os.path.dirname(xla._cache_path()))
    with open(xla._cache_path(), "w") as f:
        f.write('["--xla_a"]')
    monkeypatch.setattr(xla, "rejected_flag", lambda flags: None)
    assert xla.accepted(["--xla_b"]) == {"--xla_b": True}
    assert json.load(open(xla._cache_path())) == {"--xla_b": True}

    cfg = load(["configs/llama3_1.py:tiny", "remat.policy=auto", f"run.output_dir={tmp_path}"])
    path = os.path.join(planner._cache_dir(), planner.cache_key(cfg, None, None, jax.device_count()) + ".json")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write('{"decisions": {"decoder": {"mlpwi_0": "offload"}}, "overrides": [], "xla_preset": "turbo"}')

    class Planned(Exception):
        pass

    def decide(*_, **__):
        raise Planned

    logs = []
    monkeypatch.setattr(planner, "decide", decide)
    with pytest.raises(Planned):
        planner.plan_for(cfg, log=logs.append)
    assert logs == [f"remat.policy=auto: {path}: 'xla_preset' should be one of baseline, lhs, lhs_pipelined, "
                    "lhs_pipelined_offload, tpu_overlap, tpu_overlap_offload, got a string (\"turbo\"); planning "
                    "again (the plan replaces it)"], logs


def test_a_leftover_conversion_with_a_damaged_marker_is_not_removed(tmp_path):
    from MaxOffload.convert import staging

    out = tmp_path / "out"
    leftover = tmp_path / "out.partial-host-1-abc"
    leftover.mkdir()
    (leftover / staging.MARKER).write_text('{"out": "')
    said = []
    staging._leftovers(str(out), said.append)
    assert leftover.is_dir() and not said
