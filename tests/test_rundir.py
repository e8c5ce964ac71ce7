"""A run directory you can trust (MaxOffload/train/rundir.py): one run at a time, a finished run asked for
fewer steps changes nothing, a torn metrics line does not stop a resume, a dry run touches only its own file,
and a resume says which settings changed."""
import json
import os
import signal
import subprocess

import pytest

from conftest import run_cli, small_filesystem
from test_checkpoint import TINY, _sound, losses, start, wait_for_step


def snapshot(out):
    """Every file of the run directory (checkpoints included) -> its bytes; the lock file aside (each run that
    takes the lock writes its pid there)."""
    found = {}
    for root, _, names in os.walk(out):
        for name in names:
            if name == "run.lock":
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, out)] = f.read()
    return found


def one_error_line(result):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    return lines[0]


def test_a_finished_run_asked_for_fewer_or_as_many_steps_changes_nothing(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, f"run.output_dir={out}", "checkpoint.every_steps=3"]
    assert run_cli(["train.py", *args, "train.steps=6"]).returncode == 0
    before = snapshot(out)
    assert {"3", "6"} <= set(os.listdir(out / "checkpoints"))
    fewer = run_cli(["train.py", *args, "train.steps=4"])
    line = one_error_line(fewer)
    assert "at step 6, past train.steps=4" in line and "nothing changed" in line and "delete" not in line
    same = run_cli(["train.py", *args, "train.steps=6"])
    assert same.returncode == 0 and "nothing to train" in same.stdout, same.stderr
    assert snapshot(out) == before  # no checkpoint named 4, no eval line, config.json as it was
    # a dry run into the directory writes its own file and nothing else
    dry = run_cli(["train.py", *args, "train.steps=4", "run.dry_run=true"])
    assert dry.returncode == 0, dry.stderr
    after = snapshot(out)
    assert set(after) - set(before) == {"dry_run.json"} and all(after[f] == before[f] for f in before)
    assert json.loads(after["dry_run.json"])["config"]["train"]["steps"] == 4


def test_a_directory_holds_one_run_and_run_overwrite_moves_the_old_one_aside(tmp_path):
    """A run from step 0 into a finished run's directory (checkpoint.resume=false, a throwaway
    checkpoint.enabled=false rerun) is refused and changes nothing; a checkpoint renamed to another step is
    refused, not restored and relabelled; run.overwrite=true moves the old run aside, whole."""
    out = tmp_path / "run"
    args = [*TINY, f"run.output_dir={out}", "checkpoint.every_steps=2", "train.steps=6"]
    assert run_cli(["train.py", *args]).returncode == 0
    before = snapshot(out)
    for extra, why in ((["checkpoint.resume=false"], "checkpoint.resume=false would write over it"),
                       (["checkpoint.enabled=false", "train.steps=3"], "checkpoint.enabled=false would write over it")):
        line = one_error_line(run_cli(["train.py", *args, *extra]))
        assert "holds another run (checkpoints of step(s) 2, 4, 6 and the summary.json of a finished run)" in line
        assert why in line and "run.overwrite=true" in line and "delete" not in line, line
        assert snapshot(out) == before
    checkpoints = out / "checkpoints"
    os.rename(checkpoints / "6", checkpoints / "8")
    renamed = snapshot(out)
    line = one_error_line(run_cli(["train.py", *args, "train.steps=10"]))
    assert line == f"error: checkpoint {checkpoints}/8 holds step 6 but its directory is named 8 (renamed or copied " \
        f"by hand?); nothing was restored: rename it back to {checkpoints}/6, or move it out of {checkpoints}"
    assert snapshot(out) == renamed
    os.rename(checkpoints / "8", checkpoints / "6")
    moved = run_cli(["train.py", *args, "checkpoint.resume=false", "run.overwrite=true"])
    assert moved.returncode == 0, moved.stderr[-2000:]
    [stamp] = os.listdir(out / "replaced")
    assert f"moved the earlier run (checkpoints of step(s) 2, 4, 6 and the summary.json of a finished run) into " \
        f"{out / 'replaced' / stamp}" in moved.stdout
    assert snapshot(out / "replaced" / stamp) == before  # the old run, whole
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 6 and (out / "summary.json").is_file()


