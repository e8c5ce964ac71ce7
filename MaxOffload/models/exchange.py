"""How routed tokens reach the devices that hold their experts and come back: an exchange runs a MoE layer's
dispatch (each token choice to a row of its expert's buffer), the experts' grouped matmuls on the rows a device
holds (models/matmul.grouped) and the combine (each token's gate-weighted sum of its choices' outputs).
`ParallelLayout.exchange` names one from EXCHANGES; a new kind is one class and one `EXCHANGES[name] = ...`
(tests/test_moe_parts.py adds one from a test file). Built: `all_gather` (below) and `all_to_all`
(AllToAllExchange: each choice to its expert's owner and back; ragged on GPUs and TPUs, padded on CPUs;
`all_to_all_padded` / `all_to_all_ragged` fix the transport).

The interface (`Exchange`): dispatch(x, experts, positions) -> (rows, row of every choice, group sizes, dropped);
matmul_in(rows, w, sizes); matmul_out(h, w, sizes); combine(y_rows, row, gates). The matmuls' outputs are ordinary
(sharded) arrays between these steps, so remat/offload policies and offload/inspect.py see them.

`all_gather` (AllGatherExchange): the tokens are all-gathered over the `expert` mesh axes, each device runs its own
experts on the rows routed to them, and a reduce-scatter returns the combined outputs to the tokens' owners
(inside jax.shard_map). Against an all-to-all: a ragged all-to-all is what a GPU or TPU wants but XLA:CPU cannot
run it (AllToAllExchange pads its per-rank buffers there, or emulates the primitive); an all-to-all on
capacity-padded buffers drops tokens or pads to the worst case, while DeepSeek-V3
trains dropless. With top-8 of 256 experts on 8 expert ranks a token's choices reach several ranks
anyway (at most 4 with DeepSeek-V3's 4-of-8 group limit when groups align with ranks, ~5 without it), so the
all-gather sends each token to 7 remote ranks where an all-to-all would send 3-4.6 copies: within 2x of the traffic,
no drops, exactly the single-device result. Its cost: the gathered tokens and, dropless, a rows buffer sized for
the worst case (expert ranks x local tokens x top_k rows, of which ~1/ranks are filled), so the moe_* activations a
policy saves or offloads are that large too, unless `model.moe_buffer_factor` bounds it: factor x the rows a
balanced step gives each device, the choices past it dropped and counted (moe/dropped_fraction). FSDP combines
freely: the weights enter the shard_map gathered over fsdp and their gradients leave reduce-scattered; `moe_mlp`
over `tensor` splits every expert's hidden units.
"""
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from MaxOffload.models import kernels, matmul
from MaxOffload.parallel import logical


# --------------------------------------------------------------------------------------------
# the local steps


def _before(counts, axis):
    """Exclusive prefix sums of `counts` along `axis`."""
    return jnp.cumsum(counts, axis) - counts


def capacity_positions(experts, num_experts):
    """Each choice's place in its expert's queue within its sequence (token order, then choice order)."""
    b, length, k = experts.shape
    one_hot = jax.nn.one_hot(experts.reshape(b, length * k), num_experts, dtype=jnp.int32)
    before = _before(one_hot, 1)
    return jnp.sum(before * one_hot, -1).reshape(b, length, k)


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


def combine(y_rows, row, gates):
    """[b, l, emb] float32: per token, the gate-weighted sum of its choices' expert outputs."""
    b, length, k = gates.shape
    picked = jnp.take(y_rows, row, axis=0, mode="fill", fill_value=0).reshape(b, length, k, -1)
    with jax.named_scope(matmul.COMBINE_SCOPE):
        return jnp.einsum("blkd,blk->bld", picked.astype(jnp.float32), gates)


def _spec(*dims):
    """PartitionSpec from per-dimension tuples of mesh axes."""
    return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims))


