"""DeepSeek-V3: Multi-head Latent Attention (MLA) with decoupled RoPE + YaRN, DeepSeekMoE
(models/moe.py), the first `first_k_dense` layers dense. The dense and the MoE layers are two
separately scanned stacks, the model groups "dense" and "moe" of remat.groups.

Tagged names: the shared expert is a dense MLP every token passes through, so it tags mlpwi_0/mlpwi_1/mlpwo
like the dense layers' MLP; the moe_* names are the routed experts only, which is what a policy usually wants
to treat differently (offloaded in the JAX-Toolbox recipe).

Multi-token prediction (model.mtp_depth = D > 0; the paper's D = 1): depth k predicts the token k + 1
positions ahead, h_k = block_k(eh_proj_k [enorm_k(Emb(t_{i+k})); hnorm_k(h_{k-1})]), logits_k =
unembed(head_norm_k(h_k)), with the main model's embedding and output head shared and h_0 the main model's
final (normalised) hidden state. The concatenation puts the embedding first, as the inference engines' DeepSeek
MTP loaders do (vLLM, SGLang: `eh_proj(cat([enorm(embeds), hnorm(previous_hidden)]))`), where the paper writes
the hidden state first; the recycled hidden state is the normalised one, as in those engines. The D blocks are
the layer group "mtp" (global layers num_layers .. num_layers + D - 1: DeepSeek-V3's layer 61 in the Hugging
Face layout), of the same kind as the main model's last layer (MLA + MoE for DeepSeek-V3). The train step adds
mtp_loss_weight / D x the sum of the depths' cross-entropies (train/step.py); inference ignores the module.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxOffload.errors import require, require_choice
from MaxOffload.models import components, kernels, routing
from MaxOffload.models.attention.dispatch import attention
from MaxOffload.models.attention.key_source import KeySource
from MaxOffload.models.base import ModelConfig, field
from MaxOffload.models.layers import BATCH_LENGTH_EMBED, RMSNorm, SwiGLU, param
from MaxOffload.models.model_context import DEFAULT, ModelContext
from MaxOffload.models.rope import apply_rope, base_inv_freq, yarn_inv_freq, yarn_mscale
from MaxOffload.models.stack import DecoderModel, run_layers, stacked_layers
from MaxOffload.models.moe import MoE
from MaxOffload.offload import names


MLA_CONTEXT_GATHER = ("latent", "kv")
# Per-layer MoE metrics (moe/max_load_layerN, ...) for models with at most this many MoE layers.
PER_LAYER_METRICS_UP_TO = 8

# Published dimensions (DeepSeek-V3 technical report / Hugging Face config) and small sizes for CPU work,
# which balance their experts 10x faster (gamma 0.01) to do so within a few hundred steps.
PRESETS = {
    "deepseek_v3_671b": dict(
        family="deepseek", vocab_size=129280, emb_dim=7168, num_layers=61, first_k_dense=3, mlp_dim=18432,
        num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=256, num_experts_per_tok=8, num_shared_experts=1, moe_mlp_dim=2048,
        n_groups=8, topk_groups=4, routed_scaling_factor=2.5, router_bias_update_rate=0.001,
        seq_balance_loss_weight=1e-4, capacity_factor=0.0, norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling="yarn", rope_factor=40.0, rope_original_max_len=4096, rope_beta_fast=32.0,
        rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0, tie_embeddings=False, mtp_depth=1,
        mtp_loss_weight=0.3),
    "tiny": dict(
        family="deepseek", vocab_size=512, emb_dim=64, num_layers=3, first_k_dense=1, mlp_dim=128, num_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, moe_mlp_dim=32, n_groups=4, topk_groups=2,
        routed_scaling_factor=2.5, router_bias_update_rate=0.01, seq_balance_loss_weight=1e-4, norm_eps=1e-6,
        rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=32),
    "small": dict(
        family="deepseek", vocab_size=512, emb_dim=256, num_layers=6, first_k_dense=1, mlp_dim=704, num_heads=8,
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=16,
        num_experts_per_tok=4, num_shared_experts=1, moe_mlp_dim=128, n_groups=4, topk_groups=2,
        routed_scaling_factor=2.5, router_bias_update_rate=0.01, seq_balance_loss_weight=1e-4, norm_eps=1e-6,
        rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=128),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSeekConfig(ModelConfig):
    """DeepSeek-V3's own fields beside the shared ones (models/base.ModelConfig): MLA, MoE, MTP, YaRN."""
    rope_beta_fast: float = field(32.0, "yarn: frequencies turning more often than this within the original context "
                                        "are kept")
    rope_beta_slow: float = field(1.0, "yarn: frequencies turning less often than this are divided by rope_factor")
    rope_mscale: float = field(1.0, "yarn: mscale (the rotated parts are scaled by mscale(factor, rope_mscale) / "
                                    "mscale(factor, rope_mscale_all_dim))")
    rope_mscale_all_dim: float = field(1.0, "yarn: the softmax scale is multiplied by (0.1 * rope_mscale_all_dim * "
                                            "ln(rope_factor) + 1)^2")
    q_lora_rank: int = field(64, "deepseek MLA: rank of the query down-projection (the q latent)")
    kv_lora_rank: int = field(32, "deepseek MLA: rank of the key/value down-projection (the kv latent)")
    qk_nope_head_dim: int = field(32, "deepseek MLA: per-head query/key dimension without RoPE")
    qk_rope_head_dim: int = field(16, "deepseek MLA: per-head query/key dimension with RoPE (the key part is shared "
                                      "by all heads)")
    v_head_dim: int = field(32, "deepseek MLA: per-head value dimension")
    first_k_dense: int = field(1, "deepseek: the first k layers are dense (SwiGLU of mlp_dim), the rest MoE")
    num_experts: int = field(8, "deepseek: routed experts per MoE layer")
    num_experts_per_tok: int = field(2, "deepseek: routed experts each token is sent to (top-k)")
    num_shared_experts: int = field(1, "deepseek: shared experts every token passes through")
    moe_mlp_dim: int = field(128, "deepseek: hidden size of each routed and shared expert")
    n_groups: int = field(1, "deepseek: expert groups for group-limited routing (1 = no grouping)")
    topk_groups: int = field(1, "deepseek: groups a token may use, ranked by the sum of each group's top-2 scores")
    routed_scaling_factor: float = field(1.0, "deepseek: gate weights (normalised chosen scores) are multiplied by "
                                              "this")
    router: str = field('deepseek', "deepseek: the MoE router (models/routing.ROUTERS): deepseek (sigmoid scores, "
                                    "group-limited top-k on scores + a balancing bias) | softmax (softmax top-k, "
                                    "renormalised gates)")
    router_bias_update_rate: float = field(0.001, "deepseek: gamma of auxiliary-loss-free balancing: after each "
                                                  "step bias += gamma * sign(mean load - load)")
    seq_balance_loss_weight: float = field(0.0, "deepseek: alpha of the sequence-wise balance loss (0 = off)")
    capacity_factor: float = field(0.0, "deepseek: 0 = dropless; > 0: each expert takes at most ceil(factor * "
                                        "seq_len * top_k / num_experts) tokens per sequence, later ones are dropped")
    moe_kernel: str = field('auto', "deepseek: the dropless grouped GEMM: auto (tokamax's Triton kernel on GPUs, "
                                    "XLA's ragged_dot on CPU) | xla | tokamax (models/kernels.py)")
    mtp_depth: int = field(0, "deepseek: multi-token prediction depth D (0 = off; DeepSeek-V3 trained with 1): D "
                              "more blocks, each predicting one token further ahead; the layer group \"mtp\"")
    mtp_loss_weight: float = field(0.3, "deepseek: lambda of multi-token prediction: loss = main loss + lambda / D "
                                        "x the depths' cross-entropies (DeepSeek-V3: 0.3 early in training, 0.1 "
                                        "later)")
    mla_context_gather: str = field('latent', "deepseek MLA over a sequence split by context axes (mesh."
                                              "context_attention=all_gather): what each shard all-gathers: latent "
                                              "(the kv latent and the RoPE key, kv_lora_rank + qk_rope_head_dim a "
                                              "token; keys and values made from them block by block on every shard) "
                                              "| kv (the per-head keys and values): docs/parallelism.md")
    moe_buffer_factor: float = field(0.0, "deepseek, dropless: rows per device = factor x a balanced step's (0 = "
                                          "the worst case, every choice on this device's experts); choices past it "
                                          "are dropped and counted in moe/dropped_fraction")



    @property
    def num_moe_layers(self):
        return self.num_layers - self.first_k_dense

    @property
    def mtp_moe(self):
        """Whether the MTP blocks are MoE blocks: they are of the kind of the main model's last layer."""
        return self.num_moe_layers > 0

    def layer_groups(self):
        """The dense and the MoE layers and the MTP blocks: separately scanned stacks (an empty one is left
        out)."""
        groups = {"dense": (0, self.first_k_dense), "moe": (self.first_k_dense, self.num_layers),
                  "mtp": (self.num_layers, self.num_layers + self.mtp_depth)}
        return {name: (start, stop) for name, (start, stop) in groups.items() if stop > start}

    def pipelined_group(self):
        """The MoE layers: the first_k_dense dense layers run before the pipeline, the MTP blocks after it."""
        return "moe"

    def validate(self):
        self.require_positive("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                              "num_experts", "num_experts_per_tok", "moe_mlp_dim", "n_groups", "topk_groups",
                              "routed_scaling_factor")
        require(self.qk_rope_head_dim % 2 == 0,
                f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        require(0 <= self.first_k_dense <= self.num_layers,
                f"model.first_k_dense={self.first_k_dense} must be in [0, model.num_layers={self.num_layers}]")
        self.require_non_negative("num_shared_experts", "router_bias_update_rate", "seq_balance_loss_weight",
                                  "capacity_factor", "moe_buffer_factor", "mtp_depth", "mtp_loss_weight")
        require_choice("model.moe_kernel", self.moe_kernel, kernels.GROUPED_GEMM)
        require_choice("model.mla_context_gather", self.mla_context_gather, MLA_CONTEXT_GATHER)
        require_choice("model.router", self.router, tuple(routing.ROUTERS))
        require(not (self.capacity_factor and self.moe_buffer_factor),
                "model.moe_buffer_factor bounds dropless mode's rows; with model.capacity_factor set, the capacity "
                "bounds them: set one of the two")
        experts, top_k, groups, topk_groups = self.num_experts, self.num_experts_per_tok, self.n_groups, self.topk_groups
        require(top_k <= experts, f"model.num_experts_per_tok={top_k} exceeds model.num_experts={experts}")
        require(self.capacity_factor <= experts / top_k,
                f"model.capacity_factor={self.capacity_factor} is above num_experts / num_experts_per_tok = "
                f"{experts / top_k:g}, where each expert already takes every token of a sequence; lower it")
        require(experts % groups == 0, f"model.num_experts={experts} is not divisible by model.n_groups={groups}")
        require(topk_groups <= groups, f"model.topk_groups={topk_groups} exceeds model.n_groups={groups}")
        require(top_k <= topk_groups * (experts // groups),
                f"model.num_experts_per_tok={top_k} exceeds the {topk_groups * (experts // groups)} experts in "
                f"model.topk_groups={topk_groups} groups of {experts // groups}; raise topk_groups")
        require_choice("model.rope_scaling", self.rope_scaling, ("none", "yarn"))
        if self.rope_scaling == "yarn":
            require(self.rope_factor >= 1, f"model.rope_factor must be >= 1, got {self.rope_factor}")
            require(0 < self.rope_beta_slow < self.rope_beta_fast,
                    "model.rope_beta_slow must be > 0 and below model.rope_beta_fast")
            self.require_positive("rope_original_max_len")
            self.require_non_negative("rope_mscale", "rope_mscale_all_dim")

    def matmul_params_by_component(self):
        """Weights each token multiplies by, per models/components part: MLA projections, the dense MLPs and
        the shared experts, per MoE layer the router and the top-k routed experts; the unembedding (the
        embedding lookup excluded). The MTP depths count like layers of the main model's last kind, plus
        each one's eh_proj (a projection) and its pass through the shared output head: the work training does
        (MFU's numerator includes MTP; inference, which ignores it, does less)."""
        d, heads, rope, depth = self.emb_dim, self.num_heads, self.qk_rope_head_dim, self.mtp_depth
        qk = self.qk_nope_head_dim + rope
        mla = (d * self.q_lora_rank + self.q_lora_rank * heads * qk  # q down, q up
               + d * (self.kv_lora_rank + rope)  # kv down + the shared rope key
               + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)  # k_nope, v up
               + heads * self.v_head_dim * d)  # output
        moe_layers = self.num_moe_layers + (depth if self.mtp_moe else 0)
        dense_layers = self.first_k_dense + (0 if self.mtp_moe else depth)
        return {components.PROJECTIONS: (self.num_layers + depth) * mla + depth * 2 * d * d,
                components.MLP: (dense_layers * 3 * d * self.mlp_dim
                                 + moe_layers * 3 * d * self.moe_mlp_dim * self.num_shared_experts),
                components.ROUTER: moe_layers * d * self.num_experts,
                components.EXPERTS: moe_layers * 3 * d * self.moe_mlp_dim * self.num_experts_per_tok,
                components.UNEMBED: (1 + depth) * d * self.vocab_size}

    def params_stored_twice(self):
        """The released checkpoint's MTP layer stores its own copy of the embedding and of the output head
        (embed_tokens, shared_head.head), which this model shares with the main model."""
        return self.mtp_depth * (1 if self.tie_embeddings else 2) * self.vocab_size * self.emb_dim

    def context_gathered_params(self):
        """Weights each token multiplies by that a context shard gathering MLA's latent (mla_context_gather=latent)
        applies to every gathered token, making keys and values block by block: the up-projections wk_b, wv_b of
        every layer and MTP depth; 0 when it gathers the keys and values themselves."""
        if self.mla_context_gather != "latent":
            return 0
        up = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return (self.num_layers + self.mtp_depth) * up

    def contractions(self, model_group, seq_len):
        """{tagged name: K of the matmul producing it} (recompute FLOPs = 2 x elements x K; 0: no matmul,
        e.g. the latents' norms mla_q / mla_kv, costed by the planner as memory traffic)."""
        d = self.emb_dim
        dense = model_group == "dense" or (model_group == "mtp" and not self.mtp_moe)
        mlp_out = self.mlp_dim if dense else self.moe_mlp_dim * max(self.num_shared_experts, 1)
        n = names
        return {n.DECODER_LAYER_INPUT: 0, n.QUERY_WA_PROJ: d, n.KV_WA_PROJ: d, n.MLA_Q: 0, n.MLA_KV: 0,
                n.QUERY_PROJ: self.q_lora_rank, n.KEY_PROJ: self.kv_lora_rank, n.VALUE_PROJ: self.kv_lora_rank,
                n.ATTENTION_OUT: seq_len / 2, n.CONTEXT: seq_len / 2, n.OUT_PROJ: self.num_heads * self.v_head_dim,
                n.MLPWI_0: d, n.MLPWI_1: d, n.MLPWO: mlp_out, n.MOE_ROWS: 0, n.MOE_MLPWI_0: d, n.MOE_MLPWI_1: d,
                n.MOE_MLPWO: self.moe_mlp_dim}

    def attention_dims(self):
        """(layers, heads, qk_dim, v_dim) for the attention-score FLOPs; qk_dim = nope + rope; the MTP blocks
        count as layers."""
        return self.num_layers + self.mtp_depth, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim


# --------------------------------------------------------------------------------------------
# RoPE (MaxOffload/models/rope.py): frequencies, YaRN amplitude and softmax scale


def rope_setup(c):
    """(inverse frequencies, amplitude of the rotated parts, softmax scale) for the config's RoPE."""
    scale = 1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)
    if c.rope_scaling == "none":
        return base_inv_freq(c.qk_rope_head_dim, c.rope_theta).astype(np.float32), 1.0, scale
    if c.rope_scaling != "yarn":
        raise ValueError(f"unknown rope scaling {c.rope_scaling!r} for deepseek")
    inv_freq = yarn_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_factor, c.rope_original_max_len,
                             c.rope_beta_fast, c.rope_beta_slow)
    amplitude = yarn_mscale(c.rope_factor, c.rope_mscale) / yarn_mscale(c.rope_factor, c.rope_mscale_all_dim)
    return inv_freq, amplitude, scale * yarn_mscale(c.rope_factor, c.rope_mscale_all_dim) ** 2


