"""The data pipeline: `python -m MaxOffload.data.prepare` (byte, Hugging Face tokenizer.json and SentencePiece
tokenizers made here from a few paragraphs), the memory-mapped reader it feeds and the one it shares with
data.source=text, training on a prepared directory, and one-line errors for bad inputs."""
import concurrent.futures
import json
import math
import os
import re
import sys

import numpy as np
import pytest

from conftest import small_filesystem
from MaxOffload.data import prepare, text, tokenized, tokenizer


WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
EXTRAS = ["héllo", "wörld", "naïve", "café", "日本語", "🚀", "\n", "\t", "  "]
NUM_DOCS, NUM_TXT, EVAL_FRACTION = 40, 8, 0.1
SEQ, BATCH = 16, 4


def make_documents(count=NUM_DOCS, seed=0):
    """Documents with a unique marker, varied length, non-ASCII text, newlines, tabs and double spaces."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(count):
        words = list(rng.choice(WORDS, int(rng.integers(20, 120))))
        for k in rng.choice(len(words), 4, replace=False):
            words[k] = str(rng.choice(EXTRAS))
        docs.append(f"@@DOC{i:03d}@@ " + " ".join(words) + ".")
    return docs


def markers(decoded):
    return set(re.findall(r"@@DOC\d{3}@@", decoded))


def train_hf_tokenizer(path, documents, with_eos=True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"] if with_eos else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(documents, trainer)
    tok.save(str(path))
    return str(path)


def train_sentencepiece(prefix, documents):
    import sentencepiece

    corpus = f"{prefix}.corpus.txt"
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(doc.replace("\n", " ") for doc in documents))
    # identity normalization, no whitespace folding, byte fallback: decode(encode(text)) == text
    sentencepiece.SentencePieceTrainer.train(
        input=corpus, model_prefix=str(prefix), vocab_size=400, model_type="bpe", normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, byte_fallback=True, character_coverage=1.0,
        hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return f"{prefix}.model"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The documents as inputs: the first NUM_TXT as .txt files in nested directories, the rest as one .jsonl
    (with blank lines, an extra field and an empty document that is skipped)."""
    root = tmp_path_factory.mktemp("corpus")
    docs = make_documents()
    for i in range(NUM_TXT):
        sub = root / "txt" / ("a" if i < NUM_TXT // 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:02d}.txt").write_text(docs[i], encoding="utf-8")
    (root / "txt" / "notes.md").write_text("not an input")  # other suffixes in a directory are ignored
    with open(root / "rest.jsonl", "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs[NUM_TXT:]):
            f.write(json.dumps({"id": i, "text": doc}, ensure_ascii=i % 2 == 0) + "\n")
            if i == 3:
                f.write("\n" + json.dumps({"text": "   "}) + "\n")
    return {"docs": docs, "inputs": [str(root / "txt"), str(root / "rest.jsonl")], "root": root}


@pytest.fixture(scope="module")
def tokenizer_files(corpus):
    root = corpus["root"]
    (root / "no_eos").mkdir()
    return {"byte": "byte",
            "hf": train_hf_tokenizer(root / "tokenizer.json", corpus["docs"]),
            "hf_no_eos": train_hf_tokenizer(root / "no_eos" / "tokenizer.json", corpus["docs"], with_eos=False),
            "sp": train_sentencepiece(root / "spm", corpus["docs"])}


KINDS = ("byte", "hf", "hf_no_eos", "sp")


@pytest.fixture(scope="module")
def prepared(corpus, tokenizer_files, tmp_path_factory):
    """kind -> (directory, meta), prepared in-process through the CLI's main()."""
    out = {}
    for kind in KINDS:
        directory = str(tmp_path_factory.mktemp(f"prepared_{kind}"))
        assert prepare.main([*corpus["inputs"], "--tokenizer", tokenizer_files[kind], "--out", directory,
                             "--eval_fraction", str(EVAL_FRACTION)]) == 0
        with open(os.path.join(directory, "meta.json")) as f:
            out[kind] = (directory, json.load(f))
    return out


def file_order(meta):
    """Input document numbers in the order tokens.bin holds them: training documents, then held-out ones."""
    held = meta["held_out_documents"]
    return [i for i in range(meta["num_documents"]) if i not in set(held)] + held


# --------------------------------------------------------------------------------------------
# prepare -> read round trip, per tokenizer kind
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_reproduces_the_documents(kind, corpus, prepared, tokenizer_files):
    directory, meta = prepared[kind]
    docs = corpus["docs"]
    tok = tokenizer.load(tokenizer_files[kind])
    assert meta["num_documents"] == len(docs)  # the whitespace-only JSONL document was skipped
    assert meta["vocab_size"] == tok.vocab_size and meta["eos_id"] == tok.eos_id
    assert meta["tokenizer"]["kind"] == {"byte": "byte", "sp": "sentencepiece"}.get(kind, "huggingface")
    assert meta["dtype"] == "uint16"
    tokens = tokenized.open_tokens(directory)
    assert isinstance(tokens, np.memmap) and len(tokens) == meta["num_tokens"]
    assert os.path.getsize(os.path.join(directory, "tokens.bin")) == 2 * meta["num_tokens"]
    offsets = np.load(os.path.join(directory, "documents.npy"))
    assert offsets.dtype == np.int64 and len(offsets) == len(docs) + 1
    assert offsets[0] == 0 and offsets[-1] == meta["num_tokens"]
    for position, doc_id in enumerate(file_order(meta)):
        ids = np.asarray(tokens[offsets[position]: offsets[position + 1]])
        assert ids[-1] == meta["eos_id"] and (ids[:-1] != meta["eos_id"]).all()
        assert tok.decode(ids) == docs[doc_id], (kind, doc_id)
    # the same tokens as the in-memory path (data.source=text) builds: one layout, one reader
    in_memory, input_offsets = tokenized.encode_documents(docs, tok)
    ranges, train_tokens, held_out = tokenized.split_layout(input_offsets, EVAL_FRACTION)
    np.testing.assert_array_equal(np.asarray(tokens), tokenized.apply_layout(in_memory, ranges))
    assert meta["train_tokens"] == train_tokens == offsets[meta["train_documents"]]
    assert meta["held_out_documents"] == held_out.tolist()


def test_meta_records_sources_split_and_tokenizer(corpus, prepared, tokenizer_files):
    import hashlib

    _, meta = prepared["hf"]
    assert meta["held_out"] == "documents"
    assert meta["eval_documents"] == round(NUM_DOCS * EVAL_FRACTION)
    assert meta["train_documents"] + meta["eval_documents"] == NUM_DOCS
    assert meta["train_tokens"] + meta["eval_tokens"] == meta["num_tokens"]
    assert meta["tokenizer"]["eos_token"] == "<|endoftext|>"
    with open(tokenizer_files["hf"], "rb") as f:
        assert meta["tokenizer"]["sha256"] == hashlib.sha256(f.read()).hexdigest()
    sources = meta["sources"]
    assert [os.path.basename(s["path"]) for s in sources] == [f"doc{i:02d}.txt" for i in range(NUM_TXT)] + \
        ["rest.jsonl"]  # directories searched recursively in sorted order; notes.md ignored
    assert [s["documents"] for s in sources] == [1] * NUM_TXT + [NUM_DOCS - NUM_TXT]
    assert sources[-1]["skipped_empty"] == 1
    for s in sources:
        with open(s["path"], "rb") as f:
            data = f.read()
        assert s["bytes"] == len(data) and s["sha256"] == hashlib.sha256(data).hexdigest()


def test_tokenizer_without_end_of_text_gets_an_id_past_its_vocabulary(prepared):
    _, meta = prepared["hf_no_eos"]
    assert meta["tokenizer"]["eos_token"] is None
    assert meta["eos_id"] == meta["vocab_size"] - 1  # the extra id, counted in vocab_size
    assert prepared["hf"][1]["eos_id"] < prepared["hf"][1]["vocab_size"] - 1  # <|endoftext|> is a real token


def test_separator_splits_text_files(tmp_path):
    docs = make_documents(6)
    (tmp_path / "all.txt").write_text("<|endoftext|>".join(docs) + "<|endoftext|>\n", encoding="utf-8")
    out = str(tmp_path / "out")
    meta = prepare.prepare([str(tmp_path / "all.txt")], out, separator="<|endoftext|>", eval_fraction=0.2)
    assert meta["num_documents"] == 6  # the trailing newline alone is an empty document, skipped
    tokens, offsets = tokenized.open_tokens(out), np.load(os.path.join(out, "documents.npy"))
    decoded = [tokenizer.decode(tokens[offsets[j]: offsets[j + 1]]) for j in range(6)]
    assert [docs[i] for i in file_order(meta)] == decoded


def test_single_document_holds_out_its_tail(tmp_path):
    doc = make_documents(1)[0] * 5
    (tmp_path / "one.txt").write_text(doc, encoding="utf-8")
    meta = prepare.prepare([str(tmp_path / "one.txt")], str(tmp_path / "out"), eval_fraction=0.25)
    stream = np.concatenate([tokenizer.encode(doc), [tokenizer.EOS]])
    assert meta["train_tokens"] == int(len(stream) * 0.75) and meta["held_out_documents"] == []
    np.testing.assert_array_equal(tokenized.open_tokens(str(tmp_path / "out")), stream)
    data = text.TextData([doc], eval_fraction=0.25, global_batch=2, seq_len=16, seed=0)
    assert len(data.train_stream) == meta["train_tokens"]


def test_missing_optional_package_is_one_line(monkeypatch, tokenizer_files):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(tokenizer.TokenizerError, match=r"pip install tokenizers"):
        tokenizer.load(tokenizer_files["hf"])
    with pytest.raises(tokenizer.TokenizerError, match=r"pip install sentencepiece"):
        tokenizer.load(tokenizer_files["sp"])


# --------------------------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------------------------

def reader(directory, **kwargs):
    args = dict(global_batch=BATCH, seq_len=SEQ, seed=7)
    args.update(kwargs)
    return tokenized.TokenizedData(directory, **args)


@pytest.mark.parametrize("kind", KINDS)
def test_windows_targets_and_mask(kind, prepared):
    directory, meta = prepared[kind]
    data = reader(directory)
    assert isinstance(data.train_stream, np.memmap) and len(data.train_stream) == meta["train_tokens"]
    assert data.num_windows == (meta["train_tokens"] - 1) // SEQ
    for step in (0, 1, 7):
        batch = data.train_batch(step)
        assert batch["inputs"].shape == batch["targets"].shape == batch["mask"].shape == (BATCH, SEQ)
        assert batch["inputs"].dtype == batch["targets"].dtype == np.int32 and batch["mask"].dtype == np.float32
        assert (batch["mask"] == 1).all()
        for row, window in enumerate(data.window_ids(step)):
            expected = np.asarray(data.train_stream[window * SEQ: window * SEQ + SEQ + 1])
            np.testing.assert_array_equal(batch["inputs"][row], expected[:-1])
            np.testing.assert_array_equal(batch["targets"][row], expected[1:])


@pytest.mark.parametrize("kind", KINDS)
def test_held_out_documents_never_in_training_windows(kind, prepared, tokenizer_files):
    directory, meta = prepared[kind]
    tok = tokenizer.load(tokenizer_files[kind])
    data = reader(directory)
    held = {f"@@DOC{i:03d}@@" for i in meta["held_out_documents"]}
    assert len(held) == round(NUM_DOCS * EVAL_FRACTION)
    assert markers(tok.decode(data.eval_stream)) == held
    assert markers(tok.decode(data.train_stream)).isdisjoint(held)
    steps = data.num_windows // BATCH + 3  # more than an epoch
    ids = np.array([data.window_ids(step) for step in range(steps)]).reshape(-1)
    assert ((ids + 1) * SEQ + 1 <= meta["train_tokens"]).all()  # every window lies in the training part
    seen = "".join(tok.decode(np.concatenate([b["inputs"][r], b["targets"][r, -1:]])) + "\n"
                   for b in map(data.train_batch, range(steps)) for r in range(BATCH))
    assert markers(seen).isdisjoint(held)
    assert len(markers(seen)) > NUM_DOCS // 4  # (a window boundary may cut a marker)


def test_one_epoch_visits_every_window_once_in_a_shuffled_order(prepared):
    data = reader(prepared["byte"][0])
    per_epoch = data.num_windows // BATCH
    ids = [i for step in range(per_epoch) for i in data.window_ids(step)]
    assert len(set(ids)) == len(ids) == per_epoch * BATCH and ids != sorted(ids)
    second = [i for step in range(per_epoch, 2 * per_epoch) for i in data.window_ids(step)]
    assert second != ids[: len(second)]  # a new order each epoch


@pytest.mark.parametrize("kind", ("byte", "sp"))
def test_process_rows_are_halves_of_the_global_batch(kind, prepared):
    directory = prepared[kind][0]
    whole = reader(directory, global_batch=8)
    halves = [reader(directory, global_batch=8, process_index=p, process_count=2) for p in range(2)]
    for step in (0, 3, 11):
        full = whole.train_batch(step)
        parts = [h.train_batch(step) for h in halves]
        for key in full:
            assert parts[0][key].shape[0] == parts[1][key].shape[0] == 4
            np.testing.assert_array_equal(np.concatenate([parts[0][key], parts[1][key]]), full[key])
        ids = whole.window_ids(step)
        assert set(ids[:4]).isdisjoint(ids[4:])
    for full, p0, p1 in zip(whole.eval_batches(3), halves[0].eval_batches(3), halves[1].eval_batches(3)):
        for key in full:
            np.testing.assert_array_equal(np.concatenate([p0[key], p1[key]]), full[key])


class _RecordingArray:
    """Stands in for the memory map and records which slices are read."""

    def __init__(self, array):
        self.array, self.slices = array, []

    def __len__(self):
        return len(self.array)

    def __getitem__(self, index):
        self.slices.append((index.start, index.stop))
        return self.array[index]


def test_a_process_reads_only_its_rows(prepared):
    data = reader(prepared["byte"][0], global_batch=8, process_index=1, process_count=2)
    data.train_stream = _RecordingArray(data.train_stream)
    data.train_batch(5)
    mine = data.window_ids(5)[4:]
    assert data.train_stream.slices == [(i * SEQ, i * SEQ + SEQ + 1) for i in mine]


def test_batches_are_a_function_of_seed_and_step(prepared):
    directory = prepared["hf"][0]
    a, b, other = reader(directory, seed=3), reader(directory, seed=3), reader(directory, seed=4)
    later = a.train_batch(9)  # asked out of order: no iterator state
    for step in range(10):
        np.testing.assert_array_equal(b.train_batch(step)["inputs"], a.train_batch(step)["inputs"])
    np.testing.assert_array_equal(b.train_batch(9)["inputs"], later["inputs"])
    assert not np.array_equal(a.train_batch(0)["inputs"], other.train_batch(0)["inputs"])
    assert not np.array_equal(a.train_batch(0)["inputs"], a.train_batch(1)["inputs"])
    np.testing.assert_array_equal(a.eval_stream, other.eval_stream)  # the split does not follow the seed


def test_eval_batches_read_in_order_and_pad_with_mask_zero(prepared):
    directory, meta = prepared["sp"]
    data = reader(directory)
    length = meta["eval_tokens"]
    count = length // (BATCH * SEQ) + 2
    batches = data.eval_batches(count)
    inputs, targets, mask = (np.concatenate([b[k] for b in batches]).reshape(-1) for k in ("inputs", "targets", "mask"))
    eval_stream = np.asarray(data.eval_stream)
    np.testing.assert_array_equal(inputs[: length - 1], eval_stream[:-1])
    np.testing.assert_array_equal(targets[: length - 1], eval_stream[1:])
    np.testing.assert_array_equal(mask[: length - 1], 1.0)
    np.testing.assert_array_equal(mask[length - 1:], 0.0)
    assert batches[-1]["mask"].sum() == 0


def test_text_source_and_prepared_directory_give_identical_batches(tmp_path):
    """data.source=text (in memory) and the same documents prepared with the byte tokenizer: one reader."""
    docs = make_documents(30, seed=5)
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    prepare.prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / "out"), eval_fraction=0.2)
    kwargs = dict(global_batch=6, seq_len=24, seed=11)
    memory = text.TextData(docs, eval_fraction=0.2, **kwargs)
    mapped = tokenized.TokenizedData(str(tmp_path / "out"), **kwargs)
    assert isinstance(memory, tokenized.TokenWindows) and isinstance(mapped, tokenized.TokenWindows)
    np.testing.assert_array_equal(memory.train_stream, mapped.train_stream)
    np.testing.assert_array_equal(memory.eval_stream, mapped.eval_stream)
    for step in (0, 4, 40):
        for key, value in memory.train_batch(step).items():
            np.testing.assert_array_equal(value, mapped.train_batch(step)[key])
    for left, right in zip(memory.eval_batches(3), mapped.eval_batches(3)):
        for key in left:
            np.testing.assert_array_equal(left[key], right[key])


