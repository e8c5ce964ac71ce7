"""Grouped-query self-attention with RoPE (Llama's): the projections around models/attention/dispatch.attention."""
import jax.numpy as jnp
from flax import nnx

from MaxOffload.models import components, matmul
from MaxOffload.models.attention.dispatch import attention
from MaxOffload.models.layers import BATCH_LENGTH_EMBED, param
from MaxOffload.models.rope import apply_rope
from MaxOffload.offload import names
from MaxOffload.parallel.layout import NONE


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE."""

    def __init__(self, *, emb_dim, num_heads, num_kv_heads, head_dim, inv_freq, param_dtype, numerics, init_std,
                 rngs, attention, layout=NONE):
        """attention: the kernel, chosen for the platform (models/kernels.attention_for)."""
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
