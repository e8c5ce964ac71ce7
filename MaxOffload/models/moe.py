"""A mixture-of-experts layer in three replaceable parts: a router (models/routing.py: which experts, what gate
weights, the load statistics and router state), an exchange (models/exchange.py: how the routed tokens reach
their experts' devices and come back) and the experts' grouped GEMM (models/matmul.grouped), plus shared experts
every token passes through.

One MoE layer, x: [batch, length, emb]:
    route     the router's Routing: experts [b, l, k], gates [b, l, k], scores [b, l, E]
    dispatch  every (token, choice) gets a row of an expert-sorted buffer: dropless = sorted by expert,
              ragged groups; capacity = `capacity` slots per expert and sequence, later tokens dropped (the rows
              a device holds and where they came from: moe_rows)
    experts   three grouped matmuls over the rows: moe_mlpwi_0/1, moe_mlpwo. With a capacity every local expert
              has the same number of rows, one block each: one batched GEMM, [experts, rows, emb] x
              [experts, emb, mlp], whose compiled FLOPs are the capacity's. Dropless groups are ragged: a grouped
              GEMM, `model.moe_kernel` (models/kernels.py: tokamax's Triton kernel on GPUs, where XLA would
              rewrite jax.lax.ragged_dot into a dense dot over every expert; jax.lax.ragged_dot on CPU).
    combine   out[token] = sum over its choices of gate * expert output
    + the shared experts, a SwiGLU every token passes through (tagged mlpwi_0/1, mlpwo like a dense MLP)

Expert weights are [experts, embed, moe_mlp] on logical axes `exp`, `embed`, `moe_mlp`; the parallel layout the
layer is built with (parallel/layout.py) maps them to mesh axes and names the exchange.
"""
import math

import jax
from flax import nnx

from MaxOffload.models import components, exchange as exchange_lib
from MaxOffload.models.exchange import capacity_positions
from MaxOffload.models.layers import BATCH_LENGTH_EMBED, SwiGLU, gated_silu, param
from MaxOffload.models.model_context import DEFAULT
from MaxOffload.offload import names


@components.scoped(components.EXPERTS)
def routed_experts(x, experts, gates, positions, wi_0, wi_1, wo, capacity, ctx=DEFAULT, kernel="xla",
                   buffer_factor=0.0):
    """(sum over each token's chosen experts of gate * SwiGLU_expert(x) -> [b, l, emb] float32, the number of
    choices dropped), through the exchange of ctx's layout (models/exchange.py; without a mesh every expert is
    local)."""
    ep = exchange_lib.EXCHANGES[ctx.layout.exchange](ctx, wi_0.shape[0], capacity, kernel, buffer_factor)
    rows, row, sizes, dropped = ep.dispatch(x, experts, positions)
    # what the backward needs of the dispatch, under one name: saving it spares the backward the dispatch's exchange
    rows, (row, sizes) = ctx.tag(rows, names.MOE_ROWS), names.tag((row, sizes), names.MOE_ROWS)
    gate = ctx.tag(ep.matmul_in(rows, wi_0, sizes), names.MOE_MLPWI_0)
    up = ctx.tag(ep.matmul_in(rows, wi_1, sizes), names.MOE_MLPWI_1)
    out = ctx.tag(ep.matmul_out(gated_silu(gate, up), wo, sizes), names.MOE_MLPWO)
    return ep.combine(out, row, gates), dropped.sum()


class MoE(nnx.Module):
    """Router + routed experts (through the layout's exchange) + shared expert(s). Returns (out, stats): the router's
    per-layer statistics (`load` [E], choices per expert, at least) and `dropped` (choices over a capacity or
    buffer)."""

    def __init__(self, *, emb_dim, num_experts, mlp_dim, num_shared, router, capacity_factor, param_dtype, init_std,
                 rngs, ctx=DEFAULT, kernel="xla", buffer_factor=0.0):
        """router: a models/routing.Router; kernel: the grouped GEMM (models/kernels.grouped_gemm_for, chosen for
        the layout's devices); buffer_factor: `model.moe_buffer_factor` (dropless rows per device over a balanced
        step's; 0 = all)."""
        self.routing, self.ctx, self.kernel, self.buffer_factor = router, ctx, kernel, buffer_factor
        self.capacity_factor = capacity_factor
        self.router = param(rngs, (emb_dim, num_experts), ("embed", None), param_dtype, init_std)
        for name, kind in router.state.items():  # e.g. DeepSeek-V3's selection bias
            setattr(self, name, kind(jax.numpy.zeros((num_experts,), jax.numpy.float32)))
        self.wi_0 = param(rngs, (num_experts, emb_dim, mlp_dim), ("exp", "exp_embed", "moe_mlp"), param_dtype,
                          init_std)
        self.wi_1 = param(rngs, (num_experts, emb_dim, mlp_dim), ("exp", "exp_embed", "moe_mlp"), param_dtype,
                          init_std)
        self.wo = param(rngs, (num_experts, mlp_dim, emb_dim), ("exp", "moe_mlp", "exp_embed"), param_dtype, init_std)
        # n shared experts of width mlp_dim are one SwiGLU of width n * mlp_dim
        self.shared = SwiGLU(emb_dim=emb_dim, mlp_dim=num_shared * mlp_dim, param_dtype=param_dtype,
                             init_std=init_std, rngs=rngs, ctx=ctx) if num_shared else None

    def router_state(self):
        return {name: getattr(self, name)[...] for name in self.routing.state}

    def __call__(self, x):
        num_experts = self.wi_0.shape[0]
        _, length, _ = x.shape
        with jax.named_scope(components.ROUTER):
            logits = self.ctx.dense(x, self.router[...], "ble,en->bln", components.ROUTER)
        routing = self.routing.route(logits, self.router_state())
        capacity = math.ceil(self.capacity_factor * length * self.routing.top_k / num_experts)
        positions = capacity_positions(routing.experts, num_experts) if capacity else None
        # the weights in the matmuls' dtype before the exchange, so that FSDP gathers them in it
        dtype = self.ctx.numerics.operand_dtype(components.EXPERTS)
        weights = [w[...].astype(dtype) for w in (self.wi_0, self.wi_1, self.wo)]
        out, dropped = routed_experts(x, routing.experts, routing.gates, positions, *weights, capacity, self.ctx,
                                      self.kernel, self.buffer_factor)
        out = out.astype(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        return self.ctx.constrain(out, BATCH_LENGTH_EMBED), {**self.routing.statistics(routing), "dropped": dropped}
