"""The imperative shell around the jitted step: data in; metrics, evaluation, checkpoints and a
summary out; resume, preemption and non-finite steps handled.

Exit codes (train.py): 0 done, 1 stopped on a non-finite step or a parity failure, 2 bad input,
PREEMPTED (42) saved after SIGTERM/SIGUSR1 — the Slurm launcher requeues the job.
"""
import collections
import contextlib
import os
import signal
import time

import numpy as np

import jax

from MaxOffload import data as data_lib
from MaxOffload import from_config, hardware, memory
from MaxOffload.models import kernels
from MaxOffload.models.exchange import EXCHANGES
from MaxOffload.models.model_context import ModelContext
from MaxOffload.config.loader import describe
from MaxOffload.errors import ConfigError
from MaxOffload.train.flops import by_component, train_flops_per_step
from MaxOffload.train.checkpoint import Checkpointer, load_params
from MaxOffload.errors import NonFiniteError, ParityError
from MaxOffload.offload import xla_bugs
from MaxOffload.train.metrics import MetricsLogger
from MaxOffload.parallel import distributed, host_sync, stragglers, watchdog
from MaxOffload.reports import write_json
from MaxOffload.train import goodput, rundir
from MaxOffload.parallel.mesh import describe as mesh_describe
from MaxOffload.profile.window import Window
from MaxOffload.train.loop import Loop
from MaxOffload.train.step import HOST


PREEMPTED = 42


def speaker(lead):
    """say(text): prints (flushed) on the process that reports, process 0 of a multi-process job; else nothing."""
    return (lambda text: print(text, flush=True)) if lead else (lambda text: None)


def _human(n, unit="", suffixes=("", "K", "M", "G", "T", "P"), digits=3):
    for suffix in suffixes:
        if abs(n) < 1000 or suffix == suffixes[-1]:
            return f"{n:.{digits}g}{suffix}{unit}" if suffix else f"{n:.0f}{unit}"
        n /= 1000


def _count(n):
    """405.9B, 3.213M: a parameter count the way model cards write it."""
    return _human(n, suffixes=("", "K", "M", "B", "T"), digits=4)


def peak_flops_per_device(cfg, setup):
    """The peak FLOP/s MFU counts against: hardware.peak_tflops_per_device when set, else the device's BF16 peak,
    or with quant.mode the FP8 peak for the model FLOPs of the parts it runs in FP8 (hardware.mixed_peak);
    None for a device of unknown peak."""
    if cfg.hardware.peak_tflops_per_device is not None:
        return cfg.hardware.peak_tflops_per_device * 1e12
    accelerator = hardware.lookup(setup.mesh.devices.flat[0].device_kind)
    if accelerator is None:
        return None
    work = by_component(setup.model_config, 1, cfg.train.seq_len)
    return accelerator.peak_for(sum(work.values()),
                                sum(f for part, f in work.items() if setup.numerics.quantized(part)))


def lock_output_dir(cfg, process_count, lead):
    """The run directory's lock (train/rundir.py), taken by process 0; every process fails alike without it."""
    lock, error = None, None
    if lead:
        try:
            lock = rundir.Lock(cfg.run.output_dir)
        except ConfigError as e:
            error = e
    if process_count > 1:  # process 0's verdict, through the coordinator (parallel/host_sync.py)
        if not host_sync.shared().from_lead(lock is not None) and error is None:
            error = ConfigError(f"run.output_dir={cfg.run.output_dir} is in use by a running job (process 0 could "
                                "not lock it); wait for it to end, or give this run its own run.output_dir")
    if error is not None:
        raise error
    return lock


def verify_parity(setup, batch, say):
    from MaxOffload.offload import parity

    say("offload.verify_parity: comparing this policy with full remat on one batch ...")
    ref_loss, tolerance, rows = parity.compare(setup, batch)
    say(parity.format_rows(ref_loss, tolerance, rows))
    if not all(row[4] for row in rows):
        raise ParityError("the configured remat/offload policy changes the loss or gradients beyond tolerance; "
                          "not training. Try another XLA version or policy, and report it.")