# --------------------------------------------------------------------------------------------
# Multi-head latent attention


LATENT_AXES = ("activation_batch", "activation_length", None)


@components.scoped(components.PROJECTIONS)  # also where a context shard's attention loop makes them
def mla_keys(ctx, sources, weights, tag=False):
    """MLA's keys and values from the kv latent [b, l, r] and the RoPE key [b, l, 1, rope] (`sources`) and the
    up-projections wk_b, wv_b (`weights`): k = [latent wk_b, the RoPE key for every head], v = latent wv_b. `tag`:
    name them key_proj / value_proj for the remat policies (the whole layer's; not when a context shard makes them
    block by block from a gathered latent, where they are no activation of its tokens). Inside that shard_map
    under mxfp8, per-tensor FP8 (jax's MXFP8 VJP drops the manual axes of its gradients, as for the capacity
    experts: models/matmul.grouped)."""
    (latent, k_rope), (wk_b, wv_b) = sources, weights
    if not tag and ctx.numerics.mode == "mxfp8":
        ctx = ctx.with_numerics(mode="fp8")
    k_nope, v = (ctx.dense(latent, w, "blr,rhd->blhd", components.PROJECTIONS) for w in (wk_b, wv_b))
    if tag:
        k_nope, v = ctx.tag(k_nope, names.KEY_PROJ), ctx.tag(v, names.VALUE_PROJ)
    return jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], axis=-1), v


