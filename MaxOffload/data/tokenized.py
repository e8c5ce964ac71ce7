"""Token streams -> training batches: one reader for the in-memory text corpus and prepared directories.

A corpus is laid out as one 1-D token array: the training documents (each ending in its
end-of-text id) in input order, then the held-out documents. `TokenWindows` reads batches from
the two parts, whatever array holds them: TextData (data.source=text) builds them in memory with
the byte tokenizer, TokenizedData (data.source=tokens) memory-maps DIR/tokens.bin written by
`python -m MaxOffload.data.prepare`. `split_layout` decides the held-out part for both.

Training: the train tokens are packed into windows of seq_len + 1 (window i starts at i * seq_len,
so consecutive windows share one token and every token is a target once per epoch); the windows
are visited in a seeded random order, a new permutation per epoch. A batch is therefore a pure
function of (run.seed, step) -- a run resumed at step N reads exactly the batches it would have
read -- and each process slices only its own rows of the global batch out of the array (for a
memory map: only those pages are read).

Evaluation: the held-out tokens read in order, padded with mask 0 where they run out.

Grain is not used: with a stateless (seed, step) -> batch function there is no iterator state to
checkpoint, and a batch is a few memory-map slices, so worker processes would not pay for themselves.
"""
import functools
import os

import numpy as np

from MaxOffload.errors import ConfigError
from MaxOffload.jsonfile import is_a, read_json

EVAL_SPLIT_SEED = 1234  # fixed, so the held-out set does not change with run.seed
PAD = 0  # eval padding (masked out); id 0 exists in every vocabulary
META, TOKENS, DOCUMENTS = "meta.json", "tokens.bin", "documents.npy"
FORMAT_VERSION = 1
DTYPES = ("uint16", "uint32")  # tokens.bin: uint16 for vocabularies up to 65,536 ids, else uint32
# meta.json's fields the readers use, with their JSON types (train_documents, also an int, is optional)
META_FIELDS = {"vocab_size": int, "dtype": str, "num_tokens": int, "train_tokens": int, "num_documents": int,
               "tokenizer": dict}


# --------------------------------------------------------------------------------------------
# Documents -> tokens, and the split: which tokens are held out
# --------------------------------------------------------------------------------------------

