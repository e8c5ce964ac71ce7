"""Building blocks shared by the model families. Layers take explicit arguments, never a config.

Parameters carry logical axis names (`embed`, `heads`, `mlp`, ...); the parallel layout a layer is built with
(parallel/layout.py) maps them to mesh axes. Every weight matmul goes through models/matmul.py. Activations that a
remat policy may name are tagged from offload.names.
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from MaxOffload.models import components, kernels, matmul
from MaxOffload.models.rope import apply_rope, rope_inv_freq  # noqa: F401  (re-exported)
from MaxOffload.offload import names
from MaxOffload.parallel.layout import NONE

BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")


def param(rngs, shape, axes, dtype, std):
    """A normal-initialised parameter annotated with logical axes (sharding is applied later)."""
    value = std * jax.random.normal(rngs.params(), shape, dtype=jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim, *, eps, param_dtype, rngs=None):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",), eager_sharding=False)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


Q_AXES = ("activation_batch", "activation_length", "activation_heads", "head_dim")
KV_AXES = ("activation_batch", "activation_length", "activation_kv_heads", "head_dim")
BLOCK = 512  # query rows per block of the xla path


def query_blocks(length, block=BLOCK):
    """[(first row, stop)] of the xla path's query blocks: rows first..stop-1 attend to keys 0..stop-1."""
    return [(start, min(start + block, length)) for start in range(0, length, block)]


def xla_work_multiple(length, block=BLOCK):
    """The xla path's score FLOPs as a multiple of the causal half the model counts (train/flops.py): each
    block computes rows x visible keys, 2x for one block, (n + 1) / n for n equal blocks."""
    return sum((stop - start) * stop for start, stop in query_blocks(length, block)) / (length * length / 2)


def attention_work_multiple(kernel, length, qk_dim, v_dim, block=BLOCK, layout=NONE):
    """The multiple of the model's attention FLOPs (the causal half: train/flops.py) the compiled step's
    attention takes by construction under `kernel` (models/kernels.attention_for): the xla path's blocks
    (xla_work_multiple), or over a context split gathering keys (context_attention) every query x every key: 2;
    flash's (T + 1) / T pairs per query, and its VJP's recomputed QK^T (audit.py _attention_flops:
    (8 d + 6 dv) / (6 (d + dv))); flash over a context split gathering keys (context_flash_attention), as the audit
    counts its kernels from their shapes: each chunk of c queries x every key for the earlier keys (the forward
    kernel skips the blocks past the bound, so this over-counts it; the backward computes them) and c (c + 1) / 2
    pairs for its own: 2 + (c + 1) / T."""
    if kernel == "xla":
        if layout.gathers_context:
            return 2.0
        return xla_work_multiple(length, block)
    per_pair = (8 * qk_dim + 6 * v_dim) / (6 * (qk_dim + v_dim))
    if layout.gathers_context:
        chunk = length // (layout.context_ways * (1 if layout.token_order(length) is None else 2))
        return (2 + (chunk + 1) / length) * per_pair
    return (length + 1) / length * per_pair


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


