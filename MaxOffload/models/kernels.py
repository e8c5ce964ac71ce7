"""Maintained kernels behind the model's calls, through tokamax (Google's kernel library, which MaxText uses on
GPUs): the grouped GEMM of dropless MoE and fused causal attention; XLA's own ops where they are exact and
cheap (CPU).

Why a kernel: XLA's GPU compiler rewrites `jax.lax.ragged_dot` into a dense dot, the rows expanded over every
expert (experts x the FLOPs, gigabytes of temporaries: benchmarks/results/moe_kernels_2026-12-01/). tokamax's
Pallas-Triton `ragged_dot` is a grouped GEMM: one `__gpu$xla.gpu.triton` custom call per product (forward, d lhs, d rhs),
temporaries in megabytes, and its work follows the group sizes. It compiles deviceless for H200 / GB200 when
lowered with tokamax's cross_compile option on and, on jax >= 0.12, with the target GPU as the default
device (`lowering`). Its "mosaic" implementation refuses a CPU process even then, so Triton it is.

GROUPED_GEMM, the values of `model.moe_kernel`:
    auto     tokamax on GPUs (deviceless compiles for GPU targets included), XLA elsewhere
    xla      jax.lax.ragged_dot
    tokamax  tokamax.ragged_dot: its Triton kernel on GPUs; on CPU its XLA implementation (same API and
             custom VJP, so the model's tokamax path runs and is tested on CPU)

ATTENTION, the values of `model.attention`:
    auto     flash on GPUs (deviceless compiles for GPU targets included), splash on TPUs (the chip and deviceless
             TPU targets), xla elsewhere
    xla      models/layers.causal_attention: query blocks that attend only to the keys they can see
    flash    tokamax.dot_product_attention(is_causal=True): its Pallas-Triton flash attention on GPUs (one fused
             kernel per pass, scores never in HBM; GQA without repeating k/v, MLA's v head dim below q/k's); on
             CPU its chunked XLA implementation (same API and custom VJP, so the path runs and is tested on CPU);
             on TPUs splash
The TPU kernel, `splash`: jax's Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention; it ships
in jax, interpret=True runs the same kernel on a CPU for the tests): causal, GQA without repeating k/v, MLA's v
head dim, blocks of SPLASH_BLOCKS and the fused backward (measured fastest on the v5e: REFERENCE 2h).
"""
import contextlib
import dataclasses
import functools
import logging
import math

import jax

GROUPED_GEMM = ("auto", "xla", "tokamax")
# tokamax's implementation per platform of the devices the step runs on
TOKAMAX_IMPLEMENTATION = {"gpu": "triton", "cpu": "xla"}


ATTENTION = ("auto", "xla", "flash")
FLASH_IMPLEMENTATION = {"gpu": "triton", "cpu": "xla_chunked"}


def platform(device):
    """'gpu' | 'cpu' | ... of a device a step runs on (compile-only GPU devices say 'gpu')."""
    return "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform


def _choose(choice, on, library, implementations):
    """`auto`: `library` on GPUs, 'xla' elsewhere; `library` -> '<library>:<its implementation for platform on>'."""
    if choice == "auto":
        choice = library if on == "gpu" else "xla"
    if choice == library:
        return f"{library}:{implementations.get(on, implementations['cpu'])}"
    return choice  # 'xla', or already resolved


def grouped_gemm_for(choice, on):
    """The grouped-GEMM kernel ('xla' | 'tokamax:<implementation>') for `model.moe_kernel=choice` on devices of
    platform `on`."""
    return _choose(choice, on, "tokamax", TOKAMAX_IMPLEMENTATION)


SPLASH = "splash"
# the block sizes splash runs a sequence in, largest first: the largest that divides the length (1024 with the fused
# backward was the fastest on the v5e for Llama-8B GQA and the MLA shapes, 6.9 against 9.0 ms at MaxText's 512);
# `model.attention_block` fixes one (the kernel string is then 'splash:<block>')
SPLASH_BLOCKS = (1024, 512, 256, 128)
SPLASH_LANES = 128  # a block is a multiple of the TPU's 128 lanes


