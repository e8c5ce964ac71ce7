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
QUERY_WA_PROJ = "query_wa_proj"
KV_WA_PROJ = "kv_wa_proj"
MLA_Q = "mla_q"
MLA_KV = "mla_kv"
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
ATTENTION_OUT = "attention_out"
OUT_PROJ = "out_proj"
MLPWI_0 = "mlpwi_0"
MLPWI_1 = "mlpwi_1"
MLPWO = "mlpwo"
MOE_MLPWI_0 = "moe_mlpwi_0"
MOE_MLPWI_1 = "moe_mlpwi_1"
MOE_MLPWO = "moe_mlpwo"

# The layer input is the scan carry and the checkpointed function's input: asking to recompute
# it still keeps it in HBM (there is nothing to recompute it from). Offloading it does move
# it to the host (checked on jax 0.10.2; jax#23869 reported otherwise for older versions).
ALWAYS_KEPT = (DECODER_LAYER_INPUT,)

for _name in (DECODER_LAYER_INPUT, QUERY_WA_PROJ, KV_WA_PROJ, MLA_Q, MLA_KV, QUERY_PROJ, KEY_PROJ, VALUE_PROJ,
              ATTENTION_OUT, OUT_PROJ, MLPWI_0, MLPWI_1, MLPWO, MOE_MLPWI_0, MOE_MLPWI_1, MOE_MLPWO):
    assert _name in VOCABULARY, _name


# Logical axes of the tagged activations (layer-input layout, per layer): how the sharding
# rules split them, used to report bytes per device. Names missing here are reported as
# split over the batch only.
_BLE = ("activation_batch", "activation_length", "activation_embed")
ACTIVATION_AXES = {
    DECODER_LAYER_INPUT: _BLE, OUT_PROJ: _BLE, MLPWO: _BLE,
    QUERY_PROJ: ("activation_batch", "activation_length", "activation_heads", "activation_kv"),
    ATTENTION_OUT: ("activation_batch", "activation_length", "activation_heads", "activation_kv"),
    KEY_PROJ: ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv"),
    VALUE_PROJ: ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv"),
    MLPWI_0: ("activation_batch", "activation_length", "activation_mlp"),
    MLPWI_1: ("activation_batch", "activation_length", "activation_mlp"),
}


def tag(x, name):
    """Marks `x` as the activation `name` for jax.checkpoint policies."""
    if name not in VOCABULARY:
        raise KeyError(f"{name!r} is not in the offload vocabulary")
    return checkpoint_name(x, name)
