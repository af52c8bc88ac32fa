"""fp8 KV rows: the layout, its pure-JAX reference, and the Pallas kernel that writes rows in place.

A KV row is one ``head_dim``-wide latent (512 for DeepSeek-V4: 448 "nope" dims + 64 rope dims).
The fp8 layout stores it in two pools that share the row index:

- ``nope``: uint8 ``[..., head_dim]`` (512 B for DeepSeek-V4). Bytes ``[0, nope_dim)`` are the
  float8_e4m3fn codes of the nope dims; byte ``nope_dim + j`` is the ue8m0 exponent of the scale of
  nope block j (64 dims per block; exponent byte = log2(scale) + 127); the remaining bytes are 0.
- ``rope``: bfloat16 ``[..., rope_dim]`` (128 B): the rope dims, unquantised.

That is 640 B per row instead of 1024 B in bf16. The quantisation is exactly the reference's KV
fake-quantisation (``act_quant(kv[..., :-64], 64, ue8m0)``; ``dspark_jax.model.quant.kv_sim``):
per block, ``amax = max(|x|, 1e-4)``, ``scale = 2 ** ceil(log2(amax / 448))``, code =
``e4m3(clip(x / scale, ±448))``. Every code times a power of two is exactly representable in bf16,
so ``dequantize(quantize(x)) == kv_sim(x)`` bit for bit.

``write(pool, slots, rows)`` quantises bf16 rows and scatters them into the pool rows ``slots``
(``-1`` or any slot outside the pool = skip) in place: the Pallas kernel aliases the pool buffers
to its outputs (``input_output_aliases``); jit the caller with the pool donated to avoid a copy.
Slots must be unique apart from skipped ones (two rows to one slot race on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend

if TYPE_CHECKING:  # shape annotations only; jaxtyping is not needed at run time
    from jaxtyping import Array, Float, Int, UInt8

FP8_MAX = 448.0  # largest float8_e4m3fn
AMAX_FLOOR = 1e-4  # the reference clamps each block's amax to at least this
BLOCK = 64  # nope dims per scale
ROPE_DIM = 64  # DeepSeek-V4 rope dims; the packed layout stores up to this many scale bytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8Rows:
    """Rows in the fp8 layout: ``nope`` uint8 [..., head_dim] and ``rope`` bf16 [..., rope_dim]."""

    nope: UInt8[Array, "... d"]
    rope: Float[Array, "... r"]

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``[..., head_dim]`` of the rows (as a bf16 pool would have)."""
        return tuple(self.nope.shape)

    @property
    def head_dim(self) -> int:
        return self.nope.shape[-1]

    @property
    def rope_dim(self) -> int:
        return self.rope.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.nope.size * self.nope.dtype.itemsize + self.rope.size * self.rope.dtype.itemsize

    def reshape(self, *lead: int) -> "Fp8Rows":
        """Same rows with other leading dims (e.g. ``[B, R, d] -> [B*R, d]``)."""
        return Fp8Rows(self.nope.reshape(*lead, self.head_dim), self.rope.reshape(*lead, self.rope_dim))


def check_layout(head_dim: int, rope_dim: int) -> int:
    """Validate a (head_dim, rope_dim) pair for the fp8 layout; returns the number of nope blocks."""
    nope = head_dim - rope_dim
    if rope_dim != ROPE_DIM:
        raise ValueError(f"the fp8 KV layout needs rope_dim == {ROPE_DIM}, got {rope_dim}")
    if nope <= 0 or nope % BLOCK:
        raise ValueError(f"nope dims (head_dim - rope_dim = {nope}) must be a positive multiple of {BLOCK}")
    if not backend.is_power_of_2(head_dim):
        raise ValueError(f"the fp8 KV layout needs a power-of-two head_dim, got {head_dim}")
    return nope // BLOCK


def row_bytes(head_dim: int, rope_dim: int = ROPE_DIM, layout: str = "fp8") -> int:
    """Bytes of one KV row: ``bf16`` = 2 * head_dim; ``fp8`` = head_dim + 2 * rope_dim."""
    if layout == "bf16":
        return 2 * head_dim
    if layout == "fp8":
        check_layout(head_dim, rope_dim)
        return head_dim + 2 * rope_dim
    raise ValueError(f"layout must be 'bf16' or 'fp8', got {layout!r}")


def zeros(lead: tuple[int, ...], head_dim: int, rope_dim: int = ROPE_DIM) -> Fp8Rows:
    """An fp8 pool of ``lead`` rows, all zero (dequantises to +0.0)."""
    check_layout(head_dim, rope_dim)
    return Fp8Rows(jnp.zeros((*lead, head_dim), jnp.uint8), jnp.zeros((*lead, rope_dim), jnp.bfloat16))


