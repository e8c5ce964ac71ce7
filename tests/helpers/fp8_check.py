"""quant.mode against bf16 on CPU, in ONE process: for each case (argv[1]: JSON {case: {"overrides": [config
overrides], "modes": [quant modes]}}) and each of its modes, the mean loss of the last 10 of STEPS training steps trained on the same data from the
same seed and, for a case that asks ("gradient": true), the first batch's gradient relative to bf16's. Prints JSON {case: {mode:
{"first_loss", "final_loss", "grad": relative difference (cases with "gradient": true; bf16's is 0)}}}."""
import json
import sys

from MaxOffload.platform import pick_platform

pick_platform()  # before JAX starts: the CUDA plugin is installed, a GPU is not

import jax  # noqa: E402
import numpy as np  # noqa: E402

from MaxOffload import data as data_lib  # noqa: E402
from MaxOffload import from_config  # noqa: E402
from MaxOffload.config import load  # noqa: E402
from grad_accum_check import relative  # noqa: E402  (tests/helpers: the same relative difference of two trees)

STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 300


def run(overrides, mode, gradient):
    cfg = load([*overrides, f"quant.mode={mode}", "run.output_dir=/tmp/fp8_check"])
    setup = from_config.train_setup(cfg)
    data = data_lib.build(cfg)
    state = setup.init_state()
    grads = None
    if gradient:
        first = setup.put_step_batch([data.train_batch(0)])
        grads = jax.jit(setup.gradients)(state["params"], state["model_state"], first)[2]
    step, losses = setup.compile_train_step(), []
    for i in range(STEPS):
        state, metrics = step(state, setup.put_step_batch([data.train_batch(i)]))
        losses.append(float(metrics["loss"]))
    return grads, losses


def compare(overrides, modes, gradient):
    found, reference = {}, None
    for mode in ["bf16", *modes]:
        grads, losses = run(overrides, mode, gradient)
        found[mode] = {"first_loss": losses[0], "final_loss": float(np.mean(losses[-10:]))}
        if gradient:
            reference = grads if reference is None else reference
            found[mode]["grad"] = relative(grads, reference)
    return found


if __name__ == "__main__":
    cases = json.loads(sys.argv[1])
    print(json.dumps({case: compare(c["overrides"], c["modes"], c.get("gradient", False)) for case, c in cases.items()}))
