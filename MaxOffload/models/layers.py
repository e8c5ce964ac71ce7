"""Building blocks shared by the model families: parameters, RMSNorm, the SwiGLU MLP (attention: models/attention/).
Layers take explicit arguments, never a config.

Parameters carry logical axis names (`embed`, `heads`, `mlp`, ...); the parallel layout a layer is built with
(parallel/layout.py) maps them to mesh axes. Every weight matmul goes through models/matmul.py. Activations that a
remat policy may name are tagged from offload.names.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from MaxOffload.models import components, kernels, matmul
from MaxOffload.models.attention.plain import BLOCK, query_blocks
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