# ------------------------------------------------------------------------------ pure-JAX reference
def _scale_exponent(amax: Float[Array, "..."]) -> Int[Array, "..."]:
    """k with 2**k = 2 ** ceil(log2(max(amax, 1e-4) / 448)), exactly (as ``pow2_scale_ceil``)."""
    ratio = jnp.maximum(amax, AMAX_FLOOR) / FP8_MAX
    mant, exp = jnp.frexp(ratio)  # ratio = mant * 2**exp, mant in [0.5, 1)
    return jnp.where(mant == 0.5, exp - 1, exp).astype(jnp.int32)


def quantize(rows: Float[Array, "... d"], rope_dim: int = ROPE_DIM) -> Fp8Rows:
    """bf16 rows -> the fp8 layout (pure JAX). Inputs of another float dtype are cast to bf16 first."""
    d = rows.shape[-1]
    nb = check_layout(d, rope_dim)
    nope = d - rope_dim
    x = rows.astype(jnp.bfloat16)
    xb = x[..., :nope].astype(jnp.float32).reshape(*x.shape[:-1], nb, BLOCK)
    k = _scale_exponent(jnp.max(jnp.abs(xb), axis=-1))  # [..., nb]
    codes = jnp.clip(xb / jnp.ldexp(jnp.float32(1), k)[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    code_bytes = lax.bitcast_convert_type(codes, jnp.uint8).reshape(*x.shape[:-1], nope)
    exp_bytes = (k + 127).astype(jnp.uint8)
    pad = jnp.zeros((*x.shape[:-1], d - nope - nb), jnp.uint8)
    return Fp8Rows(jnp.concatenate([code_bytes, exp_bytes, pad], axis=-1), x[..., nope:])


def dequantize(rows: Fp8Rows, dtype=jnp.bfloat16) -> Float[Array, "... d"]:
    """The fp8 layout -> values (bit-exact ``kv_sim`` values in bf16)."""
    d, r = rows.head_dim, rows.rope_dim
    nb = check_layout(d, r)
    nope = d - r
    lead = rows.nope.shape[:-1]
    codes = lax.bitcast_convert_type(rows.nope[..., :nope], jnp.float8_e4m3fn).astype(jnp.float32)
    k = rows.nope[..., nope:nope + nb].astype(jnp.int32) - 127
    vals = codes.reshape(*lead, nb, BLOCK) * jnp.ldexp(jnp.float32(1), k)[..., None]
    return jnp.concatenate([vals.reshape(*lead, nope).astype(dtype), rows.rope.astype(dtype)], axis=-1)


def _flat_checks(pool: Fp8Rows, slots: Array, rows: Array) -> None:
    if not isinstance(pool, Fp8Rows):
        raise TypeError(f"pool must be Fp8Rows, got {type(pool).__name__}")
    if pool.nope.ndim != 2 or pool.rope.ndim != 2 or pool.nope.shape[0] != pool.rope.shape[0]:
        raise ValueError(f"pool must be flat: nope [P, d] and rope [P, r], got {pool.nope.shape} / {pool.rope.shape}")
    if pool.nope.dtype != jnp.uint8 or pool.rope.dtype != jnp.bfloat16:
        raise ValueError(f"pool dtypes must be uint8 / bfloat16, got {pool.nope.dtype} / {pool.rope.dtype}")
    check_layout(pool.head_dim, pool.rope_dim)
    if rows.ndim != 2 or rows.shape[1] != pool.head_dim:
        raise ValueError(f"rows must be [N, {pool.head_dim}], got {rows.shape}")
    if not jnp.issubdtype(rows.dtype, jnp.floating):
        raise ValueError(f"rows must be floating point, got {rows.dtype}")
    if slots.shape != rows.shape[:1] or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots must be integer [{rows.shape[0]}], got {slots.dtype} {slots.shape}")


def write_reference(pool: Fp8Rows, slots: Int[Array, " n"], rows: Float[Array, "n d"]) -> Fp8Rows:
    """pool[slots[i]] = quantize(rows[i]); slots outside [0, P) (e.g. -1) are skipped. Pure JAX."""
    _flat_checks(pool, slots, rows)
    p = pool.nope.shape[0]
    q = quantize(rows, pool.rope_dim)
    idx = jnp.where((slots >= 0) & (slots < p), slots, p).astype(jnp.int32)  # p: dropped
    return Fp8Rows(pool.nope.at[idx].set(q.nope, mode="drop"), pool.rope.at[idx].set(q.rope, mode="drop"))


# ------------------------------------------------------------------------------ Pallas kernel
def _cols(start: int, size: int) -> Array:
    """Column indices [1, size] (kernels index refs with broadcast integer arrays only, which both
    the Triton lowering and interpret mode support)."""
    return start + jnp.arange(size, dtype=jnp.int32)[None, :]


def _write_kernel(slots_ref, x_ref, nope_in_ref, rope_in_ref, nope_ref, rope_ref, *,
                  n_rows: int, n_slots: int, n_blocks: int, block_rows: int):
    del nope_in_ref, rope_in_ref  # aliased to nope_ref / rope_ref; rows not written keep their bytes
    d, rope_dim = x_ref.shape[1], rope_ref.shape[1]
    groups, nope = d // BLOCK, n_blocks * BLOCK
    r = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    r_ok = r < n_rows
    slot = pltriton.load(slots_ref.at[r], mask=r_ok, other=-1)
    ok = r_ok & (slot >= 0) & (slot < n_slots)
    slot = jnp.where(ok, slot, n_slots)[:, None]  # masked rows: out of range (never accessed)
    row = r[:, None]

    x = pltriton.load(x_ref.at[row, _cols(0, d)], mask=r_ok[:, None], other=0.0)  # [br, d] bf16
    x3 = x.astype(jnp.float32).reshape(block_rows, groups, BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(x3), axis=2), AMAX_FLOOR)  # [br, groups], normal floats
    # Exponent byte of 2**ceil(log2(amax / 448)) from the float's bits: amax = 1.m * 2**(e-127) and
    # 448 = 1.75 * 2**8, so the scale is 2**(e-127-8), or twice that when 1.m > 1.75.
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    e_byte = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
    inv_scale = lax.bitcast_convert_type((254 - e_byte) << 23, jnp.float32)  # exact 1 / scale
    codes = jnp.clip(x3 * inv_scale[:, :, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    codes = lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)

    g = lax.broadcasted_iota(jnp.int32, (1, groups, BLOCK), 1)
    c = lax.broadcasted_iota(jnp.int32, (1, groups, BLOCK), 2)
    # exponent of block j moved to lane j of the first block after the codes
    e_lanes = jnp.sum(jnp.where((g == c) & (g < n_blocks), e_byte[:, :, None], 0), axis=1)  # [br, 64]
    packed = jnp.where(g < n_blocks, codes, jnp.where(g == n_blocks, e_lanes[:, None, :], 0))
    pltriton.store(nope_ref.at[slot, _cols(0, d)], packed.astype(jnp.uint8).reshape(block_rows, d),
                   mask=ok[:, None])

    rope = pltriton.load(x_ref.at[row, _cols(nope, rope_dim)], mask=r_ok[:, None], other=0.0)
    pltriton.store(rope_ref.at[slot, _cols(0, rope_dim)], rope, mask=ok[:, None])


@functools.partial(jax.jit, static_argnames=("block_rows", "num_warps", "num_stages", "interpret"))
def _write_pallas(pool: Fp8Rows, slots, rows, *, block_rows: int, num_warps: int, num_stages: int,
                  interpret: bool) -> Fp8Rows:
    n, d = rows.shape
    p = pool.nope.shape[0]
    kernel = functools.partial(_write_kernel, n_rows=n, n_slots=p, n_blocks=check_layout(d, pool.rope_dim),
                               block_rows=block_rows)
    with backend.quiet_triton_deprecation():
        nope, rope = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(n, block_rows),),
            out_shape=(jax.ShapeDtypeStruct(pool.nope.shape, jnp.uint8),
                       jax.ShapeDtypeStruct(pool.rope.shape, jnp.bfloat16)),
            input_output_aliases={2: 0, 3: 1},
            compiler_params=backend.compiler_params(num_warps, num_stages),
            interpret=interpret,
            name="fp8_kv_write",
        )(slots.astype(jnp.int32), rows.astype(jnp.bfloat16), pool.nope, pool.rope)
    return Fp8Rows(nope, rope)


