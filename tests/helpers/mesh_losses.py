"""Runs a few training steps of a tiny model under several meshes in ONE process (8 simulated CPU
devices via XLA_FLAGS, set by the caller) and prints JSON: {mesh: {"losses": [...], "param_bytes": n}}."""
import json
import sys

import jax

from MaxOffload import from_config
from MaxOffload.config import load
from MaxOffload.data import build as build_data

BASE = ["configs/llama3_1.py:tiny", "train.steps=3", "train.warmup_steps=1", "train.seq_len=32",
        "train.per_device_batch_size=1", "model.compute_dtype=float32", "model.num_heads=4", "model.num_kv_heads=2"]


def losses(overrides, steps=3):
    cfg = load(BASE + overrides)
    setup = from_config.train_setup(cfg)
    step = setup.compile_train_step()
    data = build_data(cfg)
    state = setup.init_state()
    params = state["params"]
    param_bytes = sum(shard.data.nbytes for leaf in jax.tree.leaves(params)
                      for shard in leaf.addressable_shards if shard.device == jax.devices()[0])
    wq = params["layers"]["attention"]["wq"]
    result = {"param_bytes": int(param_bytes), "wq_spec": [str(a) for a in wq.sharding.spec],
              "wq_shard_shape": list(wq.addressable_shards[0].data.shape), "losses": []}
    for i in range(steps):  # the step donates the state: read the arrays above first
        state, metrics = step(state, setup.put_batch(data.train_batch(i)))
        result["losses"].append(float(metrics["loss"]))
    return result


if __name__ == "__main__":
    meshes = json.loads(sys.argv[1])
    print(json.dumps({name: losses(overrides) for name, overrides in meshes.items()}))