def attention_for(choice, on, block=0):
    """The attention kernel ('xla' | 'flash:<tokamax implementation>' | 'splash' | 'splash:<block>') for
    `model.attention=choice` (and `model.attention_block=block`) on devices of platform `on`."""
    if on == "tpu" and choice in ("auto", "flash"):
        return f"{SPLASH}:{block}" if block else SPLASH
    return _choose(choice, on, "flash", FLASH_IMPLEMENTATION)


def is_splash(kernel):
    return kernel == SPLASH or kernel.startswith(SPLASH + ":")


def splash_block(length, kernel=SPLASH):
    """The block splash `kernel` ('splash' or 'splash:<block>') runs a sequence of `length` tokens in: its fixed
    block, else the largest of SPLASH_BLOCKS that divides the length; None when that block does not divide it."""
    fixed = int(kernel.partition(":")[2] or 0)
    if fixed:
        return fixed if length % fixed == 0 else None
    return next((b for b in SPLASH_BLOCKS if length % b == 0), None)


def splash_attention(q, k, v, scale, q_sharding=None, interpret=False, kernel=SPLASH, fused_backward=True,
                     pad_heads=False):
    """Causal attention by jax's Pallas splash kernel: q [b, l, heads, d], k [b, l, kv_heads, d], v [b, l, kv_heads,
    dv] -> [b, l, heads, dv], in blocks of splash_block(l, kernel) with the fused backward (`fused_backward=False`:
    splash's separate dq and dkv kernels, for benchmarks/tpu/attention.py). `q_sharding`: q's NamedSharding: the
    kernel runs per shard of its batch and heads axes (shard_map); where the heads split wider than the kv heads,
    each shard's k/v heads are repeated to its queries'. `interpret`: the same kernel interpreted (any platform: the
    CPU tests). The kernel's residuals (its output and the rows' log-sum-exp) are named names.CONTEXT (MaxText's
    name for them), so a remat policy keeps (remat.tensors.context=device), offloads or recomputes them: kept, the
    backward pass runs no second forward kernel."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    from MaxOffload.offload import names

    jnp = jax.numpy
    factor = q.shape[-1] ** -0.5 if scale is None else scale  # the kernel takes q unscaled: scaled once, here
    if pad_heads:  # head dims padded with zeros to the TPU's 128 lanes (the scores and outputs are the same; the
        #            padded output columns, zero, are cut off): benchmarks/tpu/attention.py measures whether it pays
        lanes = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, -a.shape[-1] % SPLASH_LANES)])  # noqa: E731
        dv = v.shape[-1]
        out = splash_attention(lanes(q), lanes(k), lanes(v), factor, q_sharding, interpret, kernel, fused_backward)
        return out[..., :dv]
    block = splash_block(q.shape[1], kernel)
    if block is None:
        raise ValueError(f"splash attention ({kernel}) runs blocks of {kernel.partition(':')[2] or SPLASH_BLOCKS}: "
                         f"{q.shape[1]} tokens is no multiple")

    def local(q, k, v):
        length, heads = q.shape[1], q.shape[2]
        sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                      block_kv_dkv=block, block_kv_dkv_compute=block,
                                      **({} if fused_backward else {"block_q_dq": block, "block_kv_dq": block}),
                                      use_fused_bwd_kernel=fused_backward)
        mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))] * heads)
        run = kernel_lib.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                         residual_checkpoint_name=names.CONTEXT, interpret=interpret)
        heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  [b, l, h, d] <-> [b, h, l, d]
        return heads_first(jax.vmap(run)(heads_first(q * jnp.asarray(factor, q.dtype)), heads_first(k),
                                         heads_first(v)))

    if q_sharding is None:
        return local(q, k, v)
    P = jax.sharding.PartitionSpec
    spec = tuple(q_sharding.spec) + (None,) * (4 - len(q_sharding.spec))

    def ways(entry):
        return math.prod(q_sharding.mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))

    if ways(spec[1]) > 1:
        raise ValueError("splash attention runs whole sequences per shard: a split sequence takes the context path")
    if k.shape[2] % ways(spec[2]):  # a tensor axis wider than the kv heads: each shard its queries' own kv heads
        k, v = (jnp.repeat(a, q.shape[2] // k.shape[2], axis=2) for a in (k, v))
    per_shard = P(spec[0], spec[1], spec[2], None)
    # Pallas kernels inside shard_map declare no per-axis variance of their outputs (check_vma off)
    return jax.shard_map(local, mesh=q_sharding.mesh, in_specs=(per_shard,) * 3, out_specs=per_shard,
                         check_vma=False)(q, k, v)


def for_platform(config, on):
    """A model configuration with its kernel choices (`attention`, `moe_kernel` where the family has them)
    made for devices of platform `on`: TrainSetup calls it with its mesh's devices (the models never read
    the mesh)."""
    changes = {}
    if hasattr(config, "attention"):
        changes["attention"] = attention_for(config.attention, on, getattr(config, "attention_block", 0))
    if hasattr(config, "moe_kernel"):
        changes["moe_kernel"] = grouped_gemm_for(config.moe_kernel, on)
    return dataclasses.replace(config, **changes)


class _QuietMisses(logging.Filter):
    """tokamax logs a WARNING for every kernel without an autotuned config and then uses its heuristics. A
    deviceless compile can never autotune, so these would be one line per kernel of every compile."""

    def filter(self, record):
        return "Autotuning cache miss" not in record.getMessage()


@functools.cache
def _import_tokamax():
    """tokamax, imported once and set up for this process."""
    from absl import flags

    # tokamax reads its options from absl flags and parses sys.argv itself when nothing has: not our argv
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import tokamax

    # skip tokamax's check that this process has the GPU it lowers for (the deviceless compile); it must hold
    # for the whole trace, the custom VJP's backward included, so it is set once, not in a `with` block
    flags.FLAGS["tokamax_cross_compile"].value = True
    logging.getLogger("absl").addFilter(_QuietMisses())
    return tokamax


def _implementation(kernel):
    """tokamax's implementation name of a chosen kernel 'library:implementation' (grouped_gemm_for, attention_for)."""
    return kernel.split(":", 1)[1]


