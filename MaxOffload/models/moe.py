"""DeepSeekMoE: sigmoid router with auxiliary-loss-free balancing, group-limited top-k routing,
routed experts (dropless or with a capacity factor), a shared expert, and expert parallelism.

One MoE layer, x: [batch, length, emb]:
    route     scores = sigmoid(x @ w_router); the experts are chosen on scores + bias (group-limited
              top-k); gates = the chosen experts' unbiased scores, normalised, x routed_scaling_factor
    dispatch  every (token, choice) gets a row of an expert-sorted buffer: dropless = sorted by expert,
              ragged groups; capacity = `capacity` slots per expert and sequence, later tokens dropped
    experts   three grouped matmuls over the rows: moe_mlpwi_0/1, moe_mlpwo (`grouped_matmul`). With a
              capacity every local expert has the same number of rows, laid out in one block each: one
              batched GEMM, [experts, rows, emb] x [experts, emb, mlp], whose compiled FLOPs are the
              capacity's. Dropless groups are ragged: a grouped GEMM, `model.moe_kernel` (models/kernels.py:
              tokamax's Triton kernel on GPUs, where XLA would rewrite jax.lax.ragged_dot into a dense dot
              over every expert, experts x the work; jax.lax.ragged_dot on CPU).
    combine   out[token] = sum over its choices of gate * expert output
    + the shared expert, a SwiGLU every token passes through (tagged mlpwi_0/1, mlpwo like a dense MLP)

Expert parallelism (the mesh axes come from a parallel/expert.ExpertLayout that TrainSetup makes from the
mesh and the rules and hands to the model; this module never reads the active mesh): expert weights are
sharded over the `exp` logical axis (mesh axis `expert`),
tokens over the batch axes, which include `expert`. The exchange is an all-gather of the tokens over
`expert`, each device running its own experts on the rows routed to them, and a reduce-scatter of the
combined outputs back to the tokens' owners (inside jax.shard_map; the matmuls' outputs are tagged
between shard_maps, so remat/offload policies and offload/inspect.py see them as ordinary arrays).
Why not all-to-all: a ragged all-to-all is what a GPU wants but XLA:CPU cannot run it (untestable
here); an all-to-all on capacity-padded buffers drops tokens or pads to the worst case, while DeepSeek-V3
trains dropless. With top-8 of 256 experts on 8 expert ranks a token's choices reach several ranks
anyway (at most 4 with DeepSeek-V3's 4-of-8 group limit when groups align with ranks, ~5 without it),
so the all-gather sends each token to 7 remote ranks where an all-to-all would send 3-4.6 copies:
within 2x of the traffic, no drops, exactly the single-device result. Its cost: the gathered tokens
and, dropless, a rows buffer sized for the worst case (expert ranks x local tokens x top_k rows, of
which ~1/ranks are filled), so the moe_* activations a policy saves or offloads are that large too —
unless `model.moe_buffer_factor` bounds it: factor x the rows a balanced step gives each device, the
choices past it dropped and counted (moe/dropped_fraction), like a capacity but over a device's experts
together rather than per expert and sequence.
FSDP combines freely: the weights enter the shard_map gathered over fsdp (the usual FSDP all-gather)
and their gradients leave reduce-scattered; `moe_mlp` over `tensor` splits every expert's hidden units.
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from MaxOffload.models import components, kernels
from MaxOffload.models.layers import BATCH_LENGTH_EMBED, SwiGLU, param
from MaxOffload.offload import names
from MaxOffload.parallel import logical


class RouterBias(nnx.Variable):
    """Per-expert selection bias: model state the model updates itself, not an optimizer Param."""


# --------------------------------------------------------------------------------------------
# routing


def group_limited_top_k(biased, top_k, n_groups, topk_groups):
    """Indices [..., top_k] of the best experts by `biased`, among the experts of the `topk_groups`
    groups ranked highest by the sum of their two best scores (DeepSeek-V3's node-limited routing)."""
    if n_groups > 1:
        grouped = biased.reshape(*biased.shape[:-1], n_groups, -1)
        group_score = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)
        kept = jax.nn.one_hot(jax.lax.top_k(group_score, topk_groups)[1], n_groups).sum(-2) > 0
        biased = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(biased.shape)
    return jax.lax.top_k(biased, top_k)[1]