class Exchange:
    """The interface (module docstring). `ctx`: the models/model_context.ModelContext of the MoE layer (its parallel
    layout, `self.layout`, and the matmuls' numerics); `kernel`: the grouped GEMM of dropless mode
    (models/kernels.grouped_gemm_for); `buffer_factor`: dropless rows per device = this x a balanced step's (0: the
    worst case)."""

    transport = None  # how the token all-to-all exchanges move rows (AllToAllExchange); None: no all-to-all

    @classmethod
    def transport_on(cls, platform):
        """The transport this kind of exchange moves rows by on devices of `platform`: "ragged" | "padded" (auto:
        ragged on GPUs and TPUs, padded on CPUs, whose XLA has no ragged all-to-all), None without an all-to-all."""
        if cls.transport == "auto":
            return "padded" if platform == "cpu" else "ragged"
        return cls.transport

    def __init__(self, ctx, num_experts, capacity, kernel="xla", buffer_factor=0.0):
        self.ctx, self.layout, self.num_experts, self.capacity = ctx, ctx.layout, num_experts, capacity
        self.kernel, self.buffer_factor = kernel, buffer_factor

    def dispatch(self, x, experts, positions):
        raise NotImplementedError

    def matmul_in(self, rows, w, sizes):
        raise NotImplementedError

    def matmul_out(self, h, w, sizes):
        raise NotImplementedError

    def combine(self, y_rows, row, gates):
        raise NotImplementedError


class AllGatherExchange(Exchange):
    """Tokens all-gathered over the expert axes, each device running its own experts on the rows routed to them, the
    combined outputs reduce-scattered back (module docstring); without a mesh, everything local."""

    def __init__(self, ctx, num_experts, capacity, kernel="xla", buffer_factor=0.0):
        super().__init__(ctx, num_experts, capacity, kernel, buffer_factor)
        layout = self.layout
        self.mesh = layout.mesh
        if layout.mesh is None:  # every expert local; the specs are not used
            self.ep = self.mlp = self.rows = ()
            self.tokens, self.gather, self.num_local = None, False, num_experts
            return
        batch, length = layout.token_axes()
        length = () if capacity else length  # capacity is per whole sequence
        self.ep, self.mlp = layout.expert, layout.expert_mlp
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
        return jax.shard_map(fn, mesh=self.layout.current_mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=check)(*args)

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
            return self.ctx.grouped(rows, w, sizes, self.capacity, self.kernel)

        return self._run(local, (_spec(self.rows, ()), _spec(self.ep, (), self.mlp), _spec(self.rows)),
                         _spec(self.rows, self.mlp), rows, w, sizes, kernel=True)

    def matmul_out(self, h, w, sizes):
        """h [R, mlp] x w [E, mlp, emb] -> [R, emb], summed over the mlp shards."""
        def local(h, w, sizes):
            out = self.ctx.grouped(h, w, sizes, self.capacity, self.kernel)
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


def destination_rows(experts, all_counts, num_local, rank):
    """Where each of this rank's token choices lands in its expert's owner's rows, from every rank's counts.

    experts [N] (this rank's choices, token order); all_counts [ranks, E]: every rank's choices per expert (an
    all-gather of this rank's bincount); the owner of expert e is rank e // num_local and holds its experts' rows
    in expert order, each expert's rows in rank order, each rank's in token order: the order of the all-gathered
    choices (AllGatherExchange), so the rows past a budget (dropped) are the same choices. Returns the row of every
    choice in its owner's rows."""
    total = jnp.sum(all_counts, 0)  # [E]: every rank's choices per expert
    first_of_expert = _before(total.reshape(-1, num_local), 1).reshape(-1)
    before_rank = _before(all_counts, 0)[rank]  # [E]: choices of lower ranks, per expert
    order = jnp.argsort(experts, stable=True)
    first_here = _before(all_counts[rank], 0)
    within = jnp.zeros_like(experts).at[order].set(jnp.arange(experts.size) - first_here[experts[order]])
    return first_of_expert[experts] + before_rank[experts] + within


def _take_rows(source, index):
    """source[index] row by row, zeros where an index is past source's rows."""
    return jnp.take(source, index, axis=0, mode="fill", fill_value=0)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis, ranks):
    """jax.lax.ragged_all_to_all's result, built from an all-gather (XLA:CPU has no ragged all-to-all): rank s sends
    operand[input_offsets[r]:][:send_sizes[r]] to each rank r, which writes it at output[output_offsets[r] (the
    offset s gave for r):]; the rest of `output` is kept. Exact, and differentiable as any all-gather and select;
    it moves every rank's whole operand, so it is for CPU meshes (the tests), not for speed. `recv_sizes` is what
    the primitive takes; here it follows from the others."""
    del recv_sizes
    me = jax.lax.axis_index(axis)
    operands, starts, sizes, offsets = (jax.lax.all_gather(a, axis) for a in (operand, input_offsets, send_sizes,
                                                                              output_offsets))
    j = jnp.arange(output.shape[0])
    for sender in range(ranks):
        start, size = offsets[sender, me], sizes[sender, me]
        source = jnp.clip(starts[sender, me] + j - start, 0, operand.shape[0] - 1)
        here = (j >= start) & (j < start + size)
        output = jnp.where(here.reshape((-1,) + (1,) * (output.ndim - 1)), operands[sender][source], output)
    return output


