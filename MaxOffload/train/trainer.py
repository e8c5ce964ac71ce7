"""The imperative shell around the jitted step: data in; metrics, evaluation, checkpoints and a
summary out; resume, preemption and non-finite steps handled.

Exit codes (train.py): 0 done, 1 stopped on a non-finite step or a parity failure, 2 bad input,
PREEMPTED (42) saved after SIGTERM/SIGUSR1 — the Slurm launcher requeues the job.
"""
import os
import signal
import time

import numpy as np

import jax

from MaxOffload import data as data_lib
from MaxOffload import hardware
from MaxOffload.models import kernels
from MaxOffload.config.loader import describe
from MaxOffload.errors import ConfigError
from MaxOffload.train.flops import train_flops_per_step
from MaxOffload.train.checkpoint import Checkpointer, load_params
from MaxOffload.errors import NonFiniteError
from MaxOffload.offload import xla_bugs
from MaxOffload.train.metrics import MetricsLogger
from MaxOffload.parallel import distributed
from MaxOffload.reports import write_json
from MaxOffload.train import rundir
from MaxOffload.parallel.mesh import describe as mesh_describe
from MaxOffload.profile.window import Window
from MaxOffload.train.step import HOST, TrainSetup


PREEMPTED = 42
_LEAD = [True]  # whether this process reports (process 0 of a multi-process job)


def _say(text):
    if _LEAD[0]:
        print(text, flush=True)


def _human(n, unit="", suffixes=("", "K", "M", "G", "T", "P"), digits=3):
    for suffix in suffixes:
        if abs(n) < 1000 or suffix == suffixes[-1]:
            return f"{n:.{digits}g}{suffix}{unit}" if suffix else f"{n:.0f}{unit}"
        n /= 1000


def _count(n):
    """405.9B, 3.213M: a parameter count the way model cards write it."""
    return _human(n, suffixes=("", "K", "M", "B", "T"), digits=4)


def peak_flops_per_device(cfg):
    if cfg.hardware.peak_tflops_per_device is not None:
        return cfg.hardware.peak_tflops_per_device * 1e12
    accelerator = hardware.lookup(jax.devices()[0].device_kind)
    return accelerator.bf16_peak_flops if accelerator else None


def lock_output_dir(cfg, process_count):
    """The run directory's lock (train/rundir.py), taken by process 0; every process fails alike without it."""
    lock, error = None, None
    if _LEAD[0]:
        try:
            lock = rundir.Lock(cfg.run.output_dir)
        except ConfigError as e:
            error = e
    if process_count > 1:
        from jax.experimental import multihost_utils

        if not int(multihost_utils.broadcast_one_to_all(np.int32(lock is not None))) and error is None:
            error = ConfigError(f"run.output_dir={cfg.run.output_dir} is in use by a running job (process 0 could "
                                "not lock it); wait for it to end, or give this run its own run.output_dir")
    if error is not None:
        raise error
    return lock


def verify_parity(setup):
    from MaxOffload.offload import parity

    _say("offload.verify_parity: comparing this policy with full remat on one batch ...")
    ref_loss, tolerance, rows = parity.compare(setup)
    _say(parity.format_rows(ref_loss, tolerance, rows))
    if not all(row[4] for row in rows):
        raise parity.ParityError("the configured remat/offload policy changes the loss or gradients beyond tolerance; "
                          "not training. Try another XLA version or policy, and report it.")


def platform_of(setup):
    """'gpu', 'cpu', ...: the platform the run's devices belong to (models/kernels.platform: 'cuda' and 'rocm'
    devices say 'gpu', as the kernel choices do)."""
    return kernels.platform(setup.mesh.devices.flat[0])


class Preempted(Exception):
    """SIGTERM/SIGUSR1: the state was saved; exit with PREEMPTED so the launcher requeues."""


def run(cfg, plan, devices=None):
    """plan: the OffloadPlan (MaxOffload/resolve.py); devices: the run's devices (default: this process's); a
    dry run may pass compile-only GPUs."""
    process_index, process_count = distributed.initialize(cfg)
    _LEAD[0] = process_index == 0
    _say("MaxOffload config:\n" + describe(cfg))
    if process_count > 1:
        _say(f"multi-process: {process_count} processes, {jax.local_device_count()} device(s) each")
    if _LEAD[0]:
        rundir.make(cfg.run.output_dir)
    setup = TrainSetup(cfg, plan, devices or jax.devices())
    summary = describe_setup(cfg, setup)
    if cfg.run.dry_run:  # its own file only: a training run's outputs in the same directory stay as they are
        path = os.path.join(cfg.run.output_dir, rundir.DRY_RUN)
        if _LEAD[0]:
            rundir.write_dry_run(cfg.run.output_dir, cfg.to_dict(), summary)
        _say(f"dry run: nothing allocated or run; wrote {path}")
        return 0
    lock = lock_output_dir(cfg, process_count)
    try:
        miscompile = xla_bugs.affects(plan, platform_of(setup))
        if miscompile:
            _say(f"{miscompile}: turning the parity gate (offload.verify_parity) on")
        if plan.verify_parity or miscompile:
            verify_parity(setup)
        return Training(cfg, setup, summary, process_index, process_count).run()
    except Preempted:
        return PREEMPTED
    finally:
        if lock is not None:
            lock.release()