@components.scoped(components.ROUTER)
def route(x, w_router, bias, *, top_k, n_groups, topk_groups, scaling):
    """(experts [b, l, k] int32, gates [b, l, k] float32, scores [b, l, E] float32).

    The bias changes which experts are chosen, never the gate weights or the gradient."""
    scores = jax.nn.sigmoid(jnp.einsum("ble,en->bln", x.astype(jnp.float32), w_router.astype(jnp.float32)))
    experts = group_limited_top_k(scores + jax.lax.stop_gradient(bias), top_k, n_groups, topk_groups)
    chosen = jnp.take_along_axis(scores, experts, axis=-1)
    return experts, chosen / (chosen.sum(-1, keepdims=True) + 1e-20) * scaling, scores


def updated_bias(bias, load, rate):
    """Auxiliary-loss-free balancing: bias += rate * sign(mean load - load), per expert (last axis)."""
    return bias + rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load)


def sequence_balance_loss(scores, experts):
    """DeepSeek-V3's sequence-wise balance loss before its weight alpha: the mean over sequences of
    sum_i f_i P_i, f_i = E / (k L) * (tokens choosing expert i), P_i = mean_t s_i,t / sum_j s_j,t."""
    _, length, num_experts = scores.shape
    chosen = jax.nn.one_hot(experts, num_experts).sum((1, 2))  # [b, E]
    f = chosen * num_experts / (experts.shape[-1] * length)
    p = (scores / scores.sum(-1, keepdims=True)).mean(1)
    return jnp.mean(jnp.sum(f * p, -1))


def capacity_positions(experts, num_experts):
    """Each choice's place in its expert's queue within its sequence (token order, then choice order)."""
    b, length, k = experts.shape
    one_hot = jax.nn.one_hot(experts.reshape(b, length * k), num_experts, dtype=jnp.int32)
    before = jnp.cumsum(one_hot, axis=1) - one_hot
    return jnp.sum(before * one_hot, -1).reshape(b, length, k)


# --------------------------------------------------------------------------------------------
# dispatch -> grouped matmuls -> combine, for the experts held locally


def dispatch(x, experts, positions, *, first_expert, num_local, capacity, buffer_rows=0):
    """Rows for the local experts [first_expert, first_expert + num_local).

    x [b, l, emb]; experts, positions [b, l, k]. Returns (rows [R, emb] sorted by expert, row [b*l*k]
    of every choice (R where the choice is not here: another device's expert, or dropped), group
    sizes [num_local], dropped [1]: the choices for these experts that found no row). capacity=0: dropless,
    R = b*l*k (the worst case) or `buffer_rows` when that is smaller (later choices in expert order
    dropped). capacity>0: `capacity` rows per local expert and sequence, R = num_local * b * capacity;
    choices past the capacity are dropped.
    """
    b, length, k = experts.shape
    token = jnp.arange(b * length * k) // k
    local = experts.reshape(-1) - first_expert
    wanted = (local >= 0) & (local < num_local)
    if capacity:
        num_rows = num_local * b * capacity
        row = (local * b + token // length) * capacity + positions.reshape(-1)
        here = wanted & (positions.reshape(-1) < capacity)
        sizes = jnp.full((num_local,), b * capacity, jnp.int32)
    else:
        num_rows = min(buffer_rows or b * length * k, b * length * k)
        key = jnp.where(wanted, local, num_local)  # not here: after every local group
        row = jnp.argsort(jnp.argsort(key, stable=True))  # rank of each choice in expert order
        here = wanted & (row < num_rows)
        ends = jnp.minimum(jnp.cumsum(jnp.bincount(key, length=num_local + 1)[:num_local]), num_rows)
        sizes = jnp.diff(ends, prepend=0).astype(jnp.int32)
    row = jnp.where(here, row, num_rows)
    token_of_row = jnp.zeros((num_rows,), jnp.int32).at[row].set(token, mode="drop")
    filled = jnp.zeros((num_rows,), bool).at[row].set(True, mode="drop")
    rows = jnp.where(filled[:, None], x.reshape(-1, x.shape[-1])[token_of_row], 0)
    return rows, row, sizes, jnp.sum(wanted & ~here, keepdims=True).astype(jnp.float32)


def grouped_matmul(rows, w, sizes, capacity, kernel="xla"):
    """rows [R, k] x w [E, k, n] -> [R, n], row r multiplied by the expert whose group holds it (`sizes`
    [E] consecutive rows each). capacity > 0: every group has R / E rows (dispatch's layout), so this is one
    batched GEMM; dropless: the grouped GEMM `kernel` (models/kernels.resolve)."""
    if capacity:
        experts = w.shape[0]
        out = jnp.einsum("egk,ekn->egn", rows.reshape(experts, -1, rows.shape[-1]), w)
        return out.reshape(-1, w.shape[-1])
    return kernels.ragged_dot(rows, w, sizes, kernel)


def combine(y_rows, row, gates):
    """[b, l, emb] float32: per token, the gate-weighted sum of its choices' expert outputs."""
    b, length, k = gates.shape
    picked = jnp.take(y_rows, row, axis=0, mode="fill", fill_value=0).reshape(b, length, k, -1)
    return jnp.einsum("blkd,blk->bld", picked.astype(jnp.float32), gates)


def _spec(*dims):
    """PartitionSpec from per-dimension tuples of mesh axes."""
    return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims))


