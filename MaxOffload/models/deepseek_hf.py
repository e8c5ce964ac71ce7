"""DeepSeek-V3 in the Hugging Face layout (DeepseekV3ForCausalLM; REFERENCE.md §2d).

Beyond transposes: the RoPE rows of q_b_proj (per head) and of kv_a_proj_with_mqa are stored with
interleaved pairs, which this project's rotate-half RoPE reads after the permutation [0, 2, 4, ..., 1, 3, ...];
kv_b_proj holds k_nope and v of every head together; the experts are one tensor each
(experts.{e}.{gate,up,down}_proj), stacked here; the router's e_score_correction_bias is the router bias (model
state, not a parameter); the first first_k_dense_replace layers are dense; Hugging Face layer num_layers (61)
is the multi-token-prediction module, whose embed_tokens and shared_head.head are copies of the shared
embedding and output head.
"""
import numpy as np

from MaxOffload.models.hf import (Group, HFFormat, P, Rule, S, interleaved_to_halves, linear, permute_last, rule, same,
                                  stacked)
from MaxOffload.models.llama_hf import swiglu, top_level


class DeepSeekHF(HFFormat):
    architectures = ("DeepseekV3ForCausalLM",)

    def model_keys(self, hf):
        hf.expect("hidden_act", ("silu",), "silu")
        hf.expect("attention_bias", (False,), False)
        hf.expect("norm_topk_prob", (True,), True)
        hf.expect("scoring_func", ("sigmoid",), "sigmoid")
        hf.expect("topk_method", ("noaux_tc",), "noaux_tc")
        hf.expect("moe_layer_freq", (1,), 1)
        hf.expect("rope_interleave", (True,), True)
        if hf.fields.get("q_lora_rank") is None:
            hf.unsupported("q_lora_rank", None, "it supports MLA with a query latent, as in DeepSeek-V3")
        if hf.fields.get("n_routed_experts") is None:
            hf.unsupported("n_routed_experts", None, "it supports DeepSeek-V3's MoE layers")
        kind, rope, theta = hf.rope()
        if kind not in ("default", "yarn"):
            hf.unsupported("rope type", kind, "DeepSeek-V3 supports default and yarn")
        keys = {"family": "deepseek", "vocab_size": hf.get("vocab_size"), "emb_dim": hf.get("hidden_size"),
                "num_layers": hf.get("num_hidden_layers"), "first_k_dense": hf.get("first_k_dense_replace", minimum=0),
                "mlp_dim": hf.get("intermediate_size"), "num_heads": hf.get("num_attention_heads"),
                "q_lora_rank": hf.get("q_lora_rank"), "kv_lora_rank": hf.get("kv_lora_rank"),
                "qk_nope_head_dim": hf.get("qk_nope_head_dim"), "qk_rope_head_dim": hf.get("qk_rope_head_dim"),
                "v_head_dim": hf.get("v_head_dim"), "num_experts": hf.get("n_routed_experts"),
                "num_experts_per_tok": hf.get("num_experts_per_tok"),
                "num_shared_experts": hf.get("n_shared_experts", minimum=0),
                "moe_mlp_dim": hf.get("moe_intermediate_size"), "n_groups": hf.get("n_group", 1),
                "topk_groups": hf.get("topk_group", 1),
                "routed_scaling_factor": hf.get("routed_scaling_factor", kind=float, minimum=0),
                "norm_eps": hf.get("rms_norm_eps", kind=float, minimum=0), "rope_theta": theta,
                "rope_scaling": "yarn" if kind == "yarn" else "none",
                "tie_embeddings": hf.get("tie_word_embeddings", False, kind=bool)}
        if kind == "yarn":
            keys.update(rope_factor=rope("factor", minimum=1),
                        rope_original_max_len=rope("original_max_position_embeddings", kind=int, minimum=1),
                        rope_beta_fast=rope("beta_fast", 32.0), rope_beta_slow=rope("beta_slow", 1.0),
                        rope_mscale=rope("mscale", 1.0), rope_mscale_all_dim=rope("mscale_all_dim", 0.0))
        return keys

    def mtp_layers(self, hf):
        """The multi-token-prediction layers a config.json says its checkpoint has."""
        return hf.get("num_nextn_predict_layers", 0, minimum=0)

    def skipped_note(self, c, unused):
        if any(n.startswith(f"model.layers.{c.num_layers}.") for n in unused):
            return (f"; model.layers.{c.num_layers} is the multi-token-prediction module, skipped as "
                    "model.mtp_depth=0 (model.mtp_depth=1 trains with it)")
        return ""

    def config_json(self, c):
        rope = {"rope_type": "default"}
        max_len = c.rope_original_max_len
        if c.rope_scaling == "yarn":
            rope = {"rope_type": "yarn", "factor": c.rope_factor, "original_max_position_embeddings":
                    c.rope_original_max_len, "beta_fast": c.rope_beta_fast, "beta_slow": c.rope_beta_slow,
                    "mscale": c.rope_mscale, "mscale_all_dim": c.rope_mscale_all_dim}
            max_len = int(c.rope_original_max_len * c.rope_factor)
        return {"architectures": list(self.architectures), "model_type": "deepseek_v3", "vocab_size": c.vocab_size,
                "hidden_size": c.emb_dim, "intermediate_size": c.mlp_dim, "moe_intermediate_size": c.moe_mlp_dim,
                "num_hidden_layers": c.num_layers, "first_k_dense_replace": c.first_k_dense,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_heads,
                "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_nope_head_dim,
                "qk_rope_head_dim": c.qk_rope_head_dim, "head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim,
                "n_routed_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
                "n_shared_experts": c.num_shared_experts, "n_group": c.n_groups, "topk_group": c.topk_groups,
                "routed_scaling_factor": c.routed_scaling_factor, "norm_topk_prob": True, "scoring_func": "sigmoid",
                "topk_method": "noaux_tc", "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": c.norm_eps,
                "max_position_embeddings": max_len, "rope_parameters": {**rope, "rope_theta": c.rope_theta},
                "rope_interleave": True, "attention_bias": False, "tie_word_embeddings": c.tie_embeddings,
                "num_nextn_predict_layers": c.mtp_depth}

    def groups(self, c):
        groups = [top_level(c)]
        prefix = "model.layers.{}."
        if c.first_k_dense:
            groups.append(Group("dense_layers", tuple(range(c.first_k_dense)), prefix, decoder_rules(c, moe=False)))
        if c.num_moe_layers:
            groups.append(Group("moe_layers", tuple(range(c.first_k_dense, c.num_layers)), prefix,
                                decoder_rules(c, moe=True)))
        if c.mtp_depth:
            copies = [rule(P("embed"), "embed_tokens.weight", same())]
            if not c.tie_embeddings:
                copies.append(rule(P("unembed"), "shared_head.head.weight", linear()))
            groups.append(Group("mtp_layers", tuple(range(c.num_layers, c.num_layers + c.mtp_depth)), prefix, (
                rule(P("enorm.scale"), "enorm.weight", same()),
                rule(P("hnorm.scale"), "hnorm.weight", same()),
                rule(P("eh_proj"), "eh_proj.weight", linear()),
                *decoder_rules(c, moe=c.mtp_moe, block="block."),
                rule(P("head_norm.scale"), "shared_head.norm.weight", same()),
            ), copies=tuple(copies), hint="the multi-token-prediction layer; model.mtp_depth=0 imports without it"))
        return groups


