"""FP8 weight matmuls: the two recipes of `quant.mode`, each an einsum of an activation and a weight.

- `fp8`: per-tensor current scaling (stateless: each operand's scale is its own amax / the format's max). The
  forward casts both operands to float8_e4m3fn, the backward the incoming gradient to float8_e5m2; every GEMM
  is written as a dot of dequantized operands (`convert(q) * scale`), the pattern XLA's GEMM rewriter turns into
  cuBLASLt's FP8 matmul (`__cublas$lt$matmul$f8`: the forward and both backward GEMMs) when the target has a
  CUDA runtime version and Triton GEMMs are off (MaxOffload/hardware.py, MaxOffload/xla.py). The residuals the
  backward keeps are the FP8 operands and their scales: half the bytes of BF16.
- `mxfp8`: OCP microscaling (blocks of 32 along the contraction, e8m0 scales) through
  `jax.nn.scaled_dot_general`, which cuDNN runs as `__cudnn$blockScaledDot` on Blackwell (cuDNN >= 9.10 in the
  target) and its own VJP differentiates (jax >= 0.11: older jax has no CPU or differentiable lowering).

On CPU the same casts run and XLA computes the dots of the cast values in higher precision, so the quantization
error is real and tested here; which kernel a GPU runs is only visible in the GPU compile.
"""
import functools
import math

import jax
import jax.numpy as jnp

from MaxOffload.errors import ConfigError
from MaxOffload.models import kernels
from MaxOffload.offload import names

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TINY = 1e-12  # an all-zero tensor's amax: its scale stays finite


def quantize(x, dtype, axes=None):
    """(x / scale as `dtype`, scale): current scaling, scale = amax(|x|) / dtype's max (float32); per tensor, or
    with `axes` one scale per slice over those axes (kept as size-1 axes)."""
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=axes is not None).astype(jnp.float32)
    scale = jnp.maximum(amax, TINY) / float(jnp.finfo(dtype).max)
    return (x.astype(jnp.float32) / scale).astype(dtype), scale


def dequantize(q, scale, dtype):
    return q.astype(dtype) * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_fp8(spec, x, w):
    """einsum(spec, x, w) of operands of one dtype, both cast to float8_e4m3fn (per-tensor scales), the backward's
    incoming gradient to float8_e5m2; the result and the gradients in that dtype."""
    return _forward(spec, x, w)[0]


def _forward(spec, x, w):
    (xq, sx), (wq, sw) = quantize(x, E4M3), quantize(w, E4M3)
    return jnp.einsum(spec, dequantize(xq, sx, x.dtype), dequantize(wq, sw, w.dtype)), (as_bytes(xq), sx,
                                                                                         as_bytes(wq), sw)


