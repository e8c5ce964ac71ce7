"""Never lose a run: exact resume, preemption, kill -9 during an async save, resharding restore,
corrupted checkpoints, host-offloaded state, non-finite steps."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import EIGHT_CPUS, ROOT, cpu_devices, process_env, run_cli
from MaxOffload.train import rundir

TINY = ["configs/llama3_1.py:tiny", "train.seq_len=32", "train.per_device_batch_size=2", "train.warmup_steps=2",
        "train.eval_every=0", "model.compute_dtype=float32", "run.log_every=1"]


def losses(out):
    by_step = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row:
                assert row["step"] not in by_step, f"step {row['step']} logged twice"
                by_step[row["step"]] = row["loss"]
    return by_step


def start(args, env=None):
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=process_env(["train.py"], env))


def wait_for_step(proc, step, lines):
    """Reads the progress lines until `step` is reported."""
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= step:
            return
    raise AssertionError("the run ended before step %d:\n%s" % (step, "".join(lines)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    result = run_cli(["train.py", *TINY, "train.steps=40", f"run.output_dir={out}"])
    assert result.returncode == 0, result.stderr
    return losses(out)


def sigterm_and_resume(args, out, step):
    """Starts train.py ARGS (run.output_dir=out), sends SIGTERM once it reports `step`, checks that it exited 42
    with a checkpoint of the step it names, then runs the same command again: (that step, the resumed run's
    CompletedProcess, which succeeded)."""
    proc, lines = start(args), []
    wait_for_step(proc, step, lines)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 42, "".join(lines) + rest
    saved = int(rest.split("saved step ")[1].split(";")[0])
    assert str(saved) in os.listdir(out / "checkpoints")
    result = run_cli(["train.py", *args])
    assert result.returncode == 0, result.stderr[-3000:]
    return saved, result


# the state in pinned host memory on each stack's jax (its memory kinds API); on the device on py311
@pytest.mark.parametrize("offloaded", [pytest.param(False, id="device_state"),
                                       pytest.param(True, id="host_offloaded_state",
                                                    marks=pytest.mark.stack("py311", "py312"))])
def test_sigterm_saves_and_resume_is_bit_identical(tmp_path, uninterrupted, offloaded):
    extra = ["offload.params=true", "offload.optimizer_state=true"] if offloaded else []
    args = [*TINY, *extra, "train.steps=40", f"run.output_dir={tmp_path}", "checkpoint.every_steps=10"]
    saved, result = sigterm_and_resume(args, tmp_path, 15)
    assert 15 <= saved < 40
    assert f"resumed from {tmp_path / 'checkpoints'}/{saved} (step {saved})" in result.stdout
    assert f"training steps {saved + 1}-40" in result.stdout
    assert losses(tmp_path) == uninterrupted  # bit-identical, every step exactly once


def test_kill_9_during_async_saves_leaves_a_usable_checkpoint(tmp_path, uninterrupted):
    args = [*TINY, "train.steps=40", f"run.output_dir={tmp_path}", "checkpoint.every_steps=1", "checkpoint.keep=2"]
    proc, lines = start(args), []
    wait_for_step(proc, 12, lines)
    proc.kill()  # SIGKILL while a checkpoint is being written asynchronously every step
    proc.communicate(timeout=60)
    result = run_cli(["train.py", *args])
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    assert losses(tmp_path) == uninterrupted


def test_incomplete_checkpoint_is_skipped_with_a_warning(tmp_path):
    args = [*TINY, "train.steps=6", f"run.output_dir={tmp_path}"]
    assert run_cli(["train.py", *args]).returncode == 0
    # what an interrupted save leaves behind: a temporary directory that was never renamed
    os.makedirs(tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-1234567890")
    result = run_cli(["train.py", *TINY, "train.steps=8", f"run.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr
    assert "skipping incomplete checkpoint" in result.stderr and "9.orbax-checkpoint-tmp" in result.stderr
    assert "resumed from" in result.stdout and "(step 6)" in result.stdout


def test_checkpoint_disabled_neither_resumes_nor_saves(tmp_path):
    args = [*TINY, "train.steps=3", f"run.output_dir={tmp_path}"]
    assert run_cli(["train.py", *args]).returncode == 0
    result = run_cli(["train.py", *TINY, "train.steps=5", f"run.output_dir={tmp_path}", "checkpoint.enabled=false",
                      "run.overwrite=true"])  # the finished run is moved aside (tests/test_rundir.py)
    assert result.returncode == 0, result.stderr
    assert "resumed from" not in result.stdout and "training steps 1-5" in result.stdout
    assert rundir.checkpoint_steps(tmp_path) == []  # nothing saved
    # ... nor read: goodput counts no checkpoint time (a fresh state's initialisation is start-up, its `other`)
    [segment] = [json.loads(line) for line in open(tmp_path / "goodput.jsonl")]
    assert segment["checkpoint_s"] < 0.05 and segment["wall_s"] > segment["compile_s"] > 0, segment
    [aside] = os.listdir(tmp_path / "replaced")
    assert sorted(n for n in os.listdir(tmp_path / "replaced" / aside / "checkpoints") if n.isdigit()) == ["3"]


def _corrupt(step_dir):
    """Truncates every array data file of a checkpoint."""
    hit = 0
    for root, _, files in os.walk(step_dir / "state"):
        for name in files:
            if "_METADATA" not in name and not name.endswith(".json") and name != "manifest.ocdbt":
                with open(os.path.join(root, name), "wb"):
                    hit += 1
    assert hit
    return step_dir


def _flip_bytes(step_dir):
    """Flips bytes in the middle of the largest file under state/: same size, other content."""
    files = [os.path.join(root, name) for root, _, names in os.walk(step_dir / "state") for name in names]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.seek(os.path.getsize(largest) // 2)
        chunk = f.read(64)
        f.seek(os.path.getsize(largest) // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return os.path.relpath(largest, step_dir)


def _sound(step_dir):
    """Whether a step directory matches its integrity manifest (verified as a restore does)."""
    from MaxOffload.train import integrity

    with open(step_dir / "integrity.process_0.json") as f:
        saved = json.load(f)["structure"]
    try:
        return integrity.verify(str(step_dir), saved, 0, 1) is None
    except integrity.Damaged:
        return False


def test_corrupted_checkpoint_is_one_line_and_fallback_uses_the_previous(tmp_path):
    args = [*TINY, "train.steps=8", f"run.output_dir={tmp_path}", "checkpoint.every_steps=4"]
    assert run_cli(["train.py", *args]).returncode == 0
    assert sorted(os.listdir(tmp_path / "checkpoints"), key=str) == ["4", "8"]
    _corrupt(tmp_path / "checkpoints" / "8")
    later = [*TINY, "train.steps=10", f"run.output_dir={tmp_path}", "checkpoint.every_steps=4"]
    result = run_cli(["train.py", *later])
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(tmp_path / "checkpoints" / "8") in lines[0] and "fallback_to_previous" in lines[0]
    assert "delete" not in lines[0]


def test_bit_flipped_checkpoint_is_refused_and_replaced_when_the_run_gets_there_again(tmp_path):
    args = [*TINY, "train.steps=8", f"run.output_dir={tmp_path}", "checkpoint.every_steps=4"]
    assert run_cli(["train.py", *args]).returncode == 0
    eight = tmp_path / "checkpoints" / "8"
    assert _sound(eight)
    flipped = _flip_bytes(eight)
    assert not _sound(eight)  # same size: only the digest can tell
    later = [*TINY, "train.steps=10", f"run.output_dir={tmp_path}", "checkpoint.every_steps=4"]
    result = run_cli(["train.py", *later])
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "SHA-256" in lines[0] and flipped in lines[0], result.stderr
    result = run_cli(["train.py", *later, "checkpoint.fallback_to_previous=true"])
    assert result.returncode == 0, result.stderr
    assert "falling back to step 4" in result.stderr and "(step 4)" in result.stdout
    assert "training steps 5-10" in result.stdout
    assert sorted(n for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == ["10", "4", "8"]
    assert _sound(eight)  # the re-trained step 8 replaced the damaged one


def test_checkpoint_of_another_model_or_optimizer_names_the_difference_and_never_advises_deleting(tmp_path):
    """A changed model names the first differing parameter; a changed optimizer (no gradient clipping: another
    opt_state structure) says the parameters fit and points at checkpoint.load_params_from, which then starts
    a new run from them (a params-only restore: the old optimizer state is not read). With
    fallback_to_previous=true it is the same one line: a sound checkpoint is no reason to fall back."""
    run_dir = tmp_path / "run"
    assert run_cli(["train.py", *TINY, "train.steps=3", "checkpoint.every_steps=2",
                    f"run.output_dir={run_dir}"]).returncode == 0  # steps 2 and 3: an older one to fall back to
    model = "another model: ['params']['embed'] was saved as float32[512, 64]"
    for change, fallback, named in (("model.emb_dim=32", "true", model),
                                    ("train.grad_clip_norm=0", "false", "but another optimizer state")):
        result = run_cli(["train.py", *TINY, "train.steps=5", f"run.output_dir={run_dir}", change,
                          f"checkpoint.fallback_to_previous={fallback}"])
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert named in lines[0], lines[0]
        assert "corrupted" not in lines[0] and "delete" not in lines[0] and "config.json" in lines[0]
    assert f"checkpoint.load_params_from={run_dir}" in lines[0]
    new = tmp_path / "new"
    result = run_cli(["train.py", *TINY, "train.steps=3", f"run.output_dir={new}", "train.grad_clip_norm=0",
                      f"checkpoint.load_params_from={run_dir}"])
    assert result.returncode == 0 and "(step 3)" in result.stdout, result.stderr
    result = run_cli(["train.py", *TINY, "train.steps=3", f"run.output_dir={tmp_path / 'other'}", "model.emb_dim=32",
                      f"checkpoint.load_params_from={run_dir}"])
    assert result.returncode == 2 and "are not this model's (['params']['embed']" in result.stderr, result.stderr
    assert run_cli(["train.py", *TINY, "train.steps=5", f"run.output_dir={run_dir}"]).returncode == 0


def test_integrity_manifests_of_any_number_of_processes_are_all_checked(tmp_path):
    """Two saving processes' files (ocdbt.process_<i>/), checked by one restoring process; a missing manifest
    makes the checkpoint unverifiable, not damaged."""
    from MaxOffload.train import integrity

    files = {"state/ocdbt.process_0/d/a": b"zero", "state/ocdbt.process_1/d/b": b"one",
             "state/array_metadatas/process_1": b"meta", "state/_METADATA": b"shared"}
    for rel, data in files.items():
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    shape = {"['params']['w']": [[2, 3], "float32"]}
    integrity.seal(str(tmp_path), 0, 2, shape)
    integrity.seal(str(tmp_path), 1, 2, shape)
    with open(tmp_path / "integrity.process_1.json") as f:
        assert sorted(json.load(f)["files"]) == ["state/array_metadatas/process_1", "state/ocdbt.process_1/d/b"]
    assert integrity.verify(str(tmp_path), shape, 0, 1) is None
    (tmp_path / "state/ocdbt.process_1/d/b").write_bytes(b"ONE")
    with pytest.raises(integrity.Damaged, match="ocdbt.process_1/d/b"):
        integrity.verify(str(tmp_path), shape, 0, 1)
    assert integrity.verify(str(tmp_path), shape, 0, 2) is None  # process 1's files are the other process's
    with pytest.raises(integrity.Mismatch, match=r"\['params'\]\['w'\] was saved as float32\[2, 3\]"):
        integrity.verify(str(tmp_path), {"['params']['w']": [[3, 3], "float32"]}, 0, 1)
    os.remove(tmp_path / "integrity.process_1.json")
    assert "process 1" in integrity.verify(str(tmp_path), shape, 0, 1)


def test_restore_on_a_different_mesh_gives_identical_parameters(tmp_path):
    base = [*TINY, "train.steps=3", f"run.output_dir={tmp_path}"]
    sharded = [*base, "mesh.ici.fsdp=8", "train.per_device_batch_size=1"]
    assert run_cli(["train.py", *sharded], env=EIGHT_CPUS).returncode == 0
    digest = os.path.join(ROOT, "tests", "helpers", "checkpoint_digest.py")
    saved = run_cli([digest, *sharded], env=EIGHT_CPUS)
    moved = run_cli([digest, *base, "mesh.ici.data=4", "mesh.ici.fsdp=1", "train.per_device_batch_size=2"],
                    env=cpu_devices(4))
    assert saved.returncode == 0 and moved.returncode == 0, saved.stderr + moved.stderr
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (saved, moved))
    assert a["mesh"]["fsdp"] == 8 and b["mesh"]["data"] == 4 and a["step"] == b["step"] == 3
    assert a["embed_shard_shape"] == [512, 64 // 8] and b["embed_shard_shape"] == [512, 64]  # another layout
    assert a["digest"] == b["digest"]


def test_load_params_from_another_run(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    assert run_cli(["train.py", *TINY, "train.steps=30", f"run.output_dir={source}"]).returncode == 0
    result = run_cli(["train.py", *TINY, "train.steps=3", f"run.output_dir={target}",
                      f"checkpoint.load_params_from={source}"])
    assert result.returncode == 0, result.stderr
    assert "parameters loaded from" in result.stdout and "(step 30)" in result.stdout
    assert losses(target)[1] < losses(source)[1] - 0.5  # starts from trained weights, not from scratch
    bad = run_cli(["train.py", *TINY, f"run.output_dir={tmp_path / 'x'}", f"checkpoint.load_params_from={tmp_path}"])
    assert bad.returncode == 2 and "no checkpoint there" in bad.stderr


def test_a_non_finite_first_step_saves_nothing_and_names_no_later_step(tmp_path):
    """Weights so large that step 1's loss overflows: nothing was good, so nothing is saved (no checkpoint
    named 1 or 2), and only step 1 is logged."""
    args = [*TINY, "train.steps=6", "model.init_std=1e30", f"run.output_dir={tmp_path}"]
    result = run_cli(["train.py", *args])
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: step 1: non-finite") and "nothing to save" in line, line
    assert sorted(losses(tmp_path)) == [1]
    assert not os.path.exists(tmp_path / "checkpoints") or os.listdir(tmp_path / "checkpoints") == []


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_non_finite_steps(tmp_path, mode):
    # an absurd learning rate overflows the weights within a few steps
    args = [*TINY, "train.steps=12", "train.learning_rate=1e30", "train.grad_clip_norm=0", "train.warmup_steps=1",
            f"train.on_nonfinite={mode}", f"run.output_dir={tmp_path}"]
    result = run_cli(["train.py", *args])
    logged = losses(tmp_path)
    if mode == "stop":
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stderr.strip().startswith("error: step") and "non-finite" in result.stderr
        bad = max(logged)
        # saved under the last good step, holding that step's state; the step queued after the bad one is
        # neither logged nor saved
        assert os.listdir(tmp_path / "checkpoints") == [str(bad - 1)] and bad > 1
        assert f"saving the last good state, step {bad - 1}" in result.stderr
        with open(tmp_path / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        assert rows[-1]["nonfinite"] == 1.0 and all(r["nonfinite"] == 0.0 for r in rows[:-1]), bad
        assert sorted(logged) == list(range(1, bad + 1))
        resumed = run_cli(["train.py", *args, "train.on_nonfinite=skip"])  # resumes from the last good step
        assert resumed.returncode == 0 and f"(step {bad - 1})" in resumed.stdout, resumed.stderr[-2000:]
    else:
        assert result.returncode == 0, result.stderr
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["skipped_steps"] >= 1 and "update skipped" in result.stdout
        assert len(logged) == 12


def test_a_finished_save_is_sealed_before_the_next_one(tmp_path):
    """The integrity manifest of an asynchronous save is written once the save has finished, at the loop's check a
    step, not only when the next save (or the run's end) waits for it: a run killed between two saves resumes from a
    verified checkpoint (before, every resume after a kill said "restored unverified")."""
    import time

    import jax

    from MaxOffload import from_config
    from MaxOffload.config import load
    from MaxOffload.train import integrity
    from MaxOffload.train.checkpoint import Checkpointer

    cfg = load([*TINY, f"run.output_dir={tmp_path}"])
    setup = from_config.train_setup(cfg, jax.devices()[:1])
    checkpointer = Checkpointer(cfg, setup)
    try:
        checkpointer.save(5, setup.init_state(), {"step": 5})
        manifest = tmp_path / "checkpoints" / "5" / "integrity.process_0.json"
        deadline = time.monotonic() + 60
        while not manifest.exists() and time.monotonic() < deadline:
            checkpointer.seal_finished()
            time.sleep(0.05)
        assert manifest.exists() and checkpointer.unsealed is None
        # None: verified (a warning text when unverifiable; it raises when damaged or another structure)
        assert integrity.verify(str(tmp_path / "checkpoints" / "5"), checkpointer.structure, 0, 1) is None
    finally:
        checkpointer.close()
