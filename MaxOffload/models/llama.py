"""Llama 3 / 3.1 decoder: embedding, scanned pre-norm decoder layers (GQA + RoPE, SwiGLU), unembedding."""
import dataclasses

import jax.numpy as jnp
from flax import nnx

from MaxOffload.errors import require, require_choice
from MaxOffload.models import components
from MaxOffload.models.attention.gqa import Attention
from MaxOffload.models.base import ModelConfig, field
from MaxOffload.models.layers import RMSNorm, SwiGLU
from MaxOffload.models.rope import rope_inv_freq
from MaxOffload.models.stack import SingleStackDecoder
from MaxOffload.offload import names


_LLAMA3_1 = dict(vocab_size=128256, head_dim=128, norm_eps=1e-5, rope_theta=500000.0, rope_scaling="llama3",
                 rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_len=8192, tie_embeddings=False)

# Published dimensions (Meta's Llama 3.1 model cards) and small sizes for CPU work.
PRESETS = {
    "llama3_1_8b": dict(_LLAMA3_1, emb_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, mlp_dim=14336),
    "llama3_1_70b": dict(_LLAMA3_1, emb_dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, mlp_dim=28672),
    "llama3_1_405b": dict(_LLAMA3_1, emb_dim=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                          mlp_dim=53248),
    "tiny": dict(vocab_size=512, emb_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 mlp_dim=176),
    "small": dict(vocab_size=512, emb_dim=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                  mlp_dim=704),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(ModelConfig):
    """Llama's own fields beside the shared ones (models/base.ModelConfig): GQA, Llama 3.1 RoPE scaling."""
    num_kv_heads: int = field(4, "llama: key/value heads (grouped-query attention); divides num_heads")
    head_dim: int = field(32, "llama: dimension per attention head")
    rope_low_freq_factor: float = field(1.0, "llama3 scaling: low_freq_factor")
    rope_high_freq_factor: float = field(4.0, "llama3 scaling: high_freq_factor")



    def validate(self):
        self.require_positive("num_kv_heads", "head_dim")
        require(self.num_heads % self.num_kv_heads == 0,
                f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}")
        require(self.head_dim % 2 == 0, f"model.head_dim={self.head_dim} must be even for RoPE")
        require_choice("model.rope_scaling", self.rope_scaling, ("none", "llama3"))
        if self.rope_scaling == "llama3":
            require(self.rope_factor >= 1, f"model.rope_factor must be >= 1, got {self.rope_factor}")
            require(0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                    "model.rope_low_freq_factor must be > 0 and below model.rope_high_freq_factor")
            self.require_positive("rope_original_max_len")

    def matmul_params_by_component(self):
        """Weights each token multiplies by, per models/components part (embedding lookup excluded)."""
        d, hd = self.emb_dim, self.head_dim
        attention = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        return {components.PROJECTIONS: self.num_layers * attention,
                components.MLP: self.num_layers * 3 * d * self.mlp_dim, components.UNEMBED: d * self.vocab_size}

    def attention_dims(self):
        """(layers, heads, qk_dim, v_dim) for the attention-score FLOPs."""
        return self.num_layers, self.num_heads, self.head_dim, self.head_dim

    def contractions(self, model_group, seq_len):
        """{tagged name: K of the matmul producing it} (recompute FLOPs = 2 x elements x K; 0: no matmul)."""
        d = self.emb_dim
        n = names
        return {n.DECODER_LAYER_INPUT: 0, n.QUERY_PROJ: d, n.KEY_PROJ: d, n.VALUE_PROJ: d,
                n.ATTENTION_OUT: seq_len / 2, n.CONTEXT: seq_len / 2, n.OUT_PROJ: self.num_heads * self.head_dim,
                n.MLPWI_0: d, n.MLPWI_1: d, n.MLPWO: self.mlp_dim}


class DecoderLayer(nnx.Module):
    def __init__(self, c: LlamaConfig, *, rngs, ctx):
        pdt, self.ctx = jnp.dtype(c.param_dtype), ctx
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, c.rope_factor, c.rope_low_freq_factor,
                                 c.rope_high_freq_factor, c.rope_original_max_len)
        self.attention_norm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        self.attention = Attention(emb_dim=c.emb_dim, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                   head_dim=c.head_dim, inv_freq=inv_freq, param_dtype=pdt, init_std=c.init_std,
                                   rngs=rngs, attention=c.attention, ctx=ctx)
        self.mlp_norm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        self.mlp = SwiGLU(emb_dim=c.emb_dim, mlp_dim=c.mlp_dim, param_dtype=pdt, init_std=c.init_std, rngs=rngs,
                          ctx=ctx)

    def __call__(self, x, positions):
        x = self.ctx.tag(x, names.DECODER_LAYER_INPUT)
        x = x + self.attention(self.attention_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class Llama(SingleStackDecoder):
    @staticmethod
    def make_layer(c: LlamaConfig, rngs, ctx):
        return DecoderLayer(c, rngs=rngs, ctx=ctx)
