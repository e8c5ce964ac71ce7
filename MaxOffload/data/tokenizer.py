"""Tokenizers: the built-in byte-level one, and two read from local files.

Every kind has the same small interface (`Tokenizer`): `encode(text) -> int32 array`,
`encode_batch(texts)`, `decode(ids)`, `vocab_size`, `eos_id`, `name`, `kind`.

- byte: every UTF-8 byte is a token, after three special tokens (PAD=0, BOS=1, EOS=2); 259 ids.
  The module-level `encode`/`decode`/constants are this tokenizer.
- huggingface: a `tokenizer.json` read with the `tokenizers` package (pip install tokenizers).
- sentencepiece: a `.model` file read with the `sentencepiece` package (pip install sentencepiece).

Both packages are optional (the `data` extra) and imported only when such a file is used.
Documents are separated by an end-of-text id: the tokenizer's own (looked up by name) or, when it
has none, one id past its vocabulary (vocab_size then counts it).
"""
import os

import numpy as np

PAD, BOS, EOS = 0, 1, 2
OFFSET = 3
VOCAB_SIZE = 256 + OFFSET

# End-of-text tokens of common tokenizer.json files (GPT-2/NeoX, Llama 3, Llama 2/T5, Gemma, ...).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eos|>")


class TokenizerError(Exception):
    """A missing, unparsable or unsupported tokenizer; the message is one line naming the fix."""


def encode(text):
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + OFFSET


def decode(tokens):
    data = bytes(int(t) - OFFSET for t in tokens if int(t) >= OFFSET)
    return data.decode("utf-8", errors="replace")


class Tokenizer:
    """The interface: subclasses set kind, name, path, vocab_size, eos_id and implement _encode/_decode."""

    kind = name = path = None
    vocab_size = eos_id = None

    def encode(self, text):
        """Token ids of `text` (no special tokens added), int32."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts):
        return [np.asarray(ids, np.int32) for ids in self._encode(list(texts))]

    def decode(self, ids):
        """Text of `ids`; end-of-text ids are dropped."""
        return self._decode([int(t) for t in ids if int(t) != self.eos_id])

    def describe(self):
        return f"{self.name} (vocab {self.vocab_size:,}, eos {self.eos_id})"


class ByteTokenizer(Tokenizer):
    kind = name = "byte"
    vocab_size, eos_id = VOCAB_SIZE, EOS

    def encode(self, text):
        return encode(text)

    def encode_batch(self, texts):
        return [encode(t) for t in texts]

    def decode(self, ids):
        return decode(ids)


def _eos_from_vocab(base_vocab, token_to_id, eos_token):
    """(eos id, eos token, vocab size): the named token, else a known end-of-text token, else one id past."""
    names = (eos_token,) if eos_token else EOS_NAMES
    for name in names:
        token_id = token_to_id(name)
        if token_id is not None and 0 <= token_id < base_vocab:
            return token_id, name, base_vocab
    if eos_token:
        raise TokenizerError(f"the tokenizer has no token {eos_token!r}; name one it has with --eos_token, "
                             "or leave it out to use a new id past the vocabulary")
    return base_vocab, None, base_vocab + 1


def _missing_package(package, path):
    return TokenizerError(f"the tokenizer {path} needs the `{package}` package: pip install {package} "
                          "(or pip install -e '.[data]')")


class HuggingFaceTokenizer(Tokenizer):
    kind = "huggingface"

    def __init__(self, path, eos_token=None):
        try:
            import tokenizers
        except ImportError:
            raise _missing_package("tokenizers", path) from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception with a serde message
            raise TokenizerError(f"cannot read {path} as a Hugging Face tokenizer.json: "
                                 f"{_first_line(e)}; give a tokenizer.json saved by `tokenizers`") from None
        self.path, self.name = path, f"huggingface:{os.path.basename(path)}"
        base = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id, self.eos_token, self.vocab_size = _eos_from_vocab(base, self._tok.token_to_id, eos_token)
        self._base_vocab = base

    def _encode(self, texts):
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we do not use
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def _decode(self, ids):
        return self._tok.decode([i for i in ids if i < self._base_vocab], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path, eos_token=None):
        try:
            import sentencepiece
        except ImportError:
            raise _missing_package("sentencepiece", path) from None
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as e:
            raise TokenizerError(f"cannot read {path} as a SentencePiece model: {_first_line(e)}; "
                                 "give a .model file written by SentencePieceTrainer") from None
        self.path, self.name = path, f"sentencepiece:{os.path.basename(path)}"
        base = self._sp.get_piece_size()
        if eos_token is None and self._sp.eos_id() >= 0:
            eos = self._sp.eos_id()
            self.eos_id, self.eos_token, self.vocab_size = eos, self._sp.id_to_piece(eos), base
        else:
            def piece_id(piece):
                i = self._sp.piece_to_id(piece)
                return None if i == self._sp.unk_id() and piece != self._sp.id_to_piece(i) else i
            self.eos_id, self.eos_token, self.vocab_size = _eos_from_vocab(base, piece_id, eos_token)
        self._base_vocab = base

    def _encode(self, texts):
        return self._sp.encode(texts)

    def _decode(self, ids):
        return self._sp.decode([i for i in ids if i < self._base_vocab])


def _first_line(e):
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


BYTE = ByteTokenizer()


def load(spec, eos_token=None):
    """`byte`, a tokenizer.json (or a directory holding one), or a SentencePiece .model -> Tokenizer."""
    if spec == "byte":
        if eos_token:
            raise TokenizerError("--eos_token does not apply to the byte tokenizer (its end-of-text id is 2)")
        return BYTE
    path = spec
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
        raise TokenizerError(f"tokenizer file {spec} not found; give byte, a tokenizer.json or a SentencePiece .model")
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer {spec} is not a file (and holds no tokenizer.json); give byte, a "
                             "tokenizer.json or a SentencePiece .model")
    if path.endswith(".json"):
        return HuggingFaceTokenizer(path, eos_token)
    if path.endswith(".model"):
        return SentencePieceTokenizer(path, eos_token)
    raise TokenizerError(f"unsupported tokenizer file {spec}: give byte, a Hugging Face tokenizer.json (*.json) "
                         "or a SentencePiece model (*.model)")
