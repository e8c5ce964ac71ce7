"""Who came: a roll call beside jax.distributed's start-up, so a job that never assembles ends in one line.

jax.distributed.initialize blocks until every process has registered with the coordinator; when one never comes,
XLA ends the process with a fatal log and a C++ stack trace after the timeout, naming nobody. Around that call,
`watch` runs a roll call on the port after the coordinator's (before it for 65535): process 0 listens there, every other process
reports its rank to it (retrying until the deadline). A timer fires just before JAX would give up; it prints one
line and ends the process with exit status 1:
  process 0  names the processes that never reported and the coordinator address;
  the others say whether process 0 answered (then its log names the missing ones) or never came.
The roll call is advisory: a port it cannot use costs the names, never the start-up.
"""
import contextlib
import os
import socket
import sys
import threading
import time

GRACE_S = 30  # JAX's own timeout is this much longer, so the roll call speaks first


def _split(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _names(ranks):
    ranks = sorted(ranks)
    shown = ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    return f"process{'es' if len(ranks) > 1 else ''} {shown}"


class _Leader:
    """Process 0: listens on the roll-call port and records the ranks that report."""

    def __init__(self, port):
        self.arrived = {0}
        self.listener = None
        try:
            self.listener = socket.create_server(("", port), reuse_port=False)
            self.listener.settimeout(0.5)
        except OSError:
            return  # port taken: no names, the start-up goes on
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while self.listener is not None:
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.arrived.add(int(conn.recv(32).decode().strip()))
                    conn.sendall(b"ok\n")
                except (OSError, ValueError):
                    pass

    def close(self):
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()

    def verdict(self, count, address, timeout):
        if self.listener is None and len(self.arrived) == 1:
            return (f"the {count} processes did not all reach the coordinator {address} within {timeout} s (this is "
                    f"process 0; the roll call could not listen, so the missing ones are not known)")
        missing = sorted(set(range(count)) - self.arrived)
        return (f"{_names(missing)} of {count} did not reach the coordinator {address} within {timeout} s (this is "
                f"process 0); check that every process was started and can reach that address, or raise "
                f"distributed.initialization_timeout_s")


class _Member:
    """Any other process: reports its rank to process 0 until it answers or the deadline passes."""

    def __init__(self, host, port, rank, deadline):
        self.answered = False
        self.stopped = False
        threading.Thread(target=self._report, args=(host, port, rank, deadline), daemon=True).start()

    def _report(self, host, port, rank, deadline):
        while not self.stopped and time.monotonic() < deadline:
            try:
                with socket.create_connection((host, port), timeout=2) as conn:
                    conn.sendall(f"{rank}\n".encode())
                    self.answered = conn.recv(8).startswith(b"ok")
                    return
            except OSError:
                time.sleep(1)

    def close(self):
        self.stopped = True

    def verdict(self, rank, count, address, timeout):
        if self.answered:
            return (f"process {rank} of {count}: the job did not assemble at the coordinator {address} within "
                    f"{timeout} s; process 0 answered, its log names the missing processes")
        return (f"process {rank} of {count}: no answer from process 0 at the coordinator {address} within {timeout} s; "
                "check that process 0 was started and that this address reaches it")


@contextlib.contextmanager
def watch(address, rank, count, timeout):
    """Runs the block (jax.distributed.initialize, with timeout + GRACE_S) under the roll call's timer."""
    host, port = _split(address)
    port = port + 1 if port < 65535 else port - 1  # the roll call's port, beside the coordinator's
    side = _Leader(port) if rank == 0 else _Member(host, port, rank, time.monotonic() + timeout)

    def give_up():
        text = side.verdict(count, address, timeout) if rank == 0 else side.verdict(rank, count, address, timeout)
        print(f"error: distributed start-up: {text}", file=sys.stderr, flush=True)
        os._exit(1)  # the block is stuck in XLA's C++ client: nothing else can end it cleanly

    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        side.close()
