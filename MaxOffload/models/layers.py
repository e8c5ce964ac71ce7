"""Building blocks shared by the model families: parameters, RMSNorm, the SwiGLU MLP (attention: models/attention/).
Layers take explicit arguments, never a config.

Parameters carry logical axis names (`embed`, `heads`, `mlp`, ...); the parallel layout a layer is built with
(parallel/layout.py) maps them to mesh axes. A layer receives its models/model_context.ModelContext (the layout
and the numerics) once, as `ctx`, and every weight matmul goes through it to models/matmul.py. Activations that a
remat policy may name are tagged from offload.names.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from MaxOffload.models import components
from MaxOffload.models.model_context import DEFAULT
from MaxOffload.offload import names

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


@jax.custom_vjp
def gated_silu(gate, up):
    """silu(gate) * up, the SwiGLU's gate. Its backward writes d(gate) and d(up) out once (an optimization
    barrier), so that the GEMMs reading them (the inputs' gradients and wi_0/wi_1's weight gradients) do not each
    recompute the sigmoid inside their operand fusion: on TPUs that recomputation held those GEMMs at 137-177 of
    the v5e's 197 TFLOP/s."""
    return jax.nn.silu(gate) * up


def _gated_silu_fwd(gate, up):
    return gated_silu(gate, up), (gate, up)


def _gated_silu_bwd(residuals, grad):
    gate, up = residuals
    g, x, u = (a.astype(jnp.float32) for a in (grad, gate, up))
    sig = jax.nn.sigmoid(x)
    d_up = g * x * sig
    d_gate = g * u * sig * (1.0 + x * (1.0 - sig))
    return jax.lax.optimization_barrier((d_gate.astype(gate.dtype), d_up.astype(up.dtype)))


gated_silu.defvjp(_gated_silu_fwd, _gated_silu_bwd)


class SwiGLU(nnx.Module):
    def __init__(self, *, emb_dim, mlp_dim, param_dtype, init_std, rngs, ctx=DEFAULT):
        self.ctx = ctx
        self.wi_0 = param(rngs, (emb_dim, mlp_dim), ("embed", "mlp"), param_dtype, init_std)
        self.wi_1 = param(rngs, (emb_dim, mlp_dim), ("embed", "mlp"), param_dtype, init_std)
        self.wo = param(rngs, (mlp_dim, emb_dim), ("mlp", "embed"), param_dtype, init_std)

    @components.scoped(components.MLP)
    def __call__(self, x):
        ctx = self.ctx
        gate = ctx.tag(ctx.project(x, self.wi_0, None, components.MLP), names.MLPWI_0)
        up = ctx.tag(ctx.project(x, self.wi_1, None, components.MLP), names.MLPWI_1)
        out = ctx.project(gated_silu(gate, up), self.wo, None, components.MLP)
        return ctx.tag(ctx.constrain(out, BATCH_LENGTH_EMBED), names.MLPWO)
