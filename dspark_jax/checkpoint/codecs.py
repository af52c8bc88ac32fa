"""Weight encodings of the official DeepSeek-V4 checkpoints, in numpy.

- e8m0: an unsigned power-of-two scale byte, value ``2 ** (byte - 127)``; byte 255 is NaN.
- fp8: float8_e4m3fn values with one e8m0 scale per 128 x 128 block of a ``[out, in]`` matrix;
  scale shape ``[ceil(out / 128), ceil(in / 128)]`` (edge blocks may be partial).
- fp4: float4_e2m1 values packed two per byte (element 2k in the LOW nibble, 2k + 1 in the high
  nibble), stored as int8 ``[out, in / 2]``, with one e8m0 scale per 32 consecutive input
  elements, scale shape ``[out, in / 32]``.

Decoders take row ranges so that a large matrix can be decoded while it is read (the loader
never holds a tensor in two float formats at once). Encoders pick the smallest power-of-two
scale that keeps a block's largest magnitude representable (``2 ** ceil(log2(amax / max))``),
so a decoded tensor re-encodes to the same values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_BLOCK = 128
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
E8M0_BIAS = 127

# e2m1 code -> value (bit 3 = sign, bits 2..1 = exponent, bit 0 = mantissa).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


class CodecError(ValueError):
    """A tensor that cannot be encoded or decoded in the requested format."""


# ---------------------------------------------------------------------------- e8m0 scales
def e8m0_to_float(scale_bytes: np.ndarray) -> np.ndarray:
    """e8m0 bytes (uint8 or float8_e8m0fnu) -> float32 ``2 ** (byte - 127)``, NaN for byte 255."""
    b = np.asarray(scale_bytes)
    if b.dtype != np.uint8:
        b = b.view(np.uint8)
    exp = np.where(b == 255, 0, b.astype(np.int32) - E8M0_BIAS)
    return np.where(b == 255, np.float32(np.nan), np.ldexp(np.float32(1.0), exp)).astype(np.float32)


def float_to_e8m0(pow2: np.ndarray) -> np.ndarray:
    """Exact powers of two in [2**-127, 2**127] -> e8m0 bytes as float8_e8m0fnu."""
    p = np.asarray(pow2, np.float32)
    mant, exp = np.frexp(p)  # p = mant * 2**exp with mant in [0.5, 1)
    if not np.all(mant == 0.5):
        raise CodecError("e8m0 scales must be exact powers of two")
    byte = exp.astype(np.int32) - 1 + E8M0_BIAS
    if byte.size and (byte.min() < 0 or byte.max() > 254):
        raise CodecError(f"scale exponent outside the e8m0 range [-127, 127]: {byte.min() - 127}..{byte.max() - 127}")
    return byte.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def scale_to_float(scale: np.ndarray) -> np.ndarray:
    """A stored scale tensor (e8m0 bytes, or float32 in some re-exports) as float32."""
    if scale.dtype in (np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(np.uint8)):
        return e8m0_to_float(scale)
    return scale.astype(np.float32)


def pow2_ceil(ratio: np.ndarray) -> np.ndarray:
    """``2 ** ceil(log2(ratio))`` for positive finite float32 ratios, computed exactly."""
    mant, exp = np.frexp(np.asarray(ratio, np.float32))
    exp = np.where(mant == 0.5, exp - 1, exp)
    return np.ldexp(np.float32(1.0), exp).astype(np.float32)


def _block_scales(amax: np.ndarray, qmax: float) -> np.ndarray:
    # Smallest power of two s with amax / s <= qmax, at least 2**-127 (the smallest e8m0 scale).
    floor = qmax * np.float32(2.0**-127)
    return pow2_ceil(np.maximum(amax.astype(np.float32), floor) / np.float32(qmax))


def _check_finite(w: np.ndarray, what: str):
    if not np.all(np.isfinite(w)):
        raise CodecError(f"cannot encode {what}: the tensor has NaN or infinite values")


# ---------------------------------------------------------------------------- fp8 (128 x 128 blocks)
def fp8_scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    out, inp = shape
    return -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)


def encode_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (float8_e4m3fn [out, in], e8m0 scales [ceil(out/128), ceil(in/128)])."""
    if w.ndim != 2:
        raise CodecError(f"fp8 block encoding needs a 2-D [out, in] matrix, got shape {w.shape}")
    w = np.asarray(w, np.float32)
    _check_finite(w, "fp8 weights")
    out, inp = w.shape
    ob, ib = fp8_scale_shape(w.shape)
    padded = np.zeros((ob * FP8_BLOCK, ib * FP8_BLOCK), np.float32)
    padded[:out, :inp] = w
    blocks = padded.reshape(ob, FP8_BLOCK, ib, FP8_BLOCK)
    scale = _block_scales(np.abs(blocks).max(axis=(1, 3)), FP8_MAX)  # [ob, ib]
    q = np.clip(blocks / scale[:, None, :, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    q = q.reshape(ob * FP8_BLOCK, ib * FP8_BLOCK)[:out, :inp]
    return np.ascontiguousarray(q), float_to_e8m0(scale)


def decode_fp8_rows(q: np.ndarray, scale: np.ndarray, row0: int, out: np.ndarray) -> None:
    """Decode rows ``row0 .. row0 + len(q)`` of an fp8 matrix into ``out`` (any float dtype).

    q: float8_e4m3fn [rows, in] with row0 a multiple of 128; scale: the whole scale tensor.
    """
    if row0 % FP8_BLOCK:
        raise CodecError(f"fp8 rows must start on a {FP8_BLOCK}-row block, got row {row0}")
    s = scale_to_float(scale)
    inp = q.shape[1]
    for r in range(0, q.shape[0], FP8_BLOCK):
        srow = np.repeat(s[(row0 + r) // FP8_BLOCK], FP8_BLOCK)[:inp]
        out[r:r + FP8_BLOCK] = q[r:r + FP8_BLOCK].astype(np.float32) * srow


def decode_fp8(q: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    if q.ndim != 2 or scale.shape != fp8_scale_shape(q.shape):
        raise CodecError(f"fp8 weight {q.shape} needs scales of shape {fp8_scale_shape(q.shape)}, got {scale.shape}")
    out = np.empty(q.shape, dtype)
    decode_fp8_rows(q.view(ml_dtypes.float8_e4m3fn), scale, 0, out)
    return out


# ---------------------------------------------------------------------------- fp4 (packed, per-32 scales)
def fp4_shapes(shape: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Logical [out, in] -> (packed int8 shape [out, in/2], scale shape [out, in/32])."""
    out, inp = shape
    if inp % FP4_BLOCK:
        raise CodecError(f"fp4 encoding needs the input dim to be a multiple of {FP4_BLOCK}, got shape {shape}")
    return (out, inp // 2), (out, inp // FP4_BLOCK)


def encode_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (int8 [out, in/2] two e2m1 codes per byte, e8m0 scales [out, in/32])."""
    if w.ndim != 2:
        raise CodecError(f"fp4 encoding needs a 2-D [out, in] matrix, got shape {w.shape}")
    fp4_shapes(w.shape)
    w = np.asarray(w, np.float32)
    _check_finite(w, "fp4 weights")
    out, inp = w.shape
    blocks = w.reshape(out, inp // FP4_BLOCK, FP4_BLOCK)
    scale = _block_scales(np.abs(blocks).max(axis=-1), FP4_MAX)  # [out, in/32]
    q = np.clip(blocks / scale[..., None], -FP4_MAX, FP4_MAX).astype(ml_dtypes.float4_e2m1fn)
    codes = q.reshape(out, inp).view(np.uint8) & 0x0F
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(np.int8), float_to_e8m0(scale)


def decode_fp4_rows(packed: np.ndarray, scale_rows: np.ndarray, out: np.ndarray) -> None:
    """Decode packed rows [rows, in/2] with their scale rows [rows, in/32] into ``out`` [rows, in]."""
    b = packed.view(np.uint8)
    rows, half = b.shape
    vals = np.empty((rows, 2 * half), np.float32)
    vals[:, 0::2] = FP4_VALUES[b & 0x0F]
    vals[:, 1::2] = FP4_VALUES[b >> 4]
    s = scale_to_float(scale_rows)
    out[...] = (vals.reshape(rows, -1, FP4_BLOCK) * s[..., None]).reshape(rows, 2 * half)


def decode_fp4(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    rows, half = packed.shape
    if scale.shape != (rows, 2 * half // FP4_BLOCK) or (2 * half) % FP4_BLOCK:
        raise CodecError(f"fp4 weight {packed.shape} (packed) needs scales of shape "
                         f"{(rows, 2 * half // FP4_BLOCK)}, got {scale.shape}")
    out = np.empty((rows, 2 * half), dtype)
    decode_fp4_rows(packed, scale, out)
    return out


# ------------------------------------------------------- fp4 widened to e4m3, scales per 128
# Largest span of per-32 scale exponents, within one row's 128-input block, that e4m3 holds
# exactly: a code of the block's largest scale S is stored times 2**6 (6 * 64 = 384 <= 448), one of
# scale S - d times 2**(6 - d); e2m1's smallest magnitude 0.5 stays an e4m3 value (2**-9 is
# e4m3's smallest subnormal, and 1.5 * 2**-8 = 3 * 2**-9 is one too) while 6 - d >= -8.
FP4_TO_K128_SPAN = 14


def fp4_to_e4m3_k128(packed: np.ndarray, scale: np.ndarray, name: str = "fp4 weight") -> tuple[np.ndarray, np.ndarray]:
    """Packed e2m1 pairs [rows, in / 2] with e8m0 scales per 32 inputs [rows, in / 32] -> one
    float8_e4m3fn code per value [rows, in] with one e8m0 scale byte per row and 128 inputs
    [rows, in / 128], the same values exactly: a 128-input block's scale is ``S - 6`` (S its
    largest per-32 scale among sub-blocks with a nonzero code) and each code is its e2m1 value
    times ``2 ** (s - S + 6)``. Raises CodecError naming ``name`` where that is not exact (a
    nonzero sub-block whose scale is more than ``FP4_TO_K128_SPAN`` binades below S)."""
    b = np.asarray(packed).view(np.uint8)
    sb = np.asarray(scale)
    sb = sb.view(np.uint8) if sb.dtype.itemsize == 1 else float_to_e8m0(sb).view(np.uint8)
    rows, half = b.shape
    k = 2 * half
    if k % FP8_BLOCK or sb.shape != (rows, k // FP4_BLOCK):
        raise CodecError(f"{name}: fp4 {b.shape} (packed) with scales {sb.shape} cannot take scales per "
                         f"{FP8_BLOCK} inputs (needs in % {FP8_BLOCK} == 0 and scales [rows, in / {FP4_BLOCK}])")
    if np.any(sb == 255):
        raise CodecError(f"{name}: NaN scale byte (255)")
    s = sb.astype(np.int32).reshape(rows, k // FP8_BLOCK, FP8_BLOCK // FP4_BLOCK)
    nonzero = ((b & 0x77) != 0).reshape(rows, k // FP8_BLOCK, FP8_BLOCK // FP4_BLOCK, FP4_BLOCK // 2).any(-1)
    top = np.where(nonzero, s, -1).max(-1)  # -1: a block without a nonzero code
    lost = nonzero & (s < top[..., None] - FP4_TO_K128_SPAN)
    if lost.any():
        r, blk, sub = (int(v[0]) for v in np.nonzero(lost))
        raise CodecError(f"{name}: row {r}, inputs {blk * FP8_BLOCK}..{(blk + 1) * FP8_BLOCK - 1}: per-32 scale "
                         f"bytes {s[r, blk].tolist()} span more than {FP4_TO_K128_SPAN} binades, which e4m3 codes "
                         f"under one scale cannot hold exactly; keep the experts in FP4 (weight_format='official')")
    block = np.maximum(top - 6, 0)
    # each e2m1 code times 2 ** shift as an e4m3 byte, shift in [-8, 6], looked up from
    # (shift + 8) * 16 + code (< 256: one uint8 index per value)
    shift = np.where(nonzero, s - block[..., None], 0) + 8
    row = np.repeat(shift.astype(np.uint8).reshape(rows, -1), FP4_BLOCK // 2, axis=1) << 4
    codes = np.empty((rows, k), np.uint8)
    codes[:, 0::2] = _K128_BYTES[row | (b & 0x0F)]
    codes[:, 1::2] = _K128_BYTES[row | (b >> 4)]
    return codes.view(ml_dtypes.float8_e4m3fn), block.astype(np.uint8)


# e4m3 bytes of every e2m1 value times 2 ** shift, shift in [-8, 6] (index (shift + 8) * 16 + code)
_K128_BYTES = (FP4_VALUES[None, :] * np.ldexp(np.float32(1), np.arange(-8, 7))[:, None]).astype(
    ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(-1)


def decode_fp8_k128(codes: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """e4m3 codes [rows, in] with e8m0 scales per row and 128 inputs [rows, in / 128] -> values."""
    s = np.repeat(scale_to_float(scale), FP8_BLOCK, axis=-1)
    return (codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).astype(dtype)
