"""The next-token loss over the vocabulary: from whole logits (`masked`), or tile by tile from the hidden states and
the output head (`tiled`), so that the float32 logits [batch, length, vocab] never exist whole, in the forward
pass or the backward (model.vocab_tiles; `tiles_for` resolves it).

A tile is a strided set of the vocabulary's columns (tile k: columns k, k + T, k + 2T, ... of T tiles), so a
vocabulary sharded over devices stays evenly sharded inside every tile. Each tile's logits are made, reduced to
their maximum, their sum of exponentials and the targets' logits, and dropped; the backward pass makes them again
(a checkpointed scan body): one more output-head matmul a step, in exchange for never holding
[batch, length, vocab] float32 (4.2 GB at 4 x 2,048 tokens of Llama 3's 128,256 columns).
"""
import jax
import jax.numpy as jnp
import optax

MAX_COLUMNS = 8192  # a tile's columns at most under model.vocab_tiles=0 (auto), when a divisor allows
MAX_TILES = 256


def masked(logits, targets, mask):
    """(sum of next-token cross-entropy over positions where mask=1, number of such positions)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(losses * mask), jnp.sum(mask)


def tiles_for(vocab_size, tiles=0):
    """model.vocab_tiles resolved for `vocab_size`: `tiles` when given (1: whole logits), else (0, auto) the fewest
    tiles of at most MAX_COLUMNS columns that divide the vocabulary (at most MAX_TILES; 1 for a vocabulary of at
    most MAX_COLUMNS), or, when no such divisor exists, the most tiles that divide it."""
    if tiles:
        return tiles
    divisors = [t for t in range(1, min(MAX_TILES, vocab_size) + 1) if vocab_size % t == 0]
    return next((t for t in divisors if vocab_size // t <= MAX_COLUMNS), divisors[-1])


def tiled(x, head, targets, mask, tiles, logits_of):
    """masked(logits_of(x, head), targets, mask) without the whole logits: x [..., length, emb] the normalised
    hidden states, head [emb, vocab] the output head, `logits_of(x, w)` the head's matmul of x by a tile w
    [emb, vocab / tiles] (float32 logits). Gradients are those of `masked` (tests/test_cross_entropy.py)."""
    emb, vocab = head.shape
    w = jnp.moveaxis(head.reshape(emb, vocab // tiles, tiles), 2, 0)  # [tiles, emb, columns]: tile k = k::tiles
    column, owner = targets // tiles, targets % tiles
    wide = x.astype(jnp.float32)  # x's gradient summed over the tiles in float32, not in the compute dtype

    @jax.checkpoint
    def tile(carry, w_k_and_k):
        w_k, k = w_k_and_k
        logits = logits_of(wide.astype(x.dtype), w_k).astype(jnp.float32)
        top = jax.lax.stop_gradient(jnp.max(logits, -1))
        sums = jnp.sum(jnp.exp(logits - top[..., None]), -1)
        target = jnp.take_along_axis(logits, column[..., None], -1)[..., 0]
        return carry, (top, sums, jnp.where(owner == k, target, 0.0))

    _, (tops, sums, targets_logit) = jax.lax.scan(tile, None, (w, jnp.arange(tiles)))
    top = jnp.max(tops, 0)
    log_partition = top + jnp.log(jnp.sum(sums * jnp.exp(tops - top), 0))
    losses = log_partition - jnp.sum(targets_logit, 0)
    return jnp.sum(losses * mask), jnp.sum(mask)
