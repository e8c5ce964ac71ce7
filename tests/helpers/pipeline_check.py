"""Pipeline stages against one device, in ONE process (8 simulated CPU devices via XLA_FLAGS, set by the caller):
for each case, a step's gradients on the case's mesh (stage axis, M micro-batches) and on one device (one batch of
the same M micro-batches' rows). Prints JSON {case: {"loss": rel diff, "grads": rel diff, "init": max abs diff of
the initial parameters, "state": max abs diff of the model state after the step, "state_moved": how far that state
moved, "bubble": the schedule's, "metrics": the pipelined step's metric names}}.

argv[1]: JSON {case: [config overrides]}; the stacks' layers stored in the pipeline's order (mesh.pipeline.repeats
> 1) are compared in the model's order."""
import json
import sys

from MaxOffload.platform import pick_platform

pick_platform()  # before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from MaxOffload import data, from_config  # noqa: E402
from MaxOffload.config import load  # noqa: E402

M, ROWS, SEQ = 4, 1, 16


def relative(a, b):
    a, b = jax.device_get((a, b))  # on different devices
    diff = jax.tree.map(lambda x, y: x.astype(np.float64) - y.astype(np.float64), a, b)
    return float(optax.tree.norm(diff)) / max(float(optax.tree.norm(b)), 1e-30)


def max_abs(a, b):
    a, b = jax.device_get((a, b))
    return max([float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))],
               default=0.0)


def in_model_order(tree, setup):
    """A params-shaped tree with the pipelined stack's layers put back in the model's order."""
    if setup.pipeline is None or setup.pipeline.repeats == 1:
        return tree
    group = setup.model_config.pipelined_group()
    stack = {"decoder": "layers", "moe": "moe_layers"}[group]
    start, stop = setup.model_config.layer_groups()[group]
    back = np.argsort(setup.pipeline.order(stop - start))
    if stack not in tree:  # a model state without the stack's (Llama's: none)
        return tree
    tree = dict(tree)
    tree[stack] = jax.tree.map(lambda a: jax.device_get(a)[back], tree[stack])
    return tree


def compare(overrides):
    common = [*overrides, "model.compute_dtype=float32", f"train.seq_len={SEQ}", "checkpoint.enabled=false"]
    staged_cfg = load([*common, f"train.per_device_batch_size={ROWS}", f"mesh.pipeline.microbatches={M}"])
    staged = from_config.train_setup(staged_cfg)
    parts = data.micro_batches(data.build(staged_cfg), 0, M)
    whole_cfg = load([*common, f"train.per_device_batch_size={ROWS * jax.device_count() * M}",
                      "mesh.ici.stage=1", "mesh.ici.fsdp=-1", "mesh.ici.expert=1", "mesh.ici.tensor=1",
                      "mesh.pipeline.repeats=1"])
    whole = from_config.train_setup(whole_cfg, jax.devices()[:1])
    whole_state, staged_state = whole.init_state(), staged.init_state()
    big = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    loss_1, aux_1, grads_1 = jax.jit(whole.gradients)(whole_state["params"], whole_state["model_state"],
                                                      whole.put_step_batch([big]))
    loss_s, aux_s, grads_s = jax.jit(staged.gradients)(staged_state["params"], staged_state["model_state"],
                                                       staged.put_step_batch(parts))
    state_1, state_s = aux_1.get("model_state", {}), in_model_order(aux_s.get("model_state", {}), staged)
    return {"loss": abs(float(loss_s) - float(loss_1)) / abs(float(loss_1)),
            "grads": relative(in_model_order(grads_s, staged), grads_1),
            "init": max_abs(in_model_order(staged_state["params"], staged), whole_state["params"]),
            "state": max_abs(state_s, state_1), "state_leaves": len(jax.tree.leaves(state_1)),
            "state_moved": max_abs(state_1, whole_state["model_state"]),
            "bubble": staged.pipeline.bubble, "metrics": sorted(aux_s.get("metrics", {}))}


if __name__ == "__main__":
    print(json.dumps({case: compare(overrides) for case, overrides in json.loads(sys.argv[1]).items()}))
