"""What a shard of a sequence split over context axes gathers to make the keys and values of the whole sequence
(models/attention/context.py's strategies take one): the keys and values themselves, or what they are made from
(DeepSeek's MLA: its latent and RoPE key, models/deepseek.py)."""
import dataclasses

from MaxOffload.models.attention.plain import KV_AXES, Q_AXES


def make_keys(expand, sources, weights):
    """(k, v) of a span of tokens from its sources: the sources themselves when `expand` is None."""
    return tuple(sources) if expand is None else expand(tuple(sources), weights)


@dataclasses.dataclass(frozen=True)
class KeySource:
    """What a shard of a sequence split over context axes all-gathers to make the keys and values of the whole
    sequence: per-token `sources` [b, l, ...] with their logical `axes`, and `expand(sources, weights) -> (k, v)`
    for any span of tokens, with `weights` (values, their logical `weight_axes`: gathered over all but their
    tensor-parallel axes). The keys and values themselves (`of_keys`, without expand), or MLA's latent and
    RoPE key, expanded block by block on every shard (models/deepseek.py, model.mla_context_gather=latent)."""
    sources: tuple
    axes: tuple
    expand: object = None  # None: the sources are (k, v)
    weights: tuple = ()
    weight_axes: tuple = ()

    @classmethod
    def of_keys(cls, q, k, v):
        kv_axes = Q_AXES if k.shape[2] == q.shape[2] else KV_AXES
        return cls((k, v), (kv_axes, kv_axes))

    def keys(self, sources, weights):
        """(k, v) of a span of tokens from its sources."""
        return make_keys(self.expand, sources, weights)

    def shard_map_args(self, layout):
        """(sources, weights) and their PartitionSpecs on the layout's mesh, as a shard_map takes them."""
        weights = tuple(layout.gather_weight(w, a) for w, a in zip(self.weights, self.weight_axes))
        specs = (tuple(layout.spec(a) for a in self.axes),
                 tuple(layout.weight_spec(w, a) for w, a in zip(self.weights, self.weight_axes)))
        return (self.sources, weights), specs
