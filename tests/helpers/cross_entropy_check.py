"""For tests/test_cross_entropy.py, on 8 forced host devices: for each spec (config overrides, JSON list of lists)
the loss and its gradients with the whole logits (model.vocab_tiles=1) and by 4 vocabulary tiles must be equal,
and the compiled step must hold the whole float32 logits only without tiles. Exits non-zero on any difference."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from MaxOffload import audit, from_config  # noqa: E402
from MaxOffload.config import load  # noqa: E402


def objective_and_grads(setup):
    state = jax.jit(setup._init)()
    rng = np.random.default_rng(1)
    rows, length, vocab = 8, setup.seq_len, setup.model_config.vocab_size
    batch = {"inputs": jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32),
             "mask": jnp.ones((rows, length)).at[3, 5].set(0.0)}
    loss = jax.jit(jax.value_and_grad(lambda p: setup.loss(p, state["model_state"], batch)[0]))
    return loss(state["params"]), loss.lower(state["params"]).compile().as_text()


def check(spec):
    common = (*spec, "model.compute_dtype=float32", "train.seq_len=16", "train.per_device_batch_size=1")
    whole_setup = from_config.train_setup(load([*common, "model.vocab_tiles=1"]))
    (whole, whole_grads), whole_hlo = objective_and_grads(whole_setup)
    tiled_setup = from_config.train_setup(load([*common, "model.vocab_tiles=4"]))
    (tiled, tiled_grads), tiled_hlo = objective_and_grads(tiled_setup)
    np.testing.assert_allclose(tiled, whole, rtol=1e-6)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(whole_grads), jax.tree.leaves(tiled_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=jax.tree_util.keystr(path))  # to 1e-5 of the gradient's scale
    # per device: a shard of the rows (8 / split devices) and of the vocabulary (split over `tensor`)
    split = 2 if "mesh.ici.tensor=2" in spec else 1
    logits, tile = f"f32[{split},16,{512 // split}]", f"f32[{split},16,{512 // split // 4}]"
    assert logits in whole_hlo and logits not in tiled_hlo, "the whole logits: in the untiled step only"
    assert tile in tiled_hlo, "a tile's logits"
    assert f"f32[4,{split},16,{512 // split // 4}]" not in tiled_hlo, "the tiles' logits kept for the backward pass"
    if "mesh.ici.tensor=2" in spec:  # the training step's audit: the head's logits made again in the backward pass
        work = audit.of_compiled(tiled_setup.compile_train_step(), tiled_setup)
        assert abs(work["components"]["unembed"]["ratio"] - 4 / 3) < 0.02, work["components"]["unembed"]
        assert not [w for w in work["warnings"] if "unembed" in w], work["warnings"]
    print("equal:", " ".join(spec), f"loss {float(whole):.6f}", flush=True)


if __name__ == "__main__":
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    for spec in json.loads(sys.argv[1]):
        check(spec)
