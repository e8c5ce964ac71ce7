"""Real text as training data: documents -> byte tokens -> packed windows of seq_len + 1.

With no files given, the corpus is the documentation that ships inside every Python
installation (pydoc_data: ~0.5 MB of English prose about the language), so the
quickstart trains on real text without a download.
"""
import functools

import numpy as np

from MaxOffload.config.loader import ConfigError
from MaxOffload.data import tokenizer

_EVAL_SPLIT_SEED = 1234  # fixed, so the held-out set does not change with run.seed


def builtin_documents():
    from pydoc_data import topics

    return [topics.topics[key] for key in sorted(topics.topics)]


def load_documents(paths):
    if not paths:
        return builtin_documents()
    documents = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                documents.append(f.read())
        except UnicodeDecodeError as e:
            raise ConfigError(f"data.text_files: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"data.text_files: cannot read {path}: {e.strerror}") from None
    return documents


def _stream(documents):
    parts = []
    for doc in documents:
        parts += [tokenizer.encode(doc), np.array([tokenizer.EOS], np.int32)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


class TextData:
    """Packs documents (each followed by EOS) into a stream and cuts non-overlapping windows.

    Training windows are visited in a seeded random order, a new order each epoch; the
    held-out documents are read in order for evaluation.
    """

    def __init__(self, documents, *, eval_fraction, global_batch, seq_len, seed, process_index=0, process_count=1):
        self.global_batch, self.seq_len, self.seed = global_batch, seq_len, seed
        self.rows = slice(process_index * global_batch // process_count,
                          (process_index + 1) * global_batch // process_count)
        if len(documents) >= 2:
            order = np.random.default_rng(_EVAL_SPLIT_SEED).permutation(len(documents))
            num_eval = max(1, int(round(len(documents) * eval_fraction)))
            held_out = set(order[:num_eval].tolist())
            self.train_stream = _stream([d for i, d in enumerate(documents) if i not in held_out])
            self.eval_stream = _stream([d for i, d in enumerate(documents) if i in held_out])
        else:  # one document: hold out its tail
            stream = _stream(documents)
            cut = int(len(stream) * (1 - eval_fraction))
            self.train_stream, self.eval_stream = stream[:cut], stream[cut:]
        window = seq_len + 1
        self.num_windows = (len(self.train_stream) - 1) // seq_len
        if self.num_windows < 1 or len(self.eval_stream) < 2:
            raise ConfigError(f"data: the text has {len(self.train_stream) + len(self.eval_stream)} tokens, too few "
                              f"for train.seq_len={seq_len} with a held-out split; add text or lower train.seq_len")
        self.description = (f"byte-level text: {len(documents)} documents, {len(self.train_stream):,} train / "
                            f"{len(self.eval_stream):,} held-out tokens, {self.num_windows:,} windows of {window}")

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch):
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_windows)

    def _window_ids(self, step):
        first = step * self.global_batch
        return [self._order(p // self.num_windows)[p % self.num_windows] for p in range(first, first + self.global_batch)]

    def train_batch(self, step):
        ids = self._window_ids(step)[self.rows]
        windows = np.stack([self.train_stream[i * self.seq_len: i * self.seq_len + self.seq_len + 1] for i in ids])
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:],
                "mask": np.ones((len(ids), self.seq_len), np.float32)}

    def eval_batches(self, count):
        """`count` batches read in order from the held-out text, padded (mask 0) where it runs out."""
        n = count * self.global_batch
        padded = np.full((n * self.seq_len + 1,), tokenizer.PAD, np.int32)
        valid = np.zeros_like(padded, dtype=np.float32)
        length = min(len(self.eval_stream), len(padded))
        padded[:length], valid[:length] = self.eval_stream[:length], 1.0
        inputs = padded[:-1].reshape(n, self.seq_len)
        targets = padded[1:].reshape(n, self.seq_len)
        mask = valid[1:].reshape(n, self.seq_len)
        batches = []
        for b in range(count):
            rows = slice(b * self.global_batch, (b + 1) * self.global_batch)
            batches.append({"inputs": inputs[rows][self.rows], "targets": targets[rows][self.rows],
                            "mask": mask[rows][self.rows]})
        return batches