def latent_key_source(ctx, kv_latent, k_rope, weights, weight_axes):
    """The KeySource (models/attention/key_source.py) of a context shard gathering MLA's latent and RoPE key: keys
    and values made from them by mla_keys with the up-projections `weights` (wk_b, wv_b; their logical
    `weight_axes`)."""
    return KeySource((kv_latent, k_rope), (LATENT_AXES, LATENT_AXES + (None,)), functools.partial(mla_keys, ctx),
                     tuple(weights), tuple(weight_axes))


class MLA(nnx.Module):
    """Queries from a normalised q latent; keys and values from a normalised kv latent shared by all heads,
    plus a RoPE key part (qk_rope_head_dim) also shared by all heads (decoupled RoPE)."""

    def __init__(self, *, emb_dim, num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                 v_head_dim, inv_freq, rope_amplitude, softmax_scale, norm_eps, param_dtype, init_std, rngs,
                 attention, ctx=DEFAULT, context_gather="latent"):
        """attention: the kernel, chosen for the platform (models/kernels.attention_for)."""
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: hashable in the graph definition
        self.rope_amplitude, self.softmax_scale = rope_amplitude, softmax_scale
        self.ctx, self.context_gather = ctx, context_gather
        self.attention_choice = attention
        self.nope, self.kv_lora_rank = qk_nope_head_dim, kv_lora_rank
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.wq_a = param(rngs, (emb_dim, q_lora_rank), ("embed", "q_lora"), param_dtype, init_std)
        self.q_norm = RMSNorm(q_lora_rank, eps=norm_eps, param_dtype=param_dtype)
        self.wq_b = param(rngs, (q_lora_rank, num_heads, qk), ("q_lora", "heads", "head_dim"), param_dtype, init_std)
        self.wkv_a = param(rngs, (emb_dim, kv_lora_rank + qk_rope_head_dim), ("embed", "kv_lora"), param_dtype,
                           init_std)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=norm_eps, param_dtype=param_dtype)
        self.wk_b = param(rngs, (kv_lora_rank, num_heads, qk_nope_head_dim), ("kv_lora", "heads", "head_dim"),
                          param_dtype, init_std)
        self.wv_b = param(rngs, (kv_lora_rank, num_heads, v_head_dim), ("kv_lora", "heads", "head_dim"),
                          param_dtype, init_std)
        self.wo = param(rngs, (num_heads, v_head_dim, emb_dim), ("heads", "head_dim", "embed"), param_dtype,
                        init_std)

    def _rope(self, x, positions):
        x = apply_rope(x, positions.index, jnp.asarray(self.inv_freq, jnp.float32))
        return x if self.rope_amplitude == 1.0 else x * self.rope_amplitude

    @components.scoped(components.PROJECTIONS)
    def __call__(self, x, positions):
        nope, ctx = self.nope, self.ctx
        project = lambda a, w, spec: ctx.project(a, w, spec, components.PROJECTIONS)  # noqa: E731
        q_latent = ctx.tag(project(x, self.wq_a, None), names.QUERY_WA_PROJ)
        q_latent = ctx.tag(self.q_norm(q_latent), names.MLA_Q)
        q = ctx.tag(project(q_latent, self.wq_b, "blr,rhd->blhd"), names.QUERY_PROJ)
        kv = ctx.tag(project(x, self.wkv_a, None), names.KV_WA_PROJ)
        kv_latent = ctx.tag(self.kv_norm(kv[..., :self.kv_lora_rank]), names.MLA_KV)
        k_rope = self._rope(kv[:, :, None, self.kv_lora_rank:], positions)  # one rope key for all heads
        q = jnp.concatenate([q[..., :nope], self._rope(q[..., nope:], positions)], axis=-1)
        if ctx.layout.gathers_context and self.context_gather == "latent":
            weights = (self.wk_b, self.wv_b)
            source = latent_key_source(ctx, kv_latent, k_rope, (w[...] for w in weights),
                                       (tuple(w.out_sharding) for w in weights))
            k = v = None
        else:
            k, v = mla_keys(ctx, (kv_latent, k_rope),
                            tuple(ctx.weight(w) for w in (self.wk_b, self.wv_b)), True)
            source = None
        out = ctx.tag(attention(q, k, v, self.softmax_scale, self.attention_choice, ctx.layout, positions, source),
                      names.ATTENTION_OUT)
        out = project(out, self.wo, "blhd,hde->ble")
        return ctx.tag(ctx.constrain(out, BATCH_LENGTH_EMBED), names.OUT_PROJ)


