"""The loss's cross-entropy tile by tile over the vocabulary (model.vocab_tiles, models/cross_entropy.py): the same
value and gradients as optax's from whole logits, for the main head and DeepSeek-V3's MTP heads, sharded, and a
compiled step that never holds the whole float32 logits."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import EIGHT_CPUS, ROOT, run_cli
from MaxOffload.config import ConfigError, load
from MaxOffload.models import cross_entropy


def optax_loss(x, head, targets, mask):
    logits = jnp.einsum("ble,ev->blv", x, head, preferred_element_type=jnp.float32)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask)


@pytest.mark.parametrize("tiles, shards", [(2, 1), (8, 1), (64, 1), (4, 2), (8, 4)])
def test_tiled_equals_optax_in_value_and_gradients(tiles, shards):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(16, 64)) * 2, jnp.float32)  # spread logits: the tiles' maxima differ
    targets = jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32)
    mask = jnp.ones((2, 8)).at[1, 3].set(0.0)
    logits_of = lambda x, w: jnp.einsum("ble,ev->blv", x, w, preferred_element_type=jnp.float32)  # noqa: E731
    tiled = lambda x, head: cross_entropy.tiled(x, head, targets, mask, tiles, logits_of, shards)[0]  # noqa: E731
    value, grads = jax.value_and_grad(tiled, argnums=(0, 1))(x, head)
    ref_value, ref_grads = jax.value_and_grad(optax_loss, argnums=(0, 1))(x, head, targets, mask)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for got, want in zip(grads, ref_grads):  # to 1e-5 of the gradient's scale (float32 sums in other orders)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert float(cross_entropy.tiled(x, head, targets, mask, tiles, logits_of, shards)[1]) == 15.0


def test_auto_tiles_are_slices_of_at_most_8192_columns_in_lanes_of_128():
    assert cross_entropy.tiles_for(128_256) == 167  # Llama 3: 768 columns a tile (128,256 = 128 x 2 x 3 x 167)
    assert cross_entropy.tiles_for(129_280) == 101  # DeepSeek-V3: 1,280
    assert cross_entropy.tiles_for(129_280, shards=2) == 101  # 640 of each shard's 64,640
    assert cross_entropy.tiles_for(32_768) == 4
    assert cross_entropy.tiles_for(512) == 1  # the whole logits
    assert cross_entropy.tiles_for(128_256, 3) == 3
    assert cross_entropy.tiles_for(32_000) == 5  # 6,400 columns = 50 lanes
    assert cross_entropy.tiles_for(50_000) == 8  # 50,000 = 2^4 x 5^5 has no slices of whole lanes: 6,250 columns
    assert cross_entropy.tiles_for(2 * 8209) == 2  # 8209 is prime: the most tiles that divide it
    assert cross_entropy.tiles_for(2 * 8209, shards=2) == 1  # each of 2 shards: 8209 columns


def test_a_tile_count_that_does_not_divide_the_vocabulary_is_one_line():
    with pytest.raises(ConfigError, match=r"model.vocab_tiles=3 must divide model.vocab_size=512"):
        load(["configs/llama3_1.py:tiny", "model.vocab_tiles=3"])


def test_the_model_loss_by_tiles_equals_whole_logits_and_never_holds_them():
    """Llama with its vocabulary split over `tensor` (tensor 2 x fsdp 4) and DeepSeek-V3 with two MTP heads, on 8
    devices: the loss and every gradient by 4 tiles equal the whole logits' (tests/helpers/cross_entropy_check.py),
    and only the untiled step holds the whole float32 logits."""
    specs = [["configs/llama3_1.py:tiny", "mesh.ici.tensor=2", "mesh.ici.fsdp=4"],
             ["configs/deepseek_v3.py:tiny", "model.mtp_depth=2", "model.num_layers=2"]]
    result = run_cli([os.path.join(ROOT, "tests", "helpers", "cross_entropy_check.py"), json.dumps(specs)],
                     env=EIGHT_CPUS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("equal:") == 2, result.stdout
