"""The TPU attention kernel, `splash`: jax's Pallas splash attention (jax.experimental.pallas.ops.tpu.
splash_attention; it ships in jax, interpret=True runs the same kernel on a CPU for the tests): causal, GQA without
repeating k/v, MLA's v head dim, blocks of models/kernels.SPLASH_BLOCKS and the fused backward (measured fastest
on the v5e: REFERENCE 2h). Which kernel runs where: models/kernels.attention_for."""
import jax
import jax.numpy as jnp

from MaxOffload.models.kernels import SPLASH, SPLASH_BLOCKS, SPLASH_LANES, splash_block
from MaxOffload.offload import names
from MaxOffload.parallel import logical

KV_COMPUTE = 512  # the forward kernel's key compute block at most (splash's block_kv_compute)


def splash_attention(q, k, v, scale, q_sharding=None, interpret=False, kernel=SPLASH, fused_backward=True,
                     pad_heads=False, block_sizes=None, documents=None):
    """Causal attention by jax's Pallas splash kernel: q [b, l, heads, d], k [b, l, kv_heads, d], v [b, l, kv_heads,
    dv] -> [b, l, heads, dv], in blocks of splash_block(l, kernel) with the fused backward (`fused_backward=False`:
    splash's separate dq and dkv kernels, for benchmarks/tpu/attention.py). `q_sharding`: q's NamedSharding: the
    kernel runs per shard of its batch and heads axes (shard_map); where the heads split wider than the kv heads,
    each shard's k/v heads are repeated to its queries'. `interpret`: the same kernel interpreted (any platform: the
    CPU tests). The kernel's residuals (its output and the rows' log-sum-exp) are named names.CONTEXT (MaxText's
    name for them), so a remat policy keeps (remat.tensors.context=device), offloads or recomputes them: kept, the
    backward pass runs no second forward kernel. `block_sizes`: {splash BlockSizes field: size} over the block
    (benchmarks/tpu/attention.py --sweep measures such choices on the chip). `documents` [b, l] (rows holding packed
    documents: which one each token belongs to) or None: the kernel's segment ids, a token sees only its own
    document's keys."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    factor = q.shape[-1] ** -0.5 if scale is None else scale  # the kernel takes q unscaled: scaled once, here
    if pad_heads:  # head dims padded with zeros to the TPU's 128 lanes (the scores and outputs are the same; the
        #            padded output columns, zero, are cut off): benchmarks/tpu/attention.py measures whether it pays
        lanes = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, -a.shape[-1] % SPLASH_LANES)])  # noqa: E731
        dv = v.shape[-1]
        out = splash_attention(lanes(q), lanes(k), lanes(v), factor, q_sharding, interpret, kernel, fused_backward,
                               block_sizes=block_sizes, documents=documents)
        return out[..., :dv]
    block = splash_block(q.shape[1], kernel)
    if block is None:
        raise ValueError(f"splash attention ({kernel}) runs blocks of {kernel.partition(':')[2] or SPLASH_BLOCKS}: "
                         f"{q.shape[1]} tokens is no multiple")
    sizes = _block_sizes(block, fused_backward, block_sizes)

    def local(q, k, v, documents):
        length, heads = q.shape[1], q.shape[2]
        mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))] * heads)
        return _apply(_kernel(mask, sizes, interpret), q, k, v, factor, documents, documents)

    if q_sharding is None:
        return local(q, k, v, documents)
    P = jax.sharding.PartitionSpec
    spec = tuple(q_sharding.spec) + (None,) * (4 - len(q_sharding.spec))

    def ways(entry):
        return logical.ways(q_sharding.mesh, entry)

    if ways(spec[1]) > 1:
        raise ValueError("splash attention runs whole sequences per shard: a split sequence takes the context path")
    if k.shape[2] % ways(spec[2]):  # a tensor axis wider than the kv heads: each shard its queries' own kv heads
        k, v = _repeat_kv(q.shape[2], k, v)
    per_shard = P(spec[0], spec[1], spec[2], None)
    # Pallas kernels inside shard_map declare no per-axis variance of their outputs (check_vma off)
    return jax.shard_map(local, mesh=q_sharding.mesh, in_specs=(per_shard,) * 3 + (P(spec[0], spec[1]),),
                         out_specs=per_shard, check_vma=False)(q, k, v, documents)


def _block_sizes(block, fused_backward=True, overrides=None):
    """splash's BlockSizes for `block`: the forward kernel computes its key block in steps of at most KV_COMPUTE
    (measured on the v5e: 8.55 against 8.95 ms at Llama-8B GQA, 4.97 against 5.10 at DeepSeek small's MLA;
    benchmarks/tpu/attention.py); `overrides`: {BlockSizes field: size}."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

    sizes = dict(block_q=block, block_kv=block, block_kv_compute=min(block, KV_COMPUTE), block_q_dkv=block,
                 block_kv_dkv=block, block_kv_dkv_compute=block)
    if not fused_backward:
        sizes.update(block_q_dq=block, block_kv_dq=block)
    return kernel_lib.BlockSizes(**{**sizes, **(overrides or {})}, use_fused_bwd_kernel=fused_backward)