# --------------------------------------------------------------------------------------------
# layers and model


class DecoderLayer(nnx.Module):
    """Pre-norm MLA + (SwiGLU | MoE). An MoE layer returns (x, MoE statistics)."""

    def __init__(self, c: DeepSeekConfig, *, moe, rngs, ctx=None):
        pdt = jnp.dtype(c.param_dtype)
        inv_freq, amplitude, softmax_scale = rope_setup(c)
        self.ctx = ctx = ctx or ModelContext.of(c)
        common = dict(param_dtype=pdt, init_std=c.init_std, rngs=rngs, ctx=ctx)
        self.attention_norm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        self.attention = MLA(emb_dim=c.emb_dim, num_heads=c.num_heads, q_lora_rank=c.q_lora_rank,
                             kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                             qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, inv_freq=inv_freq,
                             rope_amplitude=amplitude, softmax_scale=softmax_scale, norm_eps=c.norm_eps,
                             attention=c.attention, context_gather=c.mla_context_gather, **common)
        self.mlp_norm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        if moe:
            self.mlp = MoE(emb_dim=c.emb_dim, num_experts=c.num_experts, mlp_dim=c.moe_mlp_dim,
                           num_shared=c.num_shared_experts, router=routing.ROUTERS[c.router].of(c),
                           capacity_factor=c.capacity_factor, kernel=c.moe_kernel, buffer_factor=c.moe_buffer_factor,
                           **common)
        else:
            self.mlp = SwiGLU(emb_dim=c.emb_dim, mlp_dim=c.mlp_dim, **common)

    def __call__(self, x, positions):
        x = self.ctx.tag(x, names.DECODER_LAYER_INPUT)
        x = x + self.attention(self.attention_norm(x), positions)
        if isinstance(self.mlp, MoE):
            out, stats = self.mlp(self.mlp_norm(x))
            return x + out, stats
        return x + self.mlp(self.mlp_norm(x))


