"""Packed documents (data.attend_within_documents) over a sequence split by context axes, against one device, in ONE
process (8 simulated CPU devices via XLA_FLAGS, set by the caller): for each case, a step's loss and gradients of
the same batch of real text (its documents found from the end-of-text tokens) on the case's mesh and on one device.
Prints JSON {case: {"loss": rel diff, "grads": rel diff, "boundaries": end-of-text tokens in the batch,
"vs_unpacked": rel diff of the one-device loss with each row one document}}.

argv[1]: JSON {case: [config overrides]}."""
import json
import sys

from MaxOffload.platform import pick_platform

pick_platform()  # before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from MaxOffload import data, from_config  # noqa: E402
from MaxOffload.config import load  # noqa: E402

COMMON = ["model.compute_dtype=float32", "train.seq_len=128", "train.per_device_batch_size=1",
          "data.attend_within_documents=true", "checkpoint.enabled=false"]


def relative(a, b):
    a, b = jax.device_get((a, b))
    diff = jax.tree.map(lambda x, y: x.astype(np.float64) - y.astype(np.float64), a, b)
    return float(optax.tree.norm(diff)) / max(float(optax.tree.norm(b)), 1e-30)


def gradients(cfg, devices):
    """(the jitted step's gradients of a batch, its setup's initial state)."""
    setup = from_config.train_setup(cfg, devices)
    state = setup.init_state()
    fn = jax.jit(setup.gradients)
    return lambda batch: fn(state["params"], state["model_state"], setup.put_batch(batch))


def compare(overrides):
    split = load([*overrides, *COMMON])
    batch = data.build(split).train_batch(0)
    rows = len(batch["inputs"])
    one = [*[o for o in overrides if not o.startswith("mesh.")], *COMMON, f"train.per_device_batch_size={rows}"]
    loss_s, _, grads_s = gradients(split, None)(batch)
    on_one = gradients(load(one), jax.devices()[:1])
    loss_1, _, grads_1 = on_one(batch)
    loss_u = on_one({**batch, "documents": np.zeros_like(batch["documents"])})[0]  # each row one document
    return {"loss": abs(float(loss_s) - float(loss_1)) / abs(float(loss_1)), "grads": relative(grads_s, grads_1),
            "boundaries": int(np.sum(batch["inputs"] == data.tokenizer.BYTE.eos_id)),
            "vs_unpacked": abs(float(loss_u) - float(loss_1)) / abs(float(loss_1))}


if __name__ == "__main__":
    print(json.dumps({case: compare(overrides) for case, overrides in json.loads(sys.argv[1]).items()}))
