"""Trains a tiny DeepSeek-V3 for a few steps under several meshes in ONE process (8 simulated CPU devices
via XLA_FLAGS, set by the caller) and prints JSON {run: {"losses": [...], "metrics": [...], ...}}.

argv[1]: JSON {run name: [overrides]}; a run whose overrides include "single" runs on one device with
the whole global batch (the reference the meshes must reproduce)."""
import json
import sys

import jax
import numpy as np

from MaxOffload import from_config
from MaxOffload.config import load
from MaxOffload.data import build as build_data

BASE = ["configs/deepseek_v3.py:tiny", "train.steps=3", "train.warmup_steps=1", "train.seq_len=32",
        "train.per_device_batch_size=1", "model.compute_dtype=float32", "train.learning_rate=1e-2"]


def run(overrides, steps=2):
    single = "single" in overrides
    overrides = [o for o in overrides if o != "single"]
    cfg = load(BASE + overrides)
    data = build_data(cfg)  # the global batch of 8 devices x 1 row
    devices = jax.devices()[:1] if single else None
    if single:
        cfg = load(BASE + overrides + [f"train.per_device_batch_size={jax.device_count()}"])
    setup = from_config.train_setup(cfg, devices)
    step = setup.compile_train_step()
    state = setup.init_state()
    wi_0 = state["params"]["moe_layers"]["mlp"]["wi_0"]
    result = {"wi_0_spec": [str(a) for a in wi_0.sharding.spec],
              "wi_0_shard_shape": list(wi_0.addressable_shards[0].data.shape), "losses": [], "metrics": []}
    for i in range(steps):
        state, metrics = step(state, setup.put_batch(data.train_batch(i)))
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        result["losses"].append(metrics["loss"])
        result["metrics"].append({k: v for k, v in metrics.items() if k.startswith("moe/") or k == "mtp_loss"})
    bias = state["model_state"]["moe_layers"]["mlp"]["router_bias"]
    result["router_bias"] = np.asarray(jax.device_get(bias)).tolist()
    return result


if __name__ == "__main__":
    plans = json.loads(sys.argv[1])
    print(json.dumps({name: run(overrides) for name, overrides in plans.items()}))
