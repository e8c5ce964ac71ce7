"""Pipeline stages against one device, in ONE process (8 simulated CPU devices via XLA_FLAGS, set by the caller):
for each case, a step's gradients on the case's mesh (stage axis, M micro-batches) and on one device (one batch of
the same M micro-batches' rows). Prints JSON {case: {"loss": rel diff, "grads": rel diff, "init": max abs diff of
the initial parameters, "state": max abs diff of the model state after the step, "state_moved": how far that state
moved, "bubble": the schedule's, "timeline": the pipeline's figures in the timeline of the staged gradients' compiled
program (timeline/summary.pipeline_figures, on an H200's rates), "trace_iterations" / "trace_bubbles": its
Perfetto trace's pipeline track, "metrics": the pipelined step's metric names, "placement": with
mesh.pipeline.remat=stages_offloaded, the offload report's problems, pinned_host placements, offloaded names and
bytes per device (else null)}}.

argv[1]: JSON {case: [config overrides]}; the stacks' layers stored in the pipeline's order (mesh.pipeline.repeats
> 1) are compared in the model's order."""
import json
import sys

from MaxOffload.platform import pick_platform

pick_platform()  # before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from MaxOffload import data, from_config, hardware, models  # noqa: E402
from MaxOffload.config import load  # noqa: E402
from MaxOffload.timeline import engines, simulate, trace  # noqa: E402

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
    if setup.layer_order() is None:
        return tree
    stack = models.family_of(setup.model_config).model_class.PIPELINED_STACK
    back = np.argsort(setup.layer_order())
    if stack not in tree:  # a model state without the stack's (Llama's: none)
        return tree
    tree = dict(tree)
    tree[stack] = jax.tree.map(lambda a: jax.device_get(a)[back], tree[stack])
    return tree


REFERENCES = {}


def reference(model_overrides, parts):
    """(the one-device setup, its initial state, loss, aux and gradients of one batch of the micro-batches `parts`'
    rows; under quant.mode of those micro-batches accumulated): one per model, shared by its cases (whose staged runs
    read the same micro-batches)."""
    if model_overrides not in REFERENCES:
        rows = ROWS * jax.device_count()
        if any(o.startswith("quant.mode=") for o in model_overrides):
            # FP8's per-tensor scales are of each micro-batch's tensors: the same M micro-batches, accumulated
            batch = [f"train.per_device_batch_size={rows}", f"train.grad_accum_steps={M}"]
        else:
            batch, parts = [f"train.per_device_batch_size={rows * M}"], \
                [{k: np.concatenate([p[k] for p in parts]) for k in parts[0]}]
        setup = from_config.train_setup(load([*model_overrides, *batch]), jax.devices()[:1])
        state = setup.init_state()
        REFERENCES[model_overrides] = (setup, state, *jax.jit(setup.gradients)(
            state["params"], state["model_state"], setup.put_step_batch(parts)))
    return REFERENCES[model_overrides]


def compare(overrides):
    common = ("model.compute_dtype=float32", f"train.seq_len={SEQ}", "checkpoint.enabled=false")
    model_overrides = tuple(o for o in overrides if not o.startswith("mesh.")) + common
    staged_cfg = load([*overrides, *common, f"train.per_device_batch_size={ROWS}", f"mesh.pipeline.microbatches={M}"])
    staged = from_config.train_setup(staged_cfg)
    parts = data.micro_batches(data.build(staged_cfg), 0, M)
    whole, whole_state, loss_1, aux_1, grads_1 = reference(model_overrides, parts)
    staged_state = staged.init_state()
    args = (staged_state["params"], staged_state["model_state"], staged.put_step_batch(parts))
    compiled = jax.jit(staged.gradients).lower(*args).compile()
    loss_s, aux_s, grads_s = compiled(*args)
    # the timeline of that program (its gradients: the pipeline's loops, both passes) on an H200's rates
    report, sim = simulate.simulate(compiled.as_text(), engines.Rates.of(hardware.ACCELERATORS["h200"]),
                                    staged.mesh.size, pipeline=staged.pipeline)
    track = [e["name"] for e in trace.trace(sim)["traceEvents"] if e.get("cat") == "pipeline"]
    state_1, state_s = aux_1.get("model_state", {}), in_model_order(aux_s.get("model_state", {}), staged)
    placed = None
    if staged.pipeline.remat == "stages_offloaded":  # the iterations' inputs on the host, proven in the CUDA lowering
        from MaxOffload.offload import placement

        found = placement.build_report(staged_cfg, staged, cpu_memory=False)
        placed = {"problems": found["problems"], "placements": found["cuda_pinned_host_placements"],
                  "offloaded": sorted(n for g in found["groups"].values() for n in g["offloaded"]),
                  "bytes": found["offload_bytes_per_device"]}
    return {"loss": abs(float(loss_s) - float(loss_1)) / abs(float(loss_1)),
            "grads": relative(in_model_order(grads_s, staged), grads_1),
            "init": max_abs(in_model_order(staged_state["params"], staged), whole_state["params"]),
            "state": max_abs(state_s, state_1), "state_leaves": len(jax.tree.leaves(state_1)),
            "state_moved": max_abs(state_1, whole_state["model_state"]),
            "bubble": staged.pipeline.bubble, "iterations": staged.pipeline.iterations,
            "timeline": report["pipeline"], "trace_bubbles": sum(name.startswith("bubble") for name in track),
            "trace_iterations": len(track),
            "metrics": sorted(aux_s.get("metrics", {})), "placement": placed}


if __name__ == "__main__":
    print(json.dumps({case: compare(overrides) for case, overrides in json.loads(sys.argv[1]).items()}))
