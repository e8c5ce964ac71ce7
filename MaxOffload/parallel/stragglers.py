"""Stragglers: each process's own speed, compared across the processes of a job every window of steps.

In an SPMD step every process waits at the step's collectives for the slowest, so the step time is the same on all
of them; a slow process shows only in what it does on its own. Two measures, every `distributed.straggler_window_
steps` steps:
  - own time: each step, the host's time to read the step's batch and dispatch it (`own_time_s` in metrics.jsonl);
    a slow host (a slow disk, an overloaded or throttled CPU) makes it longer. Its median and p99 over the window.
  - device probe: a fixed chain of matrix products on each of the process's devices, run between two steps while
    the device is idle, timed (the median of 3; the process's slowest device): a throttled or faulty GPU, or an
    oversubscribed CPU, takes longer on the same work.
The processes all-gather the three figures (one small collective); process 0 logs them (a `stragglers` row in
metrics.jsonl, their median and maximum in TensorBoard) and names each process whose probe, or whose median own time,
is over `distributed.straggler_factor` x the median of the other processes' (own time: and over it by at least
MIN_SHARE of the step time, below which it does not hold anybody back).
"""
import time

import numpy as np

MIN_SHARE = 0.05  # own time: a process is named only when it exceeds the others' by this share of the step time
# the probe: N x N matrices, multiplied REPS times in a chain (accelerators: ~9 TFLOP, ~10 ms on an H100; CPU: 0.8
# GFLOP, ~10 ms), in bf16 on accelerators, f32 on CPUs
PROBE = {"cpu": (256, 24, "float32")}
PROBE_ACCELERATOR = (4096, 64, "bfloat16")


def summarize(times):
    """(median, p99) of one process's own step times, in seconds."""
    p50, p99 = np.percentile(np.asarray(times, np.float64), [50, 99])
    return float(p50), float(p99)


class Probe:
    """The device probe of this process's devices: `time()` -> seconds of its slowest device (median of 3 runs)."""

    def __init__(self, devices):
        import jax
        import jax.numpy as jnp

        self.devices = list(devices)
        n, reps, dtype = PROBE.get(self.devices[0].platform, PROBE_ACCELERATOR)

        def chain(x):
            return jax.lax.fori_loop(0, reps, lambda _, y: jnp.tanh(y @ x), x)

        self.run = jax.jit(chain)
        start = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32) / np.sqrt(n)
        self.inputs = [jax.device_put(jnp.asarray(start, dtype), d) for d in self.devices]
        for x in self.inputs:  # compiled (once per device) before anything is timed
            self.run(x).block_until_ready()

    def time(self):
        slowest = 0.0
        for x in self.inputs:
            runs = []
            for _ in range(3):
                began = time.perf_counter()
                self.run(x).block_until_ready()
                runs.append(time.perf_counter() - began)
            slowest = max(slowest, sorted(runs)[1])
        return slowest


def _others(values, i):
    """The median of the other processes' values (a lone process: its own)."""
    values = np.asarray(values, np.float64)
    return float(np.median(np.delete(values, i))) if len(values) > 1 else float(values[i])


def _over(values, factor, margin=0.0):
    """Indices whose value is over factor x the median of the others' values (and over it by more than `margin`)."""
    return [i for i, v in enumerate(values) if v > factor * _others(values, i) and v - _others(values, i) >= margin]


def slow(p50s, probes, factor, step_s):
    """{process: [what is slow: "own time" and/or "device"]} of a window's figures."""
    named = {}
    for i in _over(p50s, factor, MIN_SHARE * step_s):
        named.setdefault(i, []).append("own time")
    for i in _over(probes, factor):
        named.setdefault(i, []).append("device")
    return dict(sorted(named.items()))


def row(p50s, p99s, probes, first, last, factor, step_s):
    """The metrics.jsonl row of a window (steps first..last) and its TensorBoard scalars."""
    named = slow(p50s, probes, factor, step_s)
    found = {"stragglers": {"steps": [first, last], "step_s": step_s,
                            "own_p50_s": [round(float(v), 6) for v in p50s],
                            "own_p99_s": [round(float(v), 6) for v in p99s],
                            "probe_s": [round(float(v), 6) for v in probes],
                            "slow": {str(i): what for i, what in named.items()}}}
    scalars = {"own_p50_s_median": float(np.median(p50s)), "own_p50_s_max": float(np.max(p50s)),
               "own_p99_s_max": float(np.max(p99s)), "probe_s_median": float(np.median(probes)),
               "probe_s_max": float(np.max(probes)), "slowest_probe_process": float(np.argmax(probes)),
               "slow": len(named)}
    return found, scalars


def describe(found, factor):
    """The log line naming the window's stragglers (None when there are none)."""
    s = found["stragglers"]
    if not s["slow"]:
        return None
    p50s, probes = s["own_p50_s"], s["probe_s"]

    def ratio(values, i):
        others = _others(values, i)
        return f"{values[i] / others:.1f}x" if others > 0 else "inf x"

    each = []
    for key, what in list(s["slow"].items())[:8]:
        i, parts = int(key), []
        if "device" in what:
            parts.append(f"device probe {probes[i] * 1e3:.1f} ms ({ratio(probes, i)} the others')")
        if "own time" in what:
            parts.append(f"own time {p50s[i]:.3f} s median, {s['own_p99_s'][i]:.3f} s p99 "
                         f"({ratio(p50s, i)} the others')")
        each.append(f"process {i}: " + ", ".join(parts))
    more = f" and {len(s['slow']) - 8} more" if len(s["slow"]) > 8 else ""
    return (f"warning: straggler(s) over steps {s['steps'][0]}-{s['steps'][1]} ({s['step_s']:.3f} s a step): "
            f"{'; '.join(each)}{more} (distributed.straggler_factor={factor:g}): look at that host (CPU load, "
            "throttling, its disk, its GPU's clocks and errors)")
