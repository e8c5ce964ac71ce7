"""Expert parallelism's layout, made once from the mesh and the logical-axis rules (TrainSetup) and handed to
the model: which mesh axes split the experts (logical `exp`), each expert's hidden units (`moe_mlp`) and the
tokens (the batch and length axes). The MoE layer (models/moe.py) builds its exchange from this and never
reads the active mesh."""
import dataclasses

from MaxOffload.parallel import logical

TOKEN_AXES = ("activation_batch", "activation_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    mesh: object  # the jax.sharding.Mesh the exchange's shard_maps run over
    ep: tuple  # mesh axes the experts are split over
    mlp: tuple  # mesh axes each expert's hidden units are split over
    batch: tuple  # mesh axes of the tokens' batch dimension
    length: tuple  # ... and of their sequence dimension

    @classmethod
    def of(cls, mesh, rules):
        spec = lambda axes: logical.partition_spec(axes, rules, mesh.axis_names)  # noqa: E731
        batch, length, _ = (logical.spec_axes(e) for e in spec(TOKEN_AXES))
        return cls(mesh, logical.spec_axes(spec(("exp",))[0]), logical.spec_axes(spec(("moe_mlp",))[0]), batch,
                   length)
