"""The TPU attention kernel, `splash`: jax's Pallas splash attention (jax.experimental.pallas.ops.tpu.
splash_attention; it ships in jax, interpret=True runs the same kernel on a CPU for the tests): causal, GQA without
repeating k/v, MLA's v head dim, blocks of models/kernels.SPLASH_BLOCKS and the fused backward (measured fastest
on the v5e: REFERENCE 2h). Which kernel runs where: models/kernels.attention_for."""
import math

import jax
import jax.numpy as jnp

from MaxOffload.models.kernels import SPLASH, SPLASH_BLOCKS, SPLASH_LANES, splash_block
from MaxOffload.offload import names

KV_COMPUTE = 512  # the forward kernel's key compute block at most (splash's block_kv_compute)


def splash_attention(q, k, v, scale, q_sharding=None, interpret=False, kernel=SPLASH, fused_backward=True,
                     pad_heads=False, block_sizes=None):
    """Causal attention by jax's Pallas splash kernel: q [b, l, heads, d], k [b, l, kv_heads, d], v [b, l, kv_heads,
    dv] -> [b, l, heads, dv], in blocks of splash_block(l, kernel) with the fused backward (`fused_backward=False`:
    splash's separate dq and dkv kernels, for benchmarks/tpu/attention.py). `q_sharding`: q's NamedSharding: the
    kernel runs per shard of its batch and heads axes (shard_map); where the heads split wider than the kv heads,
    each shard's k/v heads are repeated to its queries'. `interpret`: the same kernel interpreted (any platform: the
    CPU tests). The kernel's residuals (its output and the rows' log-sum-exp) are named names.CONTEXT (MaxText's
    name for them), so a remat policy keeps (remat.tensors.context=device), offloads or recomputes them: kept, the
    backward pass runs no second forward kernel. `block_sizes`: {splash BlockSizes field: size} over the block
    (benchmarks/tpu/attention.py --sweep measures such choices on the chip)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    factor = q.shape[-1] ** -0.5 if scale is None else scale  # the kernel takes q unscaled: scaled once, here
    if pad_heads:  # head dims padded with zeros to the TPU's 128 lanes (the scores and outputs are the same; the
        #            padded output columns, zero, are cut off): benchmarks/tpu/attention.py measures whether it pays
        lanes = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, -a.shape[-1] % SPLASH_LANES)])  # noqa: E731
        dv = v.shape[-1]
        out = splash_attention(lanes(q), lanes(k), lanes(v), factor, q_sharding, interpret, kernel, fused_backward,
                               block_sizes=block_sizes)
        return out[..., :dv]
    block = splash_block(q.shape[1], kernel)
    if block is None:
        raise ValueError(f"splash attention ({kernel}) runs blocks of {kernel.partition(':')[2] or SPLASH_BLOCKS}: "
                         f"{q.shape[1]} tokens is no multiple")

    def local(q, k, v):
        length, heads = q.shape[1], q.shape[2]
        # the forward kernel computes its key block in steps of at most KV_COMPUTE (measured on the v5e: 8.55
        # against 8.95 ms at Llama-8B GQA, 4.97 against 5.10 at DeepSeek small's MLA; benchmarks/tpu/attention.py)
        sizes = dict(block_q=block, block_kv=block, block_kv_compute=min(block, KV_COMPUTE), block_q_dkv=block,
                     block_kv_dkv=block, block_kv_dkv_compute=block)
        if not fused_backward:
            sizes.update(block_q_dq=block, block_kv_dq=block)
        sizes = kernel_lib.BlockSizes(**{**sizes, **(block_sizes or {})}, use_fused_bwd_kernel=fused_backward)
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
