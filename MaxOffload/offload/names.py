"""The one vocabulary of activation names a remat/offload policy can refer to.

Every layer tags its activations through `tag(x, NAME)` with a constant from this
module; the policy builder and the config validator read `VOCABULARY`. Names are
MaxText-compatible so published recipes carry over unchanged.
"""
from jax.ad_checkpoint import checkpoint_name

# name -> what the tensor is. Order is the order of the forward pass.
VOCABULARY = {
    "decoder_layer_input": "input of a decoder layer (the scan carry)",
    "query_wa_proj": "MLA: query down-projection to q_lora_rank",
    "kv_wa_proj": "MLA: key/value down-projection to kv_lora_rank (+ rope key)",
    "mla_q": "MLA: normalised query latent",
    "mla_kv": "MLA: normalised key/value latent",
    "query_proj": "query projection (before RoPE)",
    "key_proj": "key projection (before RoPE)",
    "value_proj": "value projection",
    "qkv_proj": "fused query/key/value projection",
    "kv_proj": "fused key/value projection",
    "context": "attention probabilities x values, before the output projection",
    "attention_out": "attention output (heads x head_dim), before the output projection",
    "out_proj": "attention output projection",
    "mlpwi": "fused MLP input projection",
    "mlpwi_0": "MLP gate projection (before the activation)",
    "mlpwi_1": "MLP up projection",
    "mlpwo": "MLP down projection",
    "moe_mlpwi_0": "routed experts: gate projection",
    "moe_mlpwi_1": "routed experts: up projection",
    "moe_mlpwo": "routed experts: down projection",
}

DECODER_LAYER_INPUT = "decoder_layer_input"
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
ATTENTION_OUT = "attention_out"
OUT_PROJ = "out_proj"
MLPWI_0 = "mlpwi_0"
MLPWI_1 = "mlpwi_1"
MLPWO = "mlpwo"

# The layer input is the scan carry: jax.checkpoint keeps a checkpointed function's inputs,
# so the backward pass always has it in HBM whatever the policy says (jax#23869).
ALWAYS_KEPT = (DECODER_LAYER_INPUT,)

for _name in (DECODER_LAYER_INPUT, QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTENTION_OUT,
              OUT_PROJ, MLPWI_0, MLPWI_1, MLPWO):
    assert _name in VOCABULARY, _name


def tag(x, name):
    """Marks `x` as the activation `name` for jax.checkpoint policies."""
    if name not in VOCABULARY:
        raise KeyError(f"{name!r} is not in the offload vocabulary")
    return checkpoint_name(x, name)
