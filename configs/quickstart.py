"""Quickstart: a small Llama-family model on real text (Python's bundled docs), CPU, a few minutes."""
from MaxOffload.config.defaults import get_config as defaults
from MaxOffload.models.llama import PRESETS


def get_config():
    cfg = defaults()
    cfg.run.output_dir = "runs/quickstart"
    cfg.model.update(PRESETS["small"])
    cfg.train.steps = 300
    cfg.train.per_device_batch_size = 8
    cfg.train.seq_len = 256
    cfg.train.learning_rate = 3e-3
    cfg.train.warmup_steps = 20
    cfg.train.eval_every = 100
    cfg.run.log_every = 10
    return cfg
