"""Pipeline stages through train.py (tests/test_pipeline.py has the equalities and the refusals; a file of its own so
that CI's two workers share them): the issue's DeepSeek command trains with one stage's losses and resumes on one
stage; a circular schedule's checkpoint resumes, and its weights load, under other schedules."""
import json
import shutil

import pytest

from conftest import EIGHT_CPUS, run_cli
from test_checkpoint import losses
from test_pipeline import LLAMA


# train.py on 8 CPU devices (run_cli adds conftest.FAST_COMPILE): every loss is compared with another run's compiled
# alike; the few steps of a tiny model run in far less time than they compile
def train(args, out, env=EIGHT_CPUS):
    result = run_cli(["train.py", *args, f"run.output_dir={out}"], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_train_py_stages_match_one_stage_and_resume_on_another(tmp_path):
    """The issue's command (DeepSeek tiny, stage=2 x fsdp=4) trains with stage=1's losses; its checkpoint resumes
    on stage=1 and goes on as stage=1's own run."""
    common = ["configs/deepseek_v3.py:tiny", "train.seq_len=32", "train.per_device_batch_size=1",
              "train.warmup_steps=1", "train.eval_every=0", "model.compute_dtype=float32", "run.log_every=1"]
    staged = train([*common, "mesh.ici.stage=2", "mesh.ici.fsdp=4", "train.steps=2"], tmp_path / "staged")
    assert "pipeline: 2 stages x 1 repeats, 1 micro-batches a step, bubble 50.0%" in staged.stdout
    train([*common, "train.steps=3"], tmp_path / "flat")
    train([*common, "mesh.ici.stage=1", "mesh.ici.fsdp=8", "train.steps=3"], tmp_path / "staged")  # resumes
    one, two = losses(tmp_path / "flat"), losses(tmp_path / "staged")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in (1, 2, 3):
        assert two[step] == pytest.approx(one[step], rel=1e-5), (step, one, two)


def test_checkpoint_of_a_circular_schedule_loads_under_others(tmp_path):
    """A circular schedule stores its layers in the pipeline's order and says so in the checkpoint; loaded without
    stages, or under the same schedule, the model is the same (its first losses equal); a resume on one stage
    goes on as the circular run does."""
    common = [*LLAMA, "train.seq_len=32", "train.per_device_batch_size=1", "train.warmup_steps=0",
              "train.eval_every=0", "model.compute_dtype=float32", "run.log_every=1"]
    circular = ["mesh.ici.stage=2", "mesh.ici.fsdp=4", "mesh.pipeline.repeats=2", "mesh.pipeline.microbatches=2"]
    train([*common, *circular, "train.steps=1"], tmp_path / "saved")
    with open(tmp_path / "saved" / "checkpoints" / "1" / "meta" / "metadata") as f:
        assert json.load(f)["layer_order"] == [0, 2, 1, 3]
    shutil.copytree(tmp_path / "saved", tmp_path / "copy")
    train([*common, *circular, "train.steps=2"], tmp_path / "saved")  # resumed by the same schedule
    train([*common, "train.grad_accum_steps=2", "train.steps=2"], tmp_path / "copy")  # ... and by none
    assert losses(tmp_path / "copy")[2] == pytest.approx(losses(tmp_path / "saved")[2], rel=1e-5)
    loaded = {}
    for name, schedule in (("flat", ["train.grad_accum_steps=2"]), ("circular", circular)):
        train([*common, *schedule, "train.steps=1", f"checkpoint.load_params_from={tmp_path / 'saved'}",
               "checkpoint.enabled=false"], tmp_path / name)
        loaded[name] = losses(tmp_path / name)[1]
    assert loaded["flat"] == pytest.approx(loaded["circular"], rel=1e-5)
