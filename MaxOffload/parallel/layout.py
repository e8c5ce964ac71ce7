"""The parallel layout a model is built for: the mesh, the logical-axis rules and the expert exchange, made once
(TrainSetup, from the resolved config) and handed to every family's constructor by models.build. Layers place
activations (`constrain`), run per-shard kernels (`sharding`) and exchange tokens between expert owners
(`exchange`, models/exchange.py) through it; nothing reads a global or thread-local mesh.

Without a mesh (an abstract model for counting parameters, a model built for one CPU device in a test) every
placement is a no-op: `NONE`.
"""
import dataclasses
import math

import jax
import numpy as np

from MaxOffload.parallel import logical

TOKEN_AXES = ("activation_batch", "activation_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    mesh: object  # jax.sharding.Mesh, or None
    rules: tuple = ()  # ((logical axis, (mesh axes, ...)), ...): hashable, so a module can hold it statically
    exchange: str = "all_gather"  # how routed tokens reach their experts' devices (models/exchange.EXCHANGES)
    # how the queries of a sequence split over the context axes reach its keys: a name of the context strategies'
    # registry (models/attention/context.STRATEGIES)
    context_attention: str = "all_gather"
    load_balance: bool = False  # the sequence laid out so every context shard has the same causal work
    # the pipelined stack's schedule over the `stage` axis (parallel/pipeline.Pipeline), None without stages
    pipeline: object = None

    @classmethod
    def of(cls, mesh, rules, exchange="all_gather", context_attention="all_gather", load_balance=False,
           pipeline=None):
        return cls(mesh, tuple(sorted((axis, tuple(mesh_axes)) for axis, mesh_axes in rules.items())), exchange,
                   context_attention, load_balance, pipeline)

    @property
    def context_ways(self):
        """How many shards the sequence is split into (1 without a mesh)."""
        return 1 if self.mesh is None else math.prod(self.mesh.shape[a] for a in self.context)

    @property
    def gathers_context(self):
        """Whether a sequence is split over context axes and each shard gathers its keys (the all_gather strategy)."""
        return self.context_ways > 1 and self.context_attention == "all_gather"

    def token_order(self, length):
        """The global positions of a sequence's tokens as the model lays them out, or None when they keep their
        order. Load balancing over C context shards cuts the sequence into 2C chunks and gives shard i chunks i
        and 2C-1-i: under the causal mask every shard then attends to the same number of (query, key) pairs
        (without it the last shard has 2C-1 times the first's). `length` must be a multiple of 2C
        (TrainSetup checks)."""
        ways = self.context_ways
        if not self.load_balance or ways == 1:
            return None
        chunk = length // (2 * ways)
        chunks = [c for shard in range(ways) for c in (shard, 2 * ways - 1 - shard)]
        return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks]).astype(np.int32)

    @property
    def rule_map(self):
        return dict(self.rules)

    def spec(self, axes):
        """The PartitionSpec of logical `axes` on this mesh; inside a shard_map, without the axes it makes manual
        (the pipeline's stage axis: a stage's activations are placed over the other axes)."""
        manual = jax.sharding.get_abstract_mesh().manual_axes
        return logical.partition_spec(axes, self.rule_map, [a for a in self.mesh.axis_names if a not in manual])

    @property
    def current_mesh(self):
        """The mesh placements and shard_maps name: the layout's; inside a shard_map over some of its axes (a data
        replica's share of a micro-batch: train/step.py, reduce_gradients=per_step) the abstract mesh around them,
        whose manual axes nothing inside names (a replica's rules leave them out)."""
        inner = jax.sharding.get_abstract_mesh()
        return self.mesh if inner.empty or not inner.manual_axes else inner

    def sharding(self, axes):
        """The NamedSharding of logical `axes`, or None without a mesh (for a kernel that runs per shard)."""
        return None if self.mesh is None else jax.sharding.NamedSharding(self.current_mesh, self.spec(axes))

    def constrain(self, x, axes):
        """x placed by its logical axes (a sharding constraint); x itself without a mesh."""
        return x if self.mesh is None else jax.lax.with_sharding_constraint(x, self.sharding(axes))

    def gathered(self, param):
        """A parameter's value split only over its tensor-parallel mesh axes, all-gathered over the rest (fsdp, the
        expert axis's data-parallel share of a dense weight): every device holds each weight GEMM's whole
        contraction, what FSDP gathers for the GEMM anyway, as a constraint. The value itself without a mesh."""
        return self.gather_weight(param[...], tuple(param.out_sharding))

    def gather_weight(self, value, axes):
        """`gathered` of a weight's value with logical `axes` (inside the scan over layers the value has lost the
        leading `layers` axis: the last value.ndim of them apply)."""
        if self.mesh is None:
            return value
        return jax.lax.with_sharding_constraint(value, jax.sharding.NamedSharding(self.current_mesh,
                                                                                  self.weight_spec(value, axes)))

    def weight_spec(self, value, axes):
        """The PartitionSpec of a weight gathered over all but its tensor-parallel axes (gather_weight)."""
        return logical.keep_only(self.spec(axes[len(axes) - value.ndim:]), self.tensor)

    def mesh_axes(self, axis):
        """The mesh axes one logical axis is split over (() without a mesh)."""
        return () if self.mesh is None else logical.spec_axes(self.spec((axis,))[0])

    def ways(self, axis):
        """How many shards one logical axis is split into (1 without a mesh)."""
        return 1 if self.mesh is None else math.prod(self.mesh.shape[a] for a in self.mesh_axes(axis))

    # the axes a model's parallelisms run over
    @property
    def tensor(self):
        return self.mesh_axes("activation_heads")

    @property
    def expert(self):
        return self.mesh_axes("exp")

    @property
    def context(self):
        return self.mesh_axes("activation_length")

    @property
    def expert_mlp(self):
        return self.mesh_axes("moe_mlp")

    def token_axes(self):
        """(mesh axes of the tokens' batch dimension, ... of their sequence dimension), as [batch, length, embed]
        activations are placed (a mesh axis serves one dimension)."""
        if self.mesh is None:
            return (), ()
        batch, length, _ = (logical.spec_axes(e) for e in self.spec(TOKEN_AXES))
        return batch, length


NONE = ParallelLayout(None)
