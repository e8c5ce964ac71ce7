"""Text / JSONL files -> a memory-mappable token file that `data.source=tokens data.path=DIR` trains on.

    python -m MaxOffload.data.prepare INPUTS... --output_dir DIR [--tokenizer byte|PATH/tokenizer.json|PATH/m.model]
        [--jsonl_field text] [--separator STRING] [--eval_fraction 0.05] [--eos_token TOKEN]

Inputs (files or directories, searched recursively, in sorted order):
  *.txt    one document per file; with --separator STRING (e.g. '<|endoftext|>'), split into documents there
  *.jsonl  one document per line: the string field --jsonl_field (default `text`) of a JSON object
Empty (whitespace-only) documents are skipped.

Tokenizer: `byte` (built in, 259 ids), a Hugging Face tokenizer.json (needs `pip install tokenizers`)
or a SentencePiece .model (needs `pip install sentencepiece`), read from local files. Each document
is followed by the end-of-text id (the tokenizer's own, or one id past its vocabulary if it has none).

Writes DIR/
  tokens.bin     all token ids, uint16 (vocabularies up to 65,536 ids) or uint32, no header: the training
                 documents in input order, then the held-out documents in input order
  documents.npy  int64 [num_documents + 1]: where each document starts in tokens.bin, in that order (the
                 last entry is num_tokens)
  meta.json      tokenizer (kind, file, sha256), vocab_size, eos_id, dtype, num_tokens, num_documents, the
                 split (train_tokens: tokens.bin[:train_tokens] is for training; held_out_documents: the
                 numbers of the held-out documents in input order, counting non-empty documents from 0),
                 the source files with sizes and sha256, and the options
The held-out documents are a fixed-seed random --eval_fraction of them (at least one), chosen exactly as
data.source=text chooses them; a single document holds out its tail. Everything is written into DIR/.staging
first and moved into place only when it is complete, meta.json last: a failed or interrupted run leaves a
dataset already in DIR as it was (a directory without meta.json is incomplete). The staging copy of the
tokens needs as much disk again as the tokens while running.

Progress goes to stderr about once a second; mistakes are one line `error: ...` on stderr and exit 2.
"""
import argparse
import codecs
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np

from MaxOffload import cli
from MaxOffload.data import tokenized
from MaxOffload.data import tokenizer as tokenizer_lib
from MaxOffload.errors import ConfigError
from MaxOffload.reports import unwritable_dir

TEXT_SUFFIXES, JSONL_SUFFIXES = (".txt",), (".jsonl",)
READ_CHUNK = 8 << 20  # bytes read at a time from a .txt file
BATCH_CHARS, BATCH_DOCS = 1 << 20, 1024  # documents handed to the tokenizer at once (its threads share them)
COPY_CHUNK = 16 << 20  # tokens copied at a time into the final layout
STAGING = ".staging"  # DIR/.staging: the new dataset until it is complete


class PrepareError(ConfigError):
    """A user mistake (input, tokenizer, output directory, a full disk); the message is one line naming the fix."""


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

def _kind(path):
    if path.endswith(TEXT_SUFFIXES):
        return "txt"
    if path.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def find_inputs(paths, exclude=None):
    """INPUTS -> [(file, kind)]: files as given, directories searched recursively (sorted)."""
    if not paths:
        raise PrepareError("no inputs given; pass .txt/.jsonl files or directories of them")
    files = []
    for path in paths:
        if not os.path.lexists(path):
            raise PrepareError(f"input {path} not found; give existing .txt/.jsonl files or directories")
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path, onerror=_unreadable):
                dirs[:] = sorted(d for d in dirs if exclude is None or
                                 os.path.realpath(os.path.join(root, d)) != exclude)
                found += [(os.path.join(root, n), _kind(n)) for n in sorted(names) if _kind(n)]
            if not found:
                raise PrepareError(f"input directory {path} holds no .txt or .jsonl files")
            files += found
        elif _kind(path):
            files.append((path, _kind(path)))
        else:
            raise PrepareError(f"input {path}: unsupported file type; give .txt (one document per file) or .jsonl "
                               "(one JSON object per line) files, or directories of them")
    for path, _ in files:  # each one opens (no link loop, dangling link or missing permission) before any work
        _open(path).close()
    return files


