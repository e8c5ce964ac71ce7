"""Building blocks shared by the model families. Layers take explicit arguments, never a config.

Parameters carry logical axis names (`embed`, `heads`, `mlp`, ...); the parallel layout a layer is built with
(parallel/layout.py) maps them to mesh axes. Every weight matmul goes through models/matmul.py. Activations that a
remat policy may name are tagged from offload.names.
"""
import dataclasses
import functools
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
    (8 d + 6 dv) / (6 (d + dv))); flash over C context shards gathering keys (context_flash_attention), as the audit
    counts its kernels from their shapes: each chunk of c queries c (c + 1) / 2 pairs with its own keys and c^2 with
    each earlier block of c keys: load-balanced exactly the causal half's (T + 1) / T; in sequence order every shard
    computes the last shard's C - 1 blocks, (c + 1) / T + 2 - 2 / C."""
    if kernel == "xla":
        if layout.gathers_context:
            return 2.0
        return xla_work_multiple(length, block)
    per_pair = (8 * qk_dim + 6 * v_dim) / (6 * (qk_dim + v_dim))
    if kernels.is_splash(kernel):  # whole blocks on and below the diagonal (audit.tpu_splash_flops)
        return (length + (kernels.splash_block(length, kernel) or length)) / length * per_pair
    if layout.gathers_context and layout.token_order(length) is None:
        ways = layout.context_ways
        return ((length // ways + 1) / length + 2 - 2 / ways) * per_pair
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
        return _keys(self.expand, sources, weights)

    def shard_map_args(self, layout):
        """(sources, weights) and their PartitionSpecs on the layout's mesh, as a shard_map takes them."""
        weights = tuple(layout.gather_weight(w, a) for w, a in zip(self.weights, self.weight_axes))
        specs = (tuple(layout.spec(a) for a in self.axes),
                 tuple(layout.weight_spec(w, a) for w, a in zip(self.weights, self.weight_axes)))
        return (self.sources, weights), specs


@components.scoped(components.ATTENTION_SCORES)
def context_attention(q, source, positions, scale, layout):
    """Causal attention of a sequence split over the layout's context axes (its all_gather strategy), the XLA
    path: each shard all-gathers the key source (KeySource) and the positions over those axes, makes the keys and
    values of the whole sequence and attends its own queries to them by position (masked_attention), so a
    load-balanced token order needs nothing else. Per shard: keys and values of the whole sequence, scores of its
    queries x every key."""
    (sources, weights), (source_specs, weight_specs) = source.shard_map_args(layout)
    context = layout.context

    def local(q, sources, weights, q_positions):
        gather = lambda a: jax.lax.all_gather(a, context, axis=1, tiled=True)  # noqa: E731
        k, v = source.keys(tuple(gather(a) for a in sources), weights)
        return masked_attention(q, k, v, q_positions, gather(q_positions), scale)

    specs = (layout.spec(Q_AXES), source_specs, weight_specs, layout.spec(Q_AXES[:2]))
    return jax.shard_map(local, mesh=layout.current_mesh, in_specs=specs, out_specs=specs[0])(q, sources, weights,
                                                                                      positions)


def _keys(expand, sources, weights):
    return tuple(sources) if expand is None else expand(tuple(sources), weights)


def _earlier_block(t, shard, chunks):
    """Iteration t of a shard's loop over (its query chunk, an earlier key block) pairs -> (chunk, block,
    whether the pair is causal work). One chunk (shard i of C holds positions i c .. (i + 1) c - 1): blocks 0..C-2,
    those from i on past its causal edge (computed, then dropped: the last shard, which sets the step's time,
    does all C-1). Two chunks (load balancing: chunks i and 2C-1-i): the first's i blocks, then the second's
    2C-1-i, 2C-1 on every shard."""
    if chunks == 1:
        return 0, t, t < shard
    second = (t >= shard).astype(jnp.int32)
    return second, t - second * shard, True


def _earlier_blocks(ways, chunks):
    """The length of a shard's loop over earlier key blocks (_earlier_block)."""
    return ways - 1 if chunks == 1 else 2 * ways - 1


def _weighted(out, lse, total):
    """A piece's output [b, l, heads, dv] weighted by its share exp(lse - total) of the whole softmax."""
    return out * jnp.moveaxis(jnp.exp(lse - total), -1, -2)[..., None]


def _own(local, chunks):
    """A shard's key sources [b, chunks x c, ...] -> per chunk, its sources [b, c, ...]."""
    return list(zip(*(jnp.split(s, chunks, axis=1) for s in local)))


def _chunks(a, chunks):
    """[b, chunks x c, ...] -> [chunks, b, c, ...]."""
    return jnp.stack(jnp.split(a, chunks, axis=1))


def _unchunk(a):
    return jnp.concatenate(list(a), axis=1)


def _block(a, block, size):
    return jax.lax.dynamic_slice_in_dim(a, block * size, size, axis=1)


def _gathered_block(block, ways, chunks):
    """Where block `block` of the sequence (in sequence order) is in a gather of every shard's chunks: shard i's
    chunks i and 2C-1-i follow each other under load balancing."""
    if chunks == 1:
        return block
    return jnp.where(block < ways, 2 * block, 2 * (2 * ways - 1 - block) + 1)


def _context_pieces(q, local, gathered, weights, shard, scale, kernel, expand, ways, chunks):
    """A context shard's causal attention in flash pieces (models/kernels.flash_attention_piece): each of its
    `chunks` chunks of c queries attends to its own keys causally and, in a loop of static length (_earlier_block),
    to each earlier block of c keys whole, the pieces combined by their log-sum-exp. `local`: this shard's key
    sources, `gathered`: every shard's, in shard order (KeySource); keys and values are made block by block, so no
    buffer holds them for the whole sequence but gathered sources that are themselves keys."""
    return _context_pieces_fwd(q, local, gathered, weights, shard, scale, kernel, expand, ways, chunks)[0]


@components.scoped(components.ATTENTION_SCORES)  # the backward's too: traced outside the forward's scopes
def _context_pieces_fwd(q, local, gathered, weights, shard, scale, kernel, expand, ways, chunks):
    size, qs = q.shape[1] // chunks, _chunks(q, chunks)
    pieces = [kernels.flash_attention_piece(qs[i], *_keys(expand, own, weights), scale, kernel, True)
              for i, own in enumerate(_own(local, chunks))]
    carry = (jnp.stack([o.astype(jnp.float32) for o, _ in pieces]), jnp.stack([lse for _, lse in pieces]))

    def earlier(t, carry):
        chunk, block, causal = _earlier_block(t, shard, chunks)
        at = _gathered_block(block, ways, chunks)
        k, v = _keys(expand, (_block(g, at, size) for g in gathered), weights)
        out, lse = kernels.flash_attention_piece(qs[chunk], k, v, scale, kernel, False)
        lse = jnp.where(causal, lse, -jnp.inf)
        acc_out, acc_lse = carry[0][chunk], carry[1][chunk]
        total = jnp.logaddexp(acc_lse, lse)
        new = (_weighted(acc_out, acc_lse, total) + _weighted(out.astype(jnp.float32), lse, total), total)
        return tuple(jax.lax.dynamic_update_index_in_dim(a, n, chunk, 0) for a, n in zip(carry, new))

    outs, lse = jax.lax.fori_loop(0, _earlier_blocks(ways, chunks), earlier, carry)
    outs = outs.astype(q.dtype)
    return _unchunk(outs), (q, local, gathered, weights, shard, outs, lse)


@components.scoped(components.ATTENTION_SCORES)
def _context_pieces_bwd(scale, kernel, expand, ways, chunks, residuals, dout):
    q, local, gathered, weights, shard, outs, lse = residuals
    size, qs, douts = q.shape[1] // chunks, _chunks(q, chunks), _chunks(dout, chunks)
    f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
    add = lambda a, b: jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)  # noqa: E731

    def piece(q_chunk, chunk, sources, aligned, visible=True):
        """(dq, d sources, d weights) of one piece given the whole attention's output and log-sum-exp; `aligned`:
        the chunk's own keys (causal mask), `visible`: whether an earlier block is causal work (else it gives 0)."""
        (k, v), expand_vjp = jax.vjp(functools.partial(_keys, expand), tuple(sources), weights)
        dq, dk, dv = kernels.flash_attention_piece_vjp(q_chunk, k, v, scale, kernel, aligned, lse[chunk],
                                                       outs[chunk], douts[chunk])
        if visible is not True:
            dq, dk, dv = (jnp.where(visible, a, 0) for a in (dq, dk, dv))
        return (dq, *expand_vjp((dk, dv)))

    own = [piece(qs[i], i, sources, True) for i, sources in enumerate(_own(local, chunks))]
    dq = jnp.stack([d.astype(jnp.float32) for d, _, _ in own])
    dlocal = tuple(jnp.concatenate(parts, axis=1) for parts in zip(*(d for _, d, _ in own)))
    dweights = f32(weights)
    for _, _, dw in own:
        dweights = add(dweights, dw)

    def earlier(t, carry):
        dq, dgathered, dweights = carry
        chunk, block, causal = _earlier_block(t, shard, chunks)
        at = _gathered_block(block, ways, chunks)
        d_q, d_sources, d_weights = piece(qs[chunk], chunk, (_block(g, at, size) for g in gathered), False, causal)
        dq = jax.lax.dynamic_update_index_in_dim(dq, dq[chunk] + d_q.astype(jnp.float32), chunk, 0)
        dgathered = tuple(jax.lax.dynamic_update_slice_in_dim(g, _block(g, at, size) + d.astype(g.dtype),
                                                              at * size, axis=1)
                          for g, d in zip(dgathered, d_sources))
        return dq, dgathered, add(dweights, d_weights)

    dq, dgathered, dweights = jax.lax.fori_loop(0, _earlier_blocks(ways, chunks), earlier,
                                                (dq, tuple(jnp.zeros_like(g) for g in gathered), dweights))
    dweights = tuple(d.astype(w.dtype) for d, w in zip(dweights, weights))
    return _unchunk(dq).astype(q.dtype), dlocal, dgathered, dweights, None


_context_pieces = jax.custom_vjp(_context_pieces, nondiff_argnums=(5, 6, 7, 8, 9))
_context_pieces.defvjp(_context_pieces_fwd, _context_pieces_bwd)


def context_flash_attention(q, source, scale, kernel, layout):
    """Causal attention of a sequence split over the layout's context axes, with the flash kernel per shard (its
    all_gather strategy): each shard all-gathers the key source (KeySource: the keys and values, or MLA's latent)
    and attends each of its chunks of queries (one, or two under load balancing: chunks i and 2C-1-i) to its own
    keys with the kernel's aligned causal mask and to every earlier block of keys whole, combined by log-sum-exp
    (_context_pieces). No [queries, keys] mask or score buffer exists in the forward or the backward pass; keys
    and values are made per block; load-balanced, the pieces are the causal half (attention_work_multiple)."""
    (sources, weights), (source_specs, weight_specs) = source.shard_map_args(layout)
    context, ways = layout.context, layout.context_ways
    chunks = 2 if layout.token_order(q.shape[1] * ways) is not None else 1
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    def local(q, sources, weights):
        gathered = tuple(jax.lax.all_gather(a, context, axis=1, tiled=True) for a in sources)
        return _context_pieces(q, sources, gathered, weights, jax.lax.axis_index(context), scale, kernel,
                               source.expand, ways, chunks)

    # Pallas kernels inside shard_map declare no per-axis variance of their outputs (check_vma off)
    specs = (layout.spec(Q_AXES), source_specs, weight_specs)
    return jax.shard_map(local, mesh=layout.current_mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(
        q, sources, weights)


def attention(q, k, v, scale, kernel, layout=NONE, positions=None, source=None):
    """Causal attention by `kernel`: models/kernels.attention_for of `model.attention` (TrainSetup chooses it for
    its devices; an unchosen one is chosen here for this process's default device). The flash kernel runs per
    shard of the layout's query sharding. Over a sequence split by the layout's context axes
    (`mesh.context_attention=all_gather`) each shard gathers `source` (KeySource; by default k and v, which are
    then not needed): context_attention (xla), context_flash_attention (flash); else XLA's partitioning of
    causal_attention. `positions` [b, l]: the tokens' global positions (needed when the layout reorders them)."""
    kernel = kernels.attention_for(kernel, kernels.platform(jax.devices()[0]))
    if layout.gathers_context:
        if kernels.is_splash(kernel):  # TrainSetup refuses this layout: said here for direct callers
            raise ValueError("splash attention does not run over a context axis yet: model.attention=xla there")
        source = source or KeySource.of_keys(q, k, v)
        if kernel == "xla":
            return context_attention(q, source, positions, scale, layout)
        with jax.named_scope(components.ATTENTION_SCORES):
            return context_flash_attention(q, source, scale, kernel, layout)
    if kernel == "xla" or (kernels.is_splash(kernel) and kernels.splash_block(q.shape[1], kernel) is None):
        return causal_attention(q, k, v, scale)  # (splash: a length no block divides, only in shape-only traces:
        #                                           TrainSetup refuses such a train.seq_len)
    with jax.named_scope(components.ATTENTION_SCORES):
        if kernels.is_splash(kernel):
            return kernels.splash_attention(q, k, v, scale, layout.sharding(Q_AXES), kernel=kernel)
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