def ragged_dot(lhs, rhs, group_sizes, kernel, scales=None, dtype=None):
    """lhs [R, K] x rhs [E, K, N] -> [R, N]: row r times the group whose `group_sizes` [E] span holds it; rows
    past sum(group_sizes) give zeros. `kernel`: from grouped_gemm_for(). `scales` (lhs's [R, 1], rhs's [E, 1, 1]):
    lhs and rhs hold FP8 values that those scales multiply back (models/fp8.ragged_dot_fp8); tokamax takes them
    as qwix QArrays and its Triton kernel multiplies the FP8 operands (FP8 tensor cores on Blackwell), XLA's
    ragged_dot their dequantized float32 values; the result in `dtype`."""
    if scales is not None:
        if kernel == "xla":
            lhs, rhs = (q.astype(jax.numpy.float32) * s for q, s in zip((lhs, rhs), scales))
            return jax.lax.ragged_dot(lhs, rhs, group_sizes).astype(dtype)
        import qwix  # tokamax's own dependency

        lhs, rhs = (qwix.QArray(q, s, qtype=q.dtype) for q, s in zip((lhs, rhs), scales))
    if kernel == "xla":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    out = _import_tokamax().ragged_dot(lhs, rhs, group_sizes, preferred_element_type=dtype,
                                       implementation=_implementation(kernel))
    # the Triton kernel writes only the rows inside the groups; the rest of its output is whatever the buffer
    # held. Zero them, as jax.lax.ragged_dot does, so no consumer can ever see stale values (a fused select)
    inside = jax.numpy.arange(lhs.shape[0]) < group_sizes.sum()
    return jax.numpy.where(inside[:, None], out, 0).astype(out.dtype)


# lhs [R, K] and dout [R, N], both ragged along R, contracted per group -> [E, K, N] (a weight gradient)
RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def ragged_weight_gradient(lhs, dout, group_sizes, kernel):
    """The weight gradient of ragged_dot: per group e, lhs[rows of e].T @ dout[rows of e] -> [E, K, N] in lhs's
    dtype (tokamax's ragged-contracting kernel on GPUs)."""
    if kernel == "xla":
        return jax.lax.ragged_dot_general(lhs, dout, group_sizes, RAGGED_CONTRACTING,
                                          preferred_element_type=jax.numpy.float32).astype(lhs.dtype)
    return _import_tokamax().ragged_dot_general(lhs, dout, group_sizes, RAGGED_CONTRACTING,
                                                preferred_element_type=lhs.dtype,
                                                implementation=_implementation(kernel))