def _unreadable(error):
    """os.walk's onerror: a directory that cannot be listed is a mistake, not silently skipped."""
    raise PrepareError(f"cannot read input directory {error.filename}: {error.strerror}")


class _Source:
    """One input file as it is read: size, sha256 of its bytes, documents taken from it."""

    def __init__(self, path, kind):
        self.path, self.kind = path, kind
        self.bytes_read, self.documents, self.skipped = 0, 0, 0
        self.sha256 = hashlib.sha256()

    def record(self):
        return {"path": os.path.abspath(self.path), "kind": self.kind, "bytes": self.bytes_read,
                "sha256": self.sha256.hexdigest(), "documents": self.documents, "skipped_empty": self.skipped}


def _open(path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise PrepareError(f"cannot read input {path}: {e.strerror}") from None


def _read_txt(source, separator, stats):
    """The documents of a .txt file: the whole file, or the pieces between separators (read in chunks; linear
    in the file size however long a document is)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    keep = len(separator) - 1 if separator else 0  # a separator may straddle two chunks
    parts, tail, offset = [], "", 0  # the current document: "".join(parts) + tail
    with _open(source.path) as f:
        while True:
            chunk = f.read(READ_CHUNK)
            source.sha256.update(chunk)
            source.bytes_read += len(chunk)
            stats.bytes_read += len(chunk)
            try:
                new = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                raise PrepareError(f"{source.path} is not UTF-8 text ({e.reason} at byte {offset + e.start}); "
                                   "convert it to UTF-8") from None
            offset += len(chunk)
            if not separator:
                parts.append(new)
            else:
                *done, rest = (tail + new).split(separator)
                if done:
                    yield "".join(parts) + done[0]
                    yield from done[1:]
                    parts = []
                cut = max(0, len(rest) - keep)
                parts.append(rest[:cut])
                tail = rest[cut:]
            if not chunk:
                break
    yield "".join(parts) + tail


def _read_jsonl(source, field, stats):
    with _open(source.path) as f:
        for number, line in enumerate(f, 1):
            source.sha256.update(line)
            source.bytes_read += len(line)
            stats.bytes_read += len(line)
            where = f"{source.path}:{number}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PrepareError(f"{where}: not UTF-8 ({e.reason} at column {e.start + 1})") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                reason = e.msg.removesuffix(" at")
                raise PrepareError(f"{where}: not valid JSON ({reason} at column {e.colno}); each line must be one "
                                   "JSON object") from None
            except RecursionError:
                raise PrepareError(f"{where}: JSON nested too deeply to read; each line must be one JSON object with "
                                   f"a {field!r} string field") from None
            if not isinstance(obj, dict):
                raise PrepareError(f"{where}: a JSON {type(obj).__name__}, not an object with a {field!r} field")
            if field not in obj:
                have = ", ".join(map(repr, list(obj)[:8])) or "none"
                raise PrepareError(f"{where}: no field {field!r} (fields: {have}); choose one with --jsonl_field")
            if not isinstance(obj[field], str):
                value = obj[field]
                raise PrepareError(f"{where}: field {field!r} holds {type(value).__name__} {str(value)[:40]}, "
                                   "not a string")
            try:
                obj[field].encode("utf-8")
            except UnicodeEncodeError as e:  # JSON can escape half of a surrogate pair ("\ud800"): not text
                raise PrepareError(f"{where}: field {field!r} holds a lone surrogate {obj[field][e.start]!r} at "
                                   f"character {e.start + 1}, which is not Unicode text; fix or drop that "
                                   "line") from None
            yield obj[field]


def read_documents(files, *, jsonl_field="text", separator=None, stats=None, sources=None):
    """Yields the non-empty documents of `files` in order; appends a _Source per file to `sources`."""
    stats = stats if stats is not None else _Stats(0)
    for path, kind in files:
        source = _Source(path, kind)
        if sources is not None:
            sources.append(source)
        texts = _read_txt(source, separator, stats) if kind == "txt" else _read_jsonl(source, jsonl_field, stats)
        for text in texts:
            if text.strip():
                source.documents += 1
                yield text
            else:
                source.skipped += 1


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------

class _Stats:
    def __init__(self, total_bytes):
        self.total_bytes, self.bytes_read, self.documents, self.tokens = total_bytes, 0, 0, 0


class Progress:
    """`prepare [#####.....] 48% | 12,345 docs | 3.41M tokens | 52.1 MB | 6.3 MB/s, 1,480 docs/s | eta 0:07`
    on stderr every `interval` seconds (overwritten in place on a terminal)."""

    def __init__(self, stats, interval=1.0, stream=None):
        self.stats, self.interval, self.stream = stats, interval, stream or sys.stderr
        self.start = self.last = time.perf_counter()
        self.tty, self.shown = self.stream.isatty(), False

    def line(self):
        s, elapsed = self.stats, max(time.perf_counter() - self.start, 1e-9)
        fraction = min(s.bytes_read / s.total_bytes, 1.0) if s.total_bytes else 1.0
        bar = "#" * int(fraction * 20) + "." * (20 - int(fraction * 20))
        rate = s.bytes_read / elapsed
        eta = (s.total_bytes - s.bytes_read) / rate if rate > 0 else 0
        return (f"prepare [{bar}] {fraction:4.0%} | {s.documents:,} docs | {s.tokens / 1e6:,.2f}M tokens | "
                f"{s.bytes_read / 1e6:,.1f} MB | {rate / 1e6:,.1f} MB/s, {s.documents / elapsed:,.0f} docs/s, "
                f"{s.tokens / elapsed / 1e6:,.2f}M tok/s | eta {int(eta) // 60}:{int(eta) % 60:02d}")

    def update(self, force=False):
        now, state = time.perf_counter(), (self.stats.bytes_read, self.stats.documents)
        if (force or now - self.last >= self.interval) and state != getattr(self, "_printed", None):
            self.last, self.shown, self._printed = now, True, state
            print(("\r" if self.tty else "") + self.line(), end="" if self.tty else "\n", file=self.stream, flush=True)

    def close(self):
        if self.shown and self.tty:
            print(file=self.stream, flush=True)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

def _output_dir(out):
    reason = unwritable_dir(out)
    if reason:
        raise PrepareError(f"output directory {out} is not writable ({reason}); choose a directory you can write "
                           "to with --output_dir")


def _sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare(inputs, out, *, tokenizer="byte", jsonl_field="text", separator=None, eval_fraction=0.05,
            eos_token=None, progress_interval=1.0):
    """Tokenizes INPUTS into DIR (see the module docstring); returns the meta dict written to meta.json."""
    if not 0 < eval_fraction < 1:
        raise PrepareError(f"--eval_fraction must be in (0, 1), got {eval_fraction}")
    if separator == "":
        raise PrepareError("--separator is empty; give the string that separates documents, e.g. '<|endoftext|>'")
    files = find_inputs(inputs, exclude=os.path.realpath(out))
    try:
        tok = tokenizer_lib.load(tokenizer, eos_token)
    except tokenizer_lib.TokenizerError as e:
        raise PrepareError(f"--tokenizer: {e}") from None
    _output_dir(out)
    dtype = np.dtype(tokenized.DTYPES[0] if tok.vocab_size <= 1 << 16 else tokenized.DTYPES[1])
    staging = os.path.join(out, STAGING)
    shutil.rmtree(staging, ignore_errors=True)  # left by a run that was killed
    try:
        os.makedirs(staging)
        meta = _write(files, inputs, staging, tok, dtype, jsonl_field=jsonl_field, separator=separator,
                      eval_fraction=eval_fraction, progress_interval=progress_interval)
        _swap(staging, out)
    except OSError as e:  # the disk filled up or went read-only (the inputs' own errors are PrepareErrors)
        where = f" ({e.filename})" if e.filename else ""
        raise PrepareError(f"preparing {out} failed: {e.strerror or e}{where}; free disk space (the tokens are "
                           "staged, so about twice their size is needed) or choose another --output_dir") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return meta


def _swap(staging, out):
    """The staged dataset into `out`: the old meta.json goes first (from then on the directory is an incomplete
    dataset, never a mix of old and new that looks valid), the data files, then the new meta.json."""
    old_meta = os.path.join(out, tokenized.META)
    if os.path.exists(old_meta):
        os.remove(old_meta)
    for name in (tokenized.TOKENS, tokenized.DOCUMENTS, tokenized.META):
        os.replace(os.path.join(staging, name), os.path.join(out, name))


def _write(files, inputs, out, tok, dtype, *, jsonl_field, separator, eval_fraction, progress_interval):
    """Tokenizes `files` into the (staging) directory `out`; returns the meta dict written to its meta.json."""
    paths = {name: os.path.join(out, name) for name in (tokenized.META, tokenized.TOKENS, tokenized.DOCUMENTS)}
    partial = paths[tokenized.TOKENS] + ".partial"
    started = time.perf_counter()
    stats = _Stats(sum(os.path.getsize(p) for p, _ in files))
    progress = Progress(stats, progress_interval)
    sources, lengths = [], []
    try:
        with open(partial, "wb") as sink:
            def flush(batch):
                tokens, offsets = tokenized.encode_documents(batch, tok)
                if len(tokens) and (tokens.min() < 0 or tokens.max() >= tok.vocab_size):
                    raise PrepareError(f"the tokenizer produced id {int(tokens.max())}, outside its vocabulary of "
                                       f"{tok.vocab_size}; the tokenizer file is inconsistent")
                sink.write(tokens.astype(dtype).tobytes())
                lengths.extend(np.diff(offsets).tolist())
                stats.documents += len(batch)
                stats.tokens += len(tokens)
                progress.update()

            batch, chars = [], 0
            for text in read_documents(files, jsonl_field=jsonl_field, separator=separator, stats=stats,
                                       sources=sources):
                batch.append(text)
                chars += len(text)
                if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                    flush(batch)
                    batch, chars = [], 0
            if batch:
                flush(batch)
        progress.update(force=progress.shown)
        progress.close()
        progress.shown = False
        if not lengths:
            skipped = sum(s.skipped for s in sources)
            raise PrepareError(f"no documents in {', '.join(inputs)}: the inputs are empty"
                               + (f" ({skipped} empty documents skipped)" if skipped else "")
                               + "; give files with text")
        meta = _finish(out, paths, partial, tok, dtype, np.asarray(lengths, np.int64), eval_fraction)
    finally:
        progress.close()  # end a progress line left open on a terminal before any error message
        if os.path.exists(partial):
            os.remove(partial)
    meta.update(sources=[s.record() for s in sources], jsonl_field=jsonl_field, separator=separator,
                prepare_seconds=round(time.perf_counter() - started, 3),
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    with open(paths[tokenized.META], "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return meta


def _finish(out, paths, partial, tok, dtype, lengths, eval_fraction):
    """Input-order tokens (the partial file) -> tokens.bin in the final layout, documents.npy; the meta."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    num_tokens = int(offsets[-1])
    ranges, train_tokens, held_out = tokenized.split_layout(offsets, eval_fraction)
    source = np.memmap(partial, dtype=dtype, mode="r", shape=(num_tokens,))
    with open(paths[tokenized.TOKENS], "wb") as f:
        for start, end in ranges:
            for a in range(start, end, COPY_CHUNK):
                f.write(np.asarray(source[a: min(end, a + COPY_CHUNK)]).tobytes())
    del source
    num_documents = len(lengths)
    if num_documents >= 2:
        is_held = np.zeros(num_documents, bool)
        is_held[held_out] = True
        order = np.concatenate([np.flatnonzero(~is_held), held_out])
        file_offsets = np.concatenate([[0], np.cumsum(lengths[order])]).astype(np.int64)
        held = {"held_out": "documents", "train_documents": int(num_documents - len(held_out)),
                "eval_documents": int(len(held_out))}
    else:
        file_offsets = offsets
        held = {"held_out": "the tail of the only document", "train_documents": 1, "eval_documents": 0}
    np.save(paths[tokenized.DOCUMENTS], file_offsets)
    return {
        "format_version": tokenized.FORMAT_VERSION,
        "tokenizer": {"kind": tok.kind, "name": tok.name,
                      "path": os.path.abspath(tok.path) if tok.path else None,
                      "sha256": _sha256_file(tok.path) if tok.path else None,
                      "eos_token": getattr(tok, "eos_token", None)},
        "vocab_size": int(tok.vocab_size), "eos_id": int(tok.eos_id), "dtype": dtype.name,
        "num_tokens": num_tokens, "num_documents": int(num_documents),
        "train_tokens": int(train_tokens), "eval_tokens": num_tokens - int(train_tokens),
        **held, "held_out_documents": held_out.tolist(),
        "eval_fraction": eval_fraction, "split_seed": tokenized.EVAL_SPLIT_SEED,
        "layout": "tokens.bin = the training documents in input order, then the held-out documents in input order, "
                  "each followed by eos_id; documents.npy = start offsets in that order, plus num_tokens",
    }


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _parser():
    p = cli.ArgumentParser(prog="python -m MaxOffload.data.prepare", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("inputs", nargs="*", metavar="INPUTS", help=".txt / .jsonl files or directories of them")
    p.add_argument("--output_dir", "--out", dest="out", required=True, metavar="DIR",
                   help="output directory (created if needed); --out is the older spelling")
    p.add_argument("--tokenizer", default="byte", help="byte (default) | PATH/tokenizer.json | PATH/model.model")
    p.add_argument("--jsonl_field", default="text", help="the JSONL field holding the document text")
    p.add_argument("--separator", default=None, help="split .txt files into documents at this string "
                                                     "(default: one document per file)")
    p.add_argument("--eval_fraction", type=cli.number, default=0.05, help="fraction of documents held out (default 0.05)")
    p.add_argument("--eos_token", default=None, help="the tokenizer's end-of-text token (default: found by name "
                                                     f"among {', '.join(tokenizer_lib.EOS_NAMES)}, else a new id)")
    p.add_argument("--progress_interval", type=cli.number, default=1.0, help="seconds between progress lines")
    return p


def main(argv=None):
    """Exit status: 0 written, 2 a mistake (one line `error: ...` on stderr, MaxOffload/cli.py)."""
    return cli.run(_main, argv)


def _main(argv):
    args = _parser().parse_args(argv)
    meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, jsonl_field=args.jsonl_field,
                   separator=args.separator, eval_fraction=args.eval_fraction, eos_token=args.eos_token,
                   progress_interval=args.progress_interval)
    print(f"wrote {args.out}: {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens "
          f"({meta['train_tokens']:,} train / {meta['eval_tokens']:,} held out: "
          f"{meta['eval_documents'] or 'the tail of the'} document{'s' if meta['eval_documents'] != 1 else ''}), "
          f"{meta['tokenizer']['name']} vocab {meta['vocab_size']:,}, {meta['dtype']}, "
          f"{meta['prepare_seconds']:.1f} s; train with data.source=tokens data.path={args.out} "
          f"model.vocab_size>={meta['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