class MTPLayer(nnx.Module):
    """One multi-token-prediction depth: the next token's embedding and the previous depth's hidden state,
    each normalised, concatenated (embedding first) and projected back to emb_dim (eh_proj), then one decoder
    block and its own norm before the shared output head (Hugging Face: enorm, hnorm, eh_proj, the block,
    shared_head.norm). Returns (the normalised hidden state, {"hidden": the same, MoE statistics})."""

    def __init__(self, c: DeepSeekConfig, *, rngs, ctx=None):
        pdt = jnp.dtype(c.param_dtype)
        self.ctx = ctx = ctx or ModelContext.of(c)
        self.enorm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        self.hnorm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        # [embedding; hidden] -> emb_dim (a mesh axis shards only the first of the two "embed" axes)
        self.eh_proj = param(rngs, (2 * c.emb_dim, c.emb_dim), ("embed", "embed"), pdt, c.init_std)
        self.block = DecoderLayer(c, moe=c.mtp_moe, rngs=rngs, ctx=ctx)
        self.head_norm = RMSNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)

    def __call__(self, h, positions, next_embeds):
        with jax.named_scope(components.PROJECTIONS):
            joined = jnp.concatenate([self.enorm(next_embeds), self.hnorm(h)], axis=-1)
            x = self.ctx.constrain(self.ctx.project(joined, self.eh_proj, None, components.PROJECTIONS),
                                   BATCH_LENGTH_EMBED)
        out = self.block(x, positions)
        x, stats = out if isinstance(out, tuple) else (out, {})
        normed = self.head_norm(x)
        return normed, {"hidden": normed, **stats}