def write_kernel(pool: Fp8Rows, slots: Int[Array, " n"], rows: Float[Array, "n d"], *, block_rows: int = 16,
                 num_warps: int = 4, num_stages: int = 1, interpret: bool | None = None) -> Fp8Rows:
    """The Pallas kernel: quantise ``rows`` and write them into ``pool`` rows ``slots`` in place.

    pool: flat ``Fp8Rows`` (nope [P, d], rope [P, 64]); slots [N] int (-1 = skip); rows [N, d].
    """
    _flat_checks(pool, slots, rows)
    if not backend.is_power_of_2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if rows.shape[0] == 0:
        return pool
    return _write_pallas(pool, slots, rows, block_rows=block_rows, num_warps=num_warps, num_stages=num_stages,
                         interpret=backend.interpret_mode(interpret))


def write(pool: Fp8Rows, slots: Int[Array, " n"], rows: Float[Array, "n d"], *, impl: str | None = None,
          **kernel_options) -> Fp8Rows:
    """Quantise and scatter rows into an fp8 pool through the backend switch (see ``backend``).

    The pool may have any leading dims; ``slots`` index its rows flattened in row-major order
    (for a ring pool [B, R, d]: slot = b * R + pos % R).
    """
    if not isinstance(pool, Fp8Rows):
        raise TypeError(f"pool must be Fp8Rows, got {type(pool).__name__}")
    lead = pool.shape[:-1]
    flat = pool.reshape(-1)
    if backend.resolve(impl) == "xla":
        out = write_reference(flat, slots, rows)
    else:
        out = write_kernel(flat, slots, rows, **kernel_options)
    return out.reshape(*lead)


kernel = write_kernel
reference = write_reference
