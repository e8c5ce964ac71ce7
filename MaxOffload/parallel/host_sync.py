"""What a job's processes agree on between steps, exchanged through jax.distributed's key-value store, never through
the devices.

A host value sent through a collective (`multihost_utils.process_allgather`) is an XLA program of its own, with no
data dependence on the training step's programs: nothing orders the two on a process's devices, so one process can
run the agreement's collective while another runs the step's, each waiting for the other in a different one. Two
processes hung that way in the CI rehearsal of 2026-12-07 until gloo's own timeout (30 minutes; issue 48). Here the
agreements are the coordinator's: a barrier and a few keys, which order nothing on the devices and cost about a
millisecond a call on one host.

    sync = shared()                # this process's (None for a lone process); every process, the same calls in order
    sync.wait("compiled")          # every process here before any goes on
    sync.any(local_flag)           # True on every process when any process passed True
    sync.to_lead(row)              # process 0 gets every process's row (a list of floats); the others None at once
    sync.from_lead(value)          # process 0's value (JSON) on every process
    sync.gather(value)             # every process's value (JSON), in rank order, on every process

The start-up agreements (the run directory's lock, a checkpoint's integrity verdict, the moved-aside run directory)
go through it too: each process's calls are numbered per kind, so one object serves the whole process (`shared`).
"""
import json

ROOT = "maxoffload/sync/"
WAIT_MS = 24 * 3600 * 1000  # the watchdog (parallel/watchdog.py) ends a process stuck here long before


def coordination_client():
    """jax.distributed's key-value client (parallel/consensus.py and watchdog.py use it too)."""
    from jax._src import distributed  # jax keeps its coordination client private

    return distributed.global_state.client


_SHARED = {}


def shared():
    """This process's HostSync (one for the whole process: the rounds of its calls are numbered in it), or None when
    the job is one process."""
    import jax

    if jax.process_count() == 1:
        return None
    key = (jax.process_index(), jax.process_count(), id(coordination_client()))
    if key not in _SHARED:
        _SHARED.clear()
        _SHARED[key] = HostSync(jax.process_index(), jax.process_count())
    return _SHARED[key]


class HostSync:
    def __init__(self, rank, count, client=None):
        self.rank, self.count, self.client = rank, count, client or coordination_client()
        self.rounds = {"any": 0, "to_lead": 0, "from_lead": 0, "gather": 0}

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

    def from_lead(self, value):
        """Process 0's `value` (anything JSON holds) on every process: process 0 returns its own at once, the others
        wait for it."""
        key = f"{ROOT}from_lead/{self._round('from_lead')}"
        if self.rank == 0:
            self.client.key_value_set(key, json.dumps(value))
            return value
        return json.loads(self.client.blocking_key_value_get(key, WAIT_MS))

    def gather(self, value):
        """[every process's `value`] (anything JSON holds) in rank order, on every process: each sets its own and
        waits for the others'."""
        prefix = f"{ROOT}gather/{self._round('gather')}/"
        self.client.key_value_set(f"{prefix}{self.rank}", json.dumps(value))
        return [value if rank == self.rank else
                json.loads(self.client.blocking_key_value_get(f"{prefix}{rank}", WAIT_MS)) for rank in range(self.count)]
