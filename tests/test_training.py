"""End-to-end training runs of train.py (tiny models, CPU) and in-process tests of the data pipeline,
tokenizer and weight-decay mask."""
import concurrent.futures
import glob
import json
import math
import os

import jax
import numpy as np
import pytest

from MaxOffload import from_config
from MaxOffload.data import synthetic, text, tokenizer

# A tiny Llama on the quickstart recipe (real text, lr 3e-3).
TINY_QUICKSTART = ["configs/quickstart.py", "model.num_layers=2", "model.emb_dim=64", "model.num_heads=4",
                   "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=176", "train.seq_len=64",
                   "train.per_device_batch_size=8"]
MAIN_STEPS, MAIN_WARMUP, MAIN_LR, MAIN_FINAL_RATIO, MAIN_EVAL_EVERY = 60, 5, 3e-3, 0.2, 20
# Short runs: compile time dominates, so keep them few steps and small shapes.
SHORT = ["configs/llama3_1.py:tiny", "train.steps=6", "train.warmup_steps=1", "train.learning_rate=3e-3",
         "train.seq_len=32", "train.per_device_batch_size=4", "train.eval_every=0", "train.eval_batches=1"]

STEP_KEYS = {"step", "loss", "step_time_s", "tokens_per_sec_per_device", "tflops_per_sec_per_device", "grad_norm",
             "learning_rate"}

ENGLISH = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
           "All that glitters is not gold, and not all those who wander are lost. The early bird catches the "
           "worm, but the second mouse gets the cheese. Knowledge is power, and practice makes perfect.\n")


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    return rows, train, evals