def as_bytes(q):
    """FP8 values as their bytes (uint8), for a residual or a saved activation. jax.checkpoint passes a saved
    floating-point value through reduce_precision with its dtype's exponent and mantissa bits (jax 0.10 and 0.12),
    whose IEEE-style semantics reserve float8_e4m3fn's top exponent (values of 256-448, the amax element's 448 among
    them) for infinity: kept by a policy (remat.policy=save_all, or a quant.fp8_storage name saved or offloaded),
    they turned to NaN and with them the step's loss. Bytes are saved as they are."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def from_bytes(b, dtype=E4M3):
    return jax.lax.bitcast_convert_type(b, dtype)


def _backward(spec, residuals, g):
    xq, sx, wq, sw = residuals
    xq, wq = from_bytes(xq), from_bytes(wq)
    gq, sg = quantize(g, E5M2)
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), dequantize(xq, sx, g.dtype), dequantize(wq, sw, g.dtype))
    return vjp(dequantize(gq, sg, g.dtype))


einsum_fp8.defvjp(_forward, _backward)


def _dimension_numbers(spec):
    """dot_general dimension numbers of a two-operand einsum spec without repeated or summed-away letters."""
    inputs, out = spec.replace(" ", "").split("->")
    a, b = inputs.split(",")
    batch = [c for c in a if c in b and c in out]
    contracting = [c for c in a if c in b and c not in out]
    dims = ((tuple(a.index(c) for c in contracting), tuple(b.index(c) for c in contracting)),
            (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
    # dot_general's result: batch, then lhs free, then rhs free axes
    result = "".join(batch) + "".join(c for c in a if c not in b) + "".join(c for c in b if c not in a)
    return dims, result, out


def einsum_mxfp8(spec, x, w):
    """einsum(spec, x, w) of operands of one dtype as an MXFP8 block-scaled dot (jax.nn.scaled_dot_general), the
    result in that dtype."""
    dims, result, out = _dimension_numbers(spec)
    config = jax.nn.get_scaled_dot_general_config("mxfp8")
    (x_contract, w_contract), (x_batch, w_batch) = dims
    sizes = [math.prod(x.shape[i] for i in x_contract),  # what the forward contracts, then the two backward GEMMs
             math.prod(n for i, n in enumerate(x.shape) if i not in (*x_contract, *x_batch)),
             math.prod(n for i, n in enumerate(w.shape) if i not in (*w_contract, *w_batch))]
    odd = [n for n in sizes if n % config.block_size]
    if odd:
        raise ConfigError(f"quant.mode=mxfp8 quantizes in blocks of {config.block_size}, and the GEMM {spec} of "
                          f"shapes {list(x.shape)} x {list(w.shape)} contracts {odd[0]} elements in one of its "
                          f"passes: make the model's dimensions and batch x seq_len multiples of "
                          f"{config.block_size}, or use quant.mode=fp8")
    y = jax.nn.scaled_dot_general(x, w, dims, preferred_element_type=x.dtype, configs=[config] * 3)
    return jnp.einsum(f"{result}->{out}", y) if result != out else y


EINSUMS = {"fp8": einsum_fp8, "mxfp8": einsum_mxfp8}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ragged_dot_fp8(kernel, rows, w, sizes):
    """The routed experts' dropless grouped GEMM in FP8 (both FP8 modes): rows [R, K] x w [E, K, N] -> [R, N]
    (models/kernels.ragged_dot, `kernel` its grouped-GEMM kernel), rows scaled per row and the weights per
    expert to float8_e4m3fn, the form tokamax's Triton kernel multiplies in FP8. tokamax's own VJP refuses
    quantized operands, so this is the backward: the rows' gradient an FP8 grouped GEMM too (the incoming
    gradient e4m3 per row: the kernel cannot mix e5m2 with e4m3), the weight gradient in BF16 (tokamax's
    ragged-contracting kernel dequantizes whatever it is given) from the FP8 rows kept for it."""
    return _ragged_forward(kernel, rows, w, sizes)[0]


def _ragged_forward(kernel, rows, w, sizes):
    (xq, sx), (wq, sw) = quantize(rows, E4M3, axes=1), quantize(w, E4M3, axes=(1, 2))
    return kernels.ragged_dot(xq, wq, sizes, kernel, (sx, sw), rows.dtype), (as_bytes(xq), sx, as_bytes(wq), sw,
                                                                             sizes)


def _ragged_backward(kernel, residuals, g):
    xq, sx, wq, sw, sizes = residuals
    xq, wq = from_bytes(xq), from_bytes(wq)
    gq, sg = quantize(g, E4M3, axes=1)
    rows = kernels.ragged_dot(gq, wq.transpose(0, 2, 1), sizes, kernel, (sg, sw), g.dtype)
    weights = kernels.ragged_weight_gradient(dequantize(xq, sx, g.dtype), g, sizes, kernel)
    return summed_like(rows, xq), summed_like(weights, wq), None


def summed_like(cotangent, primal):
    """`cotangent` summed over the manual mesh axes (inside a shard_map) along which it varies and `primal` does
    not: what autodiff's transpose of the primal's implicit broadcast (pvary) does, which a custom VJP must do
    itself (the experts' weights vary over the expert and tensor axes, their gradient over every axis of the
    rows too; the rows' gradient is a partial sum over the tensor-split weight columns)."""
    extra = tuple(sorted(_varying(cotangent) - _varying(primal)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent


def _varying(x):
    """The manual mesh axes along which `x` varies (jax >= 0.10 types them as `manual_axis_type.varying`; older
    jax called them `vma`); empty outside a shard_map."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


ragged_dot_fp8.defvjp(_ragged_forward, _ragged_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def stored(x, name):
    """`x` tagged as activation `name` and kept as float8_e4m3fn + a per-tensor scale (quant.fp8_storage): the
    policy saves or offloads the two (half the bytes of BF16), the forward goes on with their dequantized value
    (lossy), and the gradient passes straight through. Whatever needs the value again (the backward, a
    recomputation) dequantizes it from the stored pair, never recomputes `x`."""
    return _stored_forward(x, name)[0]


def _stored_forward(x, name):
    q, scale = quantize(x, E4M3)  # saved as its bytes (as_bytes: a saved float8_e4m3fn came back NaN)
    return dequantize(from_bytes(names.tag(as_bytes(q), name)), names.tag(scale, name), x.dtype), None


stored.defvjp(_stored_forward, lambda name, _, g: (g,))
