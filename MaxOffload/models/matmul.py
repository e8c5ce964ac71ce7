"""The one entry point of every weight matmul: attention projections, MLPs and shared experts, the router, the
output head (`dense`) and the routed experts' grouped GEMM (`grouped`). Each call names its model part
(models/components), so a numerics policy can treat parts differently; FP8 and MXFP8 plug in here.

`Numerics` is that policy. `bf16`: the weight cast to the compute dtype, the router in float32, the output head
accumulated and returned in float32. `fp8` / `mxfp8` (quant.mode): the GEMMs of the parts it names (by default
the attention projections, the MLPs and shared experts, the routed experts) through models/fp8.py; the embedding,
output head, router, norms and attention scores stay as in bf16 (as DeepSeek-V3 trained). The routed experts'
dropless grouped GEMM (tokamax ragged_dot) is quantized per row and per expert in both FP8 modes
(models/fp8.ragged_dot_fp8: its weight gradient in BF16), their capacity-mode batched GEMM per tensor (fp8).
`Numerics.tag` tags activations for the remat/offload policies, keeping the names of quant.fp8_storage in FP8.
Under mxfp8 each weight is gathered whole but for its tensor-parallel split before its GEMM (`weight`).

Every call runs under jax.named_scope(SCOPE), so a test finds every weight matmul of a traced step
(tests/test_moe_parts.py walks the jaxpr for a dot_general outside it).
"""
import dataclasses

import jax
import jax.numpy as jnp

from MaxOffload.models import components, fp8, kernels
from MaxOffload.offload import names

SCOPE = "weight_matmul"
# The only matmuls outside SCOPE contract two activations: attention's scores and values, and the routed experts'
# gate-weighted combine (models/exchange.combine); each runs under its own scope.
COMBINE_SCOPE = "expert_combine"
ACTIVATION_SCOPES = (components.ATTENTION_SCORES, COMBINE_SCOPE)


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How weight matmuls compute: the compute dtype activations and weights meet in, `mode` (bf16 | fp8 | mxfp8)
    and the model parts (models/components) whose GEMMs the FP8 modes quantize."""
    compute_dtype: str = "bfloat16"
    mode: str = "bf16"
    parts: tuple = (components.PROJECTIONS, components.MLP, components.EXPERTS)
    fp8_storage: tuple = ()  # activation names kept in FP8 when saved or offloaded (quant.fp8_storage)

    def quantized(self, part):
        """Whether the GEMMs of `part` run in FP8."""
        return self.mode != "bf16" and part in self.parts

    def tag(self, x, name):
        """`x` tagged as activation `name` for the remat/offload policies (offload/names.tag), stored in FP8 when
        `name` is in fp8_storage (models/fp8.stored)."""
        return fp8.stored(x, name) if name in self.fp8_storage else names.tag(x, name)

    def operand_dtype(self, part):
        """The dtype both operands are cast to for a matmul of `part` (the router decides in float32)."""
        return jnp.float32 if part == components.ROUTER else jnp.dtype(self.compute_dtype)

    def accumulate(self, part):
        """The matmul's result dtype: float32 for the output head (the loss reads its logits), else the default."""
        return jnp.float32 if part == components.UNEMBED else None


def weight(param, numerics, layout):
    """A weight parameter's value for its matmul: as stored, or under mxfp8 with its whole contraction on every
    device (parallel/layout.gathered). jax's block-scaled dot partitions its e8m0 scales only along whole blocks
    of 32 (an FSDP split of 7168 over 128 devices is 56 a device: IndivisibleError) and otherwise all-reduces
    them, which NCCL cannot (no f8e8m0fnu); FSDP all-gathers the weight for the GEMM in any case."""
    return layout.gathered(param) if numerics.mode == "mxfp8" else param[...]


def dense(x, w, spec, part, numerics):
    """einsum(spec, x, w) of activation x and weight w, for model part `part`, under the numerics policy; spec None:
    x @ w (the last axis of x against the first of w)."""
    dtype = numerics.operand_dtype(part)
    with jax.named_scope(SCOPE):
        if numerics.quantized(part):
            if spec is None:
                free = "abcdefghij"[:x.ndim - 1]
                spec = f"{free}k,kn->{free}n"
            return fp8.EINSUMS[numerics.mode](spec, x.astype(dtype), w.astype(dtype))
        x = x if part != components.ROUTER else x.astype(dtype)
        if spec is None:
            return jnp.matmul(x, w.astype(dtype), preferred_element_type=numerics.accumulate(part))
        return jnp.einsum(spec, x, w.astype(dtype), preferred_element_type=numerics.accumulate(part))


def grouped(rows, w, sizes, capacity, kernel, numerics):
    """The routed experts' matmul: rows [R, k] x w [E, k, n] -> [R, n], row r multiplied by the expert whose group
    of `sizes` [E] consecutive rows holds it. capacity > 0: every group has R / E rows (models/exchange.dispatch's
    layout), one batched GEMM; dropless: the grouped GEMM `kernel` (models/kernels.grouped_gemm_for)."""
    w = w.astype(numerics.operand_dtype(components.EXPERTS))
    with jax.named_scope(SCOPE):
        if capacity:
            experts = w.shape[0]
            groups = rows.reshape(experts, -1, rows.shape[-1])
            if numerics.quantized(components.EXPERTS):  # per-tensor FP8 in both modes: this GEMM runs inside the
                # exchange's shard_map, where jax's MXFP8 VJP drops the manual axes of its gradients
                out = fp8.einsum_fp8("egk,ekn->egn", groups.astype(w.dtype), w)
            else:
                out = jnp.einsum("egk,ekn->egn", groups, w)
            return out.reshape(-1, w.shape[-1])
        if numerics.quantized(components.EXPERTS):
            return fp8.ragged_dot_fp8(kernel, rows.astype(w.dtype), w, sizes)
        return kernels.ragged_dot(rows, w, sizes, kernel)
