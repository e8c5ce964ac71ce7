"""The run directory (`run.output_dir`): one run at a time, and what a rerun may change there.

- **One run at a time.** `lock` takes an exclusive `flock` on OUTPUT/run.lock for the run's life (process 0
  of a job takes it: a multi-process job locks once). The kernel drops the lock when its process dies, so
  a killed run never leaves a lock that blocks the next one; the file stays, naming its last holder. A
  second run into the same directory is one line, exit 2, before it writes anything.
- **config.json** is written once the lock is held and the checkpoint to resume from is known (never by a
  rerun that has nothing to train); when it already holds another config, the keys that differ are printed
  first.
- **One run per directory.** A run that starts from step 0 (checkpoint.resume=false, checkpoint.enabled=false,
  or nothing to resume) in a directory that holds another run (its checkpoints, or the summary.json of a run
  that finished) is refused in one line before anything is written; `run.overwrite=true` moves that run's
  files into OUTPUT/replaced/<time>/ first (nothing is deleted). A resumed run continues its own files.
- **Dry runs** write only their own file, OUTPUT/dry_run.json (the config and the summary), and take no lock:
  a training run's config.json, summary.json and metrics are never touched.
"""
import fcntl
import json
import os
import socket
import time

from MaxOffload.errors import ConfigError
from MaxOffload.jsonfile import Unreadable, read_json
from MaxOffload.reports import unwritable_dir, write_json

LOCK, CONFIG, DRY_RUN = "run.lock", "config.json", "dry_run.json"
SHOWN_CHANGES = 12  # differing keys printed in full before "... and N more"


def make(output_dir):
    """Creates the run directory; ConfigError (one line) when it cannot be written."""
    reason = unwritable_dir(output_dir)
    if reason:
        raise ConfigError(f"run.output_dir={output_dir}: cannot write there ({reason}); choose a writable directory")


class Lock:
    """The held lock of a run directory (see the module docstring); `release()` or process exit frees it."""

    def __init__(self, output_dir):
        self.path = os.path.join(output_dir, LOCK)
        self.file = open(self.path, "a+", errors="replace")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            holder = self.file.readline(200).strip() or "another process"  # the line it wrote (see below)
            self.file.close()
            raise ConfigError(f"run.output_dir={output_dir} is in use by a running job ({holder}); wait for it to "
                              "end, or give this run its own run.output_dir") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self.file.flush()

    def release(self):
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


REPLACED = "replaced"  # run.overwrite=true moves an earlier run's files into OUTPUT/replaced/<time>/
KEPT = (LOCK, REPLACED)  # what a move aside leaves in place


def checkpoint_steps(output_dir):
    """The steps of the checkpoints in OUTPUT/checkpoints (the names Orbax gives finished saves)."""
    directory = os.path.join(output_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []


def another_run(output_dir):
    """What in OUTPUT shows an earlier run a new one would overwrite ('' when nothing does): its checkpoints
    and the summary.json of a finished run."""
    steps = checkpoint_steps(output_dir)
    held = [f"checkpoints of step(s) {', '.join(map(str, steps))}"] if steps else []
    if os.path.isfile(os.path.join(output_dir, "summary.json")):
        held.append("the summary.json of a finished run")
    return " and ".join(held)


def move_aside(output_dir):
    """Moves every file of OUTPUT but its lock (and earlier moves) into OUTPUT/replaced/<time>/; returns it."""
    target = os.path.join(output_dir, REPLACED, time.strftime("%Y%m%d-%H%M%S"))
    while os.path.exists(target):
        target += "+"
    os.makedirs(target)
    for name in os.listdir(output_dir):
        if name not in KEPT:
            os.rename(os.path.join(output_dir, name), os.path.join(target, name))
    return target


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changes(saved, current):
    """['key: saved -> current', ...] for the keys whose values differ (added or removed keys included)."""
    a, b = _flat(saved), _flat(current)
    missing = object()
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)]


def write_config(output_dir, config, say=print):
    """OUTPUT/config.json := `config` (a dict); first says which keys differ from the one already there."""
    path = os.path.join(output_dir, CONFIG)
    try:
        saved = read_json(path, "", dict, missing_ok=True)
    except Unreadable as e:  # the config this run trains with replaces it: what differs cannot be said
        say(f"{path}: {e.problem}; this run writes its config over it")
        saved = None
    if saved is not None:
        diff = changes(saved, json.loads(json.dumps(config)))
        if diff:
            more = f"; ... and {len(diff) - SHOWN_CHANGES} more" if len(diff) > SHOWN_CHANGES else ""
            say(f"config changed since {path} was written ({len(diff)} key(s)): "
                + "; ".join(diff[:SHOWN_CHANGES]) + more)
    write_json(path, config)


def write_dry_run(output_dir, config, summary):
    path = os.path.join(output_dir, DRY_RUN)
    write_json(path, {"config": config, "summary": summary})
    return path
