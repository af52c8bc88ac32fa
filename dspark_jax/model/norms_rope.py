"""RMSNorm, interleaved RoPE on the last ``qk_rope_head_dim`` dims, and YaRN frequencies."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dspark_jax.config import ModelConfig, YarnConfig


def rms_norm(x: Float[Array, "... d"], weight: Array | None, eps: float) -> Float[Array, "... d"]:
    """``(w * (x_f32 * rsqrt(mean(x_f32^2) + eps))).to(x.dtype)``; ``weight=None`` is weightless."""
    xf = x.astype(jnp.float32)
    y = xf * jnp.reciprocal(jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps))
    if weight is not None:
        y = weight.astype(jnp.float32) * y
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        return rms_norm(x, self.weight[...], self.eps)


def rope_inv_freq(rope_dim: int, base: float, yarn: YarnConfig | None) -> np.ndarray:
    """Per-pair angular frequencies [rope_dim // 2] (float32), with the reference YaRN blend."""
    freqs = 1.0 / (base ** (np.arange(0, rope_dim, 2, dtype=np.float32) / rope_dim))
    if yarn is not None:
        def correction_dim(num_rotations: float) -> float:
            return rope_dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
                2 * math.log(base))

        low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
        high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / yarn.factor * (1 - smooth) + freqs * smooth
    return freqs.astype(np.float32)


def layer_inv_freq(cfg: ModelConfig, compress_ratio: int) -> np.ndarray:
    """Compressed layers: base ``compress_rope_theta`` with YaRN; window-only layers: ``rope_theta``."""
    if compress_ratio > 0:
        return rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
    return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, None)


def apply_rope(x: Float[Array, "... t h d"] | Float[Array, "... t d"], positions: Int[Array, "... t"],
               inv_freq: np.ndarray, *, inverse: bool = False, heads: bool = True) -> Array:
    """Rotate the last ``2 * len(inv_freq)`` dims of ``x`` by pairs (2i, 2i+1) at ``positions``.

    ``heads=True``: x is [..., t, h, d]; otherwise x is [..., t, d]. Math in fp32, result in x.dtype.
    """
    rd = 2 * inv_freq.shape[0]
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., t, rd/2]
    if heads:
        angle = angle[..., None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    rope = x[..., -rd:].astype(jnp.float32)
    re, im = rope[..., 0::2], rope[..., 1::2]
    rot = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(rope.shape)
    return jnp.concatenate([x[..., :-rd], rot.astype(x.dtype)], axis=-1)