def test_a_failed_reprepare_leaves_the_old_dataset_as_it_was(tmp_path, corpus):
    """Re-preparing into a directory that holds a dataset, from input that turns out broken on its last line:
    the error is the usual one line, and the old dataset is untouched and still valid (nothing is staged)."""
    out = str(tmp_path / "data")
    prepare.prepare(corpus["inputs"], out, progress_interval=0)
    before = {f: open(os.path.join(out, f), "rb").read() for f in ("meta.json", "tokens.bin", "documents.npy")}
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"text": "a new document"}) + "\n{\"text\": \"unclosed\n")
    with pytest.raises(prepare.PrepareError, match="broken.jsonl:2"):
        prepare.prepare([str(broken)], out, progress_interval=0)
    assert {f: open(os.path.join(out, f), "rb").read() for f in before} == before
    assert tokenized.read_meta(out)["num_tokens"] == json.loads(before["meta.json"])["num_tokens"]
    assert sorted(os.listdir(out)) == sorted(before)  # no staging directory left behind
    new = tmp_path / "new.jsonl"
    new.write_text(json.dumps({"text": "a new document"}) + "\n" + json.dumps({"text": "and another one"}) + "\n")
    meta = prepare.prepare([str(new)], out, progress_interval=0)  # a good re-prepare replaces it
    assert tokenized.read_meta(out)["num_documents"] == meta["num_documents"] == 2
    assert sorted(os.listdir(out)) == sorted(before)


