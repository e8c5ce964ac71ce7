"""Restores the newest checkpoint of a run directory under the current devices/mesh (argv overrides)
and prints JSON {leaf path: [sum, sum of squares]} of the parameters, computed in float64."""
import json
import sys

import jax
import numpy as np

from MaxOffload import from_config
from MaxOffload.config import load
from MaxOffload.train.checkpoint import Checkpointer

cfg = load(sys.argv[1:])
setup = from_config.train_setup(cfg)
state, meta = Checkpointer(cfg, setup).restore_latest()
digest = {}
for path, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0]:
    value = np.asarray(jax.device_get(leaf), dtype=np.float64)
    digest["/".join(str(getattr(k, "key", k)) for k in path)] = [float(value.sum()), float((value ** 2).sum())]
print(json.dumps({"step": meta["step"], "mesh": dict(setup.mesh.shape), "digest": digest,
                  "embed_shard_shape": list(state["params"]["embed"].addressable_shards[0].data.shape)}))
