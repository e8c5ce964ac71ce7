"""The GPU attention kernel, `flash`: tokamax.dot_product_attention(is_causal=True), its Pallas-Triton flash
attention on GPUs (one fused kernel per pass, scores never in HBM; GQA without repeating k/v, MLA's v head dim
below q/k's), on CPU its chunked XLA implementation (same API and custom VJP, so the path runs and is tested on
CPU); and the same kernels on pieces of the keys, combined by their log-sum-exp (a context shard's attention:
models/attention/all_gather.py). Which kernel runs where: models/kernels.attention_for."""
import jax.numpy as jnp

from MaxOffload.models import kernels
from MaxOffload.models.attention import tokamax_adapter


def flash_attention(q, k, v, scale, kernel, q_sharding=None, documents=None):
    """Causal attention by tokamax: q [b, l, heads, d], k [b, l, kv_heads, d], v [b, l, kv_heads, dv] ->
    [b, l, heads, dv]. `kernel`: from kernels.attention_for; `q_sharding`: q's NamedSharding, so that the kernel runs
    per shard (tokamax's shard_map: batch and heads split, a split sequence sees all keys). `documents` [b, l] (rows
    holding packed documents: which one each token belongs to) or None: tokamax takes no segment ids, so the
    kernel gets a mask of the row's token pairs [b, 1, l, l] (bool: l^2 bytes a row, 16 MiB at 4,096 tokens)."""
    mask = None if documents is None else (documents[:, None, :, None] == documents[:, None, None, :])
    return kernels.import_tokamax().dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                                          q_sharding=q_sharding,
                                                          implementation=kernels.implementation(kernel))


def _piece_implementation(kernel):
    """tokamax's implementation for attention computed in pieces (flash_attention_piece): its Triton kernels on GPUs;
    elsewhere its XLA implementation (the chunked one returns no log-sum-exp)."""
    name = kernels.implementation(kernel)
    return name if name == "triton" else "xla"


def flash_attention_piece(q, k, v, scale, kernel, causal):
    """Attention of q [b, l, heads, d] to one piece of its keys, k, v [b, s, kv_heads, .]: `causal` (aligned: the
    queries and keys are the same positions) or to all of them. Returns (the output normalized
    within the piece, its log-sum-exp [b, heads, l] in float32), which combine across pieces."""
    return tokamax_adapter.forward(_piece_implementation(kernel), q, k, v, scale, causal)


def flash_attention_piece_vjp(q, k, v, scale, kernel, causal, lse, out, dout):
    """(dq, dk, dv) of one piece of an attention (flash_attention_piece's arguments), given the whole attention's
    output, its cotangent and its log-sum-exp: the piece's probabilities are then exp(scores - lse), the whole
    attention's, and the pieces' gradients sum to the whole's. tokamax's VJP kernel on GPUs (its residuals are
    (max, sum): (lse, 1) says the same); elsewhere the same formulas in XLA."""
    grads = tokamax_adapter.vjp(_piece_implementation(kernel), q, k, v, scale, causal, lse, out, dout)
    if grads is not None:
        return grads
    f32 = jnp.float32
    group = q.shape[2] // k.shape[2]
    k_all, v_all = (jnp.repeat(a, group, axis=2).astype(f32) for a in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), k_all) * scale
    rows, keys = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    visible = (rows >= keys) if causal else True
    p = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
    dout, out = dout.astype(f32), out.astype(f32)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, dout)
    ds = p * (jnp.einsum("bqhd,bkhd->bhqk", dout, v_all) - jnp.einsum("bqhd,bqhd->bhq", out, dout)[..., None]) * scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k_all)
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(f32))
    per_kv_head = lambda a: a.reshape(*a.shape[:2], k.shape[2], group, a.shape[-1]).sum(3)  # noqa: E731
    return dq.astype(q.dtype), per_kv_head(dk).astype(k.dtype), per_kv_head(dv).astype(v.dtype)