def _kernel(mask, sizes, interpret, q_seq_shards=1):
    """The splash kernel of a MultiHeadMask (its residuals named names.CONTEXT); `q_seq_shards`: the query rows
    split that many ways, each shard running the kernel on its rows with its slice of the mask's block tables."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

    return kernel_lib.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=q_seq_shards,
                                      residual_checkpoint_name=names.CONTEXT, interpret=interpret)


def _apply(run, q, k, v, factor, q_documents=None, k_documents=None):
    """A splash kernel `run` on q [b, l, heads, d], k, v [b, s, kv_heads, .] (per row of the batch, heads first),
    q scaled by `factor` before it (the kernel takes q unscaled); with q_documents [b, l] / k_documents [b, s],
    the documents the rows' tokens belong to, as the kernel's segment ids."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

    heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  [b, l, h, d] <-> [b, h, l, d]
    q, k, v = heads_first(q * jnp.asarray(factor, q.dtype)), heads_first(k), heads_first(v)
    if q_documents is None:
        return heads_first(jax.vmap(lambda q, k, v: run(q, k, v))(q, k, v))
    return heads_first(jax.vmap(lambda q, k, v, dq, dk: run(q, k, v, kernel_lib.SegmentIds(dq, dk)))(
        q, k, v, q_documents, k_documents))


def _repeat_kv(heads, k, v):
    """k, v with each kv head repeated to its queries' (a shard's heads do not hold whole groups otherwise)."""
    return tuple(jnp.repeat(a, heads // a.shape[2], axis=2) for a in (k, v))


def context_splash_attention(q, source, scale, kernel, layout, interpret=False, documents=None):
    """Causal attention of a sequence split over the layout's context axes (the all_gather strategy) by the splash
    kernel: each shard all-gathers the key source (KeySource: the keys and values, or MLA's latent, expanded to the
    whole sequence's keys and values on every shard) and runs the kernel on its own queries against them. One
    causal mask of the whole sequence, its query rows split over the context shards (splash's q_seq_shards: each
    shard gets its slice of the mask's block tables, so its rows' positions are offset right and the key blocks
    past its causal edge are skipped); under load balancing the rows are the layout's token order (the mask's
    q_sequence) and the gathered keys are put back in sequence order. The block is the largest that divides a
    shard's chunk of the sequence (its rows, or half of them load-balanced). `documents` [b, l] (in the layout's
    token order, as q) or None: gathered as the keys are, the kernel's segment ids."""
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    from MaxOffload.models.attention.plain import Q_AXES

    P = jax.sharding.PartitionSpec
    (sources, weights), (source_specs, weight_specs) = source.shard_map_args(layout)
    context, ways, length = layout.context, layout.context_ways, q.shape[1]
    order = layout.token_order(length)
    chunk = length // ways // (1 if order is None else 2)
    block = splash_block(chunk, kernel)
    if block is None:
        raise ValueError(f"splash attention ({kernel}) over {ways} context shards: a shard's chunk of {chunk} "
                         f"tokens (of {length}) is no multiple of {kernel.partition(':')[2] or SPLASH_BLOCKS}")
    spec = tuple(layout.spec(Q_AXES))
    q_spec = P(*spec + (None,) * (len(Q_AXES) - len(spec)))
    mesh = layout.current_mesh
    heads_ways = logical.ways(mesh, q_spec[2])
    causal = mask_lib.CausalMask((length, length))
    if order is not None:
        causal.q_sequence = order  # the rows' global positions (the mask's hash includes them)
    mask = mask_lib.MultiHeadMask([causal] * (q.shape[2] // heads_ways))
    run = _kernel(mask, _block_sizes(block), interpret, q_seq_shards=ways)
    run_spec = run.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(None, context)))
    back = None if order is None else np.argsort(order)  # the gathered keys' sequence order
    factor = q.shape[-1] ** -0.5 if scale is None else scale

    def local(q, sources, weights, run, documents):
        gathered = tuple(jax.lax.all_gather(a, context, axis=1, tiled=True) for a in (*sources, documents)
                         if a is not None)
        if back is not None:
            gathered = tuple(jnp.take(g, back, axis=1) for g in gathered)
        k, v = source.keys(gathered[:len(sources)], weights)
        if q.shape[2] % k.shape[2]:
            k, v = _repeat_kv(q.shape[2], k, v)
        return _apply(run, q, k, v, factor, documents, None if documents is None else gathered[-1])

    # Pallas kernels inside shard_map declare no per-axis variance of their outputs (check_vma off)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, source_specs, weight_specs, run_spec,
                                                     P(q_spec[0], q_spec[1])),
                         out_specs=q_spec, check_vma=False)(q, sources, weights, run, documents)