def platform_of(setup):
    """'gpu', 'cpu', ...: the platform the run's devices belong to (models/kernels.platform: 'cuda' and 'rocm'
    devices say 'gpu', as the kernel choices do)."""
    return kernels.platform(setup.mesh.devices.flat[0])


class Preempted(Exception):
    """SIGTERM/SIGUSR1: the state was saved; exit with PREEMPTED so the launcher requeues."""


def run(cfg, plan, devices=None):
    """plan: the OffloadPlan (MaxOffload/from_config.py); devices: the run's devices (default: this process's); a
    dry run may pass compile-only GPUs."""
    started = goodput.Segment.start(os.environ)  # this segment's wall time (train/goodput.py) counts from here
    process_index, process_count = distributed.initialize(cfg)
    dog = watchdog.start(process_index, process_count, cfg.distributed.heartbeat_timeout_s)
    try:
        return _run(cfg, plan, devices, process_index, process_count, dog, started)
    finally:
        dog.close()


def _run(cfg, plan, devices, process_index, process_count, dog, started):
    lead = process_index == 0
    say = speaker(lead)
    say("MaxOffload config:\n" + describe(cfg))
    if process_count > 1:
        say(f"multi-process: {process_count} processes, {jax.local_device_count()} device(s) each")
    if started.restart:
        say(started.describe())
    if lead:
        rundir.make(cfg.run.output_dir)
    setup = from_config.train_setup(cfg, devices or jax.devices(), plan)
    summary = describe_setup(cfg, setup, say)
    if cfg.run.dry_run:  # its own file only: a training run's outputs in the same directory stay as they are
        path = os.path.join(cfg.run.output_dir, rundir.DRY_RUN)
        if lead:
            rundir.write_dry_run(cfg.run.output_dir, cfg.to_dict(), summary)
        say(f"dry run: nothing allocated or run; wrote {path}")
        return 0
    lock = lock_output_dir(cfg, process_count, lead)
    try:
        miscompile = xla_bugs.affects(plan, platform_of(setup))
        if miscompile:
            say(f"{miscompile}: turning the parity gate (offload.verify_parity) on")
        if plan.verify_parity or miscompile:
            from MaxOffload.offload.parity import first_batch

            verify_parity(setup, first_batch(cfg), say)
        return Training(cfg, setup, summary, process_index, process_count, say, dog, started).run()
    except Preempted:
        return PREEMPTED
    finally:
        if lock is not None:
            lock.release()


def describe_setup(cfg, setup, say):
    devices = list(setup.mesh.devices.flat)
    global_batch = setup.batch_rows * setup.micro_batches
    summary = {"params_total": setup.params_total(), "params_active": setup.model_config.active_params(),
               "state_bytes_per_device": setup.state_bytes_per_device(),
               "state_host_bytes_per_device": setup.state_bytes_per_device(HOST),
               "devices": len(devices), "device_kind": devices[0].device_kind, "global_batch": global_batch,
               "model_flops_per_step": train_flops_per_step(setup.model_config, global_batch, cfg.train.seq_len)}
    copies = setup.model_config.params_stored_twice()
    if copies:  # what the released checkpoint counts, e.g. DeepSeek-V3's 685B
        summary["params_as_released"] = summary["params_total"] + copies
    released = f" ({_count(summary['params_as_released'])} as released)" if copies else ""
    # a sparse model's share (MoE: routed experts); a dense one's differs only by its norms, not worth a word
    active = "" if summary["params_active"] >= 0.99 * summary["params_total"] else \
        f", {_count(summary['params_active'])} active per token"
    say(f"model {cfg.model.family}: {_count(summary['params_total'])} parameters{released}{active}; params + optimizer state "
         f"{_human(summary['state_bytes_per_device'], 'B')} per device "
         f"({_human(summary['state_host_bytes_per_device'], 'B')} of it in pinned host memory) on "
         f"{len(devices)} x {devices[0].device_kind} (mesh {mesh_describe(setup.mesh)}); "
         f"{_human(summary['model_flops_per_step'], 'FLOP')} per step")
    exchange = getattr(setup.model_config, "num_experts", 0) and EXCHANGES[setup.layout.exchange](
        ModelContext(setup.layout, setup.numerics), setup.model_config.num_experts, capacity=0)
    if hasattr(exchange, "describe"):  # the token all-to-all says which transport this platform runs
        say(exchange.describe())
    if setup.pipeline is not None:
        summary["pipeline_bubble"] = setup.pipeline.bubble
        say(f"{setup.pipeline.describe()} (the {setup.model_config.pipelined_group()} layers; the rest before and "
            "after them on every device)")
    return summary


