"""Pipeline stages (mesh.ici/dcn.stage, mesh.pipeline.*; parallel/pipeline.py): a step on 8 CPU devices split
into stages equals one device's step of the same rows, in loss, gradients and model state (Llama tiny and DeepSeek
tiny with MTP, stage2 x fsdp4, stage4 x fsdp2, stage2 x repeats2, stage2 x expert4 with offloaded activations and
DeepSeek's token all-to-all, Llama's stage2 x context4 and stage2 with each iteration's input offloaded to the host:
its placement proven), and the timeline of its
compiled program shows the schedule's bubble and the ppermutes; what the schedule cannot run is one line and exit 2
(train.py's runs and checkpoints under other schedules: tests/test_pipeline_runs.py; DeepSeek's equalities:
tests/test_pipeline_deepseek.py)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import EIGHT_CPUS as EIGHT, ROOT, process_env, run_cli
from MaxOffload.errors import ConfigError
from MaxOffload.parallel import pipeline
from MaxOffload.parallel.pipeline import Pipeline


LLAMA = ["configs/llama3_1.py:tiny", "model.num_layers=4"]
DEEPSEEK = ["configs/deepseek_v3.py:tiny", "model.num_layers=5", "model.mtp_depth=1"]  # 1 dense, 4 MoE layers
MESHES = {"stage2 fsdp4": ["mesh.ici.stage=2", "mesh.ici.fsdp=4"],
          # each iteration's input saved alone, the stage's forward run again in the backward pass
          "stage4 fsdp2": ["mesh.ici.stage=4", "mesh.ici.fsdp=2", "mesh.pipeline.remat=stages"],
          "stage2 repeats2": ["mesh.ici.stage=2", "mesh.ici.fsdp=4", "mesh.pipeline.repeats=2"],
          "stage2 expert4": ["mesh.ici.stage=2", "mesh.ici.fsdp=1", "mesh.ici.expert=4"]}
# what a stage composes with, on the same meshes: activations offloaded to the host inside the stages (Llama's q/k/v
# projections; DeepSeek's routed experts' inputs, through the token all-to-all)
COMPOSED = {"llama": ["remat.policy=qkv_proj_offloaded"],
            "deepseek": ["mesh.exchange=all_to_all", "remat.groups.moe.layers=moe",
                         "remat.groups.moe.tensors.moe_mlpwi_0=offload"]}
M = 4  # tests/helpers/pipeline_check.py's micro-batches


def test_schedule():
    """Stage s stores its virtual stages' layers one after the other; the bubble is (S-1)/(RM+S-1)."""
    circular = Pipeline(stages=2, repeats=2, microbatches=4)
    # 8 layers in 4 virtual stages of 2: stage 0 holds virtual stages 0 and 2, stage 1 holds 1 and 3
    assert circular.order(8).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert Pipeline(stages=4, repeats=1).order(8).tolist() == list(range(8))
    assert circular.iterations == 2 * 4 + 1 and circular.bubble == pytest.approx(1 / 9)
    # fewer micro-batches than stages: one repeat runs them as they are; repeats pad them to one per stage
    assert Pipeline(stages=4, repeats=1, microbatches=1).bubble == pytest.approx(3 / 4)
    assert Pipeline(stages=4, repeats=2, microbatches=2).iterations == 2 * 4 + 3
    with pytest.raises(ConfigError, match="do not split into mesh stage 4 x mesh.pipeline.repeats=2"):
        Pipeline(stages=4, repeats=2).per_stage(12)


