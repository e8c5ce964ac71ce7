"""Context strategies: how the queries of a sequence split over the layout's context axes reach its keys
(`mesh.context_attention`, parallel/layout.ParallelLayout.context_attention).

STRATEGIES maps each name to the function that runs causal attention over the split,
`fn(q, source, positions, scale, kernel, layout)`: q [b, l, heads, d] (this shard's queries as the layout places
them), `source` a KeySource (models/attention/key_source.py: the keys and values, or what makes them), `positions`
the tokens' models/positions.Positions (global positions, which a load-balanced layout reorders; documents), `kernel` the chosen attention kernel
(models/kernels.attention_for); it returns [b, l, heads, dv]. None: no function of ours, XLA's automatic
partitioning of the whole-sequence attention. Adding a strategy is a module beside this one and one entry here;
config/validate.py accepts the names listed here.
"""
from MaxOffload.models.attention import all_gather

STRATEGIES = {
    "all_gather": all_gather.attend,  # each shard gathers the key source: models/attention/all_gather.py
    "partitioned": None,  # XLA's partitioning of the whole-sequence attention (the index-masked blocks)
}


def strategy(layout):
    """The function that runs attention over the layout's context split (STRATEGIES), or None: no split (one
    context shard), or a strategy that leaves it to XLA's partitioning."""
    return STRATEGIES[layout.context_attention] if layout.context_ways > 1 else None
