"""Fake quantisation that reproduces the reference numerics (``quant_sim=True``, DESIGN 5).

The official inference code quantises activations on the fly before every FP8 / FP4 GEMM and
stores the KV latent with FP8 nope dims. Simulating it means rounding values to what the
quantised format can hold and scaling back ("quantise then dequantise"); the results are
exactly representable in bf16, so a real FP8 cache reproduces them bit for bit.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

FP8_MAX = 448.0  # float8_e4m3fn
FP4_MAX = 6.0  # float4_e2m1fn
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126


def pow2_scale_ceil(ratio: Float[Array, "..."]) -> Float[Array, "..."]:
    """2 ** ceil(log2(ratio)) computed exactly from the float's exponent and mantissa (ue8m0)."""
    mant, exp = jnp.frexp(ratio.astype(jnp.float32))  # ratio = mant * 2**exp, mant in [0.5, 1)
    exp = jnp.where(mant == 0.5, exp - 1, exp)
    return jnp.ldexp(jnp.ones_like(mant), exp)


def _blocked(x: Array, block: int) -> Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_block_amax(x: Float[Array, "... n"], block: int) -> Float[Array, "... nb"]:
    """Largest magnitude of every ``block`` contiguous elements of the last dim (fp32)."""
    return jnp.max(jnp.abs(_blocked(x.astype(jnp.float32), block)), axis=-1)


def fp8_scales_of_amax(amax: Float[Array, "..."]) -> Float[Array, "..."]:
    """The power-of-two (ue8m0) scale of a block with largest magnitude ``amax``."""
    return pow2_scale_ceil(jnp.maximum(amax, FP8_AMAX_FLOOR) / FP8_MAX)


def fp8_block_scales(x: Float[Array, "... n"], block: int) -> Float[Array, "... nb"]:
    """Power-of-two (ue8m0) scales, one per ``block`` contiguous elements of the last dim."""
    return fp8_scales_of_amax(fp8_block_amax(x, block))


def fp8_codes(x: Float[Array, "... n"], scales: Float[Array, "... nb"], block: int) -> Array:
    """float8_e4m3fn codes of x under per-block ``scales``."""
    xb = _blocked(x.astype(jnp.float32), block) / scales[..., None]
    return jnp.clip(xb, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).reshape(x.shape)


def fp8_quantize(x: Float[Array, "... n"], block: int) -> tuple[Array, Array]:
    """float8_e4m3fn codes and their per-block ue8m0 scales (``act_quant``)."""
    s = fp8_block_scales(x, block)
    return fp8_codes(x, s, block), s


def fp8_sim(x: Float[Array, "... n"], block: int) -> Float[Array, "... n"]:
    """Round ``x`` to per-block e4m3 with power-of-two scales and scale back (same dtype)."""
    q, s = fp8_quantize(x, block)
    y = _blocked(q.astype(jnp.float32), block) * s[..., None]
    return y.reshape(x.shape).astype(x.dtype)


def fp4_sim(x: Float[Array, "... n"], block: int = 32) -> Float[Array, "... n"]:
    """Round ``x`` to per-block e2m1 with power-of-two scales and scale back (``fp4_act_quant``)."""
    xb = _blocked(x.astype(jnp.float32), block)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    s = pow2_scale_ceil(jnp.maximum(amax, FP4_AMAX_FLOOR) / FP4_MAX)
    q = jnp.clip(xb / s, -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn).astype(jnp.float32)
    return (q * s).reshape(x.shape).astype(x.dtype)


def kv_sim(kv: Float[Array, "... d"], rope_dim: int) -> Float[Array, "... d"]:
    """The reference's KV fake-quantisation: fp8 (block 64) on the nope dims, rope dims exact."""
    nope = fp8_sim(kv[..., :-rope_dim], 64)
    return jnp.concatenate([nope, kv[..., -rope_dim:]], axis=-1)


@functools.lru_cache(maxsize=8)
def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of order n (a power of two), scaled by n**-0.5 (orthonormal)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h * n**-0.5).astype(np.float32)


def hadamard(x: Float[Array, "... n"]) -> Float[Array, "... n"]:
    """Rotate the last dim by the orthonormal Hadamard matrix (the indexer's ``rotate_activation``)."""
    h = jnp.asarray(hadamard_matrix(x.shape[-1]))
    return jnp.einsum("...i,ji->...j", x.astype(jnp.float32), h).astype(x.dtype)