def compiled_memory(compiled):
    """XLA's memory analysis of a compiled step, per device: arguments, temporaries, host buffers."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_temp_size_in_bytes")
    return {f: int(getattr(m, f, 0) or 0) for f in fields}


def device_peak_bytes(compiled):
    """{"device_peak_bytes", "device_allocator_peak_bytes", "device_memory_stats"}: the step's peak device memory
    and what the runtime reported (GPU, TPU; the CPU backend reports nothing: the peak is None). The peak is the larger of the
    allocator's peak and the memory in use between steps + the compiled step's temporaries: the TPU runtime
    allocates a program's temporaries outside the allocator that reports (its peak stayed the state's size whatever
    the policy), the GPU allocator counts them."""
    stats = {k: int(v) for k, v in (jax.local_devices()[0].memory_stats() or {}).items()
             if isinstance(v, (int, float))}
    if "peak_bytes_in_use" not in stats:
        return {"device_peak_bytes": None}
    temp = (compiled or {}).get("temp_size_in_bytes", 0)
    return {"device_peak_bytes": max(stats["peak_bytes_in_use"], stats.get("bytes_in_use", 0) + temp),
            "device_allocator_peak_bytes": stats["peak_bytes_in_use"], "device_memory_stats": stats}


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
    """One training run on a TrainSetup: the state in, the step loop with its hooks, the summary out."""

    def __init__(self, cfg, setup, summary, process_index, process_count, say, dog, started):
        """dog: this process's parallel/watchdog.Watchdog (told each section the run enters and each step done);
        started: this segment of the run (train/goodput.Segment: when it began, the restart it is), for its goodput."""
        self.cfg, self.setup, self.summary, self.say, self.dog = cfg, setup, summary, say, dog
        self.started, self.spent = started, collections.Counter()  # seconds per train/goodput.BUCKETS
        self.lead, self.process_count = process_index == 0, process_count
        # between steps the processes agree through the coordinator, never a device program (parallel/host_sync.py)
        self.sync = host_sync.shared()  # None for a lone process
        self.data = data_lib.build(cfg, process_index, process_count)
        say(f"data: {self.data.description}")
        self.signals = []

    # -- state -------------------------------------------------------------------------------
    def initial_state(self, checkpointer):
        """(state, first step): the newest checkpoint if resuming, else fresh (optionally with loaded params). Reading
        a checkpoint is goodput's checkpoint time; a fresh state's initialisation is start-up (its `other`)."""
        if self.cfg.checkpoint.enabled and self.cfg.checkpoint.resume:
            with self.timed("checkpoint_s"):
                restored = checkpointer.restore_latest()
            if restored is not None:
                state, meta = restored
                self.say(f"resumed from {checkpointer.directory}/{meta['step']} (step {meta['step']})")
                return state, int(meta["step"])
        state = self.setup.init_state()
        if self.cfg.checkpoint.load_params_from:
            with self.timed("checkpoint_s"):
                weights, step = load_params(self.cfg.checkpoint.load_params_from, self.setup)
            state = {**state, **weights}
            self.say(f"parameters loaded from {self.cfg.checkpoint.load_params_from} (step {step})")
        return state, 0

    def nothing_to_train(self, start):
        """A rerun whose checkpoint is at train.steps or past it: one line, and nothing written, saved or
        garbage-collected (a ConfigError when past it: the request cannot be met)."""
        steps, out = self.cfg.train.steps, self.cfg.run.output_dir
        if start > steps:
            raise ConfigError(f"run.output_dir={out} is at step {start}, past train.steps={steps}: nothing to train, "
                              f"nothing changed; raise train.steps to go on, or start a new run.output_dir "
                              f"(checkpoint.load_params_from={out} starts it from these weights)")
        self.say(f"nothing to train: the checkpoint is already at step {start} of train.steps={steps}; nothing changed")

    def one_run_per_directory(self):
        """A run that will start from step 0 where another run's checkpoints or finished summary are: refused in
        one line, or (run.overwrite=true) that run moved aside first (train/rundir.py)."""
        cfg, out = self.cfg, self.cfg.run.output_dir
        checkpoints = cfg.checkpoint
        if checkpoints.enabled and checkpoints.resume and rundir.checkpoint_steps(out):
            return  # resumes its own run
        held = rundir.another_run(out)
        if not held:
            return
        if not cfg.run.overwrite:
            why = ("checkpoint.resume=false" if checkpoints.enabled and not checkpoints.resume else
                   "checkpoint.enabled=false" if not checkpoints.enabled else "this run, starting from step 0,")
            raise ConfigError(f"run.output_dir={out} holds another run ({held}) and {why} would write over it; "
                              "nothing changed: give this run its own run.output_dir, or set run.overwrite=true to "
                              f"move that run into {os.path.join(out, rundir.REPLACED)}/ first")
        if self.lead:
            self.say(f"run.overwrite=true: moved the earlier run ({held}) into {rundir.move_aside(out)}")
        if self.sync is not None:
            self.sync.wait("run directory moved aside")

    @contextlib.contextmanager
    def catching_signals(self):
        """SIGTERM/SIGUSR1 are noted (the preemption hook saves and exits) and the old handlers restored after."""
        previous = {s: signal.signal(s, lambda signum, _: self.signals.append(signum))
                    for s in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def stop_requested(self):
        """Whether any process got SIGTERM/SIGUSR1 (all processes must agree to save together)."""
        local = bool(self.signals)
        return local if self.sync is None else self.sync.any(local)

    # -- the run -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def timed(self, bucket):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.spent[bucket] += time.perf_counter() - began

    def run(self):
        """The run; however it ends (done, preempted, stopped on an error), its segment's time is recorded."""
        self.lost, self.start, self.ended = (0, 0.0), None, "stopped"
        try:
            code = self._train()
            self.ended = "done"
            return code
        except Preempted:
            self.ended = "preempted"
            raise
        finally:
            if self.start is not None and not self.accounted:
                self.account()

    goodput_totals, accounted = None, False

    def account(self, end_step=None):
        """Appends this segment to OUTPUT/goodput.jsonl (process 0); returns the run's totals (None elsewhere)."""
        self.accounted = True
        history = getattr(getattr(self, "hooks", None), "clock", None)
        steps = sum(h["step_time_s"] for h in history.history) if history else 0.0
        row = {"wall_s": self.started.elapsed(), "compile_s": self.summary.get("compile_time_s", 0.0),
               "checkpoint_s": self.spent["checkpoint_s"], "evaluation_s": self.spent["evaluation_s"],
               "steps_s": steps, "lost_s": self.lost[1], "lost_steps": self.lost[0], "start_step": self.start,
               "end_step": end_step, "ended": self.ended, **(self.started.restart or {})}
        if self.lead:
            try:
                self.goodput_totals = goodput.record(self.cfg.run.output_dir, row, fresh=self.start == 0)
            except OSError as e:  # a full disk: never the run's error (a failed run reports its own)
                if self.ended == "done":
                    self.say(f"warning: goodput not recorded ({e.strerror or e}): "
                             f"{os.path.join(self.cfg.run.output_dir, goodput.FILE)}")
        return self.goodput_totals

    def _train(self):
        cfg, setup = self.cfg, self.setup
        with contextlib.ExitStack() as stack:  # every exit releases Orbax's threads, signals, logs and profiler
            stack.enter_context(self.catching_signals())
            self.one_run_per_directory()
            checkpointer = Checkpointer(cfg, setup)
            stack.callback(checkpointer.close)
            state, start = self.initial_state(checkpointer)
            # what an earlier segment trained past this checkpoint: trained again (before the logger drops it)
            self.lost = goodput.lost_steps(cfg.run.output_dir, start) if start and self.lead else (0, 0.0)
            self.start = start
            if start >= cfg.train.steps:
                self.start = None  # nothing trained, nothing written (not even its goodput line)
                self.nothing_to_train(start)
                return 0
            if self.lead:  # the lock is held and the starting point known: the config this run trains with
                rundir.write_config(cfg.run.output_dir, cfg.to_dict(), self.say)
            train_step, evaluate = self.compile(start)
            logger, window = self.outputs(stack, start)
            loop = Loop(train_step, self.step_batch)
            self.hooks = Hooks(self, loop, checkpointer, evaluate, logger, window)
            if window.starts_at(start + 1):
                window.start()
            try:
                state = loop.run(state, start, cfg.train.steps)
            except NonFiniteError as e:
                raise self.hooks.halted(e, loop.state, start) from None
            self.hooks.save(cfg.train.steps, state)
            eval_loss = evaluate(state, cfg.train.steps)
            with self.timed("checkpoint_s"):
                checkpointer.wait()  # the last save
        return self.finish(eval_loss, start, logger.started)

    def outputs(self, stack, start):
        """(the metrics logger, the profiler window), closed with the ExitStack `stack`."""
        cfg = self.cfg
        logger = MetricsLogger(cfg.run.output_dir, cfg.train.steps, cfg.run.log_every, enabled=self.lead,
                               resume_from=start)
        stack.callback(logger.close)
        window = Window(cfg.profile.mode, cfg.profile.start_step, cfg.profile.num_steps,
                        os.path.join(cfg.run.output_dir, "profile"), self.say)
        stack.callback(window.stop)
        return logger, window

    def step_batch(self, index):
        """Step index+1's batch on the devices: its micro-batches, a pure function of (seed, step) as one batch
        is."""
        return self.setup.put_step_batch(data_lib.micro_batches(self.data, index, self.setup.micro_batches))

    def compile(self, start):
        """(the compiled train step, evaluate(state, step) -> mean eval loss, logged)."""
        cfg, setup = self.cfg, self.setup
        self.say("compiling the training step ...")
        started = time.perf_counter()
        with self.dog.during("compiling the training step", cfg.distributed.compile_timeout_s):
            train_step = memory.compile_or_config_error(setup.compile_train_step)
            eval_step = memory.compile_or_config_error(setup.compile_eval_step, "the evaluation step")
        self.summary["compile_time_s"] = time.perf_counter() - started
        if self.sync is not None:  # the first step's collectives start together (parallel/host_sync.py: wait)
            with self.dog.during("waiting for the other processes to compile", cfg.distributed.compile_timeout_s):
                self.sync.wait("compiled")
        self.summary["compiled_memory"] = compiled_memory(train_step)
        self.say(describe_compiled_memory(self.summary["compiled_memory"]))
        self.say(f"compiled in {self.summary['compile_time_s']:.1f} s; training steps {start + 1}-{cfg.train.steps} "
                 f"of {self.summary['global_batch']} x {cfg.train.seq_len} tokens")
        batches = [setup.put_batch(b) for b in self.data.eval_batches(cfg.train.eval_batches)]

        def evaluate(state, step):
            total = count = 0.0
            with self.dog.during(f"the evaluation after step {step}", cfg.distributed.compile_timeout_s), \
                    self.timed("evaluation_s"):
                for batch in batches:
                    batch_total, batch_count = eval_step(state["params"], state["model_state"], batch)
                    total, count = total + float(batch_total), count + float(batch_count)
            loss = total / max(count, 1.0)
            self.hooks.logger.log_eval(step, {"loss": loss})
            self.hooks.clock.restart()  # evaluation time is not step time
            return loss

        return train_step, evaluate

    def finish(self, eval_loss, start, started):
        cfg, summary, history = self.cfg, self.summary, self.hooks.clock.history
        steady = history[1:] or history
        mean = lambda key: sum(h[key] for h in steady) / len(steady)  # noqa: E731
        peak = self.hooks.clock.peak
        summary.update(steps=cfg.train.steps, resumed_from_step=start, first_loss=history[0]["loss"],
                       final_loss=history[-1]["loss"], final_eval_loss=eval_loss,
                       train_time_s=time.perf_counter() - started, mean_step_time_s=mean("step_time_s"),
                       tokens_per_sec_per_device=mean("tokens_per_sec_per_device"),
                       tflops_per_sec_per_device=mean("tflops_per_sec_per_device"),
                       mfu=mean("mfu") if peak else None, skipped_steps=self.hooks.health.skipped,
                       loss_spikes=self.hooks.health.spikes,
                       **device_peak_bytes(summary.get("compiled_memory")))
        self.ended = "done"
        totals = self.account(cfg.train.steps)
        if totals:
            summary["goodput"] = totals
        if self.lead:
            write_json(os.path.join(cfg.run.output_dir, "summary.json"), summary)
        mfu = f"{summary['mfu'] * 100:.1f}%" if peak else \
            "n/a (unknown device peak; set hardware.peak_tflops_per_device)"
        self.say(f"done: {len(history)} steps in {summary['train_time_s']:.1f} s (+ {summary['compile_time_s']:.1f} s "
                 f"compile) | loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} | eval loss "
                 f"{eval_loss:.3f} | {summary['mean_step_time_s']:.3f} s/step | "
                 f"{summary['tokens_per_sec_per_device']:,.0f} tok/s/dev | "
                 f"{summary['tflops_per_sec_per_device']:.3f} TFLOP/s/dev | MFU {mfu}")
        if totals:
            self.say(goodput.describe(totals))
        self.say(f"outputs in {cfg.run.output_dir}: config.json metrics.jsonl summary.json goodput.jsonl tensorboard/ "
                 "checkpoints/")
        return 0


