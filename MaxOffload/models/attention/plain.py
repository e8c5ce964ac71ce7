"""Causal attention in XLA (`model.attention=xla`): query blocks that attend only to the keys they can see, and
the same by position for a token order other than the sequence's (a context shard's keys: models/attention/
all_gather.py)."""
import math

import jax
import jax.numpy as jnp

from MaxOffload.models import components

Q_AXES = ("activation_batch", "activation_length", "activation_heads", "head_dim")
KV_AXES = ("activation_batch", "activation_length", "activation_kv_heads", "head_dim")
BLOCK = 512  # query rows per block of the xla path


def query_blocks(length, block=BLOCK):
    """[(first row, stop)] of the xla path's query blocks: rows first..stop-1 attend to keys 0..stop-1."""
    return [(start, min(start + block, length)) for start in range(0, length, block)]


def _grouped(q, kv_heads):
    """(q with its heads as [kv heads, group], the einsum letters of q and of the scores). Multi-head attention
    (DeepSeek's MLA: group 1) goes without the group axis: with a size-1 group axis XLA's GPU compiler (jaxlib
    0.10.2, deviceless GB200) fails to tile the backward pass's projection matmuls ("Couldn't find output tile
    sizes")."""
    b, length, heads, d = q.shape
    group = heads // kv_heads
    if group == 1:
        return q, "blkd", "bkls"
    return q.reshape(b, length, kv_heads, group, d), "blkgd", "bkgls"


def _visible(rows, keys, q_documents, k_documents, letters):
    """Which keys each query row sees: rows [.., r] >= keys [.., s] (causal by position), and where the rows hold
    documents (q_documents [b, r], k_documents [b, s], or None) only its own document's; shaped for the scores
    (`letters`: _grouped's), the batch and head axes broadcast."""
    visible = rows[..., :, None] >= keys[..., None, :]
    if q_documents is not None:
        visible = visible & (q_documents[:, :, None] == k_documents[:, None, :])
    if visible.ndim == 2:
        return visible
    return visible.reshape(visible.shape[0], *(1,) * (len(letters[1]) - 3), *visible.shape[1:])


def _cutter(documents):
    """(start, stop) -> the documents [b, l] of those tokens, or None without documents."""
    return lambda start, stop: None if documents is None else documents[:, start:stop]


def _attend(q, k, v, visible, scale, letters):
    """Softmax(q k^T x scale, masked to `visible` [.., q rows, keys]) v, the scores in float32."""
    qs, ss = letters
    scores = jnp.einsum(f"{qs},bskd->{ss}", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum(f"{ss},bskd->{qs}", probs, v)


@components.scoped(components.ATTENTION_SCORES)
def causal_attention(q, k, v, scale=None, block=BLOCK, documents=None):
    """Causal grouped-query attention without repeating k/v, in XLA.

    q: [b, l, heads, d]; k: [b, l, kv_heads, d]; v: [b, l, kv_heads, dv] with heads a multiple of
    kv_heads. Softmax in float32, scale 1/sqrt(d) unless given. Returns [b, l, heads, dv].

    Query blocks of `block` rows (the last one shorter: any length works) attend only to the keys up to their
    last row, so the work is about the causal half of the square (sum over blocks of rows x visible keys), and
    each block is recomputed in the backward pass, so the score matrix never exists whole: memory O(block x l)
    per head (at l=8192, 128 heads, the full fp32 scores would be 34 GB per sequence and layer). documents
    [b, l] (rows holding packed documents: which one each token belongs to) or None: a token then sees only its own
    document's keys.
    """
    b, length, heads, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, *letters = _grouped(q, k.shape[2])

    def attend(q_block, k_seen, v_seen, first_row, q_documents, k_documents):
        rows = first_row + jnp.arange(q_block.shape[1])
        visible = _visible(rows, jnp.arange(k_seen.shape[1]), q_documents, k_documents, letters)
        return _attend(q_block, k_seen, v_seen, visible, scale, letters)

    blocks = query_blocks(length, block)
    cut = _cutter(documents)
    if len(blocks) == 1:
        out = attend(q, k, v, 0, documents, documents)
    else:
        step = jax.checkpoint(attend, static_argnums=(3,))
        out = jnp.concatenate([step(q[:, start:stop], k[:, :stop], v[:, :stop], start, cut(start, stop), cut(0, stop))
                               for start, stop in blocks], axis=1)
    return out.reshape(b, length, heads, v.shape[-1])


def masked_attention(q, k, v, q_positions, k_positions, scale=None, block=BLOCK, q_documents=None,
                     k_documents=None):
    """Attention of queries at q_positions [b, lq] to keys at k_positions [b, lk]: a query sees the keys at or
    before its own position (causal in any token order), and with q_documents [b, lq] / k_documents [b, lk] only
    its own document's. q [b, lq, heads, d], k, v [b, lk, kv_heads, .]. Query blocks of `block` rows over all the
    keys, each recomputed in the backward pass (memory O(block x lk))."""
    b, length, heads, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, *letters = _grouped(q, k.shape[2])
    cut = _cutter(q_documents)

    def attend(q_block, rows, documents):
        return _attend(q_block, k, v, _visible(rows, k_positions, documents, k_documents, letters), scale, letters)

    blocks = query_blocks(length, block)
    step = jax.checkpoint(attend) if len(blocks) > 1 else attend
    out = jnp.concatenate([step(q[:, start:stop], q_positions[:, start:stop], cut(start, stop))
                           for start, stop in blocks], axis=1)
    return out.reshape(b, length, heads, v.shape[-1])
