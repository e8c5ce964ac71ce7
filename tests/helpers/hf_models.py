"""Tiny random Llama 3.1 and DeepSeek-V3 models made and saved by transformers (the reference implementation),
for the conversion tests (tests/test_convert_hf.py): `save(kind, directory)` -> the transformers model."""
import torch

VOCAB = 512  # the quickstart's byte tokenizer needs >= 259


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512,  # 2x original x factor, as Llama 3.1
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}, rope_theta=500000.0, tie_word_embeddings=False))


def deepseek():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        rms_norm_eps=1e-6, max_position_embeddings=128, num_nextn_predict_layers=0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}))
    with torch.no_grad():  # a router bias that changes the choices (transformers initialises it to zero)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8)[torch.randperm(8)])
    return model


def save(kind, directory, seed=0):
    torch.manual_seed(seed)
    model = {"llama": llama, "deepseek": deepseek}[kind]().eval()
    model.save_pretrained(directory, max_shard_size="200KB")
    return model


def logits(model, tokens):
    """float32 logits [batch, length, vocab] of `tokens` (a numpy int array)."""
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