def encode_documents(documents, tok):
    """Documents -> (tokens int32, offsets int64): each document's ids then its end-of-text id, in input
    order; document i is tokens[offsets[i]:offsets[i + 1]]."""
    encoded = tok.encode_batch(documents)
    lengths = np.array([len(ids) + 1 for ids in encoded], np.int64)
    tokens = np.full((int(lengths.sum()),), tok.eos_id, np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for ids, start in zip(encoded, offsets):
        tokens[start: start + len(ids)] = ids
    return tokens, offsets


def held_out_documents(num_documents, eval_fraction):
    """Sorted ids of the held-out documents: a fixed-seed random eval_fraction of them (at least one)."""
    if num_documents < 2:
        return np.zeros((0,), np.int64)
    order = np.random.default_rng(EVAL_SPLIT_SEED).permutation(num_documents)
    num_eval = max(1, int(round(num_documents * eval_fraction)))
    return np.sort(order[:num_eval]).astype(np.int64)


def split_layout(offsets, eval_fraction):
    """Where each token of a corpus goes: (ranges, train_tokens, held_out).

    offsets: [num_documents + 1] token offsets of the documents in input order. The corpus in its
    final layout is the concatenation of `ranges` ((start, end) slices of the input-order tokens):
    the training part, `train_tokens` long, then the held-out part. With one document, the held-out
    part is its tail.
    """
    offsets = np.asarray(offsets, np.int64)
    num_documents, total = len(offsets) - 1, int(offsets[-1])
    held_out = held_out_documents(num_documents, eval_fraction)
    if num_documents < 2:
        cut = int(total * (1 - eval_fraction))
        return [(0, cut), (cut, total)], cut, held_out
    is_held = np.zeros(num_documents, bool)
    is_held[held_out] = True
    parts = [_runs(offsets, np.flatnonzero(~is_held)), _runs(offsets, held_out)]
    train_tokens = sum(e - s for s, e in parts[0])
    ranges = parts[0] + parts[1]
    return ranges, train_tokens, held_out


def _runs(offsets, docs):
    """(start, end) token ranges covering the documents `docs` (sorted), neighbours merged."""
    if len(docs) == 0:
        return []
    starts, ends = offsets[docs], offsets[docs + 1]
    breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    first = np.concatenate([[0], breaks])
    last = np.concatenate([breaks - 1, [len(docs) - 1]])
    return [(int(starts[a]), int(ends[b])) for a, b in zip(first, last)]


def apply_layout(tokens, ranges):
    """The corpus in its final layout (in memory)."""
    return np.concatenate([tokens[s:e] for s, e in ranges]) if ranges else tokens[:0]


# --------------------------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------------------------

class TokenWindows:
    """Batches from a training token array and a held-out token array (np.ndarray or np.memmap).

    Subclasses build the arrays and a `description`; everything about reading is here. With `eos_id` (the
    tokenizer's end-of-text id, data.attend_within_documents) a batch also holds `documents` [rows, seq_len] int32:
    which of the documents packed into its row each input token belongs to (the end-of-text token belongs to the
    document it ends).
    """

    def __init__(self, train_tokens, eval_tokens, *, global_batch, seq_len, seed, process_index=0, process_count=1,
                 source="data", eos_id=None):
        self.train_stream, self.eval_stream, self.eos_id = train_tokens, eval_tokens, eos_id
        self.global_batch, self.seq_len, self.seed = global_batch, seq_len, seed
        self.rows = slice(process_index * global_batch // process_count,
                          (process_index + 1) * global_batch // process_count)
        self.num_windows = (len(train_tokens) - 1) // seq_len
        if self.num_windows < 1 or len(eval_tokens) < 2:
            raise ConfigError(f"{source}: {len(train_tokens) + len(eval_tokens)} tokens ({len(train_tokens)} for "
                                f"training, {len(eval_tokens)} held out) are too few for train.seq_len={seq_len} "
                                "with a held-out split; add text or lower train.seq_len")

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch):
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_windows)

    def window_ids(self, step):
        """The training windows of the global batch of `step` (all processes' rows)."""
        first = step * self.global_batch
        return [int(self._order(p // self.num_windows)[p % self.num_windows])
                for p in range(first, first + self.global_batch)]

    def train_batch(self, step):
        ids = self.window_ids(step)[self.rows]
        s = self.seq_len
        windows = np.stack([np.asarray(self.train_stream[i * s: i * s + s + 1]) for i in ids]).astype(np.int32)
        return self._documents({"inputs": windows[:, :-1], "targets": windows[:, 1:],
                                "mask": np.ones((len(ids), s), np.float32)})

    def _documents(self, batch):
        """The batch with its rows' `documents` when the reader has an eos_id."""
        if self.eos_id is None:
            return batch
        ends = batch["inputs"] == self.eos_id
        return {**batch, "documents": (np.cumsum(ends, axis=1) - ends).astype(np.int32)}

    def eval_batches(self, count):
        """`count` batches read in order from the held-out tokens, padded (mask 0) where they run out.

        Global row g of the sequence of batches predicts held-out tokens g*seq_len+1 ... g*seq_len+seq_len.
        """
        s, batches = self.seq_len, []
        for b in range(count):
            rows = range(b * self.global_batch, (b + 1) * self.global_batch)[self.rows]
            windows = np.full((len(rows), s + 1), PAD, np.int32)
            valid = np.zeros((len(rows), s + 1), np.float32)
            for k, g in enumerate(rows):
                piece = np.asarray(self.eval_stream[g * s: g * s + s + 1])
                windows[k, :len(piece)], valid[k, :len(piece)] = piece, 1.0
            batches.append(self._documents({"inputs": windows[:, :-1], "targets": windows[:, 1:],
                                            "mask": valid[:, 1:]}))
        return batches


# --------------------------------------------------------------------------------------------
# A prepared directory
# --------------------------------------------------------------------------------------------

def read_meta(path, key="data.path"):
    """DIR/meta.json, checked against the files beside it; any problem is one ConfigError line."""
    fix = "run `python -m MaxOffload.data.prepare INPUTS... --out DIR` and give DIR"
    if not path:
        raise ConfigError(f"{key} is empty; {fix}")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}={path}: no such directory; {fix}")
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise ConfigError(f"{key}={path} has no {META}, so it is not a prepared directory (or its preparation did "
                            f"not finish); {fix}")
    meta = read_json(meta_path, f"{key}={path} was not prepared whole, or was edited: prepare the directory again",
                     dict)
    if meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version")
        raise ConfigError(f"{key}={path}: {META} has format_version {version!r}, this version "
                            f"reads {FORMAT_VERSION}; prepare the directory again")
    fields = {**META_FIELDS, **({"train_documents": int} if "train_documents" in meta else {})}
    wrong = [f"{name} ({'missing' if name not in meta else f'{type(meta[name]).__name__} {meta[name]!r:.40}'})"
             for name, kind in fields.items() if not is_a(meta.get(name), kind)]
    if not wrong and not is_a(meta["tokenizer"].get("name"), str):
        wrong.append("tokenizer.name")
    again = "prepare the directory again (python -m MaxOffload.data.prepare)"
    if wrong:
        raise ConfigError(f"{key}={path}: {META} has wrong or missing fields: {', '.join(wrong)} (expected: "
                            f"{', '.join(f'{n} {k.__name__}' for n, k in META_FIELDS.items())}); {META} was "
                            f"edited or damaged: {again}")
    num_tokens, vocab = meta["num_tokens"], meta["vocab_size"]
    if vocab < 1:
        raise ConfigError(f"{key}={path}: {META} has vocab_size {vocab}; {again}")
    written = DTYPES[0] if vocab <= 1 << 16 else DTYPES[1]
    if meta["dtype"] != written:
        raise ConfigError(f"{key}={path}: {META} says dtype {meta['dtype']}, but a vocabulary of {vocab:,} ids is "
                            f"written as {written}; {META} was edited or damaged: {again}")
    dtype = np.dtype(written)
    tokens_path = os.path.join(path, TOKENS)
    want = num_tokens * dtype.itemsize
    have = os.path.getsize(tokens_path) if os.path.isfile(tokens_path) else None
    if have != want:
        raise ConfigError(f"{key}={path}: {TOKENS} is {'missing' if have is None else f'{have:,} bytes'}, "
                            f"{META} says {num_tokens:,} {dtype.name} tokens ({want:,} bytes); {again}")
    train, documents = meta["train_tokens"], meta["num_documents"]
    if documents < 1 or not 0 <= train <= num_tokens:
        raise ConfigError(f"{key}={path}: {META} says {documents:,} documents and train_tokens {train:,} of "
                            f"{num_tokens:,}; it needs at least one document and 0 <= train_tokens <= num_tokens: "
                            f"{META} was edited or damaged: {again}")
    try:
        starts = np.load(os.path.join(path, DOCUMENTS), mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}={path}: {DOCUMENTS} is missing or unreadable ({e}); {again}") from None
    train_documents = meta["train_documents"] if documents >= 2 and "train_documents" in meta else None
    if (starts.shape != (documents + 1,) or int(starts[0]) != 0 or int(starts[-1]) != num_tokens
            or (train_documents is not None and not (0 <= train_documents <= documents
                                                     and int(starts[train_documents]) == train))):
        raise ConfigError(f"{key}={path}: {DOCUMENTS} does not match {META} (documents, num_tokens or the "
                            f"train/held-out split differ); {again}")
    return meta


def check_token_ids(path, meta, key="data.path"):
    """Every token id of a prepared directory is below its vocab_size: one pass over tokens.bin (read in
    chunks), so that an id past the model's embedding never reaches training; ConfigError otherwise."""
    tokens, vocab = open_tokens(path, meta), int(meta["vocab_size"])
    for start in range(0, len(tokens), 1 << 24):
        top = int(np.max(tokens[start:start + (1 << 24)]))
        if top >= vocab:
            raise ConfigError(f"{key}={path}: {TOKENS} holds token id {top:,}, but {META} says vocab_size "
                                f"{vocab:,}; {META} was edited or the files come from different preparations: "
                                "prepare the directory again (python -m MaxOffload.data.prepare)")


def open_tokens(path, meta=None):
    """The prepared tokens as a read-only memory map (nothing is read until sliced)."""
    meta = meta or read_meta(path)
    if meta["num_tokens"] == 0:
        return np.zeros((0,), meta["dtype"])
    return np.memmap(os.path.join(path, TOKENS), dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],))