class StepClock:
    """Metrics hook: each step's time, throughput and MFU beside its metrics, logged and kept in `history`."""

    def __init__(self, summary, seq_len, peak, logger):
        self.summary, self.seq_len, self.peak, self.logger = summary, seq_len, peak, logger
        self.devices, self.history = summary["devices"], []
        self.restart()

    def restart(self):
        """The next step's time counts from now (what came between was not a step: evaluation, a trace's analysis)."""
        self.last_done = time.perf_counter()

    def __call__(self, step, values):
        seconds = time.perf_counter() - self.last_done
        self.restart()
        flops_per_s = self.summary["model_flops_per_step"] / self.devices / seconds
        tokens = self.summary["global_batch"] * self.seq_len / self.devices
        values.update(step_time_s=seconds, tokens_per_sec_per_device=tokens / seconds,
                      tflops_per_sec_per_device=flops_per_s / 1e12,
                      mfu=flops_per_s / self.peak if self.peak else None, **device_memory_metrics())
        self.logger.log_step(step, values)
        self.history.append(values)


class Health:
    """Metrics hook: a non-finite step is skipped (counted) or stops the run (NonFiniteError); a loss far above its
    recent average is a warned spike."""

    def __init__(self, on_nonfinite, spike_factor, say):
        self.on_nonfinite, self.spike_factor, self.say = on_nonfinite, spike_factor, say
        self.skipped, self.spikes, self.seen, self.average = 0, 0, 0, None

    def __call__(self, step, values):
        self.seen += 1
        if values["nonfinite"]:
            self.skipped += 1
            if self.on_nonfinite == "stop":
                raise NonFiniteError(f"step {step}: non-finite loss or gradients")
            self.say(f"step {step}: non-finite loss or gradients; update skipped ({self.skipped} so far)")
            return
        loss = values["loss"]
        if self.spike_factor and self.average is not None and self.seen > 10 and loss > self.spike_factor * self.average:
            self.spikes += 1
            self.say(f"warning: loss spike at step {step}: {loss:.4f} vs a recent average of {self.average:.4f}")
        self.average = loss if self.average is None else 0.9 * self.average + 0.1 * loss


