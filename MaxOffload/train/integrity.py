"""What a checkpoint holds, checked before Orbax reads a byte of it.

Each saved step directory gets one `integrity.process_<i>.json` per process: the SHA-256 and size of every
file that process wrote (its `ocdbt.process_<i>/` shards and array metadata; process 0 also owns the shared
files), and, from process 0, the train state's structure (every leaf's path, shape and dtype). Before a
restore, the structure is compared with the configured one (a different model or optimizer is named as such,
never called damage) and every listed file is hashed again (damage is found here, before tensorstore reads a
truncated or bit-flipped chunk). The manifests are split over the processes that restore, whatever number
saved them, and all processes agree on the outcome.
"""
import hashlib
import json
import os
import re

import jax
import numpy as np

from MaxOffload.jsonfile import COUNT, Unreadable, every, optional, read_json
from MaxOffload.parallel import host_sync

_PREFIX, _SUFFIX = "integrity.process_", ".json"
_OWNER = re.compile(r"(?:^|/)(?:ocdbt\.process_|array_metadatas/process_)(\d+)(?:/|$)")


class Damaged(Exception):
    """A file is missing, has another size, or another digest than when it was saved."""


class Renamed(Exception):
    """The checkpoint holds another step than its directory's name says (renamed or copied by hand)."""

    def __init__(self, step):
        super().__init__(f"holds step {step}")
        self.step = step

    def line(self, step_dir):
        """The one line for it: what it holds and how to put it right (nothing is deleted)."""
        parent = os.path.dirname(os.path.normpath(step_dir))
        return (f"checkpoint {step_dir} {self} but its directory is named {_step_of(step_dir)} (renamed or copied "
                f"by hand?); nothing was restored: rename it back to {os.path.join(parent, str(self.step))}, or "
                f"move it out of {parent}")


class Mismatch(Exception):
    """The checkpoint is intact but holds another structure than the configured train state. `params_match`:
    whether its parameters are still the configured ones (then only the optimizer state changed); None when
    another process found the difference."""

    def __init__(self, text, params_match=None):
        super().__init__(text)
        self.params_match = params_match


PARAMS = "['params']"  # the key path prefix of the parameters in a train state's structure


def structure(tree):
    """{leaf path: [shape, dtype]} of a pytree of arrays or ShapeDtypeStructs."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): [list(leaf.shape), str(leaf.dtype)] for path, leaf in leaves}


def _digest(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _owned_files(step_dir, process_index):
    for root, _, files in os.walk(step_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel.startswith(_PREFIX):
                continue
            owner = _OWNER.search(rel)
            if (int(owner.group(1)) if owner else 0) == process_index:
                yield rel


def seal(step_dir, process_index, process_count, state_structure):
    """Writes this process's manifest for a finished save (atomically: a manifest is whole or absent)."""
    files = {rel: [os.path.getsize(os.path.join(step_dir, rel)), _digest(os.path.join(step_dir, rel))]
             for rel in sorted(_owned_files(step_dir, process_index))}
    record = {"process": process_index, "processes": process_count, "files": files}
    if process_index == 0:
        record["structure"] = state_structure
        if _step_of(step_dir) is not None:
            record["step"] = _step_of(step_dir)
    path = os.path.join(step_dir, f"{_PREFIX}{process_index}{_SUFFIX}")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def _step_of(step_dir):
    """The step a step directory's name says (checkpoints/<step>), or None for a name that is not a step."""
    name = os.path.basename(os.path.normpath(step_dir))
    return int(name) if name.isdigit() else None


def _pairs(what):
    """A manifest's {key: [x, y]} field: each file's size and digest, each leaf's shape and dtype."""
    pair = (lambda value: isinstance(value, list) and len(value) == 2), "a pair"
    return every(dict, pair, f"an object of [{what}] pairs")


_MANIFEST = {"process": COUNT, "files": _pairs("size, SHA-256"), "structure": optional(_pairs("shape, dtype")),
             "processes": optional(COUNT), "step": int | None}


