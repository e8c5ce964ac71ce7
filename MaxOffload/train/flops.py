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


def train_flops_per_step(model_config, global_batch, seq_len):
    tokens = global_batch * seq_len
    layers, heads, qk_dim, v_dim = model_config.attention_dims()
    dense = 6 * tokens * model_config.matmul_params_per_token()
    attention = 6 * tokens * layers * seq_len * heads * (qk_dim + v_dim) / 2
    return dense + attention
