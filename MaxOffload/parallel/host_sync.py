"""What a job's processes agree on between steps, exchanged through jax.distributed's key-value store, never through
the devices.

A host value sent through a collective (`multihost_utils.process_allgather`) is an XLA program of its own, with no
data dependence on the training step's programs: nothing orders the two on a process's devices, so one process can
run the agreement's collective while another runs the step's, each waiting for the other in a different one. Two
processes hung that way in the CI rehearsal of 2026-12-07 until gloo's own timeout (30 minutes; issue 48). Here the
agreements are the coordinator's: a barrier and a few keys, which order nothing on the devices and cost about a
millisecond a call on one host.

    sync = HostSync(rank, count)   # every process, in the same order of calls
    sync.wait("compiled")          # every process here before any goes on
    sync.any(local_flag)           # True on every process when any process passed True
    sync.to_lead(row)              # process 0 gets every process's row (a list of floats); the others None at once
"""
import json

ROOT = "maxoffload/sync/"
WAIT_MS = 24 * 3600 * 1000  # the watchdog (parallel/watchdog.py) ends a process stuck here long before


def coordination_client():
    """jax.distributed's key-value client (parallel/consensus.py and watchdog.py use it too)."""
    from jax._src import distributed  # jax keeps its coordination client private

    return distributed.global_state.client


class HostSync:
    def __init__(self, rank, count, client=None):
        self.rank, self.count, self.client = rank, count, client or coordination_client()
        self.rounds = {"any": 0, "to_lead": 0}

    def _round(self, kind):
        self.rounds[kind] += 1
        return self.rounds[kind]

    def wait(self, name):
        """Returns once every process has called wait(name): e.g. after compiling, so that the first step's
        collectives start together. Gloo's CPU collectives fail or stall when peers arrive far apart (jax#40831: its
        reduce-scatter gives up after 30 s), which a process compiling a minute longer than another made happen in
        the first step; NCCL would wait, but nothing is gained by the devices waiting instead of the hosts."""
        self.client.wait_at_barrier(f"{ROOT}wait/{name}", WAIT_MS)

    def any(self, local):
        """Whether any process passed True. A flag is set under this call's round before the barrier and read after
        it, so every process reads the same keys: all agree, on the same call."""
        prefix = f"{ROOT}any/{self._round('any')}/"
        if local:
            self.client.key_value_set(f"{prefix}{self.rank}", "1")
        self.client.wait_at_barrier(f"{ROOT}any", WAIT_MS)  # one barrier, reused: the coordinator counts its rounds
        return bool(self.client.key_value_dir_get(prefix))

    def to_lead(self, row):
        """Process 0: [every process's row] in rank order (it waits for them); the others: None, without waiting."""
        prefix = f"{ROOT}to_lead/{self._round('to_lead')}/"
        if self.rank != 0:
            self.client.key_value_set(f"{prefix}{self.rank}", json.dumps([float(v) for v in row]))
            return None
        rows = [[float(v) for v in row]]
        for rank in range(1, self.count):
            rows.append(json.loads(self.client.blocking_key_value_get(f"{prefix}{rank}", WAIT_MS)))
            self.client.key_value_delete(f"{prefix}{rank}")  # read once: the store keeps no history
        return rows
