"""A watchdog per process: a job whose process stops answering, or that stops making progress, ends within a bound
with one line naming who and where, instead of hanging or ending in XLA's C++ abort naming nobody.

Two threads. `beat` puts a counter in the coordinator's key-value store every second (jax.distributed's: a
SIGSTOPped or hung process stops counting). `watch` reads everybody's counters every CHECK_S seconds and ends this
process when
  - a peer's counter has not moved for `silent_s` (SILENT_SHARE, a quarter, of distributed.heartbeat_timeout_s: before
    JAX's own heartbeat ends the job with a stack trace): "process 3 stopped answering ...";
  - the coordinator (process 0) does not answer the read within `silent_s`: "process 0, the coordinator, does not
    answer ...";
  - the section this process is in (compiling, a training step, a checkpoint save) has run past its timeout while
    every process still answers: "... every process answers: it is slow or stuck, not gone".
The line goes to stderr as the process's last words, with the section, the last completed step and what to do; the
exit status is HUNG (1). A single process has no peers: only its sections are watched.
"""
import os
import sys
import threading
import time

HUNG = 1  # errors.py: the run stopped on what it found
# JAX's coordination service declares a task dead when its last heartbeat is older than the timeout, and a task sends
# one every half timeout (XLA's coordination_service_agent.cc): a task frozen just before its next heartbeat is declared
# dead half a timeout after it froze. The watchdog speaks first: after a quarter, plus a beat and a check.
SILENT_SHARE = 0.25
CHECK_S = 2.0
PREFIX = "maxoffload/heartbeat/"


class Watchdog:
    def __init__(self, rank, count, silent_s, client=None, exit=os._exit, say=None):
        """client: jax.distributed's key-value client (None: a single process, only sections watched); exit, say: what
        ends the process and prints its line (tests replace them)."""
        self.rank, self.count, self.silent_s, self.client = rank, count, silent_s, client
        self.exit, self.say = exit, say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.section, self.deadline, self.timeout, self.step = "start-up", None, None, 0
        self.beats, self.seen, self.stopped = 0, {}, False  # seen: rank -> (counter, when it last changed)
        self.lock = threading.Lock()
        if client is not None:
            threading.Thread(target=self._beat, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    # -- what the run tells it ------------------------------------------------------------------------------------
    def enter(self, section, timeout_s):
        """This process is now in `section` ("compiling the training step", "step 12", ...), for at most `timeout_s`
        (0 or None: no limit)."""
        with self.lock:
            self.section, self.timeout = section, timeout_s or None
            self.deadline = time.monotonic() + timeout_s if timeout_s else None

    def completed(self, step):
        with self.lock:
            self.step = step

    def during(self, section, timeout_s):
        """A context: `section` for at most timeout_s, then back to the section it interrupted (its clock restarted)."""
        import contextlib

        @contextlib.contextmanager
        def scope():
            with self.lock:
                before = (self.section, self.timeout)
            self.enter(section, timeout_s)
            try:
                yield
            finally:
                self.enter(*before)

        return scope()

    def close(self):
        self.stopped = True

    # -- the threads --------------------------------------------------------------------------------------------
    def _beat(self):
        while not self.stopped:
            self.beats += 1
            try:
                self.client.key_value_set(f"{PREFIX}{self.rank}", str(self.beats), allow_overwrite=True)
            except Exception:  # the coordinator is gone or slow: `watch` says so
                pass
            time.sleep(1.0)

    def _watch(self):
        while not self.stopped:
            time.sleep(CHECK_S)
            if self.stopped:
                return
            line = self.check(time.monotonic())
            if line:
                self.say(line)
                self.exit(HUNG)
                return

    def _read(self):
        """{rank: counter} from the store, or None when the coordinator did not answer within silent_s."""
        found = {}

        def read():
            found.update({int(key.rsplit("/", 1)[1]): int(value)
                          for key, value in self.client.key_value_dir_get(PREFIX)})

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(self.silent_s)
        return None if reader.is_alive() else found

    def check(self, now, counters=None):
        """The line to end with, or None. `counters`: {rank: counter} as read (default: read now; None when the
        coordinator did not answer)."""
        with self.lock:
            section, deadline, timeout, step = self.section, self.deadline, self.timeout, self.step
        where = f"during {section} (last completed step {step})"
        if self.client is not None and self.count > 1:
            counters = self._read() if counters is None else counters
            if counters is None:
                return (f"error: process {self.rank} of {self.count}: process 0, the coordinator, does not answer "
                        f"(no reply in {self.silent_s:.0f} s) {where}; the job ends: find what stopped process 0, then "
                        "rerun: it resumes from the last checkpoint")
            for rank, counter in counters.items():
                last = self.seen.get(rank)
                if last is None or last[0] != counter:
                    self.seen[rank] = (counter, now)
            silent = sorted(r for r, (_, since) in self.seen.items() if r != self.rank and now - since > self.silent_s)
            if silent:
                return (f"error: process {self.rank} of {self.count}: {_processes(silent)} stopped answering (no "
                        f"heartbeat for {self.silent_s:.0f} s) {where}; the job ends: find what stopped "
                        f"{'them' if len(silent) > 1 else 'it'} (a hung or frozen node), then rerun: it resumes from "
                        "the last checkpoint")
        if deadline is not None and now > deadline:
            alive = "every process answers: it is slow or stuck, not gone" if self.count > 1 else "it is slow or stuck"
            return (f"error: process {self.rank} of {self.count}: {section} has run {timeout:.0f} s, past its timeout "
                    f"(last completed step {step}); {alive}; the job ends: rerun to resume from the last checkpoint, "
                    "or raise its distributed.*_timeout_s")
        return None


def _processes(ranks):
    shown = ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    return f"process{'es' if len(ranks) > 1 else ''} {shown}"


def start(rank, count, heartbeat_timeout_s):
    """The watchdog of this process: its peers watched through jax.distributed's client where there is one."""
    from MaxOffload.parallel.host_sync import coordination_client

    return Watchdog(rank, count, heartbeat_timeout_s * SILENT_SHARE, coordination_client() if count > 1 else None)
