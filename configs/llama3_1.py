"""Llama 3.1 at its published sizes: configs/llama3_1.py:8b | :70b | :405b (also :tiny, :small for CPU).

The big sizes are for GPUs (and for `run.dry_run=true` / the deviceless compile anywhere).
"""
from MaxOffload.config.defaults import get_config as defaults
from MaxOffload.models.llama import PRESETS

SIZES = {"8b": "llama3_1_8b", "70b": "llama3_1_70b", "405b": "llama3_1_405b", "tiny": "tiny", "small": "small"}


def get_config(size="8b"):
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    cfg = defaults()
    cfg.run.output_dir = f"runs/llama3_1_{size}"
    cfg.model.update(PRESETS[SIZES[size]])
    if SIZES[size].startswith("llama3_1"):
        cfg.train.seq_len = 8192
        cfg.train.per_device_batch_size = 1
        cfg.train.learning_rate = 1.5e-4
        cfg.train.warmup_steps = 2000
        cfg.train.steps = 100_000
        cfg.data.source = "synthetic"
    return cfg
