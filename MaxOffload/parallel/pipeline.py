"""Pipeline parallelism: one stack of identical layers split over the `stage` mesh axis into stages x repeats
virtual stages (circular, as MaxText and Megatron's interleaved schedule), micro-batches flowing from stage to
stage by `ppermute`.

With S stages, R repeats and L layers, virtual stage v = r * S + s (repeat r, stage s) runs layers
[v * L/(S R), (v + 1) * L/(S R)): a micro-batch goes through stages 0, 1, ..., S-1, then again from stage 0 with the
next repeat's layers. Stage s stores its R virtual stages' layers contiguously (`order`), so the stack's leading
axis splits over the stage axis in blocks. At iteration t stage s runs micro-batch (t - s) mod M of repeat
(t - s) // M; the run takes T = R M' + S - 1 iterations (M' = M; with repeats max(M, S): fewer micro-batches than
stages are padded with idle ones), of which each stage works R M: the bubble, (T - R M) / T, is
(S - 1) / (R M + S - 1) for M >= S. Stage S-1's output reaches stage 0 by the same ppermute; stage 0 keeps it
until that micro-batch's next repeat (M >= S iterations later) and, after the last repeat, as the stack's output.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from MaxOffload.errors import ConfigError

AXIS = "stage"
SCOPE = "pipeline"  # the name scope of the iterations' loop: the timeline finds the pipeline's loops by it
INPUT = "pipeline_iteration_input"  # remat=stages_offloaded: the name of each iteration's input, offloaded


@dataclasses.dataclass(frozen=True)
class Pipeline:
    stages: int
    repeats: int = 1
    microbatches: int = 1  # of a step's batch (the step's micro-batches: gradient accumulation)
    # what the backward pass gets of each iteration: "layers" (what the pipelined layers' remat/offload policy keeps,
    # for all micro-batches at once) | "stages" (each iteration's input alone, kept in HBM; the virtual stage's
    # forward runs again in the backward pass, under the layers' policy) | "stages_offloaded" (the same, the inputs
    # kept in pinned host memory: named INPUT, offloaded by the virtual stage's checkpoint policy)
    remat: str = "layers"

    @property
    def padded(self):
        """Micro-batches the schedule runs: the step's; with repeats at least one per stage (the extra ones idle), so
        that stage S-1's output is back at stage 0 by the time its next repeat starts."""
        return self.microbatches if self.repeats == 1 else max(self.microbatches, self.stages)

    @property
    def iterations(self):
        return self.repeats * self.padded + self.stages - 1

    @property
    def bubble(self):
        """The fraction of each stage's iterations it idles: (S - 1) / (R M + S - 1) for M >= S."""
        return 1.0 - self.repeats * self.microbatches / self.iterations

    def work(self, t, stage=0):
        """(micro-batch, repeat) that `stage` runs at iteration t (of the forward pass; the backward pass runs the
        iterations in reverse), or None where it idles: the bubble."""
        m, r = (t - stage) % self.padded, (t - stage) // self.padded
        return None if t < stage or r >= self.repeats or m >= self.microbatches else (m, r)

    def per_stage(self, layers):
        """Layers of one virtual stage; ConfigError when the stack does not split evenly."""
        virtual = self.stages * self.repeats
        if layers % virtual:
            raise ConfigError(f"the pipelined stack's {layers} layers do not split into mesh stage {self.stages} x "
                              f"mesh.pipeline.repeats={self.repeats} = {virtual} virtual stages; choose stages x "
                              f"repeats that divide {layers}")
        return layers // virtual

    def order(self, layers):
        """order[p]: the layer (in model order) that position p of the stored stack holds. Stage s holds its
        virtual stages (r, s), r = 0..R-1, one after the other: with R = 1 the model order itself."""
        per = self.per_stage(layers)
        s, r, j = np.meshgrid(np.arange(self.stages), np.arange(self.repeats), np.arange(per), indexing="ij")
        return ((r * self.stages + s) * per + j).reshape(-1)

    def describe(self):
        return (f"pipeline: {self.stages} stages x {self.repeats} repeats, {self.microbatches} micro-batches a step, "
                f"bubble {self.bubble:.1%}" + (f", each stage's forward again in the backward pass (remat={self.remat})"
                                               if self.remat != "layers" else ""))


