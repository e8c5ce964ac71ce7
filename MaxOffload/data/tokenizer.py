"""Byte-level tokenizer: every UTF-8 byte is a token, after three special tokens."""
import numpy as np

PAD, BOS, EOS = 0, 1, 2
OFFSET = 3
VOCAB_SIZE = 256 + OFFSET


def encode(text):
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + OFFSET


def decode(tokens):
    data = bytes(int(t) - OFFSET for t in tokens if int(t) >= OFFSET)
    return data.decode("utf-8", errors="replace")
