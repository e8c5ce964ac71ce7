"""Seeded random tokens: for throughput work, where the text does not matter."""
import numpy as np


class SyntheticData:
    def __init__(self, *, vocab_size, global_batch, seq_len, seed, process_index=0, process_count=1):
        self.vocab_size, self.global_batch, self.seq_len, self.seed = vocab_size, global_batch, seq_len, seed
        self.rows = slice(process_index * global_batch // process_count,
                          (process_index + 1) * global_batch // process_count)
        self.description = f"synthetic tokens (vocab {vocab_size}, seed {seed})"

    def _batch(self, stream, index):
        rng = np.random.default_rng((self.seed, stream, index))
        tokens = rng.integers(0, self.vocab_size, (self.global_batch, self.seq_len + 1), dtype=np.int32)[self.rows]
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                "mask": np.ones((tokens.shape[0], self.seq_len), np.float32)}

    def train_batch(self, step):
        return self._batch(0, step)

    def eval_batches(self, count):
        return [self._batch(1, i) for i in range(count)]
