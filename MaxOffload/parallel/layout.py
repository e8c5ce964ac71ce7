"""The parallel layout a model is built for: the mesh, the logical-axis rules and the expert exchange, made once
(TrainSetup, from the resolved config) and handed to every family's constructor by models.build. Layers place
activations (`constrain`), run per-shard kernels (`sharding`) and exchange tokens between expert owners
(`exchange`, models/exchange.py) through it; nothing reads a global or thread-local mesh.

Without a mesh (an abstract model for counting parameters, a model built for one CPU device in a test) every
placement is a no-op: `NONE`.
"""
import dataclasses

import jax

from MaxOffload.parallel import logical

TOKEN_AXES = ("activation_batch", "activation_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    mesh: object  # jax.sharding.Mesh, or None
    rules: tuple = ()  # ((logical axis, (mesh axes, ...)), ...): hashable, so a module can hold it statically
    exchange: str = "all_gather"  # how routed tokens reach their experts' devices (models/exchange.EXCHANGES)

    @classmethod
    def of(cls, mesh, rules, exchange="all_gather"):
        return cls(mesh, tuple(sorted((axis, tuple(mesh_axes)) for axis, mesh_axes in rules.items())), exchange)

    @property
    def rule_map(self):
        return dict(self.rules)

    def spec(self, axes):
        """The PartitionSpec of logical `axes` on this mesh."""
        return logical.partition_spec(axes, self.rule_map, self.mesh.axis_names)

    def sharding(self, axes):
        """The NamedSharding of logical `axes`, or None without a mesh (for a kernel that runs per shard)."""
        return None if self.mesh is None else logical.named_sharding(self.mesh, axes, self.rule_map)

    def constrain(self, x, axes):
        """x placed by its logical axes (a sharding constraint); x itself without a mesh."""
        return x if self.mesh is None else jax.lax.with_sharding_constraint(x, self.sharding(axes))

    def gathered(self, param):
        """A parameter's value split only over its tensor-parallel mesh axes, all-gathered over the rest (fsdp, the
        expert axis's data-parallel share of a dense weight): every device holds each weight GEMM's whole
        contraction, what FSDP gathers for the GEMM anyway, as a constraint. The value itself without a mesh."""
        value = param[...]
        if self.mesh is None:
            return value
        axes = tuple(param.out_sharding)  # inside the scan over layers the value has lost the leading `layers` axis
        spec = logical.keep_only(self.spec(axes[len(axes) - value.ndim:]), self.tensor)
        return jax.lax.with_sharding_constraint(value, jax.sharding.NamedSharding(self.mesh, spec))

    def mesh_axes(self, axis):
        """The mesh axes one logical axis is split over (() without a mesh)."""
        return () if self.mesh is None else logical.spec_axes(self.spec((axis,))[0])

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