def run(pipeline, mesh, stage_fn, weights, x, positions):
    """The pipelined stack applied to a step's batch.

    weights: the stack's stored state (a pytree, each leaf [layers, ...] in `order`, split over the stage axis);
    x [batch, length, emb] with batch = rows x M, row g * M + m belonging to micro-batch m (a local reshape of the
    rows each device holds); positions [length] (the same for every row). stage_fn(virtual stage's weights [per, ...],
    h [rows, length, emb], positions [rows, length]) -> (h, per-layer outputs [per, ...] or None). Returns (the stack's
    output laid out as x, per-layer outputs summed over the micro-batches, [layers, ...] in `order`).
    """
    S, R, M, Mp = pipeline.stages, pipeline.repeats, pipeline.microbatches, pipeline.padded
    batch, length, emb = x.shape
    rows = batch // M
    micro = x.reshape(rows, M, length, emb).swapaxes(0, 1)  # [M, rows, length, emb]
    if Mp > M:
        micro = jnp.concatenate([micro, jnp.zeros((Mp - M, *micro.shape[1:]), micro.dtype)])
    per_row = jnp.broadcast_to(positions, (rows, length))
    per = pipeline.per_stage(jax.tree.leaves(weights)[0].shape[0])
    forward = [(i, (i + 1) % S) for i in range(S)]

    def stage(w, inputs, per_row):
        inputs = inputs.astype(x.dtype)
        w = jax.tree.map(lambda a: a.reshape(R, per, *a.shape[1:]), w)  # this stage's virtual stages
        s = jax.lax.axis_index(AXIS)
        first = s == 0
        shapes = jax.eval_shape(stage_fn, jax.tree.map(lambda a: a[0], w), inputs[0], per_row)[1]
        outs = jax.tree.map(lambda a: jnp.zeros((R, *a.shape), a.dtype), shapes)

        def virtual_stage(w, repeat, h, per_row):
            return stage_fn(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, keepdims=False), w), h,
                            per_row)

        if pipeline.remat == "stages":  # the stage's stored weights are the loop's invariants: saved once
            virtual_stage = jax.checkpoint(virtual_stage, policy=jax.checkpoint_policies.nothing_saveable)
        elif pipeline.remat == "stages_offloaded":  # ... and each iteration's input goes to pinned host memory
            compute = virtual_stage

            def named_input(w, repeat, h, per_row):
                return compute(w, repeat, checkpoint_name(h, INPUT), per_row)

            virtual_stage = jax.checkpoint(named_input, policy=jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=[INPUT], offload_src="device",
                offload_dst="pinned_host"))

        def iteration(carry, t):
            arrived, kept, outs = carry  # arrived: what the previous stage sent at t - 1
            # stage 0 keeps what stage S-1 finished at t - 1: micro-batch (t - S) mod M', for its next repeat
            slot = (t - S) % Mp
            kept = jax.lax.dynamic_update_index_in_dim(
                kept, jnp.where(first & (t >= S), arrived, jax.lax.dynamic_index_in_dim(kept, slot, keepdims=False)),
                slot, 0)
            m, r = (t - s) % Mp, (t - s) // Mp
            own = jnp.where(r == 0, jax.lax.dynamic_index_in_dim(inputs, m, keepdims=False),
                            jax.lax.dynamic_index_in_dim(kept, m, keepdims=False))
            h = jnp.where(first, own, arrived)
            repeat = jnp.clip(r, 0, R - 1)
            h, layer_outs = virtual_stage(w, repeat, h, per_row)
            working = (t - s >= 0) & (r < R) & (m < M)  # as Pipeline.work says
            outs = jax.tree.map(lambda acc, o: jax.lax.dynamic_update_index_in_dim(
                acc, jax.lax.dynamic_index_in_dim(acc, repeat, keepdims=False)
                + jnp.where(working, o, jnp.zeros_like(o)), repeat, 0), outs, layer_outs)
            return (jax.lax.ppermute(h, AXIS, forward), kept, outs), None

        start = (jnp.zeros_like(inputs[0]), jnp.zeros_like(inputs), outs)
        with jax.named_scope(SCOPE):
            (arrived, kept, outs), _ = jax.lax.scan(iteration, start, jnp.arange(pipeline.iterations))
        # the last micro-batch's last repeat arrives at stage 0 after the loop
        kept = jax.lax.dynamic_update_index_in_dim(kept, arrived, (pipeline.iterations - S) % Mp, 0)
        outs = jax.tree.map(lambda a: a.reshape(R * per, *a.shape[2:]), outs)
        return kept[None], outs

    # the micro-batches enter every stage; their gradient is summed over the stages, on CPUs in float32 (XLA:CPU
    # fails to compile that all-reduce in bfloat16: "Invalid binary instruction opcode copy")
    carried = jnp.float32 if getattr(mesh.devices.flat[0], "platform", "cpu") == "cpu" else micro.dtype
    kept, outs = jax.shard_map(stage, mesh=mesh, in_specs=(P(AXIS), P(), P()), out_specs=(P(AXIS), P(AXIS)),
                               axis_names={AXIS}, check_vma=False)(weights, micro.astype(carried), per_row)
    out = kept[0][:M].swapaxes(0, 1).reshape(batch, length, emb).astype(x.dtype)  # stage 0's: the stack's output
    return out, outs
