"""Rotary position embeddings, for every family: the base frequencies, Llama 3.1's and YaRN's scalings of
them, YaRN's attention temperature, and the rotation itself ("rotate half" layout)."""
import math

import jax.numpy as jnp
import numpy as np


def base_inv_freq(dim, theta):
    """theta^(-2i/dim) for i < dim/2, in float64."""
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def rope_inv_freq(head_dim, theta, scaling="none", factor=8.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_len=8192):
    """Inverse RoPE frequencies, with Llama 3.1's frequency scaling when scaling='llama3'.

    Llama 3.1 leaves high frequencies (short wavelengths) alone, divides low ones by
    `factor`, and interpolates smoothly in between.
    """
    inv_freq = base_inv_freq(head_dim, theta)
    if scaling == "none":
        return inv_freq.astype(np.float32)
    if scaling != "llama3":
        raise ValueError(f"unknown rope scaling {scaling!r}")
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_len / low_freq_factor
    high_freq_wavelen = original_max_len / high_freq_factor
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, interpolated)
    scaled = np.where(wavelen < high_freq_wavelen, inv_freq, scaled)
    return scaled.astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """Rotary embedding ("rotate half" layout). x: [batch, length, heads, head_dim]. The angles, their sines and
    cosines are float32; the rotation runs in x's dtype, as in transformers (cos and sin cast to x's dtype)."""
    angles = positions[:, :, None].astype(jnp.float32) * inv_freq[None, None, :]  # [b, l, d/2]
    sin, cos = (f(angles)[:, :, None, :].astype(x.dtype) for f in (jnp.sin, jnp.cos))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def yarn_inv_freq(dim, theta, factor, original_max_len, beta_fast, beta_slow):
    """YaRN inverse frequencies: frequencies that turn more than beta_fast times within the original
    context are kept, those turning fewer than beta_slow times are divided by `factor`, with a linear
    ramp over the dimensions in between."""
    def dim_of(rotations):  # the (fractional) dimension index that turns `rotations` times
        return dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), dim - 1)
    inv_freq = base_inv_freq(dim, theta)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0, 1)  # 0 keep .. 1 interpolate
    return (inv_freq * (1 - ramp) + inv_freq / factor * ramp).astype(np.float32)


def yarn_mscale(factor, mscale):
    """YaRN's attention temperature correction 0.1 * mscale * ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