def describe_setup(cfg, setup):
    devices = list(setup.mesh.devices.flat)
    global_batch = cfg.train.per_device_batch_size * len(devices)
    summary = {"params_total": setup.params_total(), "params_active": setup.model_config.active_params(),
               "state_bytes_per_device": setup.state_bytes_per_device(),
               "state_host_bytes_per_device": setup.state_bytes_per_device(HOST),
               "devices": len(devices), "device_kind": devices[0].device_kind, "global_batch": global_batch,
               "model_flops_per_step": train_flops_per_step(setup.model_config, global_batch, cfg.train.seq_len)}
    copies = setup.model_config.params_stored_twice()
    if copies:  # what the released checkpoint counts, e.g. DeepSeek-V3's 685B
        summary["params_as_released"] = summary["params_total"] + copies
    released = f" ({_count(summary['params_as_released'])} as released)" if copies else ""
    active = "" if summary["params_active"] >= summary["params_total"] else \
        f", {_count(summary['params_active'])} active per token"
    _say(f"model {cfg.model.family}: {_count(summary['params_total'])} parameters{released}{active}; params + optimizer state "
         f"{_human(summary['state_bytes_per_device'], 'B')} per device "
         f"({_human(summary['state_host_bytes_per_device'], 'B')} of it in pinned host memory) on "
         f"{len(devices)} x {devices[0].device_kind} (mesh {mesh_describe(setup.mesh)}); "
         f"{_human(summary['model_flops_per_step'], 'FLOP')} per step")
    return summary