def test_too_few_tokens_for_seq_len_is_a_config_error(prepared):
    from MaxOffload.config import ConfigError

    with pytest.raises(ConfigError, match="train.seq_len"):
        reader(prepared["byte"][0], seq_len=10 ** 6)


# --------------------------------------------------------------------------------------------
# Command line: progress, training on a prepared corpus, one-line errors (run concurrently)
# --------------------------------------------------------------------------------------------

PREPARE = ["-m", "MaxOffload.data.prepare"]
TRAIN = ["train.py", "configs/llama3_1.py:tiny", "train.steps=20", "train.warmup_steps=2", "train.learning_rate=3e-3",
         "train.seq_len=32", "train.per_device_batch_size=8", "train.eval_every=0", "train.eval_batches=1",
         "run.log_every=5"]


def _cli_cases(tmp, corpus, tokenizer_files, prepared):
    def write(name, content, mode="w"):
        path = os.path.join(tmp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, mode) as f:
            f.write(content)
        return path

    good = corpus["inputs"][1]
    out = os.path.join(tmp, "out")
    empty_txt = write("empty/empty.txt", "")
    write("empty/blank.jsonl", "\n\n" + json.dumps({"text": " \n "}) + "\n")
    regular = write("regular_file", "not a directory\n")
    bad_json = write("bad.jsonl", json.dumps({"text": "fine"}) + "\n\n{\"text\": \"unclosed\n")
    no_field = write("no_field.jsonl", json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    not_str = write("not_str.jsonl", json.dumps({"text": 42}) + "\n")
    latin1 = write("latin1.txt", "caf\xe9 cr\xe8me".encode("latin-1"), mode="wb")
    corrupt_json = write("corrupt/tokenizer.json", "{ this is not json")
    corrupt_model = write("corrupt/spm.model", b"\x00\x01 not a protobuf", mode="wb")
    no_tokenizers = write("empty_dir/README.md", "nothing")
    truncated = os.path.join(tmp, "truncated")
    os.makedirs(truncated)
    for name in ("meta.json", "documents.npy"):
        with open(os.path.join(prepared["byte"][0], name), "rb") as src, open(os.path.join(truncated, name), "wb") as d:
            d.write(src.read())
    with open(os.path.join(prepared["byte"][0], "tokens.bin"), "rb") as src, \
            open(os.path.join(truncated, "tokens.bin"), "wb") as dst:
        dst.write(src.read()[:-10])
    surrogate = write("surrogate.jsonl", json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "a\ud800b"}) + "\n")
    deep = write("deep.jsonl", json.dumps({"text": "fine"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    edited = {name: _edited(prepared["byte"][0], tmp, name, **change) for name, change in (
        ("dtype_edited", {"dtype": "float16"}), ("negative_train_tokens", {"train_tokens": -5}),
        ("vocab_edited", {"vocab_size": 100}))}
    hf_dir = prepared["hf"][0]
    dry = TRAIN + ["run.dry_run=true", "data.source=tokens"]
    return {
        # prepare: (argv, words in the one error line)
        "missing_corpus": (PREPARE + [os.path.join(tmp, "nope.jsonl"), "--out", out], ["nope.jsonl", "not found"]),
        "empty_corpus": (PREPARE + [os.path.dirname(empty_txt), "--out", out], ["no documents", "empty"]),
        "directory_without_inputs": (PREPARE + [os.path.dirname(no_tokenizers), "--out", out], [".txt or .jsonl"]),
        "unsupported_input": (PREPARE + [no_tokenizers, "--out", out], ["README.md", "unsupported"]),
        "tokenizer_missing": (PREPARE + [good, "--tokenizer", os.path.join(tmp, "tok.json"), "--out", out],
                              ["tok.json", "not found"]),
        "tokenizer_corrupt_json": (PREPARE + [good, "--tokenizer", corrupt_json, "--out", out],
                                   ["tokenizer.json", "Hugging Face"]),
        "tokenizer_corrupt_model": (PREPARE + [good, "--tokenizer", corrupt_model, "--out", out],
                                    ["spm.model", "SentencePiece"]),
        "tokenizer_wrong_kind": (PREPARE + [good, "--tokenizer", tokenizer_files["sp"].replace(".model", ".vocab"),
                                            "--out", out], ["spm.vocab", "unsupported tokenizer"]),
        "tokenizer_json_given_sp_model": (PREPARE + [good, "--tokenizer", _copy(tokenizer_files["sp"], tmp, "x.json"),
                                                     "--out", out], ["x.json", "Hugging Face"]),
        "unwritable_output": (PREPARE + [good, "--out", os.path.join(regular, "sub")], ["regular_file", "--out"]),
        "bad_jsonl_line": (PREPARE + [bad_json, "--out", out], ["bad.jsonl:3", "JSON"]),
        "missing_field": (PREPARE + [no_field, "--out", out], ["no_field.jsonl:2", "'text'", "--jsonl_field"]),
        "field_not_string": (PREPARE + [not_str, "--out", out], ["not_str.jsonl:1", "int"]),
        "not_utf8": (PREPARE + [latin1, "--out", out], ["latin1.txt", "UTF-8"]),
        "lone_surrogate": (PREPARE + [surrogate, "--out", out], ["surrogate.jsonl:2", "lone surrogate"]),
        "nested_too_deeply": (PREPARE + [deep, "--out", out], ["deep.jsonl:2", "nested too deeply"]),
        "eval_fraction_out_of_range": (PREPARE + [good, "--out", out, "--eval_fraction", "1.5"], ["--eval_fraction"]),
        "no_out": (PREPARE + [good], ["--out"]),
        # train.py with data.source=tokens
        "train_path_missing": (dry + [f"data.path={os.path.join(tmp, 'nowhere')}"], ["data.path", "nowhere"]),
        "train_path_empty": (dry, ["data.path", "empty"]),
        "train_path_not_prepared": (dry + [f"data.path={os.path.dirname(no_tokenizers)}"], ["meta.json", "prepare"]),
        "train_path_truncated": (dry + [f"data.path={truncated}"], ["tokens.bin", "prepare"]),
        "train_vocab_too_small": (dry + [f"data.path={hf_dir}", "model.vocab_size=299"],
                                  ["model.vocab_size=299", "300"]),
        # an edited meta.json: uint16 tokens read as float16, the held-out documents counted as training, a
        # vocabulary smaller than the ids in tokens.bin
        "meta_dtype_edited": (dry + [f"data.path={edited['dtype_edited']}"], ["dtype float16", "uint16", "edited"]),
        "meta_negative_train_tokens": (dry + [f"data.path={edited['negative_train_tokens']}"],
                                       ["train_tokens -5", "edited"]),
        "meta_vocab_edited": (dry + [f"data.path={edited['vocab_edited']}"], ["token id", "vocab_size 100"]),
    }


def _edited(src, tmp, name, **changes):
    """A copy of the prepared directory `src` whose meta.json has `changes`."""
    dst = os.path.join(tmp, name)
    os.makedirs(dst)
    for f in ("tokens.bin", "documents.npy"):
        _copy(os.path.join(src, f), dst, f)
    meta = json.load(open(os.path.join(src, "meta.json")))
    meta.update(changes)
    json.dump(meta, open(os.path.join(dst, "meta.json"), "w"))
    return dst


def _copy(src, tmp, name):
    dst = os.path.join(tmp, name)
    with open(src, "rb") as a, open(dst, "wb") as b:
        b.write(a.read())
    return dst


@pytest.fixture(scope="module")
def cli_runs(corpus, tokenizer_files, prepared, tmp_path_factory):
    """Every subprocess of this module, two at a time: the training run first (the longest), then the errors."""
    from conftest import run_cli

    tmp = str(tmp_path_factory.mktemp("cli"))
    cases = _cli_cases(tmp, corpus, tokenizer_files, prepared)
    train_out = os.path.join(tmp, "train_run")
    plans = {"train": TRAIN + ["data.source=tokens", f"data.path={prepared['hf'][0]}", f"run.output_dir={train_out}"],
             "prepare_ok": PREPARE + [*corpus["inputs"], "--tokenizer", tokenizer_files["hf"], "--out",
                                      os.path.join(tmp, "cli_out"), "--progress_interval", "0",
                                      "--eval_fraction", str(EVAL_FRACTION)]}
    plans.update({name: argv for name, (argv, _) in cases.items()})
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_cli, argv, timeout=300) for name, argv in plans.items()}
        results = {name: future.result() for name, future in futures.items()}
    return {"results": results, "cases": cases, "train_out": train_out, "cli_out": os.path.join(tmp, "cli_out")}


@pytest.mark.parametrize("case", ["missing_corpus", "empty_corpus", "directory_without_inputs", "unsupported_input",
                                  "tokenizer_missing", "tokenizer_corrupt_json", "tokenizer_corrupt_model",
                                  "tokenizer_wrong_kind", "tokenizer_json_given_sp_model", "unwritable_output",
                                  "bad_jsonl_line", "missing_field", "field_not_string", "not_utf8",
                                  "lone_surrogate", "nested_too_deeply", "eval_fraction_out_of_range", "no_out",
                                  "train_path_missing",
                                  "train_path_empty", "train_path_not_prepared", "train_path_truncated",
                                  "train_vocab_too_small", "meta_dtype_edited", "meta_negative_train_tokens",
                                  "meta_vocab_edited"])
def test_bad_input_is_one_line_and_exit_2(cli_runs, case):
    result, words = cli_runs["results"][case], cli_runs["cases"][case][1]
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (case, result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_prepare_cli_reports_progress_and_what_it_wrote(cli_runs, prepared):
    result = cli_runs["results"]["prepare_ok"]
    assert result.returncode == 0, result.stderr
    assert re.search(r"prepare \[#+\] 100% \| 40 docs \| .* MB/s", result.stderr), result.stderr
    assert "wrote" in result.stdout and "data.source=tokens" in result.stdout
    # the same inputs and tokenizer give the same bytes as the in-process run
    for name in ("tokens.bin", "documents.npy"):
        with open(os.path.join(cli_runs["cli_out"], name), "rb") as a, \
                open(os.path.join(prepared["hf"][0], name), "rb") as b:
            assert a.read() == b.read(), name


def test_training_on_a_prepared_corpus(cli_runs):
    result = cli_runs["results"]["train"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prepared tokens" in result.stdout and "huggingface:tokenizer.json" in result.stdout
    with open(os.path.join(cli_runs["train_out"], "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.0, losses
    assert len(evals) == 1 and math.isfinite(evals[0])


# --------------------------------------------------------------------------------------------
# Hostile input: meta.json fields of the wrong type, corpus files that cannot be read, a full disk
# --------------------------------------------------------------------------------------------

def _one_line_error(code, capsys, *words):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err[-2000:])
    assert "Traceback" not in err and all(w in lines[0] for w in words), (words, lines[0])


@pytest.mark.parametrize("change, words", [
    ({"num_tokens": "18"}, ["num_tokens (str '18')"]),
    ({"vocab_size": 259.0}, ["vocab_size (float 259.0)"]),
    ({"train_tokens": True}, ["train_tokens (bool True)"]),
    ({"num_documents": None}, ["num_documents (NoneType None)"]),
    ({"dtype": 2}, ["dtype (int 2)"]),
    ({"tokenizer": "byte"}, ["tokenizer (str 'byte')"]),
    ({"tokenizer": {"kind": "byte"}}, ["tokenizer.name"]),
    ({"train_documents": "1"}, ["train_documents (str '1')"]),
], ids=["num_tokens_str", "vocab_float", "train_tokens_bool", "documents_null", "dtype_int", "tokenizer_str",
        "tokenizer_without_name", "train_documents_str"])
def test_meta_fields_of_the_wrong_type_are_one_line(tmp_path, change, words):
    """A prepared directory whose meta.json holds a field of the wrong JSON type: one ConfigError line naming
    it (before, a string num_tokens passed int() and broke the memory map with a traceback)."""
    from MaxOffload.errors import ConfigError

    (tmp_path / "corpus.txt").write_text("one small document\n")
    out = str(tmp_path / "data")
    prepare.prepare([str(tmp_path / "corpus.txt")], out, progress_interval=0)
    tokenized.read_meta(out)  # as written: fine
    meta = json.load(open(os.path.join(out, "meta.json")))
    meta.update(change)
    json.dump(meta, open(os.path.join(out, "meta.json"), "w"))
    with pytest.raises(ConfigError) as e:
        tokenized.read_meta(out)
    line = str(e.value)
    assert "\n" not in line and "meta.json" in line and "prepare the directory again" in line, line
    assert all(w in line for w in words), line


@pytest.mark.parametrize("case, reason", [("link_loop", "Too many levels of symbolic links"),
                                          ("dangling_link", "No such file or directory"),
                                          ("unreadable", "Permission denied")])
def test_a_corpus_file_that_cannot_be_read_is_one_line(tmp_path, capsys, case, reason):
    """In a corpus directory or given itself: a symlink loop, a link to nothing and a file nobody may read (a
    link to the write-only /proc/sys/vm/drop_caches: permission bits do not stop root, that file does) are
    one line naming the file, before anything is written."""
    corpus, out = tmp_path / "corpus", str(tmp_path / "out")
    corpus.mkdir()
    (corpus / "good.txt").write_text("a document\n")
    bad = corpus / "bad.txt"
    if case == "link_loop":
        os.symlink(corpus / "loop.txt", bad)
        os.symlink(bad, corpus / "loop.txt")
    else:
        os.symlink(tmp_path / "gone.txt" if case == "dangling_link" else "/proc/sys/vm/drop_caches", bad)
    for inputs in ([str(corpus)], [str(bad)]):
        _one_line_error(prepare.main([*inputs, "--out", out]), capsys, f"cannot read input {bad}", reason)
    assert not os.path.exists(out)


def test_a_full_disk_during_prepare_is_one_line_and_keeps_the_old_dataset(tmp_path, capsys):
    """Re-preparing onto a full disk (a 256 KiB tmpfs: a real ENOSPC): one line, exit 2, the old dataset byte for
    byte as it was, no staging left."""
    with small_filesystem(str(tmp_path / "disk"), "256k") as disk:
        out, small, big = os.path.join(disk, "data"), tmp_path / "small.txt", tmp_path / "big.txt"
        small.write_text("a small document\n")
        big.write_text("alpha bravo charlie " * 20000)  # 400 KB: 800 KB of uint16 tokens
        assert prepare.main([str(small), "--out", out, "--progress_interval", "0"]) == 0
        before = {f: open(os.path.join(out, f), "rb").read() for f in sorted(os.listdir(out))}
        capsys.readouterr()
        _one_line_error(prepare.main([str(big), "--out", out]), capsys, f"preparing {out} failed",
                        "No space left on device", "--output_dir")
        assert {f: open(os.path.join(out, f), "rb").read() for f in sorted(os.listdir(out))} == before
        assert tokenized.read_meta(out)["num_tokens"] == 18
