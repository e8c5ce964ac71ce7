"""k micro-batches of b rows against one batch of k x b rows, in ONE process (run it with 8 simulated CPU devices
via XLA_FLAGS for the sharded case): prints JSON {case: {"loss": rel diff, "grads": rel diff, "state": max abs
diff of the model state after the step, "gathered": where the accumulating step all-gathers its weights
(MaxOffload.aot.weight_gathers of its compiled program), "reduced": where it reduces (gradient_reductions),
"grad_bytes": the gradients' bytes}}. argv[1]: JSON {case: [config overrides]}. The batches
are one step of the configured data source (data.micro_batches, as the trainer reads them): give the cases
data.source=synthetic or text."""
import json
import sys

from MaxOffload.platform import pick_platform

pick_platform()  # before JAX starts: the CUDA plugin is installed, a GPU is not

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from MaxOffload import data, from_config, hlo  # noqa: E402
from MaxOffload.aot import gradient_reductions, weight_gathers  # noqa: E402
from MaxOffload.config import load  # noqa: E402

K, ROWS, SEQ, STEP = 4, 2, 16, 3


def relative(a, b):  # (tests/helpers/fp8_check.py's)
    diff = jax.tree.map(lambda x, y: x.astype(jnp.float32) - y.astype(jnp.float32), a, b)
    return float(optax.tree.norm(diff)) / max(float(optax.tree.norm(b)), 1e-30)


def norm(tree):
    return float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(tree))))


def host_relative(a, b):
    """relative(a, b) in numpy on the host: jnp's ops on 8 devices' sharded leaves compiled a program per leaf
    shape (12 of the 37 s of DeepSeek's case)."""
    a, b = jax.device_get((a, b))
    diff = jax.tree.map(lambda x, y: x.astype(np.float32) - y.astype(np.float32), a, b)
    return norm(diff) / max(norm(b), 1e-30)


def max_abs(a, b):
    a, b = jax.device_get((a, b))
    return max([float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))], default=0.0)


def compare(overrides):
    common = [*overrides, "model.compute_dtype=float32", f"train.seq_len={SEQ}"]
    micro_cfg = load([*common, f"train.per_device_batch_size={ROWS}", f"train.grad_accum_steps={K}"])
    whole_cfg = load([*common, f"train.per_device_batch_size={K * ROWS}"])
    micro, whole = from_config.train_setup(micro_cfg), from_config.train_setup(whole_cfg)
    state = whole.init_state()
    # Step STEP's batch as training reads it from the configured source (the case's data.source), once as one
    # batch of K x ROWS rows a device and once as K micro-batches of ROWS: the source must give the same rows.
    big = data.micro_batches(data.build(whole_cfg), STEP, 1)
    parts = data.micro_batches(data.build(micro_cfg), STEP, K)
    one = jax.jit(whole.gradients)(state["params"], state["model_state"], whole.put_step_batch(big))
    args = (state["params"], state["model_state"], micro.put_step_batch(parts))
    compiled = jax.jit(micro.gradients).lower(*args).compile()
    many = compiled(*args)
    (loss_1, aux_1, grads_1), (loss_k, aux_k, grads_k) = one, many
    state_1, state_k = aux_1.get("model_state", {}), aux_k.get("model_state", {})
    program = hlo.parse(compiled.as_text())
    return {"loss": abs(float(loss_k) - float(loss_1)) / abs(float(loss_1)), "grads": host_relative(grads_k, grads_1),
            "state": max_abs(state_k, state_1), "state_leaves": len(jax.tree.leaves(state_1)),
            "state_moved": max_abs(state_k, state["model_state"]),
            "metrics": sorted(aux_k.get("metrics", {})),
            "gathered": weight_gathers(program, K), "reduced": gradient_reductions(program, K),
            "grad_bytes": sum(g.size * g.dtype.itemsize for g in jax.tree.leaves(grads_k))}


if __name__ == "__main__":
    print(json.dumps({case: compare(overrides) for case, overrides in json.loads(sys.argv[1]).items()}))
