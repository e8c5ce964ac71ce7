"""The imperative shell around the jitted step: data in, metrics/eval/summary out."""
import json
import os
import time

import jax

from MaxOffload import data as data_lib
from MaxOffload import hardware
from MaxOffload.config.loader import ConfigError, describe
from MaxOffload.train.flops import train_flops_per_step
from MaxOffload.train.metrics import MetricsLogger
from MaxOffload.parallel import distributed
from MaxOffload.parallel.mesh import describe as mesh_describe
from MaxOffload.train.step import HOST, TrainSetup


_LEAD = [True]  # whether this process reports (process 0 of a multi-process job)


def _say(text):
    if _LEAD[0]:
        print(text, flush=True)


def _human(n, unit=""):
    for suffix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or suffix == "P":
            return f"{n:.3g}{suffix}{unit}" if suffix else f"{n:.0f}{unit}"
        n /= 1000


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def peak_flops_per_device(cfg):
    if cfg.hardware.peak_tflops_per_device is not None:
        return cfg.hardware.peak_tflops_per_device * 1e12
    accelerator = hardware.lookup(jax.devices()[0].device_kind)
    return accelerator.bf16_peak_flops if accelerator else None


def prepare_output_dir(cfg):
    try:
        os.makedirs(cfg.run.output_dir, exist_ok=True)
        _write_json(os.path.join(cfg.run.output_dir, "config.json"), cfg.to_dict())
    except OSError as e:
        raise ConfigError(f"run.output_dir={cfg.run.output_dir}: cannot write there ({e.strerror}); "
                          "choose a writable directory") from None


def verify_parity(cfg):
    from MaxOffload.offload import parity

    _say("offload.verify_parity: comparing this policy with full remat on one batch ...")
    ref_loss, tolerance, rows = parity.compare(cfg)
    _say(parity.format_rows(ref_loss, tolerance, rows))
    if not all(row[4] for row in rows):
        raise parity.ParityError("the configured remat/offload policy changes the loss or gradients beyond tolerance; "
                          "not training. Try another XLA version or policy, and report it.")


def run(cfg):
    out = cfg.run.output_dir
    process_index, process_count = distributed.initialize(cfg)
    _LEAD[0] = process_index == 0
    _say("MaxOffload config:\n" + describe(cfg))
    if process_count > 1:
        _say(f"multi-process: {process_count} processes, {jax.local_device_count()} device(s) each")
    if _LEAD[0]:
        prepare_output_dir(cfg)
    devices = jax.devices()
    setup = TrainSetup(cfg, devices)
    global_batch = cfg.train.per_device_batch_size * len(devices)
    flops_per_step = train_flops_per_step(setup.model_config, global_batch, cfg.train.seq_len)
    summary = {"params_total": setup.params_total(), "state_bytes_per_device": setup.state_bytes_per_device(),
               "state_host_bytes_per_device": setup.state_bytes_per_device(HOST),
               "devices": len(devices), "device_kind": devices[0].device_kind, "global_batch": global_batch,
               "model_flops_per_step": flops_per_step}
    _say(f"model {cfg.model.family}: {_human(summary['params_total'])} parameters; params + optimizer state "
         f"{_human(summary['state_bytes_per_device'], 'B')} per device "
         f"({_human(summary['state_host_bytes_per_device'], 'B')} of it in pinned host memory) on "
         f"{len(devices)} x {devices[0].device_kind} (mesh {mesh_describe(setup.mesh)}); "
         f"{_human(flops_per_step, 'FLOP')} per step")
    if cfg.run.dry_run:
        if _LEAD[0]:
            _write_json(os.path.join(out, "summary.json"), summary)
        _say(f"dry run: nothing allocated or compiled; wrote {os.path.join(out, 'summary.json')}")
        return 0

    if cfg.offload.verify_parity:
        verify_parity(cfg)
    data = data_lib.build(cfg, process_index, process_count)
    _say(f"data: {data.description}")
    state = setup.init_state()
    _say("compiling the training step ...")
    started = time.perf_counter()
    train_step = setup.compile_train_step()
    eval_step = setup.compile_eval_step()
    summary["compile_time_s"] = time.perf_counter() - started
    _say(f"compiled in {summary['compile_time_s']:.1f} s; training {cfg.train.steps} steps of {global_batch} x "
         f"{cfg.train.seq_len} tokens")
    eval_batches = [setup.put_batch(b) for b in data.eval_batches(cfg.train.eval_batches)]
    peak = peak_flops_per_device(cfg)
    logger = MetricsLogger(out, cfg.train.steps, cfg.run.log_every, enabled=_LEAD[0])
    tokens_per_device = global_batch * cfg.train.seq_len / len(devices)

    def evaluate(step):
        total = count = 0.0
        for batch in eval_batches:
            batch_total, batch_count = eval_step(state["params"], state["model_state"], batch)
            total, count = total + float(batch_total), count + float(batch_count)
        result = {"loss": total / max(count, 1.0)}
        logger.log_eval(step, result)
        return result["loss"]

    def record(step, metrics, since):
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
        seconds = time.perf_counter() - since
        flops_per_s = flops_per_step / len(devices) / seconds
        values.update(step_time_s=seconds, tokens_per_sec_per_device=tokens_per_device / seconds,
                      tflops_per_sec_per_device=flops_per_s / 1e12, mfu=flops_per_s / peak if peak else None)
        logger.log_step(step, values)
        return values

    history, eval_loss = [], None
    pending, last_done = None, time.perf_counter()  # dispatched step not yet reported; when the last one finished

    def report_pending():
        nonlocal pending, last_done
        if pending is not None:
            history.append(record(*pending, last_done))
            pending, last_done = None, time.perf_counter()

    try:
        for step in range(cfg.train.steps):
            state, metrics = train_step(state, setup.put_batch(data.train_batch(step)))
            report_pending()  # the previous step, while the device works on this one
            pending = (step + 1, metrics)
            if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and step + 1 < cfg.train.steps:
                report_pending()
                evaluate(step + 1)
                last_done = time.perf_counter()
        report_pending()
        eval_loss = evaluate(cfg.train.steps)
    finally:
        logger.close()

    steady = history[1:] or history
    mean = lambda key: sum(h[key] for h in steady) / len(steady)  # noqa: E731
    summary.update(steps=cfg.train.steps, first_loss=history[0]["loss"], final_loss=history[-1]["loss"],
                   final_eval_loss=eval_loss, train_time_s=time.perf_counter() - logger.started,
                   mean_step_time_s=mean("step_time_s"), tokens_per_sec_per_device=mean("tokens_per_sec_per_device"),
                   tflops_per_sec_per_device=mean("tflops_per_sec_per_device"),
                   mfu=mean("mfu") if peak else None)
    if _LEAD[0]:
        _write_json(os.path.join(out, "summary.json"), summary)
    mfu = f"{summary['mfu'] * 100:.1f}%" if peak else "n/a (unknown device peak; set hardware.peak_tflops_per_device)"
    _say(f"done: {cfg.train.steps} steps in {summary['train_time_s']:.1f} s (+ {summary['compile_time_s']:.1f} s "
         f"compile) | loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} | eval loss {eval_loss:.3f} | "
         f"{summary['mean_step_time_s']:.3f} s/step | {summary['tokens_per_sec_per_device']:,.0f} tok/s/dev | "
         f"{summary['tflops_per_sec_per_device']:.3f} TFLOP/s/dev | MFU {mfu}")
    _say(f"outputs in {out}: config.json metrics.jsonl summary.json tensorboard/")
    return 0
