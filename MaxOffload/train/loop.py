"""The step loop and its hooks (Levanter's `add_hook(fn, every=N)` is the model).

The loop only steps: it feeds batches, dispatches the jitted step and calls hooks. Everything else a run does
(metrics, health checks, evaluation, checkpoints, profiling, preemption) is a hook with a period, registered by
the trainer. Metrics are fetched one step late, after the next step is queued, so the host never waits for the
device it has just fed; a hook that needs the device idle (evaluation, a save, the profiler) calls `flush()`.
"""
import dataclasses
import time
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook sees after a step: the number of steps done, the state they produced, the step's metrics (still
    on the device) and whether it was the loop's last step."""
    step: int
    state: Any
    metrics: Any
    last: bool


@dataclasses.dataclass(frozen=True)
class _Hook:
    fn: Callable
    every: int

    def due(self, info):
        return self.every > 0 and info.step % self.every == 0


class Loop:
    def __init__(self, step_fn, batch_fn):
        """step_fn(state, batch) -> (state, metrics); batch_fn(step index) -> the batch of that step."""
        self.step_fn, self.batch_fn = step_fn, batch_fn
        self.hooks, self.metrics_hooks, self.pending, self.state = [], [], None, None

    def add_hook(self, fn, every=1):
        """fn(StepInfo) after every `every`-th step (0: never), in the order added."""
        self.hooks.append(_Hook(fn, every))

    def add_metrics_hook(self, fn):
        """fn(step, {name: float}) once a step's metrics reach the host: one step late, or at `flush()`. Beside the
        step's own metrics: own_time_s, the host's time for the step (reading its batch, dispatching it)."""
        self.metrics_hooks.append(fn)

    def flush(self):
        """Waits for the step whose metrics are pending and hands them to the metrics hooks."""
        pending, self.pending = self.pending, None
        if pending is not None:
            step, metrics, own = pending
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
            values["own_time_s"] = own
            for fn in self.metrics_hooks:
                fn(step, values)

    def run(self, state, start, end):
        """Steps start+1 .. end; returns the final state (its metrics flushed). If a hook raises, `self.state` is
        the newest state (the step donates its input)."""
        for index in range(start, end):
            began = time.perf_counter()
            with jax.profiler.StepTraceAnnotation("train", step_num=index + 1):
                state, metrics = self.step_fn(state, self.batch_fn(index))
            own = time.perf_counter() - began
            self.state = state
            self.flush()  # the previous step's, while the device works on this one
            self.pending = (index + 1, metrics, own)
            info = StepInfo(index + 1, state, metrics, index + 1 == end)
            for hook in self.hooks:
                if hook.due(info):
                    hook.fn(info)
        self.flush()
        return state