def _manifests(step_dir):
    found = {}
    for name in os.listdir(step_dir):
        if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
            record = read_json(os.path.join(step_dir, name), "", _MANIFEST)
            found[record["process"]] = record
    return found


def _params(tree):
    return {k: v for k, v in tree.items() if k.startswith(PARAMS)}


def _compare(saved, configured, partial=False):
    """One line on how the saved structure differs from the configured one, or None. `partial`: the configured
    leaves are a part of the saved ones (the parameters of a saved train state)."""
    missing = [k for k in configured if k not in saved]
    extra = [] if partial else [k for k in saved if k not in configured]
    changed = sorted((k for k in configured if k in saved and saved[k] != configured[k]),
                     key=lambda k: not k.startswith(PARAMS))  # a parameter names the change best
    if not (missing or extra or changed):
        return None
    if changed:
        k = changed[0]
        what = (f"{k} was saved as {saved[k][1]}{saved[k][0]}, the config makes {configured[k][1]}{configured[k][0]}"
                + (f" (and {len(changed) - 1} more leaves differ)" if len(changed) > 1 else ""))
    elif missing:
        what = f"{len(missing)} leaves the config makes are not in it (e.g. {missing[0]})"
    else:
        what = f"it has {len(extra)} leaves the config does not make (e.g. {extra[0]})"
    return what


def _check_local(step_dir, configured, process_index, process_count, partial):
    """(code, text, params_match) for the manifests this process checks: code 0 fine, 1 unverifiable, 2 damaged,
    3 mismatch, 4 renamed."""
    try:
        manifests = _manifests(step_dir)
    except Unreadable as e:
        return 2, f"its integrity manifest {os.path.basename(e.path)} is unreadable: {e.problem}", None
    except OSError as e:  # the step directory itself (removed meanwhile)
        return 2, f"it cannot be listed ({e.strerror})", None
    if 0 not in manifests:
        return 1, "it has no integrity manifest (saved by an older MaxOffload, or the run ended before writing it)", None
    step = manifests[0].get("step")  # recorded since 2026-12-03
    if step is not None and _step_of(step_dir) is not None and step != _step_of(step_dir):
        return 4, step, None
    saved = manifests[0].get("structure") or {}
    what = _compare(saved, configured, partial)
    if what:
        return 3, what, _compare(_params(saved), _params(configured)) is None
    expected = manifests[0].get("processes") or 1
    absent = sorted(set(range(expected)) - set(manifests))
    if absent:
        return 1, f"the integrity manifest of process {absent[0]} is missing", None
    for owner in sorted(manifests):
        if owner % process_count != process_index:
            continue
        for rel, (size, digest) in manifests[owner]["files"].items():
            path = os.path.join(step_dir, rel)
            if not os.path.isfile(path):
                return 2, f"{rel} is missing", None
            if os.path.getsize(path) != size:
                return 2, f"{rel} has {os.path.getsize(path)} bytes, {size} when saved", None
            if _digest(path) != digest:
                return 2, f"{rel} differs from what was saved (SHA-256 mismatch)", None
    return 0, "", None


def verify(step_dir, configured, process_index, process_count, partial=False):
    """Returns a warning text (unverifiable) or None; raises Renamed, Damaged or Mismatch, the same on every process.
    `partial`: `configured` is the part of the saved structure that is to be restored (see _compare)."""
    code, text, params_match = _check_local(step_dir, configured, process_index, process_count, partial)
    sync = host_sync.shared()  # every process's verdict, through the coordinator (None: a lone process)
    if sync is not None:
        codes = np.asarray(sync.gather(code))
        worst = int(codes.max())
        if worst != code:
            found = {2: "damaged", 3: "different", 4: "renamed"}[worst]
            code, text, params_match = worst, f"process {int(np.argmax(codes))} found it {found}", None
    if code == 4:
        raise Renamed(text)
    if code == 2:
        raise Damaged(text)
    if code == 3:
        raise Mismatch(text, params_match)
    return text or None