def mtp_cross_entropy(cross_entropy, mtp_hidden, targets, mask, laid_out=lambda *a: a):
    """Multi-token prediction's loss: the mean over depths k = 1..D of depth k's mean cross-entropy, where its
    hidden states at position i predict targets[i + k] (the token k + 1 after inputs[i]); the last k positions
    have no such target and are masked. `cross_entropy(hidden, targets, mask)`: (sum, count) through the shared
    output head (DecoderModel.cross_entropy); `laid_out`: the shifted targets and mask in the hidden states' token
    order (DecoderModel.laid_out)."""
    length = targets.shape[1]
    losses = []
    for k, hidden in enumerate(mtp_hidden, start=1):
        within = jnp.arange(length) < length - k
        total, count = cross_entropy(hidden, *laid_out(jnp.roll(targets, -k, axis=1),
                                                       jnp.roll(mask, -k, axis=1) * within))
        losses.append(total / jnp.maximum(count, 1.0))
    return sum(losses) / len(losses)


class DeepSeek(DecoderModel):
    PIPELINED_STACK = "moe_layers"  # the stack that pipeline stages split (DeepSeekConfig.pipelined_group)

    def __init__(self, c: DeepSeekConfig, *, remat_segments, params_on_host=False, rngs, ctx=None):
        """ctx: the models/model_context.ModelContext the model is built with (DecoderModel.init_embeddings)."""
        self.dense_segments, self.moe_segments = remat_segments.get("dense", ()), remat_segments.get("moe", ())
        self.mtp_segments = remat_segments.get("mtp", ())
        self.init_embeddings(c, params_on_host, rngs, ctx)
        self.router_kind = routing.ROUTERS[c.router].of(c)
        kind = dict(ctx=self.ctx)
        if c.first_k_dense:
            self.dense_layers = stacked_layers(lambda r: DecoderLayer(c, moe=False, rngs=r, **kind), c.first_k_dense,
                                               rngs)
        if c.num_moe_layers:
            self.moe_layers = stacked_layers(lambda r: DecoderLayer(c, moe=True, rngs=r, **kind), c.num_moe_layers,
                                             rngs, self.ctx.layout.pipeline)  # the pipelined stack, with stages
        self.init_head(c, rngs)
        if c.mtp_depth:  # created last: the main model's parameters are the same with and without MTP
            self.mtp_layers = stacked_layers(lambda r: MTPLayer(c, rngs=r, **kind), c.mtp_depth, rngs)

    def __call__(self, tokens, documents=None):
        """tokens [batch, length] int32 -> (logits [batch, length, vocab] float32, aux): aux as `hidden` gives it,
        with MTP's hidden states made "mtp_logits" [depth, batch, length, vocab] (documents: as losses takes them)."""
        normed, embed, aux = self.hidden(tokens, documents)
        if "mtp_hidden" in aux:
            aux["mtp_logits"] = self.unembed_normed(aux.pop("mtp_hidden"), embed)
        return self.unembed_normed(normed, embed), aux

    def hidden(self, tokens, documents=None):
        """tokens [batch, length] int32 -> (normalised hidden states, the embedding table, aux) (DecoderModel.hidden;
        documents: as DecoderModel.losses takes them).

        aux: "aux_loss" (weighted sequence-wise balance loss), "metrics" (expert-load statistics),
        "model_state" (the router biases after this step's auxiliary-loss-free update) and, with MTP,
        "mtp_hidden" [depth, batch, length, emb]: depth k's normalised hidden states at position i predict the token
        k + 1 positions after tokens[i] (positions past the sequence's end are the train step's to mask)."""
        c, host = self.config, self.params_on_host
        x, positions, embed = self.embed_tokens(tokens, documents)
        if c.first_k_dense:
            x = run_layers(self.dense_layers, x, positions, self.dense_segments, c.scan_layers, host)
        stats = []  # (the MoE module's path, statistics [layers, ...], global layer indices) per MoE stack
        if c.num_moe_layers:
            x, moe_stats = run_layers(self.moe_layers, x, positions, self.moe_segments, c.scan_layers, host,
                                      with_outputs=True, layout=self.ctx.layout)
            layers = range(c.first_k_dense, c.num_layers)
            schedule = self.ctx.layout.pipeline
            if schedule is not None:  # its statistics summed over the micro-batches, its layers in stored order
                layers = [c.first_k_dense + int(i) for i in schedule.order(c.num_moe_layers)]
                if "balance" in moe_stats:  # a mean over the sequences: the micro-batches' mean
                    moe_stats = {**moe_stats, "balance": moe_stats["balance"] / schedule.microbatches}
            stats.append((("moe_layers", "mlp"), moe_stats, layers))
        normed = self.final_normed(x)
        aux = {"aux_loss": jnp.zeros(()), "metrics": {}, "model_state": {}}
        if c.mtp_depth:
            ahead = jnp.stack([jnp.roll(tokens, -k, axis=1) for k in range(1, c.mtp_depth + 1)])
            ahead = self.in_layout_order(ahead)  # the tokens k ahead in sequence order, laid out as x is
            next_embeds = self.ctx.constrain(jnp.take(embed, ahead, axis=0).astype(x.dtype),
                                             (None, *BATCH_LENGTH_EMBED))
            _, mtp = run_layers(self.mtp_layers, normed, positions, self.mtp_segments, c.scan_layers, host,
                                with_outputs=True, per_layer=next_embeds)
            aux["mtp_hidden"] = mtp.pop("hidden")
            if c.mtp_moe:
                stats.append((("mtp_layers", "block", "mlp"), mtp,
                              range(c.num_layers, c.num_layers + c.mtp_depth)))
        if stats:
            aux.update(self._moe_aux(stats))
        return normed, embed, aux

    def target_losses(self, aux, targets, mask, embed):
        """Multi-token prediction: (mtp_loss_weight x the MTP loss, aux with mtp_hidden consumed and
        metrics["mtp_loss"] added)."""
        if "mtp_hidden" not in aux:
            return 0.0, aux
        aux = dict(aux)
        mtp = mtp_cross_entropy(lambda h, t, m: self.cross_entropy(h, embed, t, m), aux.pop("mtp_hidden"), targets,
                                mask, self.laid_out)
        aux["metrics"] = {**aux.get("metrics", {}), "mtp_loss": mtp}
        return self.config.mtp_loss_weight * mtp, aux

    def _moe_aux(self, stacks):
        """Balance loss, the router state's update (DeepSeek-V3: the biases) and expert-load metrics from the MoE
        stacks' statistics (each [layers of the stack, ...]; the main MoE layers, then the MTP blocks), the router's
        own metrics beside them. max_load = busiest expert's choices / mean choices per expert."""
        c, router = self.config, self.router_kind
        loads = {"/".join(path): s["load"] for path, s, _ in stacks}
        model_state = self.next_model_state(loads)
        own = [router.metrics(s, self._router_state(model_state, path)) for path, s, _ in stacks]
        joined = lambda key: jnp.concatenate([s[key] for _, s, _ in stacks])  # noqa: E731
        load, dropped_choices = joined("load"), joined("dropped")
        layers = [layer for _, _, indices in stacks for layer in indices]
        max_load = load.max(-1) / load.mean(-1)
        dropped = dropped_choices / load.sum(-1)
        per_layer = {"max_load": max_load, **{k: jnp.concatenate([m[k] for m in own]) for k in own[0]}}
        metrics = {"moe/max_load": max_load.max(), **{f"moe/mean_{k}": v.mean() for k, v in per_layer.items()}}
        if c.capacity_factor or c.moe_buffer_factor:
            metrics["moe/dropped_fraction"] = dropped_choices.sum() / load.sum()
            per_layer["dropped_fraction"] = dropped
        balance = joined("balance") if "balance" in stacks[0][1] else jnp.zeros((1,))
        if c.seq_balance_loss_weight:
            metrics["moe/balance_loss"] = balance.mean()
        if len(layers) <= PER_LAYER_METRICS_UP_TO:
            for i, layer in enumerate(layers):
                metrics.update({f"moe/{k}_layer{layer}": v[i] for k, v in per_layer.items()})
        return {"aux_loss": c.seq_balance_loss_weight * balance.sum(), "metrics": metrics, "model_state": model_state,
                "statistics": loads}

    @staticmethod
    def _module_state(model_state, path):
        return functools.reduce(lambda tree, key: tree.get(key, {}), path, model_state)  # {}: no router state

    def _router_state(self, model_state, path):
        module = self._module_state(model_state, path)
        return {name: module[name] for name in self.router_kind.state}

    def next_model_state(self, statistics):
        """The model's non-Param variables (TrainSetup's model_state) after a step whose routing statistics (aux
        "statistics": {MoE module path "a/b/c": its stack's expert loads [layers, experts]}, additive over
        micro-batches) are given: the router's own update (DeepSeek-V3: the selection biases)."""
        model_state = nnx.to_pure_dict(nnx.state(self, nnx.Not(nnx.Param)))
        for key, load in statistics.items():
            path = tuple(key.split("/"))
            self._module_state(model_state, path).update(
                self.router_kind.next_state(self._router_state(model_state, path), load))
        return model_state