class TokenizedData(TokenWindows):
    """A directory written by `python -m MaxOffload.data.prepare` (data.source=tokens), memory-mapped."""

    def __init__(self, path, *, global_batch, seq_len, seed, process_index=0, process_count=1, documents=False):
        self.path, self.meta = path, read_meta(path)
        tokens = open_tokens(path, self.meta)
        cut = self.meta["train_tokens"]
        if documents and not isinstance(self.meta.get("eos_id"), int):
            raise ConfigError(f"data.path={path}: {META} names no eos_id, which data.attend_within_documents=true "
                              "needs to find the documents: prepare the directory again (python -m "
                              "MaxOffload.data.prepare), or set data.attend_within_documents=false")
        super().__init__(tokens[:cut], tokens[cut:], global_batch=global_batch, seq_len=seq_len, seed=seed,
                         process_index=process_index, process_count=process_count, source=f"data.path={path}",
                         eos_id=self.meta["eos_id"] if documents else None)
        m = self.meta
        self.description = (f"prepared tokens {path} ({m['tokenizer']['name']}, vocab {m['vocab_size']:,}): "
                            f"{m['num_documents']:,} documents, {len(self.train_stream):,} train / "
                            f"{len(self.eval_stream):,} held-out tokens, {self.num_windows:,} windows of {seq_len + 1}")