class ExpertExchange:
    """The dispatch / grouped matmul / combine steps, run per device over a parallel/expert.ExpertLayout (see
    the module docstring), or directly when there is none (every expert local). `kernel`: the grouped GEMM
    of dropless mode (models/kernels.resolve); `buffer_factor`: dropless rows per device = this x a balanced
    step's (0: the worst case)."""

    def __init__(self, layout, num_experts, capacity, kernel="xla", buffer_factor=0.0):
        self.capacity, self.kernel, self.buffer_factor, self.num_experts = capacity, kernel, buffer_factor, num_experts
        self.mesh = layout.mesh if layout is not None else None
        if layout is None:  # every expert local; the specs are not used
            self.ep = self.mlp = self.rows = ()
            self.tokens, self.gather, self.num_local = None, False, num_experts
            return
        batch, length = layout.batch, () if capacity else layout.length  # capacity is per whole sequence
        self.ep, self.mlp = layout.ep, layout.mlp
        self.gather = bool(self.ep) and set(self.ep) <= set(batch)  # else tokens are replicated over ep
        if self.ep and not self.gather and set(self.ep) & set(batch + length):
            raise ValueError(f"experts sharded over {self.ep} must shard the batch over all or none of them")
        self.tokens = _spec(batch, length, ())
        self.rows = batch + length + (() if self.gather else self.ep)
        self.num_local = num_experts // logical.ways(layout.mesh, self.ep)

    def _run(self, fn, in_specs, out_specs, *args, kernel=False):
        """`kernel`: fn calls the grouped-GEMM kernel, whose Pallas call cannot say how its output varies over
        the mesh axes: the shard_map does not check that (check_vma=False; the specs say it)."""
        if self.mesh is None:
            return fn(*args)
        check = not (kernel and self.kernel.startswith("tokamax"))
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)(*args)

    def dispatch(self, x, experts, positions):
        def local(x, experts, positions):
            first = 0
            if self.ep:
                first = jax.lax.axis_index(self.ep) * self.num_local
            if self.gather:
                x, experts, positions = (jax.lax.all_gather(a, self.ep, tiled=True) for a in (x, experts, positions))
            balanced = experts.size * self.num_local / self.num_experts  # this device's rows in a balanced step
            return dispatch(x, experts, positions, first_expert=first, num_local=self.num_local,
                            capacity=self.capacity, buffer_rows=math.ceil(self.buffer_factor * balanced))

        if positions is None:
            positions = jnp.zeros_like(experts)
        rows = _spec(self.rows)
        return self._run(local, (self.tokens,) * 3, (_spec(self.rows, ()), rows, rows, rows), x, experts, positions)

    def matmul_in(self, rows, w, sizes):
        """rows [R, emb] x w [E, emb, mlp] -> [R, mlp]."""
        def local(rows, w, sizes):
            return grouped_matmul(rows, w, sizes, self.capacity, self.kernel)

        return self._run(local, (_spec(self.rows, ()), _spec(self.ep, (), self.mlp), _spec(self.rows)),
                         _spec(self.rows, self.mlp), rows, w, sizes, kernel=True)

    def matmul_out(self, h, w, sizes):
        """h [R, mlp] x w [E, mlp, emb] -> [R, emb], summed over the mlp shards."""
        def local(h, w, sizes):
            out = grouped_matmul(h, w, sizes, self.capacity, self.kernel)
            return jax.lax.psum(out, self.mlp) if self.mlp else out

        return self._run(local, (_spec(self.rows, self.mlp), _spec(self.ep, self.mlp, ()), _spec(self.rows)),
                         _spec(self.rows, ()), h, w, sizes, kernel=True)

    def combine(self, y_rows, row, gates):
        def local(y_rows, row, gates):
            if self.gather:
                gates = jax.lax.all_gather(gates, self.ep, tiled=True)
            out = combine(y_rows, row, gates)
            if self.gather:
                return jax.lax.psum_scatter(out, self.ep, scatter_dimension=0, tiled=True)
            return jax.lax.psum(out, self.ep) if self.ep else out

        return self._run(local, (_spec(self.rows, ()), _spec(self.rows), self.tokens), self.tokens, y_rows, row, gates)