class AllToAllExchange(AllGatherExchange):
    """Each token choice travels to the rank that owns its expert and its output comes back (mesh.exchange=all_to_all,
    dropless with an optional `model.moe_buffer_factor`): the ranks all-gather their per-expert counts ([ranks, E]
    integers), each choice's row in its owner's expert-ordered rows follows from them (destination_rows), a choice
    past its owner's budget is dropped (counted, as AllGatherExchange drops the same choices), and the rows move by
    one of two transports:

    ragged  `jax.lax.ragged_all_to_all` (GPUs and TPUs; `all_to_all` there): each rank sends its kept choices sorted
            by owner, exactly as many rows as travel, into each owner's buffer of `budget` rows in sender order; the
            owner puts them in expert order with a local scatter, and the outputs return the same way. The offsets
            come from an all-gather of the [ranks] per-owner counts. On CPUs (`all_to_all_ragged` there) the
            primitive is emulated (emulated_ragged_all_to_all: an all-gather, exact), which tests its arithmetic.
    padded  `jax.lax.all_to_all` of per-rank buffers padded to the most one rank can send another (min(choices,
            budget)): the one all-to-all XLA:CPU runs, and exact (`all_to_all` on CPUs; `all_to_all_padded`
            anywhere, e.g. to avoid the ragged primitive's known failures, docs/parallelism.md). Every rank sends
            ranks x that many rows where the ragged transport sends its choices.
    Tokens not sharded over the expert axes (nothing to exchange) and no mesh: AllGatherExchange's own steps."""

    transport = "auto"  # ragged on GPUs and TPUs, padded on CPUs

    def __init__(self, ctx, num_experts, capacity, kernel="xla", buffer_factor=0.0):
        super().__init__(ctx, num_experts, capacity, kernel, buffer_factor)
        if capacity:
            raise ValueError("mesh.exchange=all_to_all is dropless: model.capacity_factor must be 0")
        self.ranks = logical.ways(self.mesh, self.ep) if self.mesh is not None and self.gather else 1
        self.on = "cpu" if self.mesh is None else kernels.platform(self.mesh.devices.flat[0])
        self.transport = self.transport_on(self.on)

    def describe(self):
        """One line for the log: the transport and, on CPUs, that the ragged primitive is emulated."""
        emulated = " (emulated by an all-gather: XLA:CPU has no ragged all-to-all)" if (
            self.transport == "ragged" and self.on == "cpu") else ""
        return f"token all-to-all over {self.ranks} expert ranks: {self.transport} transport{emulated}"

    def _sizes(self, local_choices):
        """(rows a rank holds: `budget`, rows one rank can send another: `chunk`) for `local_choices` per rank."""
        rows = self.ranks * local_choices  # the worst case: every rank's choices for one rank's experts
        if self.buffer_factor:
            rows = min(rows, math.ceil(self.buffer_factor * local_choices))  # x a balanced step's rows
        return rows, min(local_choices, rows)

    def _ragged(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        if self.on == "cpu":
            return emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                              self.ep, self.ranks)
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=self.ep)

    def dispatch(self, x, experts, positions):
        if self.ranks == 1:
            return super().dispatch(x, experts, positions)

        def local(x, experts):
            rank = jax.lax.axis_index(self.ep)
            choices = experts.reshape(-1)
            budget, chunk = self._sizes(choices.size)
            counts = jnp.bincount(choices, length=self.num_experts)
            all_counts = jax.lax.all_gather(counts, self.ep)  # [ranks, E]
            row = destination_rows(choices, all_counts, self.num_local, rank)
            kept = row < budget
            owner = choices // self.num_local
            # kept choices in expert order (so by owner), then token order; the dropped after them
            order = jnp.argsort(jnp.where(kept, choices, self.num_experts), stable=True)
            sent = jnp.bincount(jnp.where(kept, owner, self.ranks), length=self.ranks + 1)[:self.ranks]
            place = jnp.zeros_like(choices).at[order].set(jnp.arange(choices.size))
            token = jnp.arange(choices.size) // experts.shape[-1]
            mine = jax.lax.dynamic_slice_in_dim(jnp.sum(all_counts, 0), rank * self.num_local, self.num_local)
            ends = jnp.minimum(jnp.cumsum(mine), budget)
            sizes = jnp.diff(ends, prepend=0).astype(jnp.int32)
            dropped = (jnp.sum(mine) - ends[-1]).astype(jnp.float32)[None]
            flat = x.reshape(-1, x.shape[-1])
            if self.transport == "ragged":
                all_sent = jax.lax.all_gather(sent, self.ep)  # [sender, owner]: kept rows
                offsets = (_before(sent, 0), sent, _before(all_sent, 0)[rank], all_sent[:, rank])
                # output buffers made from the rows they receive (zeros_like: varying over the mesh as they are), so
                # that no gradient of a mesh-invariant buffer is all-reduced over the whole mesh in the backward pass
                send = flat[token[order]]
                received = self._ragged(send, jnp.zeros_like(send, shape=(budget, x.shape[-1])), *offsets)
                received_row = self._ragged(row[order].astype(jnp.int32), jnp.full((budget,), budget, jnp.int32),
                                            *offsets)
                slot = jnp.where(kept, place, choices.size)  # where each choice's output comes back
                meta = all_sent.reshape(-1)
            else:
                slot = jnp.where(kept, owner * chunk + place - _before(sent, 0)[owner], self.ranks * chunk)
                send = jnp.zeros((self.ranks * chunk, x.shape[-1]), x.dtype).at[slot].set(flat[token], mode="drop")
                send_row = jnp.full((self.ranks * chunk,), budget, jnp.int32).at[slot].set(row, mode="drop")
                received = jax.lax.all_to_all(send, self.ep, 0, 0, tiled=True)  # chunk r: from rank r
                received_row = jax.lax.all_to_all(send_row, self.ep, 0, 0, tiled=True)
                meta = jnp.zeros((0,), jnp.int32)
            # the held rows in expert order: a gather of the received ones (the indices by a scatter of integers;
            # a gather reads only the rows it takes, where a scatter of the rows writes a buffer of them)
            slot_of_row = jnp.full((budget,), received.shape[0], jnp.int32).at[received_row].set(
                jnp.arange(received.shape[0], dtype=jnp.int32), mode="drop")
            rows = _take_rows(received, slot_of_row)
            # `row` for combine: where each held row sits in the received buffer, where each of this rank's choices
            # finds its output in the buffer that comes back (past its end: dropped), and (ragged) the counts sent
            return rows, jnp.concatenate([slot_of_row, slot.astype(jnp.int32), meta.astype(jnp.int32)]), sizes, dropped

        rows = _spec(self.rows)
        return self._run(local, (self.tokens,) * 2, (_spec(self.rows, ()), rows, rows, rows), x, experts)

    def combine(self, y_rows, row, gates):
        if self.ranks == 1:
            return super().combine(y_rows, row, gates)

        def local(y_rows, row, gates):
            budget, chunk = self._sizes(gates.size)
            slot_of_row, slot = row[:budget], row[budget:budget + gates.size]
            # the outputs back in arrival order (each slot its row's: a gather, as dispatch's)
            arrived = budget if self.transport == "ragged" else self.ranks * chunk
            row_of_slot = jnp.full((arrived,), budget, jnp.int32).at[slot_of_row].set(
                jnp.arange(budget, dtype=jnp.int32), mode="drop")
            back = _take_rows(y_rows, row_of_slot)
            if self.transport == "ragged":
                me = jax.lax.axis_index(self.ep)
                all_sent = row[budget + gates.size:].reshape(self.ranks, self.ranks)
                # each sender's rows back from where they arrived to where they left
                returned = self._ragged(back, jnp.zeros_like(back, shape=(gates.size, y_rows.shape[-1])),
                                        _before(all_sent[:, me], 0), all_sent[:, me], _before(all_sent, 1)[:, me],
                                        all_sent[me])
            else:
                returned = jax.lax.all_to_all(back, self.ep, 0, 0, tiled=True)  # chunk r: from rank r's experts
            return combine(returned, slot, gates)

        return self._run(local, (_spec(self.rows, ()), _spec(self.rows), self.tokens), self.tokens, y_rows, row, gates)


class PaddedAllToAllExchange(AllToAllExchange):
    """mesh.exchange=all_to_all_padded: the padded transport on every platform (AllToAllExchange)."""
    transport = "padded"


class RaggedAllToAllExchange(AllToAllExchange):
    """mesh.exchange=all_to_all_ragged: the ragged transport on every platform, emulated on CPUs (AllToAllExchange)."""
    transport = "ragged"


EXCHANGES = {"all_gather": AllGatherExchange, "all_to_all": AllToAllExchange,
             "all_to_all_padded": PaddedAllToAllExchange, "all_to_all_ragged": RaggedAllToAllExchange}
