"""Grouped-query self-attention with RoPE (Llama's): the projections around models/attention/dispatch.attention."""
import jax.numpy as jnp
from flax import nnx

from MaxOffload.models import components
from MaxOffload.models.attention.dispatch import attention
from MaxOffload.models.layers import BATCH_LENGTH_EMBED, param
from MaxOffload.models.model_context import DEFAULT
from MaxOffload.models.rope import apply_rope
from MaxOffload.offload import names


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE."""

    def __init__(self, *, emb_dim, num_heads, num_kv_heads, head_dim, inv_freq, param_dtype, init_std, rngs,
                 attention, ctx=DEFAULT):
        """attention: the kernel, chosen for the platform (models/kernels.attention_for)."""
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: hashable in the graph definition
        self.attention, self.ctx = attention, ctx
        self.wq = param(rngs, (emb_dim, num_heads, head_dim), ("embed", "heads", "head_dim"), param_dtype, init_std)
        self.wk = param(rngs, (emb_dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        param_dtype, init_std)
        self.wv = param(rngs, (emb_dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        param_dtype, init_std)
        self.wo = param(rngs, (num_heads, head_dim, emb_dim), ("heads", "head_dim", "embed"), param_dtype,
                        init_std)

    @components.scoped(components.PROJECTIONS)
    def __call__(self, x, positions):
        ctx = self.ctx
        project = lambda a, w, spec: ctx.project(a, w, spec, components.PROJECTIONS)  # noqa: E731
        q = ctx.tag(project(x, self.wq, "ble,ehd->blhd"), names.QUERY_PROJ)
        k = ctx.tag(project(x, self.wk, "ble,ehd->blhd"), names.KEY_PROJ)
        v = ctx.tag(project(x, self.wv, "ble,ehd->blhd"), names.VALUE_PROJ)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q = apply_rope(q, positions.index, inv_freq)
        k = apply_rope(k, positions.index, inv_freq)
        out = ctx.tag(attention(q, k, v, None, self.attention, ctx.layout, positions), names.ATTENTION_OUT)
        out = project(out, self.wo, "blhd,hde->ble")
        return ctx.tag(ctx.constrain(out, BATCH_LENGTH_EMBED), names.OUT_PROJ)
