"""Llama 3 / 3.1 in the Hugging Face layout (LlamaForCausalLM): transposed linear weights, the heads split
off the projections, nothing else (the checkpoints are already in rotate-half RoPE order)."""
from MaxOffload.models.hf import Group, HFFormat, P, linear, rule, same


class LlamaHF(HFFormat):
    architectures = ("LlamaForCausalLM",)

    def model_keys(self, hf):
        hf.expect("hidden_act", ("silu",), "silu")
        hf.expect("attention_bias", (False,), False)
        hf.expect("mlp_bias", (False,), False)
        kind, rope, theta = hf.rope()
        if kind not in ("default", "llama3"):
            hf.unsupported("rope type", kind, "Llama supports default and llama3")
        heads, emb = hf.get("num_attention_heads"), hf.get("hidden_size")
        keys = {"family": "llama", "vocab_size": hf.get("vocab_size"), "emb_dim": emb,
                "num_layers": hf.get("num_hidden_layers"), "num_heads": heads,
                "num_kv_heads": hf.get("num_key_value_heads", heads),
                "head_dim": hf.get("head_dim", emb // heads),
                "mlp_dim": hf.get("intermediate_size"), "norm_eps": hf.get("rms_norm_eps", kind=float, minimum=0),
                "rope_theta": theta, "rope_scaling": "llama3" if kind == "llama3" else "none",
                "tie_embeddings": hf.get("tie_word_embeddings", False, kind=bool)}
        if kind == "llama3":
            keys.update(rope_factor=rope("factor", minimum=1), rope_low_freq_factor=rope("low_freq_factor"),
                        rope_high_freq_factor=rope("high_freq_factor"),
                        rope_original_max_len=rope("original_max_position_embeddings", kind=int, minimum=1))
        return keys

    def config_json(self, c):
        rope = {"rope_type": "default"}
        max_len = c.rope_original_max_len
        if c.rope_scaling == "llama3":
            rope = {"rope_type": "llama3", "factor": c.rope_factor, "low_freq_factor": c.rope_low_freq_factor,
                    "high_freq_factor": c.rope_high_freq_factor,
                    "original_max_position_embeddings": c.rope_original_max_len}
            max_len = int(c.rope_original_max_len * c.rope_factor)
        return {"architectures": list(self.architectures), "model_type": "llama", "vocab_size": c.vocab_size,
                "hidden_size": c.emb_dim, "intermediate_size": c.mlp_dim, "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "hidden_act": "silu", "rms_norm_eps": c.norm_eps, "max_position_embeddings": max_len,
                "rope_parameters": {**rope, "rope_theta": c.rope_theta}, "attention_bias": False,
                "mlp_bias": False, "tie_word_embeddings": c.tie_embeddings}

    def groups(self, c):
        return [top_level(c), Group("layers", tuple(range(c.num_layers)), "model.layers.{}.", (
            rule(P("attention_norm.scale"), "input_layernorm.weight", same()),
            rule(P("attention.wq"), "self_attn.q_proj.weight", linear()),
            rule(P("attention.wk"), "self_attn.k_proj.weight", linear()),
            rule(P("attention.wv"), "self_attn.v_proj.weight", linear()),
            rule(P("attention.wo"), "self_attn.o_proj.weight", linear(inputs=2)),
            rule(P("mlp_norm.scale"), "post_attention_layernorm.weight", same()),
            *swiglu("mlp", "mlp"),
        ))]


def top_level(c):
    """The embedding, the final norm and (untied) the output head: every family's."""
    rules = [rule(P("embed"), "model.embed_tokens.weight", same()), rule(P("final_norm.scale"), "model.norm.weight", same())]
    if not c.tie_embeddings:
        rules.append(rule(P("unembed"), "lm_head.weight", linear()))
    return Group(None, (), "", tuple(rules))


def swiglu(ours, theirs):
    """A SwiGLU MLP's three Rules: ours.wi_0/wi_1/wo <- theirs.gate_proj/up_proj/down_proj."""
    return (rule(P(f"{ours}.wi_0"), f"{theirs}.gate_proj.weight", linear()),
            rule(P(f"{ours}.wi_1"), f"{theirs}.up_proj.weight", linear()),
            rule(P(f"{ours}.wo"), f"{theirs}.down_proj.weight", linear()))
