"""From (preset, per-tensor settings) to a `jax.checkpoint` policy.

A decision per vocabulary name: "remat" (recompute in the backward pass), "device"
(keep in HBM) or "offload" (move to pinned host memory, stream back for the backward).
"""
import jax

from MaxOffload.offload import names
from MaxOffload.offload.names import VOCABULARY

REMAT, DEVICE, OFFLOAD = "remat", "device", "offload"
DECISIONS = (REMAT, DEVICE, OFFLOAD)

_QKV = (names.QUERY_PROJ, names.KEY_PROJ, names.VALUE_PROJ, names.QKV_PROJ, names.KV_PROJ)
_MLA = (names.QUERY_WA_PROJ, names.KV_WA_PROJ, names.MLA_Q, names.MLA_KV)
_MLP = (names.MLPWI, names.MLPWI_0, names.MLPWI_1, names.MLPWO)
_MOE = (names.MOE_MLPWI_0, names.MOE_MLPWI_1, names.MOE_MLPWO)
_OUT, _CONTEXT = names.OUT_PROJ, names.CONTEXT
_PROJECTIONS = _MLA + _QKV + (_OUT,) + _MLP + _MOE

# preset -> {name: decision}; names not listed are recomputed. MaxText-compatible.
PRESETS = {
    "full": {},
    "minimal": {n: DEVICE for n in _PROJECTIONS},
    "minimal_offloaded": {n: OFFLOAD for n in _PROJECTIONS},
    "minimal_with_context": {n: DEVICE for n in _PROJECTIONS + (_CONTEXT,)},
    "qkv_proj_offloaded": {n: OFFLOAD for n in _QKV},
    "save_qkv_proj": {n: DEVICE for n in _QKV},
    "save_out_proj": {_OUT: DEVICE},
    "save_dot_except_mlp": {n: DEVICE for n in _QKV + _MLA + (_OUT,)},
    "save_dot_except_mlpwi": {n: DEVICE for n in _QKV + _MLA + (_OUT, names.MLPWO, names.MOE_MLPWO)},
    "save_dot_with_context_except_mlp": {n: DEVICE for n in _QKV + _MLA + (_CONTEXT, _OUT)},
    "save_all": {n: DEVICE for n in VOCABULARY},
    "custom": {},
}


# remat.policy=auto: the planner (MaxOffload/offload/planner.py) chooses per tensor and layer group and
# returns an OffloadPlan of `custom` + its decisions right after the config is loaded. Accepted by the
# validator for remat.policy only (ACCEPTED), never a key of PRESETS: the policy builder refuses it.
AUTO = "auto"
ACCEPTED = tuple(PRESETS) + (AUTO,)


def decisions(preset, tensors):
    """{name: decision} for every vocabulary name: the preset, then explicit `tensors` settings."""
    if preset == AUTO:
        raise ValueError("remat.policy=auto must be planned first: MaxOffload.offload.planner.plan_for(cfg)")
    if preset not in PRESETS:
        raise ValueError(f"unknown remat policy {preset!r}")
    out = {name: PRESETS[preset].get(name, REMAT) for name in VOCABULARY}
    for name, decision in tensors.items():
        if decision:
            out[name] = decision
    return out


def policy_from_decisions(chosen, save_everything=False):
    """The `jax.checkpoint` policy for {name: decision}.

    save_everything (plain `save_all`) keeps every intermediate: no recomputation at all.
    Otherwise the policy is name-based and untagged values are always recomputed.
    """
    if save_everything:
        return jax.checkpoint_policies.everything_saveable
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[n for n, d in chosen.items() if d == DEVICE],
        names_which_can_be_offloaded=[n for n, d in chosen.items() if d == OFFLOAD],
        offload_src="device",
        offload_dst="pinned_host",
    )
