"""Consensus at start-up: the processes of one job run the same job.

Right after jax.distributed's start-up (parallel/distributed.py), every process puts its fingerprint (its resolved
config without the keys that differ per process, a digest of this package's code, the jax and jaxlib versions) in
the coordinator's key-value store, reads everybody's, and waits at a barrier until all have read them. A process
started from another config or code (a stale node) would otherwise compile another program and every process would
hang in its first collective; here each process finds the difference itself and ends with one line naming the
differing keys and the processes on each side (ConfigError: exit 2), before anything is compiled or written.
"""
import hashlib
import json
import os

from MaxOffload.errors import ConfigError

PER_PROCESS = ("distributed.process_id", "distributed.local_device_ids")  # keys each process sets its own way
SHOWN = 3  # differing keys named in the line


def code_digest():
    """A digest of the package's Python files (their paths and bytes): two checkouts that differ in any line
    differ here."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def flat_items(tree, prefix=""):
    """(dotted key, leaf) of nested dicts, in order."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat_items(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def fingerprint(settings):
    """{key: value as text}: `settings` (the resolved config as nested dicts) without the per-process keys, the
    code digest and the jax / jaxlib versions."""
    import jax
    import jaxlib

    found = {key: json.dumps(value, sort_keys=True, default=str) for key, value in flat_items(settings)
             if key not in PER_PROCESS}
    return {**found, "code": code_digest(), "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def disagreement(prints):
    """None when the fingerprints {rank: fingerprint} agree, else the line that says how they differ: the keys
    (the first SHOWN) with each value and the processes holding it."""
    groups = {}
    for rank, found in sorted(prints.items()):
        groups.setdefault(json.dumps(found, sort_keys=True), []).append(rank)
    if len(groups) == 1:
        return None
    sides = [(json.loads(text), ranks) for text, ranks in groups.items()]
    keys = sorted({key for found, _ in sides for key in found
                   if len({json.dumps(f.get(key)) for f, _ in sides}) > 1})
    described = "; ".join(
        f"{key}: " + ", ".join(f"{f.get(key, 'absent')} on {_processes(ranks)}" for f, ranks in sides)
        for key in keys[:SHOWN])
    more = f" (and {len(keys) - SHOWN} more keys)" if len(keys) > SHOWN else ""
    return (f"the {len(prints)} processes of this job do not run the same job: {described}{more}; start every "
            "process with the same config, code and jax (the processes were stopped before compiling anything)")


def _processes(ranks):
    shown = ",".join(map(str, ranks[:8])) + (f",... ({len(ranks)})" if len(ranks) > 8 else "")
    return f"process{'es' if len(ranks) > 1 else ''} {shown}"


def agree(mine, rank, count, timeout_s, client=None):
    """Exchanges fingerprints through jax.distributed's key-value store; ConfigError (one line) where they differ.
    `client`: the distributed runtime's (default: the one jax.distributed.initialize made)."""
    if client is None:
        from MaxOffload.parallel.host_sync import coordination_client

        client = coordination_client()
    client.key_value_set(f"maxoffload/fingerprint/{rank}", json.dumps(mine, sort_keys=True))
    timeout_ms = int(timeout_s * 1000)
    prints = {r: json.loads(client.blocking_key_value_get(f"maxoffload/fingerprint/{r}", timeout_ms))
              for r in range(count)}
    client.wait_at_barrier("maxoffload_fingerprints_read", timeout_ms)  # nobody leaves before all have read
    problem = disagreement(prints)
    if problem:
        raise ConfigError(problem)
