"""Logical axis names -> mesh axes.

Models name their axes (`embed`, `mlp`, `activation_batch`, ...); these rules say which mesh axes shard each one.
A model gets them inside its parallel layout (parallel/layout.py), never from a global.
"""
import math

from jax.sharding import NamedSharding, PartitionSpec

# `stage` first: pipeline stages are the outermost split (across racks over mesh.dcn.stage)
MESH_AXES = ("stage", "data", "fsdp", "tensor", "expert", "context")

# logical axis -> mesh axes that shard it (in order); absent or () = replicated.
DEFAULT_RULES = {
    # outside the pipelined stack the stages split the batch too (the embedding, head and unpipelined layers are
    # not computed once per stage); inside it the stage axis is manual and no placement names it
    "activation_batch": ("data", "fsdp", "expert", "stage"),
    "activation_length": ("context",),
    "activation_embed": (),
    "activation_heads": ("tensor",),
    "activation_kv_heads": ("tensor",),
    "activation_mlp": ("tensor",),
    "activation_vocab": ("tensor",),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "norm": (),
    "layers": (),
    # the pipelined stack's leading axis (parallel/pipeline.py): each stage holds its own layers
    "stage_layers": ("stage",),
    # DeepSeek: MLA latents (FSDP-shard the up-projections, whose other axes are heads) and experts.
    "q_lora": ("fsdp",),
    "kv_lora": ("fsdp",),
    "exp": ("expert",),
    # the routed experts' model dimension: FSDP-sharded like every weight's (gathered per micro-batch); [] keeps
    # each expert whole on its owners (the expert axis alone shards them: the token all-to-all's layout)
    "exp_embed": ("fsdp",),
    "moe_mlp": ("tensor",),
}

def partition_spec(axes, rules, mesh_axis_names=None):
    """Logical axes tuple -> PartitionSpec; a mesh axis is used at most once per array."""
    used, spec = set(), []
    for axis in axes:
        mesh_axes = tuple(a for a in rules.get(axis, ()) if a not in used
                          and (mesh_axis_names is None or a in mesh_axis_names))
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*spec)


def spec_axes(entry):
    """One PartitionSpec entry (None, a mesh axis or a tuple of them) -> the tuple of mesh axes."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def keep_only(spec, mesh_axes):
    """`spec` with each entry reduced to the mesh axes among `mesh_axes` (the dimension gathered over the rest)."""
    return PartitionSpec(*(tuple(a for a in spec_axes(entry) if a in mesh_axes) or None for entry in spec))


def ways(mesh, entry):
    """How many devices one PartitionSpec entry splits a dimension over."""
    return math.prod(mesh.shape[a] for a in spec_axes(entry))


def named_sharding(mesh, axes, rules):
    return NamedSharding(mesh, partition_spec(axes, rules, mesh.axis_names))
