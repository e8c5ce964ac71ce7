"""The next-token loss over the vocabulary: from whole logits (`masked`), or tile by tile from the hidden states and
the output head (`tiled`), so that the float32 logits [batch, length, vocab] never exist whole, in the forward
pass or the backward (model.vocab_tiles; `tiles_for` resolves it).

A tile is a contiguous slice of each device's block of the vocabulary (tile k of T: the k-th T-th of every block), so
a vocabulary sharded over devices stays evenly sharded inside every tile and a tile is a slice of the head, never a
relayout of it (a strided tile costs the TPU a transposed copy of the head and of its gradient).
Each tile's logits are made, folded into each row's running maximum, sum of exponentials and target logit, and
dropped; the backward pass (a custom VJP) makes them again, one at a time, and writes each tile's columns of the
head's gradient in place: one more output-head matmul a step, in exchange for never holding [batch, length, vocab]
float32 (4.2 GB at 4 x 2,048 tokens of Llama 3's 128,256 columns).
"""
import functools

import jax
import jax.numpy as jnp
import optax

MAX_COLUMNS = 8192  # a tile's columns at most under model.vocab_tiles=0 (auto), when a divisor allows
MAX_TILES = 256
# a tile's columns on a device, a multiple of this when the vocabulary allows: TPUs lay the head's columns out in
# lanes of 128, and a slice of another width makes XLA relayout the whole head (and its gradient) for the loop
LANES = 128


def masked(logits, targets, mask):
    """(sum of next-token cross-entropy over positions where mask=1, number of such positions)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(losses * mask), jnp.sum(mask)


def tiles_for(vocab_size, tiles=0, shards=1):
    """model.vocab_tiles resolved for `vocab_size` columns split over `shards` devices: `tiles` when given (1: whole
    logits), else (0, auto) the fewest tiles of at most MAX_COLUMNS columns that split each shard's columns into
    slices of a multiple of LANES (1 for a vocabulary of at most MAX_COLUMNS); without such a split, the fewest of at
    most MAX_COLUMNS columns, else the most that divide the shard's columns (at most MAX_TILES)."""
    if tiles:
        return tiles
    per_shard = vocab_size // shards
    divisors = [t for t in range(1, min(MAX_TILES, per_shard) + 1) if per_shard % t == 0]
    small = [t for t in divisors if vocab_size // t <= MAX_COLUMNS]
    aligned = [t for t in small if (per_shard // t) % LANES == 0]
    return (aligned or small or divisors)[0 if aligned or small else -1]


def tiles_under(config, layout):
    """(tiles, shards) of a model configuration's loss under a parallel layout: its vocabulary's shards
    (`layout.ways("vocab")`) and its model.vocab_tiles resolved for them (tiles_for)."""
    shards = layout.ways("vocab")
    return tiles_for(config.vocab_size, config.vocab_tiles, shards), shards


def tiled(x, head, targets, mask, tiles, logits_of, shards=1):
    """masked(logits_of(x, head), targets, mask) without the whole logits: x [batch, length, emb] the normalised
    hidden states, head [emb, vocab] the output head, its vocabulary split in `shards` equal blocks over devices,
    `logits_of(x, w)` the head's matmul of x by a tile w [emb, vocab / tiles] (float32 logits). Gradients are those
    of `masked` (tests/test_cross_entropy.py)."""
    return _tiled(x, head, targets, mask, (tiles, shards), logits_of), jnp.sum(mask)


def _tile(head, k, tiles, shards):
    """Tile k of `head` [emb, vocab] [emb, vocab / tiles]: columns k x c .. (k + 1) x c - 1 of each shard's block of
    vocab / shards columns (c = vocab / shards / tiles), the blocks side by side: a slice, no relayout of the head."""
    emb, vocab = head.shape
    columns = vocab // shards // tiles
    blocks = jax.lax.dynamic_slice_in_dim(head.reshape(emb, shards, vocab // shards), k * columns, columns, axis=2)
    return blocks.reshape(emb, shards * columns)


def _place(targets, vocab, tiles, shards):
    """(each target's tile, its column in that tile) (_tile's order)."""
    block, within = targets // (vocab // shards), targets % (vocab // shards)
    columns = vocab // shards // tiles
    return within // columns, block * columns + within % columns


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tiled(x, head, targets, mask, split, logits_of):
    return _tiled_forward(x, head, targets, mask, split, logits_of)[0]


def _tiled_forward(x, head, targets, mask, split, logits_of):
    """(sum of the masked losses, residuals): one pass over the tiles keeps each row's running maximum, sum of
    exponentials and target logit."""
    tiles, shards = split
    owner, column = _place(targets, head.shape[1], tiles, shards)

    def tile(k, carry):
        top, sums, target = carry
        logits = logits_of(x, _tile(head, k, tiles, shards)).astype(jnp.float32)
        new_top = jnp.maximum(top, jnp.max(logits, -1))
        sums = sums * jnp.exp(top - new_top) + jnp.sum(jnp.exp(logits - new_top[..., None]), -1)
        mine = jnp.take_along_axis(logits, column[..., None], -1)[..., 0]
        return new_top, sums, jnp.where(owner == k, mine, target)

    rows = jnp.full(targets.shape, -jnp.inf, jnp.float32)
    top, sums, target = jax.lax.fori_loop(0, tiles, tile, (rows, jnp.zeros_like(rows), jnp.zeros_like(rows)))
    log_partition = top + jnp.log(sums)
    return jnp.sum((log_partition - target) * mask), (x, head, targets, mask, log_partition)


def _tiled_backward(split, logits_of, residuals, g):
    """The tiles' logits made again, one at a time: d logits = (softmax - one-hot) x mask x g, through the head's
    matmul to x (summed over the tiles in float32) and to each tile's columns of the head (each column in one tile:
    written once in place, no sum)."""
    tiles, shards = split
    x, head, targets, mask, log_partition = residuals
    emb, vocab = head.shape
    owner, column = _place(targets, vocab, tiles, shards)
    weight = (mask * g).astype(jnp.float32)[..., None]
    columns = vocab // shards // tiles

    def tile(k, carry):
        dx, dhead = carry
        logits, pullback = jax.vjp(lambda x, w: logits_of(x, w).astype(jnp.float32), x, _tile(head, k, tiles, shards))
        one_hot = jax.nn.one_hot(jnp.where(owner == k, column, -1), logits.shape[-1], dtype=jnp.float32)
        dx_k, dw_k = pullback((jnp.exp(logits - log_partition[..., None]) - one_hot) * weight)
        dhead = jax.lax.dynamic_update_slice_in_dim(dhead, dw_k.reshape(emb, shards, columns), k * columns, axis=2)
        return dx + dx_k.astype(jnp.float32), dhead

    dx, dhead = jax.lax.fori_loop(0, tiles, tile, (jnp.zeros(x.shape, jnp.float32),
                                                   jnp.zeros((emb, shards, vocab // shards), head.dtype)))
    return dx.astype(x.dtype), dhead.reshape(emb, vocab), None, None


_tiled.defvjp(_tiled_forward, _tiled_backward)
