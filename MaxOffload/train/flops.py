"""Model FLOPs per step: the MFU numerator, written once.

    train FLOPs = 6 * tokens * P  +  6 * tokens * layers * seq_len * heads * (qk_dim + v_dim) / 2

P = matmul parameters each token is multiplied by (all projections and the unembedding;
the embedding lookup is a gather and is not counted; for MoE only the router, the top-k
routed and the shared experts, never all experts; for MLA its six projections). 6 = forward
(2) + backward (4) per multiply-add. The second term is causal self-attention (QK^T and PV,
half the score matrix), MaxText's convention; for MLA qk_dim = nope + rope and v_dim is its
own. Each family's config says P (matmul_params_per_token) and the attention dimensions.
Recomputation (remat) is deliberately not counted, nor are tokens a capacity factor drops:
MFU measures the useful work of the nominal model.
"""


from MaxOffload.models import components


def attention_flops(model_config, global_batch, seq_len):
    tokens = global_batch * seq_len
    layers, heads, qk_dim, v_dim = model_config.attention_dims()
    return 6 * tokens * layers * seq_len * heads * (qk_dim + v_dim) / 2


def train_flops_per_step(model_config, global_batch, seq_len):
    dense = 6 * global_batch * seq_len * model_config.matmul_params_per_token()
    return dense + attention_flops(model_config, global_batch, seq_len)


def by_component(model_config, global_batch, seq_len):
    """{models/components part: its train FLOPs per step}; they sum to train_flops_per_step."""
    tokens = global_batch * seq_len
    out = {part: 6 * tokens * p for part, p in model_config.matmul_params_by_component().items()}
    out[components.ATTENTION_SCORES] = attention_flops(model_config, global_batch, seq_len)
    return out