def flash_attention(q, k, v, scale, kernel, q_sharding=None):
    """Causal attention by tokamax: q [b, l, heads, d], k [b, l, kv_heads, d], v [b, l, kv_heads, dv] ->
    [b, l, heads, dv]. `kernel`: from attention_for; `q_sharding`: q's NamedSharding, so that the kernel runs
    per shard (tokamax's shard_map: batch and heads split, a split sequence sees all keys)."""
    return _import_tokamax().dot_product_attention(q, k, v, scale=scale, is_causal=True, q_sharding=q_sharding,
                                                   implementation=_implementation(kernel))


def _piece_op(kernel):
    """tokamax's attention op for attention computed in pieces (flash_attention_piece): its Triton kernels on GPUs;
    elsewhere its XLA implementation (the chunked one returns no log-sum-exp)."""
    _import_tokamax()
    from tokamax._src.ops.attention import api  # the ops by implementation: the public call hides the residuals

    name = _implementation(kernel)
    return api.IMPLEMENTATIONS[name if name == "triton" else "xla"]


def flash_attention_piece(q, k, v, scale, kernel, causal):
    """Attention of q [b, l, heads, d] to one piece of its keys, k, v [b, s, kv_heads, .]: `causal` (aligned: the
    queries and keys are the same positions) or to all of them. Returns (the output normalized
    within the piece, its log-sum-exp [b, heads, l] in float32), which combine across pieces."""
    out, (m, l) = _piece_op(kernel)(q, k, v, logits_scale=scale, is_causal=causal, return_residuals=True)
    return out, (0.0 if m is None else m) + jax.numpy.log(l)


def flash_attention_piece_vjp(q, k, v, scale, kernel, causal, lse, out, dout):
    """(dq, dk, dv) of one piece of an attention (flash_attention_piece's arguments), given the whole attention's
    output, its cotangent and its log-sum-exp: the piece's probabilities are then exp(scores - lse), the whole
    attention's, and the pieces' gradients sum to the whole's. tokamax's VJP kernel on GPUs (its residuals are
    (max, sum): (lse, 1) says the same); elsewhere the same formulas in XLA."""
    op = _piece_op(kernel)
    if op.vjp is not None:
        bound = op.bind(q, k, v, logits_scale=scale, is_causal=causal)
        kwargs = {name: value for name, value in bound.kwargs.items() if name != "return_residuals"}
        grads = op.vjp((lse, jax.numpy.ones_like(lse)), out, dout, *bound.args, **kwargs)
        return (grads["q"], grads["k"], grads["v"]) if isinstance(grads, dict) else tuple(grads[:3])
    jnp, f32 = jax.numpy, jax.numpy.float32
    group = q.shape[2] // k.shape[2]
    k_all, v_all = (jnp.repeat(a, group, axis=2).astype(f32) for a in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), k_all) * scale
    rows, keys = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    visible = (rows >= keys) if causal else True
    p = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
    dout, out = dout.astype(f32), out.astype(f32)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, dout)
    ds = p * (jnp.einsum("bqhd,bkhd->bhqk", dout, v_all) - jnp.einsum("bqhd,bqhd->bhq", out, dout)[..., None]) * scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k_all)
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(f32))
    per_kv_head = lambda a: a.reshape(*a.shape[:2], k.shape[2], group, a.shape[-1]).sum(3)  # noqa: E731
    return dq.astype(q.dtype), per_kv_head(dk).astype(k.dtype), per_kv_head(dv).astype(v.dtype)


def lowering(device):
    """Context for lowering a step for the devices of `device`'s kind: for GPUs this process does not have (the
    deviceless compile), Pallas-Triton reads the target GPU's kind from the default device (jax >= 0.12)."""
    if platform(device) == "gpu" and jax.default_backend() != "gpu":
        return jax.default_device(device)
    return contextlib.nullcontext()
