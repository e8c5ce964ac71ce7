"""Seeded random tokens: for throughput work, where the text does not matter.

Every sequence is drawn by itself from (seed, stream, position), where position is the sequence's place in
the run: row r of the global batch of `step` is sequence step x global_batch + r, as in the readers of text
(tokenized.TokenWindows). So the tokens of a step do not depend on how the step is cut: k micro-batches of b
rows (train_batch(step * k + i), i < k, with global_batch b) are the rows of one batch of k x b, and a process
draws only its own rows, whatever the number of processes.
"""
import numpy as np


class SyntheticData:
    TRAIN, EVAL = 0, 1  # the two streams: training sequences, held-out sequences

    def __init__(self, *, vocab_size, global_batch, seq_len, seed, process_index=0, process_count=1):
        self.vocab_size, self.global_batch, self.seq_len, self.seed = vocab_size, global_batch, seq_len, seed
        self.rows = slice(process_index * global_batch // process_count,
                          (process_index + 1) * global_batch // process_count)
        self.description = f"synthetic tokens (vocab {vocab_size}, seed {seed})"

    def sequence(self, stream, position):
        """The seq_len + 1 tokens of sequence `position` of `stream`."""
        rng = np.random.default_rng((self.seed, stream, position))
        return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)

    def _batch(self, stream, index):
        first = index * self.global_batch
        rows = range(first, first + self.global_batch)[self.rows]
        tokens = np.array([self.sequence(stream, p) for p in rows], np.int32).reshape(len(rows), self.seq_len + 1)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                "mask": np.ones((len(rows), self.seq_len), np.float32)}

    def train_batch(self, step):
        return self._batch(self.TRAIN, step)

    def eval_batches(self, count):
        return [self._batch(self.EVAL, i) for i in range(count)]