def read_summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every training run of this module, two at a time (one per CPU core): name -> (CompletedProcess, out)."""
    from conftest import run_cli

    tmp = tmp_path_factory.mktemp("runs")
    user_text = tmp / "english.txt"
    user_text.write_text(ENGLISH * 16)  # ~5 KB, one document
    plans = {
        "main": TINY_QUICKSTART + [f"train.steps={MAIN_STEPS}", f"train.warmup_steps={MAIN_WARMUP}",
                                   f"train.learning_rate={MAIN_LR}", f"train.final_lr_ratio={MAIN_FINAL_RATIO}",
                                   f"train.eval_every={MAIN_EVAL_EVERY}", "train.eval_batches=2", "run.log_every=20"],
        "seed0_a": SHORT + ["run.seed=0"],
        "seed0_b": SHORT + ["run.seed=0"],
        "seed1": SHORT + ["run.seed=1"],
        "synthetic": SHORT + ["data.source=synthetic"],
        "user_text": SHORT + ["train.steps=12", f"data.text_files={user_text}"],
        "dry": TINY_QUICKSTART + ["run.dry_run=true"],
    }
    outs = {name: str(tmp / name) for name in plans}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_cli, ["train.py", *args, f"run.output_dir={outs[name]}"], timeout=400)
                   for name, args in plans.items()}
        return {name: (future.result(), outs[name]) for name, future in futures.items()}


def finished(runs, name):
    result, out = runs[name]
    assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr
    return result, out


# --------------------------------------------------------------------------------------------
# The main tiny run on the bundled text
# --------------------------------------------------------------------------------------------

@pytest.mark.stack("py311", "py312")
def test_loss_falls_on_real_text(runs):
    _, out = finished(runs, "main")
    _, train, _ = read_metrics(out)
    losses = [r["loss"] for r in train]
    assert all(math.isfinite(x) for x in losses)
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert first > 5.5  # ~ln(512) at initialisation
    assert first - last > 1.0, f"loss fell only {first - last:.3f} nats ({first:.3f} -> {last:.3f})"


@pytest.mark.stack("py311", "py312")
def test_metrics_jsonl_one_object_per_step(runs):
    _, out = finished(runs, "main")
    rows, train, evals = read_metrics(out)
    assert len(rows) == len(train) + len(evals)
    assert [r["step"] for r in train] == list(range(1, MAIN_STEPS + 1))
    for r in train:
        assert STEP_KEYS <= set(r), f"missing {STEP_KEYS - set(r)} in {r}"
        for key in STEP_KEYS - {"step"}:
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r[key])
        assert r["step_time_s"] > 0 and r["tokens_per_sec_per_device"] > 0 and r["tflops_per_sec_per_device"] > 0
        assert r["grad_norm"] > 0
        assert r["learning_rate"] >= 0
        assert r["mfu"] is None  # a CPU has no known peak


@pytest.mark.stack("py311", "py312")
def test_eval_lines(runs):
    _, out = finished(runs, "main")
    _, _, evals = read_metrics(out)
    assert [r["step"] for r in evals] == list(range(MAIN_EVAL_EVERY, MAIN_STEPS + 1, MAIN_EVAL_EVERY))
    losses = [r["eval_loss"] for r in evals]
    assert all(math.isfinite(x) and x > 0 for x in losses)
    assert losses[-1] < losses[0]


@pytest.mark.stack("py311", "py312")
def test_summary_json(runs):
    result, out = finished(runs, "main")
    _, train, evals = read_metrics(out)
    summary = read_summary(out)
    assert summary["steps"] == MAIN_STEPS
    assert summary["first_loss"] == pytest.approx(train[0]["loss"])
    assert summary["final_loss"] == pytest.approx(train[-1]["loss"])
    assert summary["final_eval_loss"] == pytest.approx(evals[-1]["eval_loss"])
    assert summary["params_total"] > 0 and summary["state_bytes_per_device"] > 0
    for key in ("compile_time_s", "train_time_s", "mean_step_time_s", "tokens_per_sec_per_device",
                "tflops_per_sec_per_device"):
        assert summary[key] > 0, key
    assert os.path.isfile(os.path.join(out, "config.json"))
    assert "done:" in result.stdout


@pytest.mark.stack("py311", "py312")
def test_tensorboard_events_match_metrics(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = finished(runs, "main")
    tb = os.path.join(out, "tensorboard")
    assert glob.glob(os.path.join(tb, "events.out.tfevents.*")), os.listdir(out)
    acc = EventAccumulator(tb, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/learning_rate", "eval/loss"} <= tags, tags
    _, train, evals = read_metrics(out)
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [r["step"] for r in train]
    np.testing.assert_allclose([e.value for e in events], [r["loss"] for r in train], rtol=1e-6)
    lr_events = acc.Scalars("train/learning_rate")
    np.testing.assert_allclose([e.value for e in lr_events], [r["learning_rate"] for r in train], rtol=1e-6,
                               atol=1e-12)
    eval_events = acc.Scalars("eval/loss")
    assert [e.step for e in eval_events] == [r["step"] for r in evals]
    np.testing.assert_allclose([e.value for e in eval_events], [r["eval_loss"] for r in evals], rtol=1e-6)


def expected_lr(step, *, peak=MAIN_LR, warmup=MAIN_WARMUP, steps=MAIN_STEPS, ratio=MAIN_FINAL_RATIO):
    """The learning rate applied in 1-based step `step`: the optimizer has taken t = step - 1 updates.
    Linear warmup 0 -> peak over `warmup` updates, then cosine from peak to peak * ratio at t = steps."""
    t = step - 1
    if t < warmup:
        return peak * t / warmup
    end = peak * ratio
    progress = (t - warmup) / (steps - warmup)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.stack("py311", "py312")
def test_learning_rate_schedule(runs):
    _, out = finished(runs, "main")
    _, train, _ = read_metrics(out)
    lr = {r["step"]: r["learning_rate"] for r in train}
    for step in (1, 2, 3, MAIN_WARMUP, MAIN_WARMUP + 1, MAIN_WARMUP + 2, 20, 33, 45, MAIN_STEPS - 1, MAIN_STEPS):
        assert lr[step] == pytest.approx(expected_lr(step), rel=1e-5, abs=1e-10), step
    assert lr[1] == 0.0
    assert max(lr.values()) == pytest.approx(MAIN_LR, rel=1e-6)  # peak reached right after the warmup
    assert lr[MAIN_WARMUP + 1] == pytest.approx(MAIN_LR, rel=1e-6)
    warm = [lr[s] for s in range(1, MAIN_WARMUP + 2)]
    decay = [lr[s] for s in range(MAIN_WARMUP + 1, MAIN_STEPS + 1)]
    assert warm == sorted(warm)
    assert decay == sorted(decay, reverse=True)
    # the decay ends at learning_rate * final_lr_ratio (within one step's worth of cosine)
    assert lr[MAIN_STEPS] == pytest.approx(MAIN_LR * MAIN_FINAL_RATIO, rel=0.01)


# --------------------------------------------------------------------------------------------
# Determinism, data sources, dry run
# --------------------------------------------------------------------------------------------

@pytest.mark.stack("py311", "py312")
def test_same_seed_same_losses_other_seed_differs(runs):
    losses = {}
    for name in ("seed0_a", "seed0_b", "seed1"):
        _, out = finished(runs, name)
        _, train, _ = read_metrics(out)
        losses[name] = [r["loss"] for r in train]
        assert len(losses[name]) == 6
    assert losses["seed0_a"] == losses["seed0_b"]
    assert losses["seed0_a"] != losses["seed1"]
    assert losses["seed0_a"][0] != losses["seed1"][0]  # different init and data from the first step


@pytest.mark.stack("py311", "py312")
def test_synthetic_data_runs(runs):
    result, out = finished(runs, "synthetic")
    assert "synthetic" in result.stdout
    _, train, evals = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) for r in train)
    # uniform random tokens: nothing to learn below ln(vocab)
    assert train[0]["loss"] == pytest.approx(math.log(512), abs=0.3)
    assert len(evals) == 1 and math.isfinite(evals[0]["eval_loss"])


@pytest.mark.stack("py311", "py312")
def test_user_text_file_runs(runs):
    result, out = finished(runs, "user_text")
    assert "byte-level text: 1 documents" in result.stdout
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["data"]["text_files"][0].endswith("english.txt")
    _, train, evals = read_metrics(out)
    assert len(train) == 12 and len(evals) == 1
    losses = [r["loss"] for r in train]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5  # repeated sentences are quickly learnt


@pytest.mark.stack("py311", "py312")
def test_dry_run_writes_sizes_only(runs):
    result, out = finished(runs, "dry")
    with open(os.path.join(out, "dry_run.json")) as f:
        dry = json.load(f)
    summary = dry["summary"]
    # tiny: embed + unembed 2*512*64; per layer 2 norms, q/o 64*4*16 each, k/v 64*2*16 each, MLP 3*64*176
    per_layer = 2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176
    assert summary["params_total"] == 2 * 512 * 64 + 2 * per_layer + 64
    # float32 params + AdamW mu and nu, plus a few scalars (step counters)
    assert 12 * summary["params_total"] <= summary["state_bytes_per_device"] < 12 * summary["params_total"] + 1024
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))
    assert not os.path.exists(os.path.join(out, "tensorboard"))
    assert sorted(os.listdir(out)) == ["dry_run.json"]  # its own file only: no config.json, no summary.json
    assert dry["config"]["run"]["dry_run"] is True
    assert "dry run" in result.stdout


# --------------------------------------------------------------------------------------------
# In-process: TextData, tokenizer, weight-decay mask
# --------------------------------------------------------------------------------------------

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def make_documents(count=20, words=60, seed=0):
    rng = np.random.default_rng(seed)
    return [f"@@DOC{i:03d}@@ " + " ".join(rng.choice(WORDS, words)) + "." for i in range(count)]


def markers(decoded):
    import re

    return set(re.findall(r"@@DOC\d{3}@@", decoded))


SEQ, BATCH = 32, 4


@pytest.fixture
def data():
    return text.TextData(make_documents(), eval_fraction=0.2, global_batch=BATCH, seq_len=SEQ, seed=7)


def window_index(data, window):
    """The index i of the training window train_stream[i*SEQ : i*SEQ + SEQ + 1] equal to `window`."""
    for i in range(data.num_windows):
        if np.array_equal(data.train_stream[i * SEQ: i * SEQ + SEQ + 1], window):
            return i
    raise AssertionError("window is not a seq_len+1 slice of the train stream at a multiple of seq_len")


def test_text_windows_are_shifted_slices_of_the_train_stream(data):
    for step in (0, 1, 5):
        batch = data.train_batch(step)
        assert batch["inputs"].shape == batch["targets"].shape == batch["mask"].shape == (BATCH, SEQ)
        assert batch["inputs"].dtype == np.int32 and batch["mask"].dtype == np.float32
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        assert (batch["mask"] == 1).all()
        for row in range(BATCH):
            window = np.concatenate([batch["inputs"][row], batch["targets"][row, -1:]])
            assert len(window) == SEQ + 1
            window_index(data, window)


def test_held_out_documents_never_in_training(data):
    all_markers = {f"@@DOC{i:03d}@@" for i in range(20)}
    held_out = markers(tokenizer.decode(data.eval_stream))
    trained = markers(tokenizer.decode(data.train_stream))
    assert len(held_out) == round(20 * 0.2)
    assert held_out.isdisjoint(trained) and held_out | trained == all_markers
    steps_per_epoch = data.num_windows // BATCH
    seen = ""
    for step in range(2 * steps_per_epoch + 1):  # more than one epoch
        batch = data.train_batch(step)
        for row in range(BATCH):
            seen += tokenizer.decode(np.concatenate([batch["inputs"][row], batch["targets"][row, -1:]])) + "\n"
    assert markers(seen).isdisjoint(held_out)
    # no piece of a held-out document's body leaks either
    documents = make_documents()
    for marker in held_out:
        body = documents[int(marker[5:8])]
        assert body[20:60] not in tokenizer.decode(data.train_stream)


def test_held_out_split_does_not_depend_on_run_seed():
    kwargs = dict(eval_fraction=0.2, global_batch=BATCH, seq_len=SEQ)
    a = text.TextData(make_documents(), seed=0, **kwargs)
    b = text.TextData(make_documents(), seed=123, **kwargs)
    np.testing.assert_array_equal(a.eval_stream, b.eval_stream)
    assert not np.array_equal(a.train_batch(0)["inputs"], b.train_batch(0)["inputs"])


def test_one_epoch_does_not_repeat_windows(data):
    steps_per_epoch = data.num_windows // BATCH
    assert steps_per_epoch >= 5
    ids = []
    for step in range(steps_per_epoch):
        batch = data.train_batch(step)
        ids += [window_index(data, np.concatenate([batch["inputs"][r], batch["targets"][r, -1:]]))
                for r in range(BATCH)]
    assert len(ids) == len(set(ids)) == steps_per_epoch * BATCH
    # the order is shuffled, and the same step gives the same batch
    assert ids != sorted(ids)
    np.testing.assert_array_equal(data.train_batch(3)["inputs"], data.train_batch(3)["inputs"])


def test_eval_batches_pad_with_mask_zero(data):
    length = len(data.eval_stream)
    count = length // (BATCH * SEQ) + 2  # more than the held-out text fills
    batches = data.eval_batches(count)
    assert len(batches) == count
    inputs = np.concatenate([b["inputs"] for b in batches]).reshape(-1)
    targets = np.concatenate([b["targets"] for b in batches]).reshape(-1)
    mask = np.concatenate([b["mask"] for b in batches]).reshape(-1)
    for b in batches:
        assert b["inputs"].shape == b["targets"].shape == b["mask"].shape == (BATCH, SEQ)
    # read in order: position p predicts eval_stream[p + 1]
    np.testing.assert_array_equal(inputs[: length - 1], data.eval_stream[: length - 1])
    np.testing.assert_array_equal(targets[: length - 1], data.eval_stream[1:])
    np.testing.assert_array_equal(mask[: length - 1], 1.0)
    np.testing.assert_array_equal(mask[length - 1:], 0.0)
    assert (targets[length - 1:] == tokenizer.PAD).all()
    assert batches[-1]["mask"].sum() == 0  # the last batch is all padding


def test_eval_batches_without_padding_when_text_suffices(data):
    (batch,) = data.eval_batches(1)
    assert len(data.eval_stream) > BATCH * SEQ + 1
    assert (batch["mask"] == 1).all()


def test_single_document_holds_out_its_tail():
    doc = make_documents(1, words=400)[0]
    d = text.TextData([doc], eval_fraction=0.25, global_batch=2, seq_len=16, seed=0)
    stream = np.concatenate([tokenizer.encode(doc), [tokenizer.EOS]])
    np.testing.assert_array_equal(np.concatenate([d.train_stream, d.eval_stream]), stream)
    assert len(d.eval_stream) == pytest.approx(0.25 * len(stream), abs=1)


def test_too_little_text_is_a_config_error():
    from MaxOffload.config import ConfigError

    with pytest.raises(ConfigError, match="train.seq_len"):
        text.TextData(["short", "texts"], eval_fraction=0.5, global_batch=2, seq_len=64, seed=0)


def test_synthetic_data_is_a_function_of_seed_and_step():
    a = synthetic.SyntheticData(vocab_size=100, global_batch=4, seq_len=8, seed=0)
    b = synthetic.SyntheticData(vocab_size=100, global_batch=4, seq_len=8, seed=0)
    c = synthetic.SyntheticData(vocab_size=100, global_batch=4, seq_len=8, seed=1)
    np.testing.assert_array_equal(a.train_batch(2)["inputs"], b.train_batch(2)["inputs"])
    assert not np.array_equal(a.train_batch(2)["inputs"], c.train_batch(2)["inputs"])
    assert not np.array_equal(a.train_batch(2)["inputs"], a.train_batch(3)["inputs"])
    batch = a.train_batch(0)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert batch["inputs"].max() < 100


@pytest.mark.parametrize("source", ["synthetic", "text"])
def test_a_steps_rows_do_not_depend_on_micro_batches_or_processes(source):
    """Row r of step s is the same sequence whatever cuts the step: k micro-batches of b rows (the trainer reads
    micro-batch i of step s as train_batch(s * k + i)) are one batch of k x b, and P processes' rows of each are
    its P slices. Fails if a source draws a batch per batch shape (synthetic data did: gradient accumulation then
    trained on other tokens than the whole batch)."""
    def make(global_batch, process_index=0, process_count=1):
        common = dict(global_batch=global_batch, seq_len=8, seed=3, process_index=process_index,
                      process_count=process_count)
        if source == "synthetic":
            return synthetic.SyntheticData(vocab_size=100, **common)
        return text.TextData(["some words of text, " * 40 + str(i) for i in range(6)], eval_fraction=0.2, **common)

    k, b = 4, 2
    whole = make(k * b)
    for step in (0, 5):
        one = whole.train_batch(step)
        for processes in (1, 2):
            parts = [make(b, p, processes).train_batch(step * k + i) for i in range(k) for p in range(processes)]
            for key in one:
                np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), one[key])
    halves = [make(k * b, p, 2).eval_batches(2) for p in range(2)]
    for full, p0, p1 in zip(whole.eval_batches(2), *halves):
        for key in full:
            np.testing.assert_array_equal(np.concatenate([p0[key], p1[key]]), full[key])


@pytest.mark.parametrize("sample", ["hello, world", "héllo wörld — naïve café", "日本語のテキスト",
                                    "emoji 🚀🎉 and\nnewlines\ttabs", ""])
def test_byte_tokenizer_round_trip(sample):
    tokens = tokenizer.encode(sample)
    assert len(tokens) == len(sample.encode("utf-8"))
    assert tokens.dtype == np.int32
    if len(tokens):
        assert tokens.min() >= tokenizer.OFFSET and tokens.max() < tokenizer.VOCAB_SIZE
    assert tokenizer.decode(tokens) == sample
    # special tokens are dropped on decode
    assert tokenizer.decode([tokenizer.BOS, *tokens, tokenizer.EOS, tokenizer.PAD]) == sample


def test_tokenizer_vocab_size():
    assert tokenizer.VOCAB_SIZE == 259
    assert len({tokenizer.PAD, tokenizer.BOS, tokenizer.EOS}) == 3 and max(tokenizer.PAD, tokenizer.BOS,
                                                                           tokenizer.EOS) < tokenizer.OFFSET


def _tiny_params(*extra):
    from flax import nnx

    from MaxOffload.config import load

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load([os.path.join(root, "configs", "llama3_1.py") + ":tiny", *extra])
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: from_config.model(cfg))))


def _mask_by_name(mask):
    return {jax.tree_util.keystr(path): value for path, value in jax.tree_util.tree_flatten_with_path(mask)[0]}


def test_decay_mask_excludes_norms_and_embeddings():
    from MaxOffload.train.optimizer import decay_mask

    mask = _mask_by_name(decay_mask(_tiny_params(), decay_embeddings=False))
    norms = [k for k in mask if "scale" in k]
    embeddings = [k for k in mask if k.endswith("['embed']") or k.endswith("['unembed']")]
    weights = [k for k in mask if k not in norms and k not in embeddings]
    assert len(norms) >= 3 and len(embeddings) == 2 and len(weights) >= 7, mask
    assert not any(mask[k] for k in norms), mask
    assert not any(mask[k] for k in embeddings), mask
    assert all(mask[k] for k in weights), mask
    assert any("wq" in k for k in weights) and any("wi_0" in k for k in weights)


def test_decay_mask_with_decay_embeddings():
    from MaxOffload.train.optimizer import decay_mask

    mask = _mask_by_name(decay_mask(_tiny_params(), decay_embeddings=True))
    for key, value in mask.items():
        if "scale" in key:
            assert value is False, key
        else:
            assert value is True, key
    assert mask["['embed']"] is True and mask["['unembed']"] is True