def decoder_rules(c, *, moe, block=""):
    """One decoder layer's Rules (MLA, then the dense MLP or the MoE); `block`: our path prefix (the MTP's)."""
    b = block
    attention = (
        rule(P(f"{b}attention_norm.scale"), "input_layernorm.weight", same()),
        rule(P(f"{b}attention.wq_a"), "self_attn.q_a_proj.weight", linear()),
        rule(P(f"{b}attention.q_norm.scale"), "self_attn.q_a_layernorm.weight", same()),
        rule(P(f"{b}attention.wq_b"), "self_attn.q_b_proj.weight", rope_rows(c.qk_nope_head_dim, c.qk_rope_head_dim)),
        rule(P(f"{b}attention.wkv_a"), "self_attn.kv_a_proj_with_mqa.weight", rope_rows(c.kv_lora_rank, c.qk_rope_head_dim)),
        rule(P(f"{b}attention.kv_norm.scale"), "self_attn.kv_a_layernorm.weight", same()),
        Rule((P(f"{b}attention.wk_b"), P(f"{b}attention.wv_b")), ("self_attn.kv_b_proj.weight",),
             *kv_b(c.num_heads, c.qk_nope_head_dim)),
        rule(P(f"{b}attention.wo"), "self_attn.o_proj.weight", linear(inputs=2)),
        rule(P(f"{b}mlp_norm.scale"), "post_attention_layernorm.weight", same()),
    )
    if not moe:
        return (*attention, *swiglu(f"{b}mlp", "mlp"))
    experts = range(c.num_experts)
    return (*attention,
            rule(P(f"{b}mlp.router"), "mlp.gate.weight", linear()),
            rule(S(f"{b}mlp.router_bias"), "mlp.gate.e_score_correction_bias", same()),
            stacked(P(f"{b}mlp.wi_0"), [f"mlp.experts.{e}.gate_proj.weight" for e in experts], linear()),
            stacked(P(f"{b}mlp.wi_1"), [f"mlp.experts.{e}.up_proj.weight" for e in experts], linear()),
            stacked(P(f"{b}mlp.wo"), [f"mlp.experts.{e}.down_proj.weight" for e in experts], linear()),
            *swiglu(f"{b}mlp.shared", "mlp.shared_experts"))


def rope_rows(start, rope_dim):
    """(load, save) of a projection whose output's last `rope_dim` entries (per head: ours [in, heads, dim] or
    [in, dim]) are RoPE rows stored interleaved: ours = theirs transposed, those rows in rotate-half order."""
    perm = interleaved_to_halves(rope_dim)
    inverse = np.argsort(perm)

    def load(w, shapes):
        return (permute_last(w.T.reshape(shapes[0]), start, perm),)

    def save(x):
        return (permute_last(x, start, inverse).reshape(x.shape[0], -1).T,)

    return load, save


def kv_b(heads, nope):
    """(load, save) of kv_b_proj [heads x (nope + v), kv_lora] <-> (wk_b [kv_lora, heads, nope], wv_b [kv_lora,
    heads, v])."""
    def load(w, shapes):
        w = w.reshape(heads, -1, w.shape[-1])
        return w[:, :nope].transpose(2, 0, 1).reshape(shapes[0]), w[:, nope:].transpose(2, 0, 1).reshape(shapes[1])

    def save(wk, wv):
        joined = np.concatenate([wk.transpose(1, 2, 0), wv.transpose(1, 2, 0)], axis=1)
        return (joined.reshape(-1, joined.shape[-1]),)

    return load, save