def test_a_second_run_into_a_running_directory_is_refused_and_a_dead_ones_lock_is_not(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, f"run.output_dir={out}", "checkpoint.every_steps=0"]
    first, lines = start([*args, "train.steps=100000"]), []
    try:
        wait_for_step(first, 2, lines)
        metrics = open(out / "metrics.jsonl", "rb").read()
        second = run_cli(["train.py", *args, "train.steps=3"])
        line = one_error_line(second)
        assert f"run.output_dir={out} is in use by a running job (pid {first.pid} on" in line, line
        assert open(out / "metrics.jsonl", "rb").read()[:len(metrics)] == metrics  # the first run's lines intact
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert os.path.exists(out / "run.lock")  # left by the killed run; the kernel released its lock
    third = run_cli(["train.py", *args, "train.steps=3"])
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    assert sorted(losses(out)) == [1, 2, 3]


def test_a_torn_metrics_line_is_dropped_on_resume_and_changed_settings_are_named(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, f"run.output_dir={out}", "checkpoint.every_steps=2"]
    assert run_cli(["train.py", *args, "train.steps=4"]).returncode == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 3.1')  # a crash in the middle of a line
    resumed = run_cli(["train.py", *args, "train.steps=6", "run.log_every=2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "dropped 1 unreadable line(s)" in resumed.stdout
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6]  # each step once (losses() refuses duplicates)
    changed = [line for line in resumed.stdout.splitlines() if line.startswith("config changed since")]
    assert len(changed) == 1 and "run.log_every: 1 -> 2" in changed[0] and "train.steps: 4 -> 6" in changed[0]
    assert json.load(open(out / "config.json"))["train"]["steps"] == 6


def test_a_tensorboard_directory_that_cannot_be_written_is_one_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("a file where the events directory should be")
    result = run_cli(["train.py", *TINY, f"run.output_dir={out}", "train.steps=3"])
    line = one_error_line(result)
    assert f"cannot write TensorBoard events to {out / 'tensorboard'}" in line, line


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs (a full disk for real: tensorstore's own writes fail with ENOSPC)."""
    with small_filesystem(str(tmp_path / "disk"), "6m"):
        yield tmp_path / "disk"


def test_a_full_disk_is_one_line_and_the_checkpoints_before_it_stay_sound(small_disk):
    """Checkpoints of ~1.5 MiB every step on a 6 MiB disk: step 4's save fails. One line names the directory,
    the free and the needed space and the step a rerun resumes from; its partial write is removed, steps 1-3
    stay sound. With room made (the tmpfs grown), the same command resumes there and finishes, each step
    logged once."""
    out = small_disk / "run"
    args = [*TINY, f"run.output_dir={out}", "train.steps=8", "checkpoint.every_steps=1", "checkpoint.keep=10"]
    line = one_error_line(run_cli(["train.py", *args]))
    assert f"checkpoint of step 4 not saved: {out / 'checkpoints'} is out of space" in line, line
    assert "MiB free, a checkpoint needs about 1." in line and "then rerun: a rerun resumes from step 3" in line
    assert sorted(os.listdir(out / "checkpoints")) == ["1", "2", "3"]  # no partial step 4 left taking space
    assert all(_sound(out / "checkpoints" / step) for step in ("1", "2", "3"))
    subprocess.run(["mount", "-o", "remount,size=24m", str(small_disk)], check=True)
    result = run_cli(["train.py", *args])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout and "(step 3)" in result.stdout
    assert sorted(losses(out)) == list(range(1, 9))


def test_a_disk_that_fills_under_the_metrics_log_is_one_line(small_disk):
    import shutil

    (small_disk / "filler").write_bytes(b"x" * (shutil.disk_usage(small_disk).free - 16384))  # room for config.json
    out = small_disk / "run"
    line = one_error_line(run_cli(["train.py", *TINY, f"run.output_dir={out}", "train.steps=300",
                                   "checkpoint.enabled=false"]))
    assert f"to {out / 'metrics.jsonl'} (No space left on device); free space there" in line, line
