"""The context strategy `all_gather` (mesh.context_attention=all_gather; models/attention/context.py): each shard of
a sequence split over the layout's context axes all-gathers the key source (KeySource: the keys and values, or
MLA's latent) over those axes and attends its own queries to the whole sequence's keys. XLA path: masked by
position (any token order: load balancing's). Splash path (TPUs): the kernel on the shard's queries against the
whole sequence's keys (splash.context_splash_attention). Flash path: the kernel on pieces, each chunk of queries to its own
keys causally and to every earlier block of keys whole, combined by log-sum-exp; no [queries, keys] mask or score
buffer exists in the forward or the backward pass."""
import functools
import math

import jax
import jax.numpy as jnp

from MaxOffload.models import components, kernels
from MaxOffload.models.attention.flash import flash_attention_piece, flash_attention_piece_vjp
from MaxOffload.models.attention.key_source import make_keys
from MaxOffload.models.attention.plain import Q_AXES, masked_attention
from MaxOffload.models.attention.splash import context_splash_attention


def attend(q, source, positions, scale, kernel, layout):
    """Causal attention of q [b, l, heads, d] (a sequence split over the layout's context axes) to the keys and
    values `source` (KeySource) makes, by `kernel` (chosen: models/kernels.attention_for); `positions`: the tokens'
    models/positions.Positions (global positions; documents: each token attends within its own)."""
    if kernel == "xla":
        return context_attention(q, source, positions, scale, layout)
    with jax.named_scope(components.ATTENTION_SCORES):
        if kernels.is_splash(kernel):
            return context_splash_attention(q, source, scale, kernel, layout, documents=positions.document)
        if positions.document is not None:  # TrainSetup refuses this: said here for direct callers
            raise ValueError("the flash kernel over context shards runs no document mask: model.attention=xla")
        return context_flash_attention(q, source, scale, kernel, layout)


@components.scoped(components.ATTENTION_SCORES)
def context_attention(q, source, positions, scale, layout):
    """Causal attention of a sequence split over the layout's context axes, the XLA path: each shard all-gathers
    the key source (KeySource) and the positions (and documents) over those axes, makes the keys and values of the
    whole sequence and attends its own queries to them by position (masked_attention), so a load-balanced token
    order needs nothing else. Per shard: keys and values of the whole sequence, scores of its queries x every key."""
    (sources, weights), (source_specs, weight_specs) = source.shard_map_args(layout)
    context = layout.context

    def local(q, sources, weights, positions):
        gather = lambda a: jax.lax.all_gather(a, context, axis=1, tiled=True)  # noqa: E731
        k, v = source.keys(tuple(gather(a) for a in sources), weights)
        everyone = jax.tree.map(gather, positions)
        return masked_attention(q, k, v, positions.index, everyone.index, scale, q_documents=positions.document,
                                k_documents=everyone.document)

    rows = layout.spec(Q_AXES[:2])
    specs = (layout.spec(Q_AXES), source_specs, weight_specs, jax.tree.map(lambda _: rows, positions))
    return jax.shard_map(local, mesh=layout.current_mesh, in_specs=specs, out_specs=specs[0])(q, sources, weights,
                                                                                      positions)


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
    """A context shard's causal attention in flash pieces (models/attention/flash.flash_attention_piece): each of
    its `chunks` chunks of c queries attends to its own keys causally and, in a loop of static length
    (_earlier_block), to each earlier block of c keys whole, the pieces combined by their log-sum-exp. `local`: this
    shard's key sources, `gathered`: every shard's, in shard order (KeySource); keys and values are made block by
    block, so no buffer holds them for the whole sequence but gathered sources that are themselves keys."""
    return _context_pieces_fwd(q, local, gathered, weights, shard, scale, kernel, expand, ways, chunks)[0]


@components.scoped(components.ATTENTION_SCORES)  # the backward's too: traced outside the forward's scopes
def _context_pieces_fwd(q, local, gathered, weights, shard, scale, kernel, expand, ways, chunks):
    size, qs = q.shape[1] // chunks, _chunks(q, chunks)
    pieces = [flash_attention_piece(qs[i], *make_keys(expand, own, weights), scale, kernel, True)
              for i, own in enumerate(_own(local, chunks))]
    carry = (jnp.stack([o.astype(jnp.float32) for o, _ in pieces]), jnp.stack([lse for _, lse in pieces]))

    def earlier(t, carry):
        chunk, block, causal = _earlier_block(t, shard, chunks)
        at = _gathered_block(block, ways, chunks)
        k, v = make_keys(expand, (_block(g, at, size) for g in gathered), weights)
        out, lse = flash_attention_piece(qs[chunk], k, v, scale, kernel, False)
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
        (k, v), expand_vjp = jax.vjp(functools.partial(make_keys, expand), tuple(sources), weights)
        dq, dk, dv = flash_attention_piece_vjp(q_chunk, k, v, scale, kernel, aligned, lse[chunk], outs[chunk],
                                               douts[chunk])
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
    """Causal attention of a sequence split over the layout's context axes, with the flash kernel per shard: each
    shard all-gathers the key source (KeySource: the keys and values, or MLA's latent) and attends each of its
    chunks of queries (one, or two under load balancing: chunks i and 2C-1-i) to its own keys with the kernel's
    aligned causal mask and to every earlier block of keys whole, combined by log-sum-exp (_context_pieces). No
    [queries, keys] mask or score buffer exists in the forward or the backward pass; keys and values are made per
    block; load-balanced, the pieces are the causal half's (query, key) pairs, (T + 1) / T of it; in sequence order
    every shard computes the last shard's C - 1 earlier blocks."""
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