# The watchdog's bound on each of the first steps, before 3 are measured (or the compile's time if longer): a
# collective that never completes in step 1 ends the job with one line within it, not after gloo's 30 minutes.
FIRST_STEPS_TIMEOUT_S = 600


class Hooks:
    """The hooks a training run registers on its Loop, each with its period."""

    def __init__(self, training, loop, checkpointer, evaluate, logger, window):
        cfg, say = training.cfg, training.say
        self.training, self.loop, self.checkpointer, self.logger, self.window = training, loop, checkpointer, logger, window
        self.evaluate, self.say, self.cfg = evaluate, say, cfg
        self.clock = StepClock(training.summary, cfg.train.seq_len, peak_flops_per_device(cfg, training.setup),
                               logger)
        self.health = Health(cfg.train.on_nonfinite, cfg.train.loss_spike_factor, say)
        loop.add_metrics_hook(self.clock)
        loop.add_metrics_hook(self.health)
        loop.add_metrics_hook(self.progress)
        loop.add_hook(self.end_profile)
        loop.add_hook(self.evaluation, every=cfg.train.eval_every)
        loop.add_hook(lambda info: self.flushed_save(info.step, info.state), every=cfg.checkpoint.every_steps)
        loop.add_hook(lambda info: checkpointer.seal_finished())  # a finished save's manifest, before the next save
        loop.add_hook(self.preemption)
        if training.process_count > 1:
            self.own_times, self.probe = [], None  # (step, own_time_s) since the last window; the device probe
            loop.add_metrics_hook(lambda step, values: self.own_times.append((step, values["own_time_s"])))
            loop.add_hook(self.stragglers, every=cfg.distributed.straggler_window_steps)
        loop.add_hook(self.start_profile)
        training.dog.enter(f"step {training.start + 1}", self.step_timeout())  # a hang in the first steps ends too

    def step_timeout(self):
        """distributed.step_timeout_s, or 20 x the median step so far (at least 120 s) once 3 are measured; before
        that FIRST_STEPS_TIMEOUT_S, or the compile's time if longer (a step runs what was compiled)."""
        if self.cfg.distributed.step_timeout_s:
            return self.cfg.distributed.step_timeout_s
        times = [h["step_time_s"] for h in self.clock.history]
        if len(times) >= 3:
            return max(120.0, 20 * sorted(times)[len(times) // 2])
        return max(FIRST_STEPS_TIMEOUT_S, self.training.summary["compile_time_s"])

    def progress(self, step, values):
        """Tells the watchdog a step is done and the next one's timeout."""
        self.training.dog.completed(step)
        self.training.dog.enter(f"step {step + 1}", self.step_timeout())

    def stragglers(self, info):
        """Every straggler window: the processes' own step times and device probes compared (parallel/stragglers.py);
        process 0 logs them and names a slow process."""
        self.loop.flush()  # the devices idle for the probe (its own step time is in the window)
        window, self.own_times = self.own_times, []
        if not window:
            return
        if self.probe is None:
            self.probe = stragglers.Probe(self.training.setup.mesh.local_devices)
        mine = np.array([*stragglers.summarize([t for _, t in window]), self.probe.time()], np.float32)
        rows = self.training.sync.to_lead(mine)  # process 0: [processes, (own p50, own p99, probe)]; others None
        self.clock.restart()  # the probe is not step time
        if rows is None:
            return
        table = np.asarray(rows)
        steps = [h["step_time_s"] for h in self.clock.history[-len(window):]]
        found, scalars = stragglers.row(table[:, 0], table[:, 1], table[:, 2], window[0][0], window[-1][0],
                                        self.cfg.distributed.straggler_factor, float(np.median(steps)))
        self.logger.log_row(info.step, found, scalars, "stragglers/")
        line = stragglers.describe(found, self.cfg.distributed.straggler_factor)
        if line:
            self.say(line)

    def save(self, step, state):
        if self.cfg.checkpoint.enabled and not self.checkpointer.has(step):
            with self.training.dog.during(f"the checkpoint save of step {step}",
                                          self.cfg.distributed.checkpoint_timeout_s), \
                    self.training.timed("checkpoint_s"):
                self.checkpointer.save(step, state, {"step": step, "seed": self.cfg.run.seed, "data_position": step,
                                                     "data": self.training.data.description})
            self.clock.restart()  # the device waited for the save (its metrics were flushed): not step time

    def flushed_save(self, step, state):
        self.loop.flush()
        self.save(step, state)

    def evaluation(self, info):
        if not info.last:  # the last step's evaluation is the run's final one
            self.loop.flush()
            self.evaluate(info.state, info.step)

    def preemption(self, info):
        if not self.training.stop_requested():
            return
        self.flushed_save(info.step, info.state)
        self.checkpointer.wait()
        saved = f"saved step {info.step}" if self.cfg.checkpoint.enabled else "nothing saved (checkpoint.enabled=false)"
        signals = self.training.signals
        self.say(f"preempted by signal {signals[0] if signals else '(on another process)'}: {saved}; exiting with "
                 f"{PREEMPTED} so the launcher requeues the job")
        raise Preempted()

    def start_profile(self, info):
        if self.window.starts_at(info.step + 1):
            self.loop.flush()  # the device is idle: the trace starts with the next step
            self.window.start()

    def end_profile(self, info):
        """Stops the profiler after the window (waiting for its last step); with xprof, prints the overlap verdict
        (profile/overlap.json)."""
        if not self.window.ends_at(info.step):
            return
        self.loop.flush()
        trace_dir = self.window.stop()
        if trace_dir and self.cfg.profile.overlap_report and self.training.lead:
            from MaxOffload.profile import overlap

            try:
                result = overlap.report(trace_dir)
                result["verdict"] = overlap.verdict(result)
                write_json(os.path.join(trace_dir, "overlap.json"), result)
                self.training.summary["overlap"] = {"verdict": result["verdict"], "per_step": result["mean"]}
                self.say(result["verdict"])
            except Exception as e:  # an unreadable trace must not end the training run
                self.say(f"overlap report failed ({type(e).__name__}: {e}); the trace is in {trace_dir}")
        self.clock.restart()  # the analysis is not step time

    def halted(self, error, state, start):
        """The NonFiniteError to stop with, after saving the last good state: the bad update was never applied
        and halted the state, so the state in hand is the last good one."""
        good, state = self.training.setup.last_good(state)
        if good > start:
            self.save(good, state)
            self.checkpointer.wait()
            return NonFiniteError(f"{error}; stopped after saving the last good state, step {good} (set "
                                  "train.on_nonfinite=skip to go on)")
        return NonFiniteError(f"{error}; stopped with nothing to save: no step after {start} was good (set "
                              "train.on_nonfinite=skip to go on)")
