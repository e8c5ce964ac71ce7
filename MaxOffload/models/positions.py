"""Where each token of a batch's rows is, as the layers see it: `Positions` goes from the embedding through every
layer (and the scans and checkpoints around them: it is a pytree) to RoPE and the attention kernels."""
import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Positions:
    """index [batch, length] int32: each token's position in its row (RoPE's angle and the causal order; in the
    layout's token order, models/stack.DecoderModel.embed_tokens). document [batch, length] int32 or None: which of
    the documents packed into its row it belongs to (data.attend_within_documents: a token attends only to earlier
    tokens of its own document); None: each row is one context."""
    index: jax.Array
    document: jax.Array | None = None
