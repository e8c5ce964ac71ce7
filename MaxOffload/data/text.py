"""Real text as training data: documents -> byte tokens -> packed windows of seq_len + 1.

The same reader as a prepared directory (tokenized.py): the text is tokenized in memory into
the layout `python -m MaxOffload.data.prepare` writes to disk.

With no files given, the corpus is the documentation that ships inside every Python
installation (pydoc_data: ~0.5 MB of English prose about the language), so the
quickstart trains on real text without a download.
"""
from MaxOffload.errors import ConfigError
from MaxOffload.data import tokenized, tokenizer


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


class TextData(tokenized.TokenWindows):
    """Byte-level tokens of documents, laid out and read exactly like a prepared directory
    (`tokenized.TokenizedData`), but built in memory: the held-out documents (a fixed-seed
    eval_fraction of them; the tail of a single document) go after the training ones, the training
    tokens are cut into windows of seq_len + 1 visited in a seeded order, a new one each epoch, and
    the held-out tokens are read in order for evaluation.
    """

    def __init__(self, documents, *, eval_fraction, global_batch, seq_len, seed, process_index=0, process_count=1,
                 attend_within_documents=False):
        tokens, offsets = tokenized.encode_documents(documents, tokenizer.BYTE)
        ranges, train_tokens, _ = tokenized.split_layout(offsets, eval_fraction)
        stream = tokenized.apply_layout(tokens, ranges)
        super().__init__(stream[:train_tokens], stream[train_tokens:], global_batch=global_batch, seq_len=seq_len,
                         seed=seed, process_index=process_index, process_count=process_count, source="data",
                         eos_id=tokenizer.BYTE.eos_id if attend_within_documents else None)
        self.description = (f"byte-level text: {len(documents)} documents, {len(self.train_stream):,} train / "
                            f"{len(self.eval_stream):,} held-out tokens, {self.num_windows:,} windows of "
                            f"{seq_len + 1}")
