"""quant.mode against bf16 on CPU, in ONE process: for each case (argv[1]: JSON {case: [config overrides]}) and each
mode (argv[2]: JSON list), the first batch's gradient relative to bf16's and the mean loss of the last 10 of
STEPS training steps, trained on the same data from the same seed. Prints JSON {case: {mode: {"grad": relative
difference, "final_loss": ..., "first_loss": ...}}} (bf16 included, its "grad" 0)."""
import json
import sys

from MaxOffload.platform import prefer_cpu_without_gpu

prefer_cpu_without_gpu()  # before JAX starts: the CUDA plugin is installed, a GPU is not

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from MaxOffload import data as data_lib  # noqa: E402
from MaxOffload import from_config  # noqa: E402
from MaxOffload.config import load  # noqa: E402

STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 300


def run(overrides, mode):
    cfg = load([*overrides, f"quant.mode={mode}", "run.output_dir=/tmp/fp8_check"])
    setup = from_config.train_setup(cfg)
    data = data_lib.build(cfg)
    state = setup.init_state()
    first = setup.put_step_batch([data.train_batch(0)])
    _, _, grads = jax.jit(setup.gradients)(state["params"], state["model_state"], first)
    step, losses = setup.compile_train_step(), []
    for i in range(STEPS):
        state, metrics = step(state, setup.put_step_batch([data.train_batch(i)]))
        losses.append(float(metrics["loss"]))
    return grads, losses


def relative(a, b):
    diff = jax.tree.map(lambda x, y: x.astype(jnp.float32) - y.astype(jnp.float32), a, b)
    return float(optax.tree.norm(diff)) / max(float(optax.tree.norm(b)), 1e-30)


def compare(overrides, modes):
    reference, losses = run(overrides, "bf16")
    found = {"bf16": {"grad": 0.0, "first_loss": losses[0], "final_loss": float(np.mean(losses[-10:]))}}
    for mode in modes:
        grads, losses = run(overrides, mode)
        found[mode] = {"grad": relative(grads, reference), "first_loss": losses[0],
                       "final_loss": float(np.mean(losses[-10:]))}
    return found


if __name__ == "__main__":
    modes = json.loads(sys.argv[2])
    print(json.dumps({case: compare(overrides, modes) for case, overrides in json.loads(sys.argv[1]).items()}))
