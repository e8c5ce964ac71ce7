"""Rows of packed documents (data.attend_within_documents): a token attends only within its own document. The data
finds the documents from the end-of-text tokens; the model's logits of a packed row are each document's logits
run alone (Llama through XLA's attention and tokamax's flash path, DeepSeek's MLA with its MoE); what cannot keep
documents apart is one line. The TPU kernel's segment ids: tests/test_tpu.py (splash_check's packed cases)."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import EIGHT_CPUS, ROOT, process_env, run_cli
from MaxOffload import from_config
from MaxOffload.config import load
from MaxOffload.data import tokenized

LENGTHS = (13, 22, 29)  # three documents packed into one row of 64 tokens


def packed_row(vocab, seed=0):
    """(tokens [1, 64], documents [1, 64], the documents' spans): random tokens, three documents."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (1, sum(LENGTHS)), np.int32)
    documents = np.repeat(np.arange(len(LENGTHS)), LENGTHS)[None].astype(np.int32)
    starts = np.cumsum((0,) + LENGTHS[:-1])
    return jnp.asarray(tokens), jnp.asarray(documents), [slice(s, s + n) for s, n in zip(starts, LENGTHS)]


def logits_of(model, tokens, documents=None):
    out = model(tokens, documents)
    return out[0] if isinstance(out, tuple) else out


# the xla paths' masks are pure JAX (py311 only); the flash kernel is tokamax's, another release on each stack
@pytest.mark.parametrize("spec, attention", [("configs/llama3_1.py:tiny", "xla"),
                                             pytest.param("configs/llama3_1.py:tiny", "flash",
                                                          marks=pytest.mark.stack("py311", "py312")),
                                             ("configs/deepseek_v3.py:tiny", "xla")],
                         ids=["llama-xla", "llama-flash", "deepseek-xla"])
def test_a_packed_row_is_its_documents_run_alone(spec, attention):
    """Each document's logits in the packed row equal the same tokens run as a row of their own (RoPE's angles
    differ by the document's offset, which attention's scores do not see), to float32 rounding; without the
    documents the later ones see their predecessors and differ."""
    cfg = load([spec, "model.compute_dtype=float32", "model.param_dtype=float32", f"model.attention={attention}",
                "model.mtp_depth=0"])
    model = from_config.model(cfg)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, t, d: logits_of(nnx.merge(graphdef, s), t, d))
    tokens, documents, spans = packed_row(cfg.model.vocab_size)
    packed, mixed = run(state, tokens, documents), run(state, tokens, None)
    scale = float(jnp.max(jnp.abs(packed)))
    for span in spans:
        alone = run(state, tokens[:, span], jnp.zeros_like(documents[:, span]))
        assert float(jnp.max(jnp.abs(packed[:, span] - alone))) < 1e-5 * scale, span
    later = spans[-1]
    assert float(jnp.max(jnp.abs(mixed[:, later] - packed[:, later]))) > 1e-3 * scale  # the mask does something


def test_the_documents_of_a_row_come_from_its_end_of_text_tokens():
    """The token ending a document belongs to it; the next one starts the next document; without eos_id no
    documents key (the batch the step had before)."""
    eos = 9
    stream = np.array([1, 2, eos, 3, 4, 5, eos, 6, eos, 7, 8, 1, 2, 3, eos, 4, 5], np.int32)
    reader = tokenized.TokenWindows(stream, stream, global_batch=1, seq_len=8, seed=0, eos_id=eos)
    batch = reader.train_batch(0)
    inputs, documents = batch["inputs"][0], batch["documents"][0]
    ends = np.flatnonzero(inputs == eos)
    expected = np.array([np.sum(ends < t) for t in range(len(inputs))])
    assert documents.tolist() == expected.tolist() and documents.dtype == np.int32
    assert set(reader.eval_batches(1)[0]) == {"inputs", "targets", "mask", "documents"}
    plain = tokenized.TokenWindows(stream, stream, global_batch=1, seq_len=8, seed=0)
    assert set(plain.train_batch(0)) == {"inputs", "targets", "mask"}


def test_train_py_with_documents_runs_and_its_step_takes_them(tmp_path):
    """The quickstart's real text, documents kept apart: the run trains (its loss falls from the first step) and
    the step's batch carries the documents."""
    out = tmp_path / "run"
    result = run_cli(["train.py", "configs/llama3_1.py:tiny", "data.attend_within_documents=true", "train.steps=6",
                      "train.warmup_steps=1", "train.eval_every=0", "checkpoint.enabled=false",
                      f"run.output_dir={out}"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    setup = from_config.train_setup(load(["configs/llama3_1.py:tiny", "data.attend_within_documents=true"]))
    assert "documents" in setup.abstract_batch() and "documents" in setup.batch_shardings()


def test_documents_over_load_balanced_context_shards_equal_one_device(tmp_path):
    """DeepSeek tiny (MLA: each shard gathers the latent, and the documents with the positions) over 4 load-balanced
    context shards x fsdp 2, XLA's attention, a batch of real text whose rows hold several documents (lines of
    docs/tpu.md, each a document): the loss and gradients of one device's step of the same batch, which itself
    differs from attending across the documents."""
    lines = [ln.strip() for ln in open(os.path.join(ROOT, "docs", "tpu.md")) if len(ln.strip()) > 40][:60]
    files = []
    for i, line in enumerate(lines):
        files.append(tmp_path / f"{i:03d}.txt")
        files[-1].write_text(line + "\n")
    case = ["configs/deepseek_v3.py:tiny", "mesh.ici.context=4", "mesh.ici.fsdp=2", "mesh.context_load_balance=true",
            "model.attention=xla", f"data.text_files=[{','.join(map(str, files))}]"]
    helper = "tests/helpers/documents_check.py"
    result = subprocess.run([sys.executable, helper, json.dumps({"deepseek": case})], cwd=ROOT, text=True,
                            capture_output=True, env=process_env([helper], EIGHT_CPUS), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])["deepseek"]
    assert found["boundaries"] >= 4, found  # the batch's rows hold several documents
    assert found["loss"] < 1e-5 and found["grads"] < 1e-5, found
    assert found["vs_unpacked"] > 1e-4, found


@pytest.mark.parametrize("args, says", [
    (["data.source=synthetic"], "synthetic rows are random tokens, not documents"),
    (["mesh.ici.stage=2", "model.num_layers=4"], "pipeline stages (mesh stage > 1) run every row at one set"),
    (["mesh.ici.context=4", "model.attention=flash"], "the flash kernel over context shards takes no mask"),
])
def test_what_cannot_keep_documents_apart_is_one_line(args, says, tmp_path):
    result = run_cli(["-m", "MaxOffload.aot", "configs/llama3_1.py:tiny", "data.attend_within_documents=true",
                      "--target", "gb200", "--topology", "1x1x4", *args, f"run.output_dir={tmp_path}"])
    assert result.returncode == 2 and says in result.stdout + result.stderr, result.stdout + result.stderr[-1500:]
    assert "Traceback" not in result.stderr