def _attend(q, k, v, visible, scale, letters):
    """Softmax(q k^T x scale, masked to `visible` [.., q rows, keys]) v, the scores in float32."""
    qs, ss = letters
    scores = jnp.einsum(f"{qs},bskd->{ss}", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum(f"{ss},bskd->{qs}", probs, v)


@components.scoped(components.ATTENTION_SCORES)
def causal_attention(q, k, v, scale=None, block=BLOCK):
    """Causal grouped-query attention without repeating k/v, in XLA.

    q: [b, l, heads, d]; k: [b, l, kv_heads, d]; v: [b, l, kv_heads, dv] with heads a multiple of
    kv_heads. Softmax in float32, scale 1/sqrt(d) unless given. Returns [b, l, heads, dv].

    Query blocks of `block` rows (the last one shorter: any length works) attend only to the keys up to their
    last row, so the work is about the causal half of the square (xla_work_multiple), and each block is
    recomputed in the backward pass, so the score matrix never exists whole: memory O(block x l) per head
    (at l=8192, 128 heads, the full fp32 scores would be 34 GB per sequence and layer).
    """
    b, length, heads, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, *letters = _grouped(q, k.shape[2])

    def attend(q_block, k_seen, v_seen, first_row):
        rows = first_row + jnp.arange(q_block.shape[1])
        return _attend(q_block, k_seen, v_seen, rows[:, None] >= jnp.arange(k_seen.shape[1])[None, :], scale,
                       letters)

    blocks = query_blocks(length, block)
    if len(blocks) == 1:
        out = attend(q, k, v, 0)
    else:
        step = jax.checkpoint(attend, static_argnums=(3,))
        out = jnp.concatenate([step(q[:, start:stop], k[:, :stop], v[:, :stop], start) for start, stop in blocks],
                              axis=1)
    return out.reshape(b, length, heads, v.shape[-1])


def masked_attention(q, k, v, q_positions, k_positions, scale=None, block=BLOCK):
    """Attention of queries at q_positions [b, lq] to keys at k_positions [b, lk]: a query sees the keys at or
    before its own position (causal in any token order). q [b, lq, heads, d], k, v [b, lk, kv_heads, .]. Query
    blocks of `block` rows over all the keys, each recomputed in the backward pass (memory O(block x lk))."""
    b, length, heads, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, *letters = _grouped(q, k.shape[2])
    head_axes = (1,) * (len(letters[1]) - 3)  # the scores' head axes, between their batch and rows

    def attend(q_block, rows):
        visible = rows[:, :, None] >= k_positions[:, None, :]  # [b, rows, keys]
        return _attend(q_block, k, v, visible.reshape(b, *head_axes, *visible.shape[1:]), scale, letters)

    blocks = query_blocks(length, block)
    step = jax.checkpoint(attend) if len(blocks) > 1 else attend
    out = jnp.concatenate([step(q[:, start:stop], q_positions[:, start:stop]) for start, stop in blocks], axis=1)
    return out.reshape(b, length, heads, v.shape[-1])


@components.scoped(components.ATTENTION_SCORES)
def context_attention(q, k, v, positions, scale, layout):
    """Causal attention of a sequence split over the layout's context axes (its all_gather strategy): each
    shard all-gathers the keys, the values and their positions over those axes and attends its own queries to
    them by position (masked_attention), so a load-balanced token order needs nothing else. Per shard: keys and
    values of the whole sequence, scores of its queries x every key."""
    kv_axes = Q_AXES if k.shape[2] == q.shape[2] else KV_AXES
    specs = (layout.spec(Q_AXES), layout.spec(kv_axes), layout.spec(kv_axes), layout.spec(Q_AXES[:2]))
    context = layout.context

    def local(q, k, v, q_positions):
        k, v, k_positions = (jax.lax.all_gather(a, context, axis=1, tiled=True) for a in (k, v, q_positions))
        return masked_attention(q, k, v, q_positions, k_positions, scale)

    return jax.shard_map(local, mesh=layout.mesh, in_specs=specs, out_specs=specs[0])(q, k, v, positions)


def _chunk_attention(q, k, v, keys, values, start, scale, kernel):
    """Causal attention of a chunk of queries (positions start..start+l-1) to the keys and values of the same
    positions (k, v) and to every earlier one (the first `start` of keys, values: the whole sequence in order), as
    two flash pieces (models/kernels.flash_attention_piece) combined by their log-sum-exp."""
    return _chunk_attention_fwd(q, k, v, keys, values, start, scale, kernel)[0]


def _chunk_attention_fwd(q, k, v, keys, values, start, scale, kernel):
    before, lse_before = kernels.flash_attention_piece(q, keys, values, scale, kernel, False, start)
    own, lse_own = kernels.flash_attention_piece(q, k, v, scale, kernel, True)
    lse = jnp.logaddexp(lse_before, lse_own)  # [b, heads, l]
    weight = lambda piece: jnp.moveaxis(jnp.exp(piece - lse), -1, -2)[..., None]  # noqa: E731  [b, l, heads, 1]
    out = (before * weight(lse_before) + own * weight(lse_own)).astype(q.dtype)
    return out, (q, k, v, keys, values, start, out, lse)


def _chunk_attention_bwd(scale, kernel, residuals, dout):
    q, k, v, keys, values, start, out, lse = residuals
    dq_before, dkeys, dvalues = kernels.flash_attention_piece_vjp(q, keys, values, scale, kernel, False, start, lse,
                                                                  out, dout)
    dq_own, dk, dv = kernels.flash_attention_piece_vjp(q, k, v, scale, kernel, True, None, lse, out, dout)
    return dq_before + dq_own, dk, dv, dkeys, dvalues, None


_chunk_attention = jax.custom_vjp(_chunk_attention, nondiff_argnums=(6, 7))
_chunk_attention.defvjp(_chunk_attention_fwd, _chunk_attention_bwd)


def context_flash_attention(q, k, v, scale, kernel, layout):
    """Causal attention of a sequence split over the layout's context axes, with the flash kernel per shard (its
    all_gather strategy): each shard all-gathers the keys and values, and each of its chunks of queries (one, or
    two under load balancing: chunks i and 2C-1-i) attends to its own positions with the kernel's aligned causal
    mask and to every earlier key with a key bound (one row for all queries), combined by log-sum-exp
    (_chunk_attention). No [queries, keys] mask or score buffer exists in the forward or the backward pass; the
    backward kernel computes the earlier keys' blocks past the bound too (they come out zero)."""
    kv_axes = Q_AXES if k.shape[2] == q.shape[2] else KV_AXES
    specs = (layout.spec(Q_AXES), layout.spec(kv_axes), layout.spec(kv_axes))
    context, ways = layout.context, layout.context_ways
    chunks = 2 if layout.token_order(q.shape[1] * ways) is not None else 1
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    def in_sequence_order(gathered):  # shard i's chunks i and 2C-1-i -> chunks 0..2C-1
        if chunks == 1:
            return gathered
        split = gathered.reshape(gathered.shape[0], ways, 2, -1, *gathered.shape[2:])
        return jnp.concatenate([split[:, :, 0], split[:, ::-1, 1]], axis=1).reshape(gathered.shape)

    def local(q, k, v):
        keys, values = (in_sequence_order(jax.lax.all_gather(a, context, axis=1, tiled=True)) for a in (k, v))
        shard, size = jax.lax.axis_index(context), q.shape[1] // chunks
        out = []
        for i in range(chunks):
            index = shard if i == 0 else 2 * ways - 1 - shard
            rows = slice(i * size, (i + 1) * size)
            out.append(_chunk_attention(q[:, rows], k[:, rows], v[:, rows], keys, values, index * size, scale,
                                        kernel))
        return jnp.concatenate(out, axis=1)

    # Pallas kernels inside shard_map declare no per-axis variance of their outputs (check_vma off)
    return jax.shard_map(local, mesh=layout.mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(q, k, v)


def attention(q, k, v, scale, kernel, layout=NONE, positions=None):
    """Causal attention by `kernel`: models/kernels.attention_for of `model.attention` (TrainSetup chooses it for
    its devices; an unchosen one is chosen here for this process's default device). The flash kernel runs per
    shard of the layout's query sharding. The xla path over a sequence split by the layout's context axes:
    context_attention (`mesh.context_attention=all_gather`), or XLA's partitioning of causal_attention;
    `positions` [b, l]: the tokens' global positions (needed when the layout reorders them)."""
    kernel = kernels.attention_for(kernel, kernels.platform(jax.devices()[0]))
    if kernel == "xla":
        if layout.gathers_context:
            return context_attention(q, k, v, positions, scale, layout)
        return causal_attention(q, k, v, scale)
    with jax.named_scope(components.ATTENTION_SCORES):
        if layout.gathers_context:
            return context_flash_attention(q, k, v, scale, kernel, layout)
        return kernels.flash_attention(q, k, v, scale, kernel, layout.sharding(Q_AXES))


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE."""

    def __init__(self, *, emb_dim, num_heads, num_kv_heads, head_dim, inv_freq, param_dtype, numerics, init_std,
                 rngs, attention="auto", layout=NONE):
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: hashable in the graph definition
        self.numerics, self.attention, self.layout = numerics, attention, layout
        self.wq = param(rngs, (emb_dim, num_heads, head_dim), ("embed", "heads", "head_dim"), param_dtype, init_std)
        self.wk = param(rngs, (emb_dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        param_dtype, init_std)
        self.wv = param(rngs, (emb_dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        param_dtype, init_std)
        self.wo = param(rngs, (num_heads, head_dim, emb_dim), ("heads", "head_dim", "embed"), param_dtype,
                        init_std)

    @components.scoped(components.PROJECTIONS)
    def __call__(self, x, positions):
        project = lambda spec, a, w: matmul.dense(a, matmul.weight(w, self.numerics, self.layout), spec,  # noqa: E731
                                                  components.PROJECTIONS, self.numerics)
        q = self.numerics.tag(project("ble,ehd->blhd", x, self.wq), names.QUERY_PROJ)
        k = self.numerics.tag(project("ble,ehd->blhd", x, self.wk), names.KEY_PROJ)
        v = self.numerics.tag(project("ble,ehd->blhd", x, self.wv), names.VALUE_PROJ)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        out = self.numerics.tag(attention(q, k, v, None, self.attention, self.layout, positions),
                                names.ATTENTION_OUT)
        out = project("blhd,hde->ble", out, self.wo)
        return self.numerics.tag(self.layout.constrain(out, BATCH_LENGTH_EMBED), names.OUT_PROJ)


class SwiGLU(nnx.Module):
    def __init__(self, *, emb_dim, mlp_dim, param_dtype, numerics, init_std, rngs, layout=NONE):
        self.numerics, self.layout = numerics, layout
        self.wi_0 = param(rngs, (emb_dim, mlp_dim), ("embed", "mlp"), param_dtype, init_std)
        self.wi_1 = param(rngs, (emb_dim, mlp_dim), ("embed", "mlp"), param_dtype, init_std)
        self.wo = param(rngs, (mlp_dim, emb_dim), ("mlp", "embed"), param_dtype, init_std)

    @components.scoped(components.MLP)
    def __call__(self, x):
        mlp = lambda a, w: matmul.dense(a, matmul.weight(w, self.numerics, self.layout), None,  # noqa: E731
                                        components.MLP, self.numerics)
        gate = self.numerics.tag(mlp(x, self.wi_0), names.MLPWI_0)
        up = self.numerics.tag(mlp(x, self.wi_1), names.MLPWI_1)
        out = mlp(jax.nn.silu(gate) * up, self.wo)
        return self.numerics.tag(self.layout.constrain(out, BATCH_LENGTH_EMBED), names.MLPWO)
