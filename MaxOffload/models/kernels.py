"""The kernels behind the model's calls: which runs on which platform (`for_platform`; the values of
`model.moe_kernel` and `model.attention`), tokamax (Google's kernel library, which MaxText uses on GPUs) set up
for this process, and the grouped GEMM of dropless MoE; XLA's own ops where they are exact and cheap (CPU).

Why a kernel: XLA's GPU compiler rewrites `jax.lax.ragged_dot` into a dense dot, the rows expanded over every
expert (experts x the FLOPs, gigabytes of temporaries: benchmarks/results/moe_kernels_2026-12-01/). tokamax's
Pallas-Triton `ragged_dot` is a grouped GEMM: one `__gpu$xla.gpu.triton` custom call per product (forward, d lhs, d rhs),
temporaries in megabytes, and its work follows the group sizes. It compiles deviceless for H200 / GB200 when
lowered with tokamax's cross_compile option on and, on jax >= 0.12, with the target GPU as the default
device (MaxOffload/deviceless.lowering). Its "mosaic" implementation refuses a CPU process even then, so Triton it is.

GROUPED_GEMM, the values of `model.moe_kernel`:
    auto     tokamax on GPUs (deviceless compiles for GPU targets included), XLA elsewhere
    xla      jax.lax.ragged_dot
    tokamax  tokamax.ragged_dot: its Triton kernel on GPUs; on CPU its XLA implementation (same API and
             custom VJP, so the model's tokamax path runs and is tested on CPU)

ATTENTION, the values of `model.attention`:
    auto     flash on GPUs (deviceless compiles for GPU targets included), splash on TPUs (the chip and deviceless
             TPU targets), xla elsewhere
    xla      models/attention/plain.causal_attention: query blocks that attend only to the keys they can see
    flash    tokamax.dot_product_attention(is_causal=True) (models/attention/flash.py): its Pallas-Triton flash
             attention on GPUs, its chunked XLA implementation on CPU; on TPUs splash
The TPU kernel, `splash`: jax's Pallas splash attention (models/attention/splash.py), in blocks of SPLASH_BLOCKS.
The attention kernels themselves live in models/attention/; this module names them and says which runs where.
"""
import dataclasses
import functools
import logging

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
def import_tokamax():
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


def implementation(kernel):
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
    out = import_tokamax().ragged_dot(lhs, rhs, group_sizes, preferred_element_type=dtype,
                                       implementation=implementation(kernel))
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
    return import_tokamax().ragged_dot_general(lhs, dout, group_sizes, RAGGED_CONTRACTING,
                                                preferred_element_type=lhs.dtype,
                                                implementation=implementation(kernel))

