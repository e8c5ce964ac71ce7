"""Where a conversion writes: never into anything it did not create.

A conversion (from-hf, to-hf) writes its whole output into a staging directory beside `--out`, named for this
conversion (`<out>.partial-<host>-<pid>-<random>`, with a marker file saying which conversion made it), and
renames it to `--out` only when everything is written. So:
  - `--out` must be new or an empty directory, not a file or a symbolic link, and may not be, contain or lie
    inside the source;
  - Ctrl-C, SIGTERM, a full disk or a read-only filesystem remove the staging directory and leave `--out`
    as it was (one line; exit 130/143 for a signal, 2 for the filesystem);
  - after a kill -9 the staging directory stays; the next conversion to the same `--out` finds it by its
    marker (its process gone), removes it and says so in one line. Nothing unmarked is ever removed.
"""
import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import signal
import socket

from MaxOffload.errors import ConfigError, Interrupted
from MaxOffload.jsonfile import read_json

MARKER = ".maxoffload-conversion.json"
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def check_out(out, sources):
    """ConfigError unless `out` may receive a conversion of `sources` (directories it reads)."""
    if os.path.islink(out):
        raise ConfigError(f"--out {out} is a symbolic link; give a new directory (the link's target is left alone)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out} is a file; nothing was changed: give a new directory")
    target = os.path.realpath(out)
    for source in sources:
        real = os.path.realpath(source)
        if target == real or target.startswith(real + os.sep) or real.startswith(target + os.sep):
            raise ConfigError(f"--out {out} is, contains or lies inside the source {source}; nothing was changed: "
                              "give a directory outside it")
    if os.path.isdir(out) and os.listdir(out):
        raise ConfigError(f"--out {out} is not empty; nothing was changed: give a new directory")


def _alive(marker):
    if marker.get("host") != socket.gethostname():
        return True  # another machine's: cannot tell, so it is not ours to remove
    try:
        os.kill(int(marker["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, KeyError, TypeError):
        return True
    return True


def _leftovers(out, say):
    """Removes the staging directories of earlier conversions to `out` whose process is gone (a kill -9, a
    crash); refuses while one is still running."""
    parent, name = os.path.split(os.path.abspath(out))
    for entry in sorted(os.listdir(parent)):
        path = os.path.join(parent, entry)
        if not entry.startswith(name + ".partial-") or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            marker = read_json(os.path.join(path, MARKER), "", {"out": str})
        except ConfigError:
            continue  # no whole marker: not made by a conversion, so not ours to remove
        if marker["out"] != os.path.realpath(out):
            continue
        if _alive(marker):
            raise ConfigError(f"another conversion to --out {out} is running (process {marker.get('pid')} on "
                              f"{marker.get('host')}, writing {path}); wait for it or give another --out")
        shutil.rmtree(path)
        say(f"removed {path}, the partial output of an interrupted conversion to the same --out")


def _errno(error):
    """The operating system's error number behind `error`: an OSError's, or the one tensorstore (the zarr writes
    of from-hf) puts in its status ("[os_error_code='28']"); None for any other error."""
    if isinstance(error, OSError):
        return error.errno
    found = re.search(r"os_error_code='(\d+)'", str(error))
    return int(found.group(1)) if found else None


def _raise_interrupted(signum, _frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def staged(out, sources, say=print):
    """Yields a new directory to write the conversion into; renames it to `out` when the block completes,
    removes it when the block fails or is interrupted (SIGTERM and SIGINT become Interrupted meanwhile). A write
    that the filesystem refuses (full, read-only, no permission) becomes one ConfigError line."""
    check_out(out, sources)
    _leftovers(out, say)
    staging = f"{os.path.abspath(out)}.partial-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    # both signals explicitly: a process started in the background inherits SIGINT ignored (no KeyboardInterrupt)
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            os.makedirs(staging)
            with open(os.path.join(staging, MARKER), "w") as f:
                json.dump({"out": os.path.realpath(out), "sources": [os.path.realpath(s) for s in sources],
                           "host": socket.gethostname(), "pid": os.getpid()}, f)
            yield staging
            os.remove(os.path.join(staging, MARKER))
            if os.path.isdir(out):
                os.rmdir(out)  # empty (checked above)
            os.replace(staging, out)
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(e, KeyboardInterrupt):
                raise Interrupted(getattr(e, "signum", signal.SIGINT),
                                  f"{out} was not written (its partial output was removed)") from None
            code = _errno(e)
            if code in FULL:
                raise ConfigError(f"cannot write {out} ({os.strerror(code)}); nothing was written: free space "
                                  "or give a writable --out") from None
            raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