def compiled_memory(compiled):
    """XLA's memory analysis of a compiled step, per device: arguments, temporaries, host buffers."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_temp_size_in_bytes")
    return {f: int(getattr(m, f, 0) or 0) for f in fields}


def device_peak_bytes():
    """Peak device memory the runtime reports (GPU), else None (the CPU backend reports none)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def device_memory_metrics():
    """Per-step device memory figures the runtime reports (GPU): {} where it reports none (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {f"device_{k}": int(stats[k]) for k in ("peak_bytes_in_use", "bytes_in_use") if k in stats}


def describe_compiled_memory(memory):
    if not memory:
        return "compiled step memory: not reported by this backend"
    names = (("argument", "argument_size_in_bytes"), ("output", "output_size_in_bytes"),
             ("alias", "alias_size_in_bytes"), ("temp", "temp_size_in_bytes"),
             ("host argument", "host_argument_size_in_bytes"), ("host temp", "host_temp_size_in_bytes"))
    return "compiled step memory per device: " + ", ".join(f"{label} {_human(memory[key], 'B')}"
                                                           for label, key in names)


class Training:
    def __init__(self, cfg, setup, summary, process_index, process_count):
        self.cfg, self.setup, self.summary = cfg, setup, summary
        self.process_count = process_count
        self.data = data_lib.build(cfg, process_index, process_count)
        _say(f"data: {self.data.description}")
        self.devices = len(jax.devices())
        self.peak = peak_flops_per_device(cfg)
        self.signals = []
        self.history, self.spikes, self.skipped, self.loss_average = [], 0, 0, None

    # -- state -------------------------------------------------------------------------------
    def initial_state(self, checkpointer):
        """(state, first step): the newest checkpoint if resuming, else fresh (optionally with loaded params)."""
        if self.cfg.checkpoint.enabled and self.cfg.checkpoint.resume:
            restored = checkpointer.restore_latest()
            if restored is not None:
                state, meta = restored
                _say(f"resumed from {checkpointer.directory}/{meta['step']} (step {meta['step']})")
                return state, int(meta["step"])
        state = self.setup.init_state()
        if self.cfg.checkpoint.load_params_from:
            weights, step = load_params(self.cfg.checkpoint.load_params_from, self.setup)
            state = {**state, **weights}
            _say(f"parameters loaded from {self.cfg.checkpoint.load_params_from} (step {step})")
        return state, 0

    def save(self, checkpointer, step, state):
        if not self.cfg.checkpoint.enabled or checkpointer.has(step):
            return
        checkpointer.save(step, state, {"step": step, "seed": self.cfg.run.seed, "data_position": step,
                                        "data": self.data.description})

    # -- signals -----------------------------------------------------------------------------
    def _on_signal(self, signum, _frame):
        self.signals.append(signum)

    def stop_requested(self):
        """Whether any process got SIGTERM/SIGUSR1 (all processes must agree to save together)."""
        local = bool(self.signals)
        if self.process_count == 1:
            return local
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(local))))

    def nothing_to_train(self, start):
        """A rerun whose checkpoint is at train.steps or past it: one line, and nothing written, saved or
        garbage-collected (a ConfigError when past it: the request cannot be met)."""
        steps, out = self.cfg.train.steps, self.cfg.run.output_dir
        if start > steps:
            raise ConfigError(f"run.output_dir={out} is at step {start}, past train.steps={steps}: nothing to train, "
                              f"nothing changed; raise train.steps to go on, or start a new run.output_dir "
                              f"(checkpoint.load_params_from={out} starts it from these weights)")
        _say(f"nothing to train: the checkpoint is already at step {start} of train.steps={steps}; nothing changed")

    # -- the loop ----------------------------------------------------------------------------
    def run(self):
        cfg, setup = self.cfg, self.setup
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGUSR1)}
        checkpointer = Checkpointer(cfg, setup)

        def release():  # Orbax's threads and the signal handlers, before any one-line error or early exit
            checkpointer.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

        try:
            state, start = self.initial_state(checkpointer)
            finished = start >= cfg.train.steps
            if finished:
                self.nothing_to_train(start)
        except BaseException:  # e.g. a corrupted checkpoint
            release()
            raise
        if finished:
            release()
            return 0
        if _LEAD[0]:  # the lock is held and the starting point known: the config this run trains with
            rundir.write_config(cfg.run.output_dir, cfg.to_dict(), _say)
        _say("compiling the training step ...")
        started = time.perf_counter()
        train_step, self.eval_step = setup.compile_train_step(), setup.compile_eval_step()
        self.summary["compile_time_s"] = time.perf_counter() - started
        self.summary["compiled_memory"] = compiled_memory(train_step)
        _say(describe_compiled_memory(self.summary["compiled_memory"]))
        self.window = Window(cfg.profile.mode, cfg.profile.start_step, cfg.profile.num_steps,
                             os.path.join(cfg.run.output_dir, "profile"), _say)
        _say(f"compiled in {self.summary['compile_time_s']:.1f} s; training steps {start + 1}-{cfg.train.steps} of "
             f"{self.summary['global_batch']} x {cfg.train.seq_len} tokens")
        self.eval_batches = [setup.put_batch(b) for b in self.data.eval_batches(cfg.train.eval_batches)]
        self.logger = MetricsLogger(cfg.run.output_dir, cfg.train.steps, cfg.run.log_every, enabled=_LEAD[0],
                                    resume_from=start)
        pending, self.last_done = None, time.perf_counter()
        try:
            for step in range(start, cfg.train.steps):
                if self.window.starts_at(step + 1):
                    pending = self.report(pending)  # the device is idle: the trace starts with this step
                    self.window.start()
                with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
                    state, metrics = train_step(state, setup.put_batch(self.data.train_batch(step)))
                pending = self.report(pending)  # the previous step, while the device works on this one
                pending, done = (step + 1, metrics), step + 1
                if self.window.ends_at(done):
                    pending = self.report(pending)  # waits for the last profiled step: the trace holds it all
                    self.end_profile()
                due_eval = cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < cfg.train.steps
                due_save = cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0
                stop = self.stop_requested()
                if due_eval or due_save or stop:
                    pending = self.report(pending)
                    if due_eval:
                        self.evaluate(state, done)
                    if due_save or stop:
                        self.save(checkpointer, done, state)
                    if stop:
                        checkpointer.wait()
                        saved = f"saved step {done}" if cfg.checkpoint.enabled else \
                            "nothing saved (checkpoint.enabled=false)"
                        _say(f"preempted by signal {self.signals[0] if self.signals else '(on another process)'}: "
                             f"{saved}; exiting with {PREEMPTED} so the launcher requeues the job")
                        raise Preempted()
            pending = self.report(pending)
            self.save(checkpointer, cfg.train.steps, state)
            eval_loss = self.evaluate(state, cfg.train.steps)
        except NonFiniteError as e:
            # the bad update was never applied and halted the state: the state in hand is the last good one
            good, state = setup.last_good(state)
            if good > start:
                self.save(checkpointer, good, state)
                checkpointer.wait()
                raise NonFiniteError(f"{e}; stopped after saving the last good state, step {good} (set "
                                     "train.on_nonfinite=skip to go on)") from None
            raise NonFiniteError(f"{e}; stopped with nothing to save: no step after {start} was good (set "
                                 "train.on_nonfinite=skip to go on)") from None
        finally:
            self.window.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
            checkpointer.close()
            self.logger.close()
        return self.finish(eval_loss, start)

    def report(self, pending):
        """Logs a finished step (waiting for it); returns None (nothing pending)."""
        if pending is None:
            return None
        step, metrics = pending
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
        seconds = time.perf_counter() - self.last_done
        self.last_done = time.perf_counter()
        flops_per_s = self.summary["model_flops_per_step"] / self.devices / seconds
        tokens = self.summary["global_batch"] * self.cfg.train.seq_len / self.devices
        values.update(step_time_s=seconds, tokens_per_sec_per_device=tokens / seconds,
                      tflops_per_sec_per_device=flops_per_s / 1e12,
                      mfu=flops_per_s / self.peak if self.peak else None, **device_memory_metrics())
        self.logger.log_step(step, values)
        self.history.append(values)
        self.check_health(step, values)
        return None

    def end_profile(self):
        """Stops the profiler after the window; with xprof, prints the overlap verdict (profile/overlap.json)."""
        trace_dir = self.window.stop()
        if trace_dir and self.cfg.profile.overlap_report and _LEAD[0]:
            from MaxOffload.profile import overlap

            try:
                result = overlap.report(trace_dir)
                result["verdict"] = overlap.verdict(result)
                write_json(os.path.join(trace_dir, "overlap.json"), result)
                self.summary["overlap"] = {"verdict": result["verdict"], "per_step": result["mean"]}
                _say(result["verdict"])
            except Exception as e:  # an unreadable trace must not end the training run
                _say(f"overlap report failed ({type(e).__name__}: {e}); the trace is in {trace_dir}")
        self.last_done = time.perf_counter()  # the analysis is not step time

    def check_health(self, step, values):
        if values["nonfinite"]:
            self.skipped += 1
            if self.cfg.train.on_nonfinite == "stop":
                raise NonFiniteError(f"step {step}: non-finite loss or gradients")
            _say(f"step {step}: non-finite loss or gradients; update skipped ({self.skipped} so far)")
            return
        factor, loss = self.cfg.train.loss_spike_factor, values["loss"]
        if factor and self.loss_average is not None and len(self.history) > 10 and loss > factor * self.loss_average:
            self.spikes += 1
            _say(f"warning: loss spike at step {step}: {loss:.4f} vs a recent average of {self.loss_average:.4f}")
        self.loss_average = loss if self.loss_average is None else 0.9 * self.loss_average + 0.1 * loss

    def evaluate(self, state, step):
        total = count = 0.0
        for batch in self.eval_batches:
            batch_total, batch_count = self.eval_step(state["params"], state["model_state"], batch)
            total, count = total + float(batch_total), count + float(batch_count)
        loss = total / max(count, 1.0)
        self.logger.log_eval(step, {"loss": loss})
        self.last_done = time.perf_counter()  # evaluation time is not step time
        return loss

    def finish(self, eval_loss, start):
        cfg, summary, history = self.cfg, self.summary, self.history
        steady = history[1:] or history
        mean = lambda key: sum(h[key] for h in steady) / len(steady)  # noqa: E731
        summary.update(steps=cfg.train.steps, resumed_from_step=start, first_loss=history[0]["loss"],
                       final_loss=history[-1]["loss"], final_eval_loss=eval_loss,
                       train_time_s=time.perf_counter() - self.logger.started, mean_step_time_s=mean("step_time_s"),
                       tokens_per_sec_per_device=mean("tokens_per_sec_per_device"),
                       tflops_per_sec_per_device=mean("tflops_per_sec_per_device"),
                       mfu=mean("mfu") if self.peak else None, skipped_steps=self.skipped, loss_spikes=self.spikes,
                       device_peak_bytes=device_peak_bytes())
        if _LEAD[0]:
            write_json(os.path.join(cfg.run.output_dir, "summary.json"), summary)
        mfu = f"{summary['mfu'] * 100:.1f}%" if self.peak else \
            "n/a (unknown device peak; set hardware.peak_tflops_per_device)"
        _say(f"done: {len(history)} steps in {summary['train_time_s']:.1f} s (+ {summary['compile_time_s']:.1f} s "
             f"compile) | loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} | eval loss {eval_loss:.3f} "
             f"| {summary['mean_step_time_s']:.3f} s/step | {summary['tokens_per_sec_per_device']:,.0f} tok/s/dev | "
             f"{summary['tflops_per_sec_per_device']:.3f} TFLOP/s/dev | MFU {mfu}")
        _say(f"outputs in {cfg.run.output_dir}: config.json metrics.jsonl summary.json tensorboard/ checkpoints/")
        return 0
