"""Gradient accumulation (train.grad_accum_steps): k micro-batches of b sequences inside one step are one batch
of k x b, in loss, gradients and the model's own state (DeepSeek-V3's router biases), on one device and on eight
with FSDP; a preempted run resumes bit-identically; the compiled step does k x the micro-batch's work."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, process_env, run_cli
from test_checkpoint import TINY, losses, sigterm_and_resume


# Each case's batches are a step of synthetic data as the trainer reads it (tests/helpers/grad_accum_check.py): K
# micro-batches of the source and one batch of K x the rows, so a source that drew other tokens per batch shape
# fails here too (tests/test_training.py checks the rows themselves, for synthetic and text data).
CASES = {
    "llama": ["configs/llama3_1.py:tiny", "data.source=synthetic"],
    # the balance loss, the router-bias update from the whole step's loads, multi-token prediction
    "deepseek": ["configs/deepseek_v3.py:tiny", "data.source=synthetic", "model.mtp_depth=1",
                 "model.seq_balance_loss_weight=0.01"],
}


def check(cases, devices=1, extra=()):
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}" if devices > 1 else ""}
    args = json.dumps({name: [*overrides, *extra] for name, overrides in cases.items()})
    helper = "tests/helpers/grad_accum_check.py"
    result = subprocess.run([sys.executable, helper, args], cwd=ROOT, text=True, capture_output=True,
                            env=process_env([helper], env), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_one_batch(found):
    for name, diff in found.items():
        assert diff["loss"] < 1e-6 and diff["grads"] < 1e-6, (name, diff)
        assert diff["state"] == 0.0, (name, diff)  # the router biases move by the same signs of the same loads
    assert found["deepseek"]["state_leaves"] >= 2  # the MoE layers' and the MTP block's biases were compared
    assert found["deepseek"]["state_moved"] > 0  # ... after the step's update moved them
    assert "moe/max_load" in found["deepseek"]["metrics"]


def test_micro_batches_are_one_batch_on_one_device():
    assert_one_batch(check(CASES))


def test_micro_batches_are_one_batch_under_fsdp_on_eight_devices():
    """... and train.gather_weights=per_step gathers the fsdp-sharded weights once, outside the micro-batches' loop,
    with the same result; by default XLA gathers them in each micro-batch."""
    found = check({**CASES, "llama gathered per step": [*CASES["llama"], "train.gather_weights=per_step"]},
                  devices=8, extra=["mesh.ici.fsdp=8"])
    assert_one_batch(found)
    default, once = found["llama"]["gathered"], found["llama gathered per step"]["gathered"]
    assert default["where"] == "per micro-batch" and default["in_micro_batch_loop_bytes"] > 0
    assert once["where"] == "per step" and once["in_micro_batch_loop_bytes"] == 0 and once["per_step_bytes"] > 0


def test_per_step_reduction_over_the_data_replicas_is_one_batch():
    """train.reduce_gradients=per_step: each data replica accumulates its own gradients and the step sums them over
    the data axis once, after the micro-batches' loop (the compiled program's reductions say where), with the
    result of one batch: Llama on eight data replicas, DeepSeek (balance loss, router biases, MTP) on two data
    replicas of four expert owners exchanging tokens by all-to-all (the 671B recipe's layout). By default XLA
    reduces every micro-batch's gradients inside the loop."""
    data8 = ["mesh.ici.fsdp=1", "mesh.ici.data=8"]
    found = check({"llama": [*CASES["llama"], *data8, "train.reduce_gradients=per_step"],
                   "llama reduced per micro-batch": [*CASES["llama"], *data8],
                   "deepseek": [*CASES["deepseek"], "mesh.ici.fsdp=1", "mesh.ici.data=2", "mesh.ici.expert=4",
                                "mesh.exchange=all_to_all", "mesh.rules.exp_embed=[]",
                                "train.reduce_gradients=per_step"]}, devices=8)
    assert_one_batch(found)
    once, each = found["llama"], found["llama reduced per micro-batch"]
    k = each["reduced"]["micro_batches"]
    assert each["reduced"]["in_micro_batch_loop_bytes"] >= k * each["grad_bytes"]  # every micro-batch's gradients
    assert once["reduced"]["in_micro_batch_loop_bytes"] < 0.01 * once["grad_bytes"]  # the loss's scalars, no more
    assert once["grad_bytes"] <= once["reduced"]["per_step_bytes"] < 2 * once["grad_bytes"]  # the gradients once


def test_a_preempted_accumulating_run_resumes_bit_identically(tmp_path):
    args = [*TINY, "train.per_device_batch_size=1", "train.global_batch_size=2", "train.steps=16",
            "checkpoint.every_steps=4"]
    straight = tmp_path / "straight"
    result = run_cli(["train.py", *args, f"run.output_dir={straight}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "of 2 x 32 tokens" in result.stdout  # two micro-batches of one (derived from global_batch_size)
    resumed = tmp_path / "resumed"
    saved, _ = sigterm_and_resume([*args, f"run.output_dir={resumed}"], resumed, 6)
    assert 6 <= saved < 16
    assert losses(resumed) == losses(straight)


def test_grad_accum_steps_must_be_positive(tmp_path):
    result = run_cli(["train.py", *TINY, "train.grad_accum_steps=0", f"run.output_dir={tmp_path}"])
    assert result.returncode == 2
    assert result.stderr.strip() == "error: train.grad_accum_steps must be > 0, got 0"


def test_global_batch_size_sets_the_micro_batches_or_says_in_one_line_why_not(tmp_path):
    from MaxOffload import from_config
    from MaxOffload.config import ConfigError, load

    base = [*TINY, "train.per_device_batch_size=2", f"run.output_dir={tmp_path}"]
    assert from_config.micro_batches(load([*base, "train.grad_accum_steps=3"]), 4) == 3
    assert from_config.micro_batches(load([*base, "train.global_batch_size=64"]), 4) == 8
    with pytest.raises(ConfigError, match=r"^train.global_batch_size=12 is not a multiple of per_device_batch_size 2 "
                                          r"x 4 devices = 8 sequences a micro-batch; give a multiple of 8"):
        from_config.micro_batches(load([*base, "train.global_batch_size=12"]), 4)
    with pytest.raises(ConfigError, match="both set the step's batch; set one of them"):
        load([*base, "train.global_batch_size=16", "train.grad_accum_steps=2"])
    with pytest.raises(ConfigError, match="train.global_batch_size must be >= 0"):
        load([*base, "train.global_batch_size=-4"])


def test_inspect_reports_offloaded_bytes_per_micro_batch(tmp_path):
    """Offloaded activations live for one micro-batch's passes: two micro-batches of 8 offload what one batch of 8
    does, and the report says per micro-batch."""
    args = ["-m", "MaxOffload.offload.inspect", *TINY, "train.per_device_batch_size=8", "remat.policy=custom",
            "remat.tensors.mlpwi_0=offload", "--no_cpu_memory"]
    found = {}
    for k in (1, 2):
        result = run_cli([*args, f"train.grad_accum_steps={k}", f"run.output_dir={tmp_path / str(k)}"])
        assert result.returncode == 0, result.stdout + result.stderr
        found[k] = [line for line in result.stdout.splitlines() if line.startswith("CUDA lowering")][0]
    assert "per device per step" in found[1] and "per device per micro-batch" in found[2]
    assert found[1].split("offloaded in total ")[1].split(" per")[0] == \
        found[2].split("offloaded in total ")[1].split(" per")[0]


@pytest.mark.stack("py311", "py312")  # the refusal itself needs the newer jax (MXFP8)
def test_per_step_reduction_refuses_mxfp8_outside_the_routed_experts_in_one_line(tmp_path):
    """Inside the data replicas' shard_map jax's MXFP8 matmul cannot be partitioned (its cuDNN rule fails on the
    compile of the 671B recipe): one line, exit 2, naming the parts and the two ways out; the routed experts alone
    (their GEMMs run inside the exchange's own shard_map) pass the check. (jax 0.10.2 refuses MXFP8 itself first.)"""
    from MaxOffload.platform import jax_at_least

    args = ["train.py", "configs/deepseek_v3.py:tiny", "data.source=synthetic", "train.seq_len=32",
            "train.per_device_batch_size=2", "mesh.ici.fsdp=1", "mesh.ici.data=2", "train.grad_accum_steps=2",
            "train.reduce_gradients=per_step", "quant.mode=mxfp8", "run.dry_run=true", f"run.output_dir={tmp_path}"]
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = run_cli(args, env)
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    if not jax_at_least(0, 11):
        assert "needs jax >= 0.11" in line
        return
    assert line.startswith("error: train.reduce_gradients=per_step") and "projections,mlp" in line
    assert "quant.parts=[routed_experts]" in line
    experts_only = run_cli([*args, "quant.parts=[routed_experts]"], env)
    assert experts_only.returncode == 0, experts_only.stderr[-2000:]