def test_stages_equal_one_device():
    """Llama's cases; DeepSeek's are tests/test_pipeline_deepseek.py (a file of their own: CI's two workers share
    the files, and the cases of both families in one took ~7 minutes)."""
    cases = stage_cases("llama", LLAMA)
    # ... and a sequence split over a context axis inside the stages
    cases["llama stage2 context4"] = [*LLAMA, "mesh.ici.stage=2", "mesh.ici.fsdp=1", "mesh.ici.context=4",
                                      "model.attention=xla"]
    # ... and each iteration's input kept in pinned host memory for the backward pass
    cases["llama stage2 offloaded inputs"] = [*LLAMA, "mesh.ici.stage=2", "mesh.ici.fsdp=4",
                                              "mesh.pipeline.remat=stages_offloaded"]
    found = check_stages_equal_one_device(cases)
    placed = found["llama stage2 offloaded inputs"]["placement"]
    # one pinned_host placement, the iteration's input [8 rows, 16, emb 64] in float32; per device 2 of the 8 rows
    # (fsdp 4) in each of the M + 1 iterations
    assert placed["problems"] == [] and placed["placements"] == 1, placed
    assert placed["offloaded"] == [pipeline.INPUT] and placed["bytes"] == (M + 1) * 2 * 16 * 64 * 4, placed
    assert all(f["placement"] is None for name, f in found.items() if "offloaded" not in name)


def stage_cases(family, model):
    return {f"{family} {mesh}": [*model, *overrides, *(COMPOSED[family] if "expert4" in mesh else ())]
            for mesh, overrides in MESHES.items()}


def check_stages_equal_one_device(cases):
    helper = "tests/helpers/pipeline_check.py"
    result = subprocess.run([sys.executable, helper, json.dumps(cases)], cwd=ROOT, text=True, capture_output=True,
                            env=process_env([helper], EIGHT), timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for name, diff in found.items():
        assert diff["loss"] < 1e-5 and diff["grads"] < 1e-5, (name, diff)
        assert diff["init"] == 0.0, (name, diff)  # each layer initialised as without stages, whatever its place
        stages, repeats = (4, 1) if "stage4" in name else (2, 2 if "repeats2" in name else 1)
        assert diff["iterations"] == repeats * M + stages - 1, (name, diff)
        assert diff["bubble"] == pytest.approx((stages - 1) / (repeats * M + stages - 1)), (name, diff)
        # the timeline of the compiled program finds both passes' loops, every iteration in them; their
        # iterations cost alike, so the bubble it predicts is the schedule's; ppermute carries the activations
        timeline, iterations = diff["timeline"], repeats * M + stages - 1
        assert len(timeline["loops"]) == 2 and timeline["peeled_iterations"] == 0, (name, timeline)
        assert timeline["bubble_fraction"] == pytest.approx(diff["bubble"], rel=1e-3), (name, timeline)
        assert timeline["ppermute_bytes"] > 0 and timeline["working_s"] > 0, (name, timeline)
        assert diff["trace_iterations"] == 2 * iterations, (name, diff)
        assert diff["trace_bubbles"] == 2 * (stages - 1), (name, diff)
        if name.startswith("deepseek"):  # router biases from the whole step's loads; MTP and balance losses
            assert diff["state"] == 0.0 and diff["state_leaves"] >= 2 and diff["state_moved"] > 0, (name, diff)
            assert {"mtp_loss", "moe/balance_loss", "moe/max_load"} <= set(diff["metrics"]), (name, diff)
    return found


@pytest.mark.parametrize("overrides,expected", [
    (["configs/llama3_1.py:tiny", "mesh.ici.stage=4", "mesh.ici.fsdp=2"],
     "the pipelined stack's 2 layers do not split into mesh stage 4 x mesh.pipeline.repeats=1"),
    ([*LLAMA, "mesh.ici.stage=2", "mesh.ici.fsdp=4", "remat.groups.first.layers=0-1",
      "remat.groups.first.policy=minimal"], "the pipelined layer group 'decoder' runs under one remat/offload policy"),
    ([*LLAMA, "mesh.pipeline.repeats=2"], "mesh.pipeline.* is set but mesh.ici.stage = mesh.dcn.stage = 1"),
    ([*LLAMA, "mesh.ici.stage=2", "mesh.pipeline.microbatches=2", "train.grad_accum_steps=2"],
     "set one of them"),
])
def test_what_the_schedule_cannot_run_is_one_line(overrides, expected, tmp_path):
    result = run_cli(["train.py", *overrides, "run.dry_run=true", f"run.output_dir={tmp_path}"], env=EIGHT)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not os.listdir(tmp_path)
