"""Conversion against the reference implementation: tiny random Llama 3.1 (llama3 RoPE scaling, GQA) and
DeepSeek-V3 (YaRN, MLA, a nonzero router bias, group-limited routing, the first layer dense) made and saved by
transformers -> `python -m MaxOffload.convert from-hf` -> this project's float32 logits within 1e-4 relative of
transformers', and the printed command trains a step from them; `to-hf` -> transformers loads the export and
gives the same logits.

Needs torch and transformers: the CPU build of torch exists for Python 3.11 only here (setup.py's test extra
installs it there), so .ci/run runs this file on the py311 stack; torch is imported inside the fixtures, so the
file collects on any stack."""
import json
import os
import shlex

import jax
import numpy as np
import pytest

from conftest import run_cli
from MaxOffload import from_config
from MaxOffload.config.loader import load
from MaxOffload.train.checkpoint import load_params


CONFIGS = {"llama": "configs/llama3_1.py:tiny", "deepseek": "configs/deepseek_v3.py:tiny"}
TOKENS = np.random.default_rng(0).integers(0, 512, (2, 40))


def relative_error(ours, reference):
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def imported(request, tmp_path_factory):
    """(kind, the transformers model, its logits, the from-hf output, the printed train command)."""
    from helpers import hf_models

    kind, tmp = request.param, tmp_path_factory.mktemp(request.param)
    hf_dir, out = str(tmp / "hf"), str(tmp / "weights")
    model = hf_models.save(kind, hf_dir)
    assert len([f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]) > 1, "a sharded checkpoint"
    result = run_cli(["-m", "MaxOffload.convert", "from-hf", hf_dir, "--config", CONFIGS[kind], "--out", out])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-2] == "train from these weights:", result.stdout
    return kind, model, hf_models.logits(model, TOKENS), out, shlex.split(lines[-1])


def our_logits(command, out):
    """The logits of the imported weights under the printed command's config, computed in float32."""
    config = [a for a in command[2:] if not a.startswith("checkpoint.load_params_from=")]
    setup = from_config.train_setup(load([*config, "model.compute_dtype=float32"]))
    weights, _ = load_params(out, setup)
    logits, _ = jax.jit(setup.forward)(weights["params"], weights["model_state"], TOKENS)
    return np.asarray(logits)


def test_imported_weights_give_transformers_logits(imported):
    kind, _, reference, out, command = imported
    error = relative_error(our_logits(command, out), reference)
    assert error < 1e-4, f"{kind}: logits differ by {error:.2e} relative"


def test_the_printed_command_trains_from_the_weights_on_two_devices(imported, tmp_path):
    kind, *_, command = imported
    run = str(tmp_path / "run")
    assert command[:2] == ["python", "train.py"] and command[-1].startswith("checkpoint.load_params_from=")
    # two devices: the weights are restored into the run's sharding (fsdp over both), not as they were written
    result = run_cli([*command[1:], "train.steps=2", "train.warmup_steps=1", "train.seq_len=32", "train.eval_every=0",
                      f"run.output_dir={run}"], env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "parameters loaded from" in result.stdout and "(mesh fsdp=2)" in result.stdout
    with open(os.path.join(run, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    assert len(losses) >= 1 and np.all(np.isfinite(losses))


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_an_export_loads_in_transformers_with_the_same_logits(imported, tmp_path, dtype, tolerance):
    from helpers import hf_models
    import torch
    from transformers import AutoModelForCausalLM

    kind, original, reference, out, _ = imported
    exported = str(tmp_path / "export")
    result = run_cli(["-m", "MaxOffload.convert", "to-hf", out, "--out", exported, "--dtype", dtype,
                      "--max_shard_size", "300KB"])
    assert result.returncode == 0, result.stderr
    with open(os.path.join(exported, "config.json")) as f:
        config = json.load(f)
    assert config["dtype"] == dtype
    # what the model does not define is carried over from the checkpoint imported (from-hf kept its config.json)
    for key in ("max_position_embeddings", "bos_token_id", "eos_token_id", "initializer_range"):
        assert config[key] == getattr(original.config, key), key
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    error = relative_error(hf_models.logits(model, TOKENS), reference)
    assert error < tolerance, f"{kind} exported as {dtype}: logits differ by {error:.2e} relative"