@components.scoped(components.EXPERTS)
def routed_experts(x, experts, gates, positions, wi_0, wi_1, wo, capacity, layout=None, kernel="xla",
                   buffer_factor=0.0):
    """(sum over each token's chosen experts of gate * SwiGLU_expert(x) -> [b, l, emb] float32, the number of
    choices dropped); `layout`: the parallel/expert.ExpertLayout (None: every expert on this device); `kernel`,
    `buffer_factor`: see ExpertExchange."""
    ep = ExpertExchange(layout, wi_0.shape[0], capacity, kernel, buffer_factor)
    rows, row, sizes, dropped = ep.dispatch(x, experts, positions)
    gate = names.tag(ep.matmul_in(rows, wi_0, sizes), names.MOE_MLPWI_0)
    up = names.tag(ep.matmul_in(rows, wi_1, sizes), names.MOE_MLPWI_1)
    out = names.tag(ep.matmul_out(jax.nn.silu(gate) * up, wo, sizes), names.MOE_MLPWO)
    return ep.combine(out, row, gates), dropped.sum()


# --------------------------------------------------------------------------------------------
# the layer


class MoE(nnx.Module):
    """Routed experts + shared expert(s). Returns (out, stats) with per-step statistics:
    load [E] (choices per expert), dropped (choices over capacity), balance (sequence-wise loss)."""

    def __init__(self, *, emb_dim, num_experts, top_k, mlp_dim, num_shared, n_groups, topk_groups, scaling,
                 capacity_factor, param_dtype, compute_dtype, init_std, rngs, experts=None, kernel="auto",
                 buffer_factor=0.0):
        """experts: the parallel/expert.ExpertLayout the exchange runs over (None: every expert local, on the
        CPU); kernel: `model.moe_kernel` (models/kernels.GROUPED_GEMM), resolved for the layout's devices;
        buffer_factor: `model.moe_buffer_factor` (dropless rows per device over a balanced step's; 0 = all)."""
        self.top_k, self.n_groups, self.topk_groups, self.scaling = top_k, n_groups, topk_groups, scaling
        self.layout, self.buffer_factor = experts, buffer_factor
        self.kernel = kernels.resolve(kernel, kernels.platform(experts.mesh.devices.flat[0]) if experts else "cpu")
        self.capacity_factor, self.compute_dtype = capacity_factor, compute_dtype
        self.router = param(rngs, (emb_dim, num_experts), ("embed", None), param_dtype, init_std)
        self.router_bias = RouterBias(jnp.zeros((num_experts,), jnp.float32))
        self.wi_0 = param(rngs, (num_experts, emb_dim, mlp_dim), ("exp", "embed", "moe_mlp"), param_dtype, init_std)
        self.wi_1 = param(rngs, (num_experts, emb_dim, mlp_dim), ("exp", "embed", "moe_mlp"), param_dtype, init_std)
        self.wo = param(rngs, (num_experts, mlp_dim, emb_dim), ("exp", "moe_mlp", "embed"), param_dtype, init_std)
        # n shared experts of width mlp_dim are one SwiGLU of width n * mlp_dim
        self.shared = SwiGLU(emb_dim=emb_dim, mlp_dim=num_shared * mlp_dim, param_dtype=param_dtype,
                             compute_dtype=compute_dtype, init_std=init_std, rngs=rngs) if num_shared else None

    def __call__(self, x):
        cdt, num_experts = self.compute_dtype, self.wi_0.shape[0]
        _, length, _ = x.shape
        experts, gates, scores = route(x, self.router[...], self.router_bias[...], top_k=self.top_k,
                                       n_groups=self.n_groups, topk_groups=self.topk_groups, scaling=self.scaling)
        capacity = math.ceil(self.capacity_factor * length * self.top_k / num_experts)
        positions = capacity_positions(experts, num_experts) if capacity else None
        out, dropped = routed_experts(x, experts, gates, positions, self.wi_0[...].astype(cdt),
                                      self.wi_1[...].astype(cdt), self.wo[...].astype(cdt), capacity, self.layout,
                                      self.kernel, self.buffer_factor)
        out = out.astype(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        stats = {"load": jax.nn.one_hot(experts, num_experts).sum((0, 1, 2)), "dropped": dropped,
                 "balance": sequence_balance_loss(scores, experts)}
        return logical.constrain(out, BATCH_LENGTH_EMBED), stats
