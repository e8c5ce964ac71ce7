"""The one vocabulary of activation names a remat/offload policy can refer to.

Every layer tags its activations through `tag(x, NAME)` with a constant from this
module; `TABLE` holds each name once with its doc and logical axes, and the policy presets,
the config schema, the validator and the reports read it (or its views). Names are
MaxText-compatible so published recipes carry over unchanged.
"""
import dataclasses

from jax.ad_checkpoint import checkpoint_name

DECODER_LAYER_INPUT = "decoder_layer_input"
QUERY_WA_PROJ = "query_wa_proj"
KV_WA_PROJ = "kv_wa_proj"
MLA_Q = "mla_q"
MLA_KV = "mla_kv"
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
QKV_PROJ = "qkv_proj"
KV_PROJ = "kv_proj"
CONTEXT = "context"
ATTENTION_OUT = "attention_out"
OUT_PROJ = "out_proj"
MLPWI = "mlpwi"
MLPWI_0 = "mlpwi_0"
MLPWI_1 = "mlpwi_1"
MLPWO = "mlpwo"
MOE_ROWS = "moe_rows"
MOE_MLPWI_0 = "moe_mlpwi_0"
MOE_MLPWI_1 = "moe_mlpwi_1"
MOE_MLPWO = "moe_mlpwo"


@dataclasses.dataclass(frozen=True)
class Entry:
    doc: str  # what the tensor is
    axes: tuple = None  # logical axes (layer-input layout, per layer): how the sharding rules split it for the
    #                     bytes-per-device report; None: split over the batch only
    always_kept: bool = False  # the scan carry: asking to recompute it still keeps it in HBM


_BLE = ("activation_batch", "activation_length", "activation_embed")
_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_KV_HEADS = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
_MLP = ("activation_batch", "activation_length", "activation_mlp")

# THE table: every name a policy can refer to, once, in the order of the forward pass. MaxText-compatible, so
# published recipes carry over unchanged (qkv_proj, kv_proj, context and mlpwi are MaxText's fused or
# alternative tensors: accepted; context is tagged only by the splash kernel on TPUs, the others never).
TABLE = {
    # The layer input is the scan carry and the checkpointed function's input: asking to recompute it still
    # keeps it in HBM (there is nothing to recompute it from). Offloading it does move it to the host (checked
    # on jax 0.10.2; jax#23869 reported otherwise for older versions).
    DECODER_LAYER_INPUT: Entry("input of a decoder layer (the scan carry)", _BLE, always_kept=True),
    QUERY_WA_PROJ: Entry("MLA: query down-projection to q_lora_rank"),
    KV_WA_PROJ: Entry("MLA: key/value down-projection to kv_lora_rank (+ rope key)"),
    MLA_Q: Entry("MLA: normalised query latent"),
    MLA_KV: Entry("MLA: normalised key/value latent"),
    QUERY_PROJ: Entry("query projection (before RoPE)", _HEADS),
    KEY_PROJ: Entry("key projection (before RoPE)", _KV_HEADS),
    VALUE_PROJ: Entry("value projection", _KV_HEADS),
    QKV_PROJ: Entry("fused query/key/value projection"),
    KV_PROJ: Entry("fused key/value projection"),
    CONTEXT: Entry("attention probabilities x values, before the output projection: on TPUs the splash kernel's "
                   "residuals (its output and the rows' log-sum-exp; kept, the backward runs no second forward "
                   "kernel)"),
    ATTENTION_OUT: Entry("attention output (heads x head_dim), before the output projection", _HEADS),
    OUT_PROJ: Entry("attention output projection", _BLE),
    MLPWI: Entry("fused MLP input projection"),
    MLPWI_0: Entry("MLP gate projection (before the activation)", _MLP),
    MLPWI_1: Entry("MLP up projection", _MLP),
    MLPWO: Entry("MLP down projection", _BLE),
    MOE_ROWS: Entry("routed experts: the token rows a device holds for its experts, in expert order, with where each "
                    "came from (the exchange's dispatch: recomputing them repeats its all-gather or all-to-all)"),
    MOE_MLPWI_0: Entry("routed experts: gate projection"),
    MOE_MLPWI_1: Entry("routed experts: up projection"),
    MOE_MLPWO: Entry("routed experts: down projection"),
}

# Views of the table, for the readers that want one column.
VOCABULARY = {name: entry.doc for name, entry in TABLE.items()}  # name -> what the tensor is
ACTIVATION_AXES = {name: entry.axes for name, entry in TABLE.items() if entry.axes}
ALWAYS_KEPT = tuple(name for name, entry in TABLE.items() if entry.always_kept)


def tag(x, name):
    """Marks `x` as the activation `name` for jax.checkpoint policies."""
    if name not in VOCABULARY:
        raise KeyError(f"{name!r} is not in the offload vocabulary")
    return checkpoint_name(x, name)


def sub_jaxprs(eqn):
    """The jaxprs nested in one equation (scan, remat, pjit, cond ... bodies)."""
    for param in eqn.params.values():
        for item in param if isinstance(param, (list, tuple)) else (param,):
            if hasattr(item, "jaxpr") and hasattr(item, "consts"):
                yield item.jaxpr
            elif hasattr(item, "eqns"):
                yield item


def traced(jaxpr):
    """The names `tag` put in a jaxpr, each once, in the order they are first tagged (nested bodies too)."""
    found = {}

    def walk(body):
        for eqn in body.eqns:
            if eqn.primitive.name == "name":
                found.setdefault(eqn.params["name"], None)
            for sub in sub_jaxprs(eqn):
                walk(sub)

    walk(jaxpr)
    return tuple(found)
