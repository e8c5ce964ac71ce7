"""Llama 3 / 3.1 decoder: embedding, scanned pre-norm decoder layers (GQA + RoPE, SwiGLU), unembedding."""
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from MaxOffload.models.base import FromConfig
from MaxOffload.models.layers import BATCH_LENGTH_EMBED, Attention, RMSNorm, SwiGLU, param, rope_inv_freq
from MaxOffload.offload import names
from MaxOffload.parallel.logical import constrain

# Every name this family tags; the config validator and a test hold it to that.
TAGGED_NAMES = (names.DECODER_LAYER_INPUT, names.QUERY_PROJ, names.KEY_PROJ, names.VALUE_PROJ,
                names.ATTENTION_OUT, names.OUT_PROJ, names.MLPWI_0, names.MLPWI_1, names.MLPWO)

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


@dataclasses.dataclass(frozen=True)
class LlamaConfig(FromConfig):
    vocab_size: int
    emb_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    scan_layers: bool = True
    init_std: float = 0.02

    def matmul_params_per_token(self):
        """Weights each token multiplies by: the FLOP-bearing parameters (embedding lookup excluded)."""
        d, hd = self.emb_dim, self.head_dim
        attention = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * d * self.mlp_dim
        return self.num_layers * (attention + mlp) + d * self.vocab_size

    def attention_dims(self):
        """(layers, heads, qk_dim, v_dim) for the attention-score FLOPs."""
        return self.num_layers, self.num_heads, self.head_dim, self.head_dim


class DecoderLayer(nnx.Module):
    def __init__(self, c: LlamaConfig, *, rngs):
        pdt, cdt = jnp.dtype(c.param_dtype), jnp.dtype(c.compute_dtype)
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, c.rope_factor, c.rope_low_freq_factor,
                                 c.rope_high_freq_factor, c.rope_original_max_len)
        self.attention_norm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        self.attention = Attention(emb_dim=c.emb_dim, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                   head_dim=c.head_dim, inv_freq=inv_freq, param_dtype=pdt, compute_dtype=cdt,
                                   init_std=c.init_std, rngs=rngs)
        self.mlp_norm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        self.mlp = SwiGLU(emb_dim=c.emb_dim, mlp_dim=c.mlp_dim, param_dtype=pdt, compute_dtype=cdt,
                          init_std=c.init_std, rngs=rngs)

    def __call__(self, x, positions):
        x = names.tag(x, names.DECODER_LAYER_INPUT)
        x = x + self.attention(self.attention_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


def stacked_layers(make_layer, num_layers, rngs):
    """`num_layers` layers with their parameters stacked on a leading `layers` axis (for scan)."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        return make_layer(rngs)

    return create(rngs)


def run_layers(layers, x, positions, segments, scan, params_on_host=False, with_outputs=False):
    """Applies stacked `layers` to x, segment by segment.

    segments: ((start, stop, policy, label), ...) covering the layers in order; each segment
    is one `jax.checkpoint` with its own remat/offload policy, traced under the name scope
    `label` (offload/inspect.py reads it back). scan=False runs a Python loop over the same
    stacked parameters (for tests and debugging). params_on_host: the stacked parameters live
    in pinned host memory and each layer's slice is copied to the device inside the scan, so
    only the current layer's weights need HBM.

    A layer returns h, or (h, outputs) with per-layer outputs (e.g. MoE expert loads);
    with_outputs=True returns (x, outputs stacked over all layers on a leading axis).
    """
    graphdef, stacked = nnx.split(layers)

    def body(h, layer_state):
        out = nnx.merge(graphdef, to_device(layer_state, params_on_host))(h, positions)
        return out if isinstance(out, tuple) else (out, None)

    outputs = []
    for start, stop, policy, label in segments:
        segment_state = stacked if (start, stop) == (0, _depth(stacked)) else \
            jax.tree.map(lambda p: p[start:stop], stacked)
        step = jax.checkpoint(body, policy=policy, prevent_cse=not scan)
        with jax.named_scope(label):
            if scan:
                x, ys = jax.lax.scan(step, x, segment_state)
            else:
                per_layer = []
                for i in range(stop - start):
                    x, y = step(x, jax.tree.map(lambda p: p[i], segment_state))
                    per_layer.append(y)
                ys = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        outputs.append(ys)
    if not with_outputs:
        return x
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *outputs)


def to_device(tree, enabled=True):
    """Copies host-resident values into device memory inside a jitted step (no-op when not enabled)."""
    return jax.device_put(tree, jax.memory.Space.Device) if enabled else tree


def on_device(module, enabled=True):
    """The module with its parameters copied to device memory (itself when not enabled)."""
    if not enabled:
        return module
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, to_device(state))


def _depth(stacked):
    return jax.tree.leaves(stacked)[0].shape[0]


class Llama(nnx.Module):
    def __init__(self, c: LlamaConfig, *, remat_segments, params_on_host=False, rngs):
        pdt = jnp.dtype(c.param_dtype)
        self.config = c
        self.params_on_host = params_on_host
        self.remat_segments = remat_segments["decoder"]
        self.embed = param(rngs, (c.vocab_size, c.emb_dim), ("vocab", "embed"), pdt, c.init_std)
        self.layers = stacked_layers(lambda r: DecoderLayer(c, rngs=r), c.num_layers, rngs)
        self.final_norm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        if not c.tie_embeddings:
            self.unembed = param(rngs, (c.emb_dim, c.vocab_size), ("embed", "vocab"), pdt, c.init_std)

    def __call__(self, tokens):
        """tokens [batch, length] int32 -> logits [batch, length, vocab] float32."""
        c = self.config
        cdt = jnp.dtype(c.compute_dtype)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        host = self.params_on_host
        embed = to_device(self.embed[...], host)
        x = constrain(jnp.take(embed, tokens, axis=0).astype(cdt), BATCH_LENGTH_EMBED)
        x = run_layers(self.layers, x, positions, self.remat_segments, c.scan_layers, host)
        x = on_device(self.final_norm, host)(x)
        unembed = embed.T if c.tie_embeddings else to_device(self.unembed[...], host)
        logits = jnp.einsum("ble,ev->blv", x, unembed.astype(cdt), preferred_element_type=jnp.float32)
        return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))
