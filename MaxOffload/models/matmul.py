"""The one entry point of every weight matmul: attention projections, MLPs and shared experts, the router, the
output head (`dense`) and the routed experts' grouped GEMM (`grouped`). Each call names its model part
(models/components), so a numerics policy can treat parts differently; FP8 and MXFP8 plug in here.

`Numerics` is that policy. Today's (`bf16`): the weight cast to the compute dtype, the router in float32, the output
head accumulated and returned in float32. Every call runs under jax.named_scope(SCOPE), so a test finds every weight
matmul of a traced step (tests/test_moe_parts.py walks the jaxpr for a dot_general outside it).
"""
import dataclasses

import jax
import jax.numpy as jnp

from MaxOffload.models import components, kernels

SCOPE = "weight_matmul"
# The only matmuls outside SCOPE contract two activations: attention's scores and values, and the routed experts'
# gate-weighted combine (models/exchange.combine); each runs under its own scope.
COMBINE_SCOPE = "expert_combine"
ACTIVATION_SCOPES = (components.ATTENTION_SCORES, COMBINE_SCOPE)


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How weight matmuls compute: `mode` (bf16) and the compute dtype activations and weights meet in."""
    compute_dtype: str = "bfloat16"
    mode: str = "bf16"

    def operand_dtype(self, part):
        """The dtype both operands are cast to for a matmul of `part` (the router decides in float32)."""
        return jnp.float32 if part == components.ROUTER else jnp.dtype(self.compute_dtype)

    def accumulate(self, part):
        """The matmul's result dtype: float32 for the output head (the loss reads its logits), else the default."""
        return jnp.float32 if part == components.UNEMBED else None


def dense(x, w, spec, part, numerics):
    """einsum(spec, x, w) of activation x and weight w, for model part `part`, under the numerics policy; spec None:
    x @ w (the last axis of x against the first of w)."""
    dtype = numerics.operand_dtype(part)
    with jax.named_scope(SCOPE):
        x = x if part != components.ROUTER else x.astype(dtype)
        if spec is None:
            return jnp.matmul(x, w.astype(dtype), preferred_element_type=numerics.accumulate(part))
        return jnp.einsum(spec, x, w.astype(dtype), preferred_element_type=numerics.accumulate(part))


def grouped(rows, w, sizes, capacity, kernel, numerics):
    """The routed experts' matmul: rows [R, k] x w [E, k, n] -> [R, n], row r multiplied by the expert whose group
    of `sizes` [E] consecutive rows holds it. capacity > 0: every group has R / E rows (models/moe.dispatch's
    layout), one batched GEMM; dropless: the grouped GEMM `kernel` (models/kernels.grouped_gemm_for)."""
    w = w.astype(numerics.operand_dtype(components.EXPERTS))
    with jax.named_scope(SCOPE):
        if capacity:
            experts = w.shape[0]
            out = jnp.einsum("egk,ekn->egn", rows.reshape(experts, -1, rows.shape[-1]), w)
            return out.reshape(-1, w.shape[-1])
        return kernels.ragged_dot(rows, w, sizes, kernel)
