"""Building blocks shared by the model families: parameters, RMSNorm, the SwiGLU MLP (attention: models/attention/).
Layers take explicit arguments, never a config.

Parameters carry logical axis names (`embed`, `heads`, `mlp`, ...); the parallel layout a layer is built with
(parallel/layout.py) maps them to mesh axes. Every weight matmul goes through models/matmul.py. Activations that a
remat policy may name are tagged from offload.names.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from MaxOffload.models import components, matmul
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
