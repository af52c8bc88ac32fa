"""Grouped matmul over weights kept in the checkpoint's formats: the Pallas kernel and its
pure-JAX reference (the routed experts of DeepSeek-V4, and its FP8 linear layers as one group).

Rows ``x [M, K]`` come in tiles of ``block_m`` rows (``group_metadata``); tile ``t`` is multiplied
by the weights of group ``tile_group[t]``: ``out[r] = x[r] @ W[g(r)]^T`` with ``W [G, N, K]`` in the
official ``[out, in]`` layout. Tiles at or past ``num_tiles`` are unused and get zeros. Only the
groups named by used tiles are read, each once per tile.

Weight formats (``Weights``), stored as in the checkpoint and dequantised in registers:

- ``dense``: bf16 / fp32 values ``[G, N, K]``;
- ``fp8``: float8_e4m3fn values ``[G, N, K]`` with one e8m0 scale byte per 128 x 128 block,
  ``scales [G, ceil(N / 128), ceil(K / 128)]``;
- ``fp4``: e2m1 codes packed two per byte (element 2i in the low nibble, 2i + 1 in the high one),
  ``values uint8 [G, N, K / 2]``, one e8m0 scale byte per 32 inputs, ``scales [G, N, K / 32]``;
- ``fp8_k128``: float8_e4m3fn values ``[G, N, K]`` with one e8m0 scale byte per output row and
  128 inputs, ``scales [G, N, K / 128]``: the FP4 experts widened to one e4m3 code per byte, each
  row's four per-32 scales of a 128-input block merged into one (``dspark_jax.checkpoint.codecs.
  fp4_to_e4m3_k128``; the same values): twice the bytes of ``fp4``, no bit shuffling in registers,
  and one fp8 dot per 128 inputs for quantised rows.

Dequantised weights are exactly the reference's values (an e4m3 / e2m1 value times a power of
two is a bf16 number), and the kernel applies each scale to the fp32 partial product of its block
instead of to every weight (exact: multiplying by a power of two commutes with fp32 rounding);
FP4 weights are decoded with their per-32 scales (exact in bf16) before one dot per loop step: a
few bit operations move each e2m1 code into an e4m3 byte, which the hardware's fp8 conversion
decodes (``_fp4_as_e4m3``). FP4 codes are not interleaved in registers: the kernel splits x into
even and odd columns and multiplies them by the low and high nibbles separately.

Rows may come quantised (``ActQuant``: the reference's FP8 GEMM input, e4m3 codes and the
per-128 amax that gives their power-of-two scales): in decode / verify row tiles against ``fp8``
or ``fp8_k128`` weights the kernel then runs e4m3 x e4m3 dots, one per 128-input block, and
scales their fp32 sums by the weight block's (or each output column's) and the row's scales
(exact products; only the fp32 summation order differs from multiplying the rows' values), reading half the activation bytes and converting no
weights in registers. Rows may also come to be quantised (``QuantRows``): the kernel then
quantises each 128-input block itself (amax, scale, codes in registers, as ``ActQuant.of``), so
no codes or amax array is computed by separate kernels before it.

Extra weights (``extra``, opt-in: a shared expert beside the routed ones): tiles whose group is
G, one past the stacked groups, multiply one more weight of the same N and K in its own format
(``check_extra``) in the same launch; their programs branch to it (``pl.when`` on the tile's
group), the other tiles' programs are unchanged.

``grouped_swiglu`` fuses the expert's first half: ``h = swiglu(x W1^T, x W3^T) * row_weight``
with the reference's roundings (the products rounded to x's dtype, SwiGLU in fp32, result in x's
dtype).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend
from pallas_kernels.group_metadata import dense_tiles

if TYPE_CHECKING:
    from jaxtyping import Array, Float, Int

FORMATS = ("dense", "fp8", "fp4", "fp8_k128")
FP8_BLOCK = 128
FP4_BLOCK = 32
# e2m1 code -> value (bit 3 = sign, bits 2..1 = exponent, bit 0 = mantissa)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    """Stacked weights ``[G, N, K]`` of one format (see the module docstring)."""

    values: Array
    scales: Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True), default="dense")

    @property
    def shape(self) -> tuple[int, int, int]:
        g, n, k = self.values.shape
        return g, n, 2 * k if self.fmt == "fp4" else k

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.values, self.scales) if a is not None)

    def group(self, g) -> "Weights":
        """The weights of group ``g`` (a traced index) as a 1-group ``Weights``."""
        pick = lambda a: None if a is None else lax.dynamic_index_in_dim(a, g, keepdims=True)  # noqa: E731
        return Weights(pick(self.values), pick(self.scales), self.fmt)


ACT_AMAX_FLOOR = 1e-4  # the reference's act_quant (dspark_jax.model.quant.FP8_AMAX_FLOOR, FP8_MAX)
ACT_FP8_MAX = 448.0


def _act_scale_exponent(amax: Array) -> Array:
    """The biased fp32 exponent of ``act_scale(amax)`` (int32; see there)."""
    bits = lax.bitcast_convert_type(jnp.maximum(amax.astype(jnp.float32), ACT_AMAX_FLOOR), jnp.int32)
    up = ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)  # m > 1.75
    return (bits >> 23) - 8 + up


def act_scale_inverse(amax: Float[Array, "..."]) -> Float[Array, "..."]:
    """``1 / act_scale(amax)``, exactly (a power of two: the exponent negated; 105 <= the scale's
    biased exponent <= 247 for amax between the floor and the fp32 maximum)."""
    return lax.bitcast_convert_type((254 - _act_scale_exponent(amax)) << 23, jnp.float32)


def act_scale(amax: Float[Array, "..."]) -> Float[Array, "..."]:
    """The power-of-two scale of a block of quantised rows, ``2 ** ceil(log2(max(amax, 1e-4) /
    448))``, from the exponent bits (no division; usable in a kernel). With ``a = m * 2**E``
    (1 <= m < 2) and 448 = 1.75 * 2**8, a / 448 = (m / 1.75) * 2**(E - 8) with m / 1.75 in
    (4/7, 8/7): the scale is 2**(E - 8), doubled when m > 1.75. The reference divides first, and
    the correctly rounded quotient never crosses the power of two, so the scales are equal."""
    return lax.bitcast_convert_type(_act_scale_exponent(amax) << 23, jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ActQuant:
    """Rows quantised as the reference quantises a GEMM's input (``act_quant``, block 128): e4m3
    codes ``[M, K]`` and each 128-input block's largest magnitude ``amax [M, K / 128]`` (fp32),
    whose power-of-two ``act_scale`` the codes were divided by; the rows' values are ``codes *
    scales`` (each block's scale repeated), activations of dtype ``dtype``. Against ``fp8`` weights
    the kernel multiplies codes by codes on the fp8 tensor cores (products exact, fp32 sums) and
    applies both scales to the sums (``fp8_dots``), computing the rows' scales from ``amax`` itself
    (so no separate scale array is materialised); against other weights it multiplies the rows'
    values."""

    codes: Array
    amax: Array
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True), default=jnp.bfloat16)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def scales(self) -> Array:
        return act_scale(self.amax)

    def values(self) -> Array:
        """``codes * scales`` in ``dtype`` (exact: an e4m3 value times a power of two)."""
        m, k = self.codes.shape
        v = self.codes.astype(jnp.float32).reshape(m, k // FP8_BLOCK, FP8_BLOCK) * self.scales()[..., None]
        return v.reshape(m, k).astype(self.dtype)

    @classmethod
    def of(cls, x: Float[Array, "m k"]) -> "ActQuant":
        """x quantised as the reference quantises a GEMM's input (``act_quant``, block 128; the
        values are ``dspark_jax.model.quant.fp8_sim(x, 128)``)."""
        from dspark_jax.model.quant import fp8_block_amax, fp8_codes

        amax = fp8_block_amax(x, FP8_BLOCK)
        return cls(fp8_codes(x, act_scale(amax), FP8_BLOCK), amax, x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantRows:
    """Rows [M, K] to be quantised as the reference quantises a GEMM's input (``ActQuant.of``) by
    whoever multiplies them: where ``fp8_dots`` holds the kernel quantises each 128-input block in
    registers (amax, ``act_scale``, e4m3 codes) before its e4m3 x e4m3 dot, so nothing runs between
    the rows' producer and the kernel; elsewhere the rows' rounded values are multiplied
    (``ActQuant.of(rows).values()``)."""

    rows: Array

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape

    @property
    def dtype(self):
        return self.rows.dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Route:
    """A decode step's routing left for the routed SwiGLU's programs to decide
    (``routing.select_rows``, each program its own pair's) instead of a launch of their own: the
    router's logits as float32 partial sums ``logits`` [S n, e] (S = 1: the logits themselves),
    ``sel`` the selection bias [e] (learned routing) or the given experts [n, k] (hash routing),
    and the routing's constants (``routing.select``'s). For pairs in their own tiles
    (``group_metadata.pair_tiles``): tile t holds pair t = (token t // k, slot t % k) in its first
    row, so ``shape`` is that of the tiles' experts it stands for, [n k]."""

    logits: Array
    sel: Array
    n: int = dataclasses.field(metadata=dict(static=True), default=1)
    k: int = dataclasses.field(metadata=dict(static=True), default=1)
    func: str = dataclasses.field(metadata=dict(static=True), default="sqrtsoftplus")
    norm: bool = dataclasses.field(metadata=dict(static=True), default=True)
    scale: float = dataclasses.field(metadata=dict(static=True), default=1.0)

    @property
    def shape(self) -> tuple[int]:
        return (self.n * self.k,)

    def constants(self) -> tuple:
        """What the kernel's programs need besides the refs (hashable)."""
        return (self.n, self.logits.shape[-1], self.k, self.func, self.norm, self.scale, self.sel.ndim == 1,
                self.logits.shape[0] // self.n)


def _routed_pair(l_ref, sel_ref, t, bm: int, route: tuple) -> tuple[Array, Array]:
    """(expert, the tile's row weights [bm]) of pair tile t, decided in the program (``Route``)."""
    from pallas_kernels.routing import select_rows  # (it imports this module through gemv)

    n, e, k, func, norm, scale, learned, parts = route
    rows = (jnp.arange(1, dtype=jnp.int32) + t // k)[:, None]
    w, idx, slots = select_rows(l_ref, sel_ref, rows, n=n, e=e, k=k, func=func, norm=norm, scale=scale,
                                learned=learned, parts=parts)
    mine = slots == t % k
    g = jnp.sum(jnp.sum(jnp.where(mine, idx, 0), axis=1))  # (a [1, kp] tile: one term each)
    w_pair = jnp.sum(jnp.sum(jnp.where(mine, w, 0.0), axis=1))
    return g, jnp.where(jnp.arange(bm, dtype=jnp.int32) == 0, w_pair, 0.0)


def _values(x: Array | ActQuant | QuantRows) -> Array:
    """The values rows of any kind stand for (quantised rows: their rounded values)."""
    if isinstance(x, QuantRows):
        return ActQuant.of(x.rows).values()
    return x.values() if isinstance(x, ActQuant) else x


def check_act_quant(x: ActQuant) -> None:
    m, k = x.codes.shape if x.codes.ndim == 2 else (None, None)
    if m is None or x.codes.dtype != jnp.float8_e4m3fn or k % FP8_BLOCK:
        raise ValueError(f"ActQuant codes must be float8_e4m3fn [M, K] with K a multiple of {FP8_BLOCK}, got "
                         f"{x.codes.dtype} {x.codes.shape}")
    if x.amax.dtype != jnp.float32 or x.amax.shape != (m, k // FP8_BLOCK):
        raise ValueError(f"ActQuant amax must be float32 {(m, k // FP8_BLOCK)}, got {x.amax.dtype} "
                         f"{x.amax.shape}")
    if jnp.dtype(x.dtype) not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"ActQuant dtype must be bf16 / fp32, got {x.dtype}")


def fp8_dots(x: Array | ActQuant | QuantRows, w: Weights, block_m: int) -> bool:
    """Whether the kernel multiplies fp8 codes by fp8 codes: quantised rows against ``fp8`` or
    ``fp8_k128`` weights (one dot per 128-input block) in decode / verify row tiles (16 rows).
    (Against FP4 widened with its per-32 scales that took one dot per 32 inputs, which measured
    slower on an H200 than multiplying the rows' values: hence ``fp8_k128``, docs/benchmarks.md.)
    Prefill's larger row tiles have not been measured with fp8 dots on a GPU; those (and the other
    formats) take the rows' values."""
    return isinstance(x, (ActQuant, QuantRows)) and takes_codes(w.fmt, block_m)


# The largest row tile that multiplies quantised rows as fp8 codes (read at the call;
# ``benchmarks/linear_tiles.py`` raises it to time larger tiles).
CODE_DOTS_MAX_BLOCK_M = 16


def takes_codes(fmt: str, block_m: int) -> bool:
    """Whether quantised rows are multiplied as fp8 codes against ``fmt`` weights in ``block_m``-row
    tiles (``fp8_dots``)."""
    return fmt in ("fp8", "fp8_k128") and block_m <= CODE_DOTS_MAX_BLOCK_M


def _kernel_rows(x: Array | ActQuant | QuantRows, w: Weights, block_m: int,
                 codes: bool | None = None) -> Array | ActQuant | QuantRows:
    """What the kernel multiplies: quantised rows as codes where ``fp8_dots`` (or, ``codes`` given,
    where it says so and the rows and weights can: ``plain_linear_tiles``), else their values."""
    if codes is not None:
        codes = codes and isinstance(x, (ActQuant, QuantRows)) and w.fmt in ("fp8", "fp8_k128")
    return x if (fp8_dots(x, w, block_m) if codes is None else codes) else _values(x)


def check_weights(w: Weights) -> None:
    if w.fmt not in FORMATS:
        raise ValueError(f"weight format must be one of {FORMATS}, got {w.fmt!r}")
    if w.values.ndim != 3:
        raise ValueError(f"weights must be [G, N, K], got values of shape {w.values.shape}")
    g, n, k = w.shape
    if w.fmt == "dense":
        if w.scales is not None or w.values.dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"dense weights are bf16 / fp32 without scales, got {w.values.dtype}")
        return
    want = {"fp8": (jnp.float8_e4m3fn, (g, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))),
            "fp4": (jnp.uint8, (g, n, k // FP4_BLOCK)),
            "fp8_k128": (jnp.float8_e4m3fn, (g, n, k // FP8_BLOCK))}[w.fmt]
    if w.values.dtype != want[0] or w.scales is None or w.scales.dtype != jnp.uint8 or w.scales.shape != want[1]:
        raise ValueError(f"{w.fmt} weights need values {jnp.dtype(want[0]).name} and uint8 scales of shape "
                         f"{want[1]}, got {w.values.dtype} {w.values.shape} and "
                         f"{None if w.scales is None else (w.scales.dtype, w.scales.shape)}")
    if w.fmt == "fp4" and k % FP4_BLOCK:
        raise ValueError(f"fp4 weights need K to be a multiple of {FP4_BLOCK}, got {k}")
    if w.fmt == "fp8_k128" and k % FP8_BLOCK:
        raise ValueError(f"fp8_k128 weights need K to be a multiple of {FP8_BLOCK}, got {k}")


# ------------------------------------------------------------------------------ pure-JAX reference
def e8m0_to_float(b: Array) -> Array:
    """e8m0 scale bytes -> float32 ``2 ** (b - 127)``."""
    return jnp.ldexp(jnp.ones(b.shape, jnp.float32), b.astype(jnp.int32) - 127)


def dequantize(w: Weights, dtype) -> Array:
    """The weights as ``dtype`` [G, N, K]: codes times their scales, computed in fp32 like the
    reference's dequantisation (exact in bf16)."""
    g, n, k = w.shape
    if w.fmt == "dense":
        return w.values.astype(dtype)
    if w.fmt == "fp8":
        s = e8m0_to_float(w.scales)
        s = jnp.repeat(jnp.repeat(s, FP8_BLOCK, axis=1), FP8_BLOCK, axis=2)[:, :n, :k]
        return (w.values.astype(jnp.float32) * s).astype(dtype)
    if w.fmt == "fp8_k128":
        return (w.values.astype(jnp.float32) * jnp.repeat(e8m0_to_float(w.scales), FP8_BLOCK, axis=2)).astype(dtype)
    s = jnp.repeat(e8m0_to_float(w.scales), FP4_BLOCK, axis=2)
    table = jnp.asarray(FP4_VALUES, jnp.float32)
    b = w.values.astype(jnp.int32)
    vals = jnp.stack([table[b & 15], table[b >> 4]], axis=-1).reshape(g, n, k)
    return (vals * s).astype(dtype)


def swiglu(g: Array, u: Array, limit: float) -> Array:
    """silu(min(g, limit)) * clamp(u, -limit, limit) in fp32 (no clamp for limit <= 0)."""
    g, u = g.astype(jnp.float32), u.astype(jnp.float32)
    if limit > 0:
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return jax.nn.silu(g) * u


def _tile_products(x: Array, w: Weights, tile_group: Array, num_tiles: Array, block_m: int,
                   extra: Weights | None = None) -> Array:
    """fp32 [T, block_m, N] products, one tile at a time (memory: one group's weights at a time);
    tiles of group G (``w``'s count) multiply ``extra``'s group 0."""
    t = tile_group.shape[0]
    xt = x.reshape(t, block_m, x.shape[-1])
    groups = w.shape[0]

    def one(args):
        xb, g = args
        wg = dequantize(w.group(jnp.minimum(g, groups - 1)), x.dtype)[0]
        if extra is not None:
            wg = jnp.where(g < groups, wg, dequantize(extra.group(0), x.dtype)[0])
        return jnp.einsum("mk,nk->mn", xb, wg, preferred_element_type=jnp.float32)

    out = lax.map(one, (xt, tile_group))
    used = jnp.arange(t) < num_tiles[0]
    return jnp.where(used[:, None, None], out, 0.0)


def reference(x: Float[Array, "m k"] | ActQuant | QuantRows, w: Weights, tile_group: Int[Array, " t"],
              num_tiles: Int[Array, " 1"], *, block_m: int, out_dtype=None, extra: Weights | None = None
              ) -> Float[Array, "m n"]:
    """Pure-JAX grouped matmul (XLA): a loop over tiles, so memory never grows with the groups.
    ``extra``: one more weight (``check_extra``), multiplied by the tiles of group G."""
    check_inputs(x, w, tile_group, block_m)
    check_extra(w, extra)
    x = _values(x)
    y = _tile_products(x, w, tile_group, num_tiles, block_m, extra)
    return y.reshape(x.shape[0], -1).astype(out_dtype or x.dtype)


def swiglu_reference(x: Float[Array, "m k"] | ActQuant | QuantRows, w1: Weights, w3: Weights,
                     row_weight: Float[Array, " m"], tile_group: Int[Array, " t"], num_tiles: Int[Array, " 1"],
                     *, block_m: int, limit: float, extra: tuple[Weights, Weights] | None = None
                     ) -> Float[Array, "m n"]:
    """``swiglu(x W1^T, x W3^T) * row_weight`` per tile, in x's dtype (the reference's roundings);
    ``extra`` = (W1', W3'): one more pair of weights, multiplied by the tiles of group G."""
    check_inputs(x, w1, tile_group, block_m)
    check_inputs(x, w3, tile_group, block_m)
    extra1, extra3 = extra or (None, None)
    check_extra(w1, extra1)
    check_extra(w3, extra3)
    x = _values(x)
    dt = x.dtype
    g = _tile_products(x, w1, tile_group, num_tiles, block_m, extra1).astype(dt)
    u = _tile_products(x, w3, tile_group, num_tiles, block_m, extra3).astype(dt)
    h = swiglu(g, u, limit).reshape(x.shape[0], -1) * row_weight.astype(dt).astype(jnp.float32)[:, None]
    return h.astype(dt)


def extra_fits(w: Weights, extra: Weights) -> bool:
    """Whether ``extra`` takes the same rows as ``w`` in the kernel (``check_extra``): both fp8
    formats, or neither of them nor FP4."""
    fp8 = ("fp8", "fp8_k128")
    return (w.fmt in fp8) == (extra.fmt in fp8) and "fp4" not in (w.fmt, extra.fmt)


def check_extra(w: Weights, extra: Weights | None) -> None:
    """An extra weight (one group, its own format) must take the same rows as ``w``: N and K
    alike, and rows of the same kind in the kernel (``extra_fits``)."""
    if extra is None:
        return
    check_weights(extra)
    if extra.shape[0] != 1 or extra.shape[1:] != w.shape[1:]:
        raise ValueError(f"an extra weight must be one group of [N, K] = {list(w.shape[1:])}, got {extra.shape}")
    if not extra_fits(w, extra):
        raise ValueError(f"an extra weight of format {extra.fmt!r} cannot take the rows of {w.fmt!r} weights "
                         "(both fp8 / fp8_k128, or neither of them nor FP4)")


def check_inputs(x: Array | ActQuant | QuantRows, w: Weights, tile_group: Array, block_m: int) -> None:
    check_weights(w)
    if isinstance(x, ActQuant):
        check_act_quant(x)
    elif len(x.shape) != 2 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be a bf16 / fp32 [M, K] matrix, got {x.dtype} {x.shape}")
    elif isinstance(x, QuantRows) and x.shape[1] % FP8_BLOCK:
        raise ValueError(f"rows to quantise need K to be a multiple of {FP8_BLOCK}, got {x.shape[1]}")
    g, n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns but the weights take K = {k}")
    if x.shape[0] != tile_group.shape[0] * block_m:
        raise ValueError(f"x has {x.shape[0]} rows, expected {tile_group.shape[0]} tiles x {block_m} rows")


# ------------------------------------------------------------------------------ Pallas kernel
@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiles of the kernel: ``block_n`` output columns per program and ``block_k`` inputs per loop
    step (powers of two; fp8 weights need block_n <= 128 so a tile sits in one row of scale blocks,
    and a step wider than a 128-input scale block takes one product per block; fp4 needs
    block_k >= 32). The row tile ``block_m`` comes with the metadata. ``split_k`` (a power of two):
    programs per output tile, each over K / split_k of the inputs; their fp32 partial products are
    summed after the kernel (XLA), then rounded (and, fused SwiGLU, activated) as without the split.
    A decode step's few rows and wide K give few output tiles; splitting K keeps every core
    streaming weights. ``fold_scales`` (``fp8`` / ``fp8_k128`` weights, rows as values): each
    weight tile is multiplied by its scales in registers (exact in the rows' dtype: a power of
    two times an e4m3 value), so the loop's dots accumulate in place instead of scaling every
    step's product before adding it."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    fold_scales: bool = False

    def __post_init__(self):
        if not backend.is_power_of_2(self.split_k):
            raise ValueError(f"split_k must be a power of two, got {self.split_k}")

    def fit(self, n: int, k: int, fmt: str, code_dots: bool = False) -> "GemmConfig":
        """This config with tiles shrunk to divide N and K (and the format's scale blocks), and
        the split to divide K's loop steps. ``code_dots`` (quantised rows: fp8 codes times fp8
        codes): steps of whole 128-input blocks of the rows' scales."""
        bn = backend.largest_pow2_divisor(n, self.block_n if fmt != "fp8" else min(self.block_n, FP8_BLOCK))
        bk = backend.largest_pow2_divisor(k, max(self.block_k, FP8_BLOCK) if code_dots else self.block_k)
        if code_dots and bk < FP8_BLOCK:
            raise ValueError(f"quantised rows need K to be a multiple of {FP8_BLOCK}, got {k}")
        kmin = FP4_BLOCK if fmt == "fp4" else 16
        if bn < 16 or bk < kmin:
            raise ValueError(f"no legal tiles for N = {n}, K = {k} ({fmt}): need N % 16 == 0 and K % {kmin} == 0")
        split = backend.largest_pow2_divisor(k // bk, self.split_k)
        return dataclasses.replace(self, block_n=bn, block_k=bk, split_k=split)


# Decode / verify (row tile 16): K is split until the kernel has at least this many programs
# (output tiles x splits), keeping at least SPLIT_MIN_STEPS loop steps per program. Chosen from
# the device times of every Flash decode GEMM on an H200 (``benchmarks/gemm_decode.py``,
# docs/benchmarks.md): 384 programs, 4 steps came closest to the best of the sweep (a kernel of
# 384 programs or more, e.g. the routed experts' down projection at one token, is slower split).
SPLIT_TARGET_PROGRAMS = 384
SPLIT_MIN_STEPS = 4


# A decode step's routed SwiGLU (``fp8_k128`` weights in 16-row tiles, where ``split_for`` splits
# K): 0 keeps the split, its halves added, activated and quantised by a second launch
# (``swiglu_quantise``); N > 0 runs it unsplit in N-column tiles with the SwiGLU in its epilogue,
# and w2's programs quantise their rows (``QuantRows``): one launch fewer per layer, but w2 took
# 4-5 us longer on an H200 (with ``MoE.one_row`` "experts", docs/benchmarks.md), so 0. Read at
# the call (``benchmarks/moe.py --one-token-swiglu``, ``benchmarks/decode.py --one-token-swiglu``).
ONE_TOKEN_SWIGLU_BLOCK_N = 0


def split_for(programs: int, k_steps: int, target: int | None = None, min_steps: int | None = None) -> int:
    """The smallest power-of-two K split that gives ``target`` programs (default
    ``SPLIT_TARGET_PROGRAMS``, read at the call: 0 turns splitting off), at most ``k_steps /
    min_steps`` (default ``SPLIT_MIN_STEPS``); 1: no split."""
    target = SPLIT_TARGET_PROGRAMS if target is None else target
    min_steps = SPLIT_MIN_STEPS if min_steps is None else min_steps
    split = 1
    while programs * split < target and k_steps // (split * 2) >= min_steps:
        split *= 2
    return split


def default_config(block_m: int, fmt: str, *, n: int | None = None, k: int | None = None,
                   tiles: int | None = None, weights: int = 1) -> GemmConfig:
    """Few rows (decode / verify): narrow column tiles, many programs streaming weights, and K split
    (``split_for``) when the output's ``tiles`` x N give too few programs (not FP4, whose SwiGLU at
    one token measured 98 us unsplit against 103 us split in two on an H200). Many rows (prefill):
    wider tiles for reuse. FP4 tiles as tuned by ``benchmarks/moe.py --tune`` on an H200 (one
    weight: 64 columns); the others as first measured there. Routed experts
    (``fp8_k128``) with enough programs unsplit (a verify's or a batch's pairs): 256-input steps in
    3 stages, which read their weights 3-13 % faster on an H200 than 128-input steps in 4
    (``gemm_decode.py --pipelines``: the 36-pair SwiGLU 173 -> 151 us, docs/benchmarks.md); split
    programs (a decode step's 6 pairs) were slower with them. ``weights`` = 2 (the fused SwiGLU):
    FP4 in 32-column tiles, which decode twice the weights per program in registers (the 1-token
    SwiGLU 98 -> 73 us, the 36-pair one 448 -> 416 us on an H200; one weight is fastest at 64)."""
    cfg = _tile_config(block_m, fmt)
    if fmt == "fp4" and block_m <= 16 and weights == 2:
        cfg = dataclasses.replace(cfg, block_n=32)
    if block_m > 16 or None in (n, k, tiles) or fmt == "fp4":  # FP4: bound by its decoding, faster unsplit
        return cfg
    fit = cfg.fit(n, k, fmt)
    split = split_for(tiles * (n // fit.block_n), k // fit.block_k)
    if split == 1 and fmt == "fp8_k128":
        return dataclasses.replace(cfg, block_k=256, num_stages=3)
    return dataclasses.replace(cfg, split_k=split)


def _tile_config(block_m: int, fmt: str) -> GemmConfig:
    if fmt == "fp8_k128":
        if block_m <= 16:
            return GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
        return GemmConfig(block_n=128, block_k=128 if block_m <= 32 else 64, num_warps=4, num_stages=3)
    if block_m <= 16:
        return GemmConfig(block_n=64, block_k=128 if fmt == "fp8" else 256, num_warps=4, num_stages=4)
    if fmt == "fp4":
        return GemmConfig(block_n=64, block_k=256 if block_m <= 32 else 128, num_warps=4, num_stages=3)
    if fmt == "dense" and block_m >= 64:  # bf16 prefill: 256-column tiles, 46 % of the matmul peak at 8192
        return GemmConfig(block_n=256, block_k=64, num_warps=8, num_stages=3)  # tokens on an H200 (38 % at 128)
    return GemmConfig(block_n=128, block_k=64, num_warps=8 if block_m >= 64 else 4, num_stages=3)


def _scale_f32(b: Array) -> Array:
    """e8m0 bytes -> fp32 powers of two, built from the exponent bits (byte 0 is 2**-127)."""
    bits = b.astype(jnp.int32)
    return lax.bitcast_convert_type(jnp.where(bits == 0, 0x400000, bits << 23), jnp.float32)


def _scale_bf16(b: Array, times: int = 1) -> Array:
    """e8m0 bytes -> bf16 powers of two ``times * 2 ** (b - 127)`` from the exponent bits (byte 0
    is the subnormal 2**-127). ``times`` = 64: exact for bytes up to 248 (weights below 2**122)."""
    bits = b.astype(jnp.int32)
    if times == 1:
        return lax.bitcast_convert_type(jnp.where(bits == 0, 0x40, bits << 7).astype(jnp.int16), jnp.bfloat16)
    shift = times.bit_length() - 1
    if times != 1 << shift:
        raise ValueError(f"times must be a power of two, got {times}")
    return lax.bitcast_convert_type(((bits + shift) << 7).astype(jnp.int16), jnp.bfloat16)


def _fp4_as_e4m3(b: Array) -> tuple[Array, Array]:
    """Packed e2m1 pairs (uint8) -> the e4m3 codes of their values / 64, low and high nibble.

    An e2m1 code (s, e1 e0, m) placed in an e4m3 byte as sign bit 7, exponent bits 4..3 and
    mantissa bit 2 is exactly its value / 64 (e4m3's bias 7 against e2m1's 1, and e2m1's
    subnormal 0.5 lands on e4m3's subnormal 2**-7): the hardware's fp8 conversion then decodes
    it, and the missing 64 goes into the block scale (``_scale_bf16(.., times=64)``)."""
    lo = ((b & 0x07) << 2) | ((b & 0x08) << 4)
    hi = ((b >> 2) & 0x1C) | (b & 0x80)
    return (lax.bitcast_convert_type(lo, jnp.float8_e4m3fn), lax.bitcast_convert_type(hi, jnp.float8_e4m3fn))


def _dot_t(a: Array, b: Array) -> Array:
    """a [m, k] @ b [n, k]^T in fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def weight_tiles(w_refs, fmt: str, g, n: int, k: int, n0, k0, bn: int, bk: int,
                 dt, fold: bool = False) -> tuple[tuple[Array, ...], Array | None]:
    """The weights of one loop step decoded in registers: output columns n0 .. n0 + bn of group g
    against inputs k0 .. k0 + bk, as ``dt`` tiles [bn, bk] (fp4: the low and high nibbles
    [bn, bk / 2], which multiply the even and odd inputs), and the fp32 scale of their product
    (fp8: one per 128 x 128 block; fp8_k128: one per output column [1, bn], bk <= 128) or None
    (``fold``: fp8 / fp8_k128 tiles come multiplied by their scales, exact in ``dt``)."""
    if fmt == "dense":
        (w_ref,) = w_refs
        return (w_ref[pl.ds(g * n + n0, bn), pl.ds(k0, bk)].astype(dt),), None
    if fmt == "fp8":
        w_ref, s_ref = w_refs
        w = w_ref[pl.ds(g * n + n0, bn), pl.ds(k0, bk)].astype(dt)
        nb = -(-n // FP8_BLOCK)
        scale = _scale_f32(s_ref[g * nb + n0 // FP8_BLOCK, k0 // FP8_BLOCK])
        return ((w * scale.astype(dt),), None) if fold else ((w,), scale)
    if fmt == "fp8_k128":
        w_ref, s_ref = w_refs
        w = w_ref[pl.ds(g * n + n0, bn), pl.ds(k0, bk)].astype(dt)
        scale = _column_scales(s_ref, g, n, n0, k0, bn)
        return ((w * scale.T.astype(dt),), None) if fold else ((w,), scale)
    w_ref, s_ref = w_refs
    half, nsb = bk // 2, bk // FP4_BLOCK  # packed bytes, scale blocks of this step
    b = w_ref[pl.ds(g * n + n0, bn), pl.ds(k0 // 2, half)]
    sb = s_ref[pl.ds(g * n + n0, bn), pl.ds(k0 // FP4_BLOCK, nsb)]
    # one scale (times 64, see _fp4_as_e4m3) per 16 packed bytes, spread over them in registers
    s = jnp.broadcast_to(_scale_bf16(sb, times=64)[:, :, None], (bn, nsb, FP4_BLOCK // 2)).reshape(bn, half)
    return tuple(c.astype(dt) * s.astype(dt) for c in _fp4_as_e4m3(b)), None


def _column_scales(s_ref, g, n: int, n0, k0, bn: int) -> Array:
    """fp32 [1, bn]: the ``fp8_k128`` scales of output columns n0 .. n0 + bn of group g in the
    128-input block holding input k0."""
    return _scale_f32(s_ref[pl.ds(g * n + n0, bn), k0 // FP8_BLOCK])[None, :]


def step_product(xs: tuple[Array, ...], w_refs, fmt: str, g, n: int, k: int, n0, k0, bn: int, bk: int,
                 dt, fold: bool = False) -> Array:
    """fp32 [m, bn] product of one loop step: the inputs ``xs`` (x [m, bk]; fp4: its even and odd
    columns [m, bk / 2]) against ``weight_tiles``."""
    tiles, scale = weight_tiles(w_refs, fmt, g, n, k, n0, k0, bn, bk, dt, fold)
    acc = _dot_t(xs[0], tiles[0])
    for x, w in zip(xs[1:], tiles[1:]):
        acc = acc + _dot_t(x, w)
    return acc if scale is None else acc * scale


def _quantise_block(xb: Array) -> tuple[Array, Array]:
    """One 128-input block of rows [bm, 128] as ``ActQuant.of`` quantises it: e4m3 codes and the
    rows' scales [bm, 1] (division by a power of two = multiplication by its exact inverse)."""
    xb = xb.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xb), axis=1, keepdims=True)
    codes = jnp.clip(xb * act_scale_inverse(amax), -ACT_FP8_MAX, ACT_FP8_MAX).astype(jnp.float8_e4m3fn)
    return codes, act_scale(amax)


def _code_dots_step(x_refs, w_refs, fmt: str, g, n: int, r0, n0, k0, bm: int, bn: int, bk: int,
                    quantise: bool) -> Array:
    """fp32 [bm, bn] product of one loop step of quantised rows (codes and per-128 amax, or rows
    that ``quantise`` here: ``_quantise_block``) against ``fp8`` / ``fp8_k128`` weights: per
    128-input block an e4m3 x e4m3 dot (exact products, fp32 sums) times the weight block's scale
    (``fp8_k128``: each output column's) and each row's scale (``act_scale`` of its amax)."""
    w_ref, s_ref = w_refs
    rows, cols = pl.ds(r0, bm), pl.ds(g * n + n0, bn)
    nb = -(-n // FP8_BLOCK)
    total = None
    for c in range(0, bk, FP8_BLOCK):
        kb = k0 + c
        if quantise:
            xq, sx = _quantise_block(x_refs[0][rows, pl.ds(kb, FP8_BLOCK)])
        else:
            xq, sx = x_refs[0][rows, pl.ds(kb, FP8_BLOCK)], act_scale(x_refs[1][rows, pl.ds(kb // FP8_BLOCK, 1)])
        p = _dot_t(xq, w_ref[cols, pl.ds(kb, FP8_BLOCK)])
        if fmt == "fp8":
            p = p * (sx * _scale_f32(s_ref[g * nb + n0 // FP8_BLOCK, kb // FP8_BLOCK]))
        else:
            p = p * (sx * _column_scales(s_ref, g, n, n0, kb, bn))
        total = p if total is None else total + p
    return total


def _weight_step(x_refs, w_refs, fmt: str, g, n: int, k: int, r0, n0, k0, bm: int, bn: int, bk: int, dt,
                 code_dots: bool = False, quantise: bool = False, fold: bool = False) -> Array:
    """fp32 [bm, bn] product of one loop step: inputs k0 .. k0 + bk of rows r0 .. r0 + bm against
    output columns n0 .. n0 + bn of group g."""
    if code_dots:
        return _code_dots_step(x_refs, w_refs, fmt, g, n, r0, n0, k0, bm, bn, bk, quantise)
    if fmt == "fp4":
        xs = tuple(ref[pl.ds(r0, bm), pl.ds(k0 // 2, bk // 2)] for ref in x_refs)
    elif fmt in ("fp8", "fp8_k128") and bk > FP8_BLOCK:  # one product per 128-input scale block of the step
        return functools.reduce(jnp.add, [
            step_product((x_refs[0][pl.ds(r0, bm), pl.ds(k0 + c, FP8_BLOCK)],), w_refs, fmt, g, n, k, n0, k0 + c,
                         bn, FP8_BLOCK, dt, fold) for c in range(0, bk, FP8_BLOCK)])
    else:
        xs = (x_refs[0][pl.ds(r0, bm), pl.ds(k0, bk)],)
    return step_product(xs, w_refs, fmt, g, n, k, n0, k0, bn, bk, dt, fold)


def _swiglu_rows(gate: Array, up: Array, row_weight: Array, limit: float, dt) -> Array:
    """The expert's SwiGLU with the reference's roundings (products in ``dt``, SwiGLU in fp32),
    times the routing weight (rounded to ``dt``) of each row: fp32 [rows, n]."""
    return swiglu(gate.astype(dt), up.astype(dt), limit) * row_weight.astype(dt).astype(jnp.float32)[:, None]


def _kernel(*refs, fmt: str, n: int, k: int, m: int, bm: int, cfg: GemmConfig, n_weights: int,
            limit: float | None, code_dots: bool, quantise: bool, dt, route: tuple | None = None,
            extra_fmt: str | None = None, groups: int = 0):
    if route is None:
        tile_group_ref, num_tiles_ref = refs[:2]
        refs = refs[2:]
    else:  # the logits (their partial sums) and the selection instead of the tiles' experts (``Route``)
        l_ref, sel_ref, num_tiles_ref = refs[:3]
        refs = refs[3:]
        *refs, group_out_ref, rw_out_ref = refs  # (the decided experts and row weights, for what follows)
    n_x = 2 if fmt == "fp4" or (code_dots and not quantise) else 1
    x_refs, refs = refs[:n_x], refs[n_x:]
    per_w = 1 if fmt == "dense" else 2
    w_sets = [refs[i * per_w:(i + 1) * per_w] for i in range(n_weights)]
    refs = refs[n_weights * per_w:]
    if extra_fmt is not None:  # the extra weights (``Extra``): tiles of group ``groups`` multiply them
        per_x = 1 if extra_fmt == "dense" else 2
        extra_sets = [refs[i * per_x:(i + 1) * per_x] for i in range(n_weights)]
        refs = refs[n_weights * per_x:]
    rw_ref = refs[0] if limit is not None and cfg.split_k == 1 and route is None else None
    o_ref = refs[-1]

    bn, bk, split = cfg.block_n, cfg.block_k, cfg.split_k
    t, nb = pl.program_id(0), pl.program_id(1)
    r0, n0 = t * bm, nb * bn
    steps = k // bk // split
    s_id = pl.program_id(2) if split > 1 else 0  # (read here: interpret mode has no program ids in branches)
    k_base = s_id * steps * bk

    def store(outs):
        if split == 1:  # the finished rows
            o_ref[pl.ds(r0, bm), pl.ds(n0, bn)] = outs[0].astype(o_ref.dtype)
        else:  # fp32 partial products: split s at rows s * m.., weight i at columns i * n..
            s0 = s_id * m + r0
            for i, out in enumerate(outs):
                o_ref[pl.ds(s0, bm), pl.ds(i * n + n0, bn)] = out

    first = (nb == 0) & (s_id == 0)  # (the program that stores a routed tile's decisions)

    @pl.when(t < num_tiles_ref[0])
    def _compute():
        if route is None:
            g = tile_group_ref[t]
            rw = None if rw_ref is None else rw_ref[pl.ds(r0, bm)]
        else:
            g, rw = _routed_pair(l_ref, sel_ref, t, bm, route)

            @pl.when(first)
            def _decided():
                group_out_ref[pl.ds(t, 1)] = jnp.full((1,), g, jnp.int32)
                rw_out_ref[pl.ds(r0, bm)] = rw

        def products(sets, w_fmt: str, g):
            def body(step, accs):
                k0 = k_base + step * bk
                return tuple(a + _weight_step(x_refs, w, w_fmt, g, n, k, r0, n0, k0, bm, bn, bk, dt, code_dots,
                                              quantise, cfg.fold_scales) for a, w in zip(accs, sets))

            zero = jnp.zeros((bm, bn), jnp.float32)
            accs = lax.fori_loop(0, steps, body, (zero,) * n_weights)
            if limit is not None and split == 1:
                accs = (_swiglu_rows(accs[0], accs[1], rw, limit, dt),)
            store(accs)

        if extra_fmt is None:
            products(w_sets, fmt, g)
        else:
            pl.when(g < groups)(lambda: products(w_sets, fmt, g))
            pl.when(g >= groups)(lambda: products(extra_sets, extra_fmt, 0))

    @pl.when(t >= num_tiles_ref[0])
    def _unused():
        store((jnp.zeros((bm, bn), jnp.float32),) * (n_weights if split > 1 else 1))
        if route is not None:
            @pl.when(first)
            def _none():
                group_out_ref[pl.ds(t, 1)] = jnp.zeros((1,), jnp.int32)
                rw_out_ref[pl.ds(r0, bm)] = jnp.zeros((bm,), jnp.float32)


def flat_operands(w: Weights) -> tuple[Array, ...]:
    """The kernel operands of stacked weights: values [G * N, K'] (and scales [G * N', K''])."""
    vals = w.values.reshape(-1, w.values.shape[-1])
    return (vals,) if w.fmt == "dense" else (vals, w.scales.reshape(-1, w.scales.shape[-1]))


def _x_operands(x: Array | ActQuant | QuantRows, fmt: str) -> tuple[Array, ...]:
    if isinstance(x, ActQuant):
        return x.codes, x.amax
    if isinstance(x, QuantRows):
        return (x.rows,)
    return (x[:, 0::2], x[:, 1::2]) if fmt == "fp4" else (x,)


def _swiglu_quantise_kernel(y_ref, rw_ref, codes_ref, amax_ref, *, m: int, n: int, split: int, limit: float, dt):
    """One row's 128 SwiGLU outputs from the K split's partial sums (gate at columns 0.., up at N..,
    split s at rows s M..; added in order), rounded to ``dt``, then quantised as ``ActQuant.of``."""
    r, j = pl.program_id(0), pl.program_id(1)
    c0 = j * FP8_BLOCK
    gate, up = y_ref[pl.ds(r, 1), pl.ds(c0, FP8_BLOCK)], y_ref[pl.ds(r, 1), pl.ds(n + c0, FP8_BLOCK)]
    for s in range(1, split):
        gate = gate + y_ref[pl.ds(s * m + r, 1), pl.ds(c0, FP8_BLOCK)]
        up = up + y_ref[pl.ds(s * m + r, 1), pl.ds(n + c0, FP8_BLOCK)]
    h = _swiglu_rows(gate, up, rw_ref[pl.ds(r, 1)], limit, dt).astype(dt)
    codes, _ = _quantise_block(h)
    codes_ref[pl.ds(r, 1), pl.ds(c0, FP8_BLOCK)] = codes
    amax_ref[pl.ds(r, 1), pl.ds(j, 1)] = jnp.max(jnp.abs(h.astype(jnp.float32)), axis=1, keepdims=True)


def _swiglu_quantised(y: Array, row_weight: Array, *, m: int, n: int, split: int, limit: float, dt,
                      interpret: bool) -> ActQuant:
    """The SwiGLU of a split kernel's partial sums y [split M, 2 N], quantised as the next GEMM's
    input (``ActQuant.of``): one launch instead of XLA's two (the sums and SwiGLU; the quantisation)."""
    kernel = functools.partial(_swiglu_quantise_kernel, m=m, n=n, split=split, limit=limit, dt=dt)
    with backend.quiet_triton_deprecation():
        codes, amax = pl.pallas_call(
            kernel, grid=(m, n // FP8_BLOCK),
            out_shape=(jax.ShapeDtypeStruct((m, n), jnp.float8_e4m3fn),
                       jax.ShapeDtypeStruct((m, n // FP8_BLOCK), jnp.float32)),
            compiler_params=backend.compiler_params(1, 1), interpret=interpret, name="swiglu_quantise",
        )(y, row_weight.astype(jnp.float32))
    return ActQuant(codes, amax, dt)


@functools.partial(jax.jit, static_argnames=("block_m", "cfg", "limit", "out_dtype", "quantised_out", "interpret"))
def _pallas(x, ws, row_weight, tile_group, num_tiles, *, block_m: int, cfg: GemmConfig, limit, out_dtype,
            interpret: bool, quantised_out: bool = False, extra: tuple[Weights, ...] | None = None):
    fmt = ws[0].fmt
    groups, n, k = ws[0].shape
    code_dots, quantise = isinstance(x, (ActQuant, QuantRows)), isinstance(x, QuantRows)
    cfg = cfg.fit(n, k, fmt, code_dots)
    extra_fmt = None if extra is None else extra[0].fmt
    if extra_fmt is not None:  # (tiles legal for both formats)
        cfg = cfg.fit(n, k, extra_fmt, code_dots)
    m, split = x.shape[0], cfg.split_k
    dt = jnp.dtype(x.dtype)
    route = tile_group if isinstance(tile_group, Route) else None
    if route is not None and extra is not None:
        raise ValueError("extra weights need the tiles' groups given, not a Route")
    args = [tile_group] if route is None else [route.logits, route.sel]
    args += [num_tiles, *_x_operands(x, fmt)]
    for w in ws + (extra or ()):
        args += flat_operands(w)
    if limit is not None and split == 1 and route is None:
        args.append(row_weight.astype(jnp.float32))
    kernel = functools.partial(_kernel, fmt=fmt, n=n, k=k, m=m, bm=block_m, cfg=cfg, n_weights=len(ws), limit=limit,
                               code_dots=code_dots, quantise=quantise, dt=dt,
                               route=None if route is None else route.constants(), extra_fmt=extra_fmt, groups=groups)
    grid = (tile_group.shape[0], n // cfg.block_n) + ((split,) if split > 1 else ())
    out_shape = (jax.ShapeDtypeStruct((m, n), out_dtype) if split == 1
                 else jax.ShapeDtypeStruct((split * m, len(ws) * n), jnp.float32))
    if route is not None:  # (the decided experts and row weights)
        out_shape = (out_shape, jax.ShapeDtypeStruct(route.shape, jnp.int32), jax.ShapeDtypeStruct((m,), jnp.float32))
    with backend.quiet_triton_deprecation():
        y = pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=out_shape,
            compiler_params=backend.compiler_params(cfg.num_warps, cfg.num_stages),
            interpret=interpret,
            name=f"grouped_matmul_{fmt}" + ("_a8q" if quantise else "_a8" if code_dots else "")
                 + ("_swiglu" if limit is not None else "")
                 + (f"_split{split}" if split > 1 else "") + ("_routed" if route is not None else "")
                 + (f"_and_{extra_fmt}" if extra_fmt else ""),
        )(*args)
    if route is not None:
        y, group, row_weight = y
        return _finish(y, row_weight, m=m, n=n, split=split, n_weights=len(ws), limit=limit, dt=dt,
                       out_dtype=out_dtype, quantised_out=quantised_out, interpret=interpret), group
    return _finish(y, row_weight, m=m, n=n, split=split, n_weights=len(ws), limit=limit, dt=dt, out_dtype=out_dtype,
                   quantised_out=quantised_out, interpret=interpret)


def _finish(y, row_weight, *, m: int, n: int, split: int, n_weights: int, limit, dt, out_dtype, quantised_out,
            interpret: bool):
    """The kernel's output ``y`` as the call's result: a split's partial sums added (and activated,
    and quantised, as ``quantised_out`` says)."""
    if quantised_out and split > 1 and n % FP8_BLOCK == 0:
        return _swiglu_quantised(y, row_weight, m=m, n=n, split=split, limit=limit, dt=jnp.dtype(out_dtype),
                                 interpret=interpret)
    if split == 1:
        return QuantRows(y) if quantised_out == "rows" else ActQuant.of(y) if quantised_out else y
    parts = jnp.sum(y.reshape(split, m, n_weights, n), axis=0)  # fp32 [m, weights, n]
    if limit is None:
        return parts[:, 0].astype(out_dtype)
    h = _swiglu_rows(parts[:, 0], parts[:, 1], row_weight.astype(jnp.float32), limit, dt).astype(out_dtype)
    return ActQuant.of(h) if quantised_out else h


def _check_kernel_shapes(x: Array, ws: list[Weights], block_m: int) -> None:
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"the kernel needs block_m to be a power of two >= 16, got {block_m}")
    if any(w.fmt != ws[0].fmt or w.shape != ws[0].shape for w in ws):
        raise ValueError("fused weights must share their format and shape")


def kernel(x: Float[Array, "m k"] | ActQuant | QuantRows, w: Weights, tile_group: Int[Array, " t"],
           num_tiles: Int[Array, " 1"], *, block_m: int, out_dtype=None, config: GemmConfig | None = None,
           interpret: bool | None = None, codes: bool | None = None, extra: Weights | None = None
           ) -> Float[Array, "m n"]:
    """The Pallas kernel (same contract as ``reference``). ``codes``: see ``_kernel_rows``.
    ``extra``: the programs of tiles of group G take these weights instead, in the same launch."""
    check_inputs(x, w, tile_group, block_m)
    check_extra(w, extra)
    _check_kernel_shapes(x, [w], block_m)
    x = _kernel_rows(x, w, block_m, codes)
    cfg = config or default_config(block_m, w.fmt, n=w.shape[1], k=w.shape[2], tiles=tile_group.shape[0])
    return _pallas(x, (w,), None, tile_group, num_tiles, block_m=block_m, cfg=cfg, limit=None,
                   out_dtype=jnp.dtype(out_dtype or x.dtype), interpret=backend.interpret_mode(interpret),
                   extra=None if extra is None else (extra,))



def swiglu_kernel(x: Float[Array, "m k"] | ActQuant | QuantRows, w1: Weights, w3: Weights,
                  row_weight: Float[Array, " m"], tile_group: Int[Array, " t"], num_tiles: Int[Array, " 1"], *,
                  block_m: int, limit: float, config: GemmConfig | None = None, interpret: bool | None = None,
                  codes: bool | None = None, quantised_out: bool = False,
                  extra: tuple[Weights, Weights] | None = None) -> Float[Array, "m n"] | ActQuant | QuantRows:
    """The fused Pallas kernel (same contract as ``swiglu_reference``). ``codes``: see ``_kernel_rows``.
    ``quantised_out``: the result quantised as the next GEMM's input (``ActQuant.of``; after a K
    split, with the partial sums' SwiGLU in one launch: ``_swiglu_quantised``; a decode step's
    SwiGLU unsplit by ``ONE_TOKEN_SWIGLU_BLOCK_N``: ``QuantRows`` for that GEMM to quantise).
    ``tile_group`` a ``Route`` (pair tiles; ``row_weight`` unused): each program decides its tile's
    expert and routing weight, and the result comes with the tiles' experts [t] for w2.
    ``extra`` = (W1', W3'): the programs of tiles of group G take these instead, in the same launch."""
    check_inputs(x, w1, tile_group, block_m)
    _check_kernel_shapes(x, [w1, w3], block_m)
    if extra is not None:
        for w, e in zip((w1, w3), extra):
            check_extra(w, e)
        _check_kernel_shapes(x, list(extra), block_m)
    x = _kernel_rows(x, w1, block_m, codes)
    cfg = config or default_config(block_m, w1.fmt, n=w1.shape[1], k=w1.shape[2], tiles=tile_group.shape[0],
                                   weights=2)
    if config is None and quantised_out and ONE_TOKEN_SWIGLU_BLOCK_N and w1.fmt == "fp8_k128" and cfg.split_k > 1:
        # a decode step's SwiGLU unsplit, its rows quantised by the next GEMM's programs
        cfg, quantised_out = dataclasses.replace(cfg, block_n=ONE_TOKEN_SWIGLU_BLOCK_N, split_k=1), "rows"
    return _pallas(x, (w1, w3), row_weight, tile_group, num_tiles, block_m=block_m, cfg=cfg, limit=float(limit),
                   out_dtype=x.dtype, quantised_out=quantised_out, interpret=backend.interpret_mode(interpret),
                   extra=None if extra is None else tuple(extra))


def grouped_matmul(x, w: Weights, tile_group, num_tiles, *, block_m: int, out_dtype=None, impl: str | None = None,
                   extra: Weights | None = None, **kernel_options):
    """Grouped matmul through the backend switch: the Pallas kernel or the XLA reference."""
    if backend.resolve(impl) == "xla":
        return reference(x, w, tile_group, num_tiles, block_m=block_m, out_dtype=out_dtype, extra=extra)
    return kernel(x, w, tile_group, num_tiles, block_m=block_m, out_dtype=out_dtype, extra=extra, **kernel_options)


def grouped_swiglu(x, w1: Weights, w3: Weights, row_weight, tile_group, num_tiles, *, block_m: int, limit: float,
                   impl: str | None = None, quantised_out: bool = False, extra: tuple[Weights, Weights] | None = None,
                   **kernel_options):
    """Fused SwiGLU half of the experts through the backend switch (``quantised_out``: its result
    quantised as the next GEMM's input, ``ActQuant``)."""
    if backend.resolve(impl) == "xla":
        if isinstance(tile_group, Route):
            raise ValueError("a Route is decided inside the Pallas kernel only; decide it first on the XLA path")
        h = swiglu_reference(x, w1, w3, row_weight, tile_group, num_tiles, block_m=block_m, limit=limit, extra=extra)
        return ActQuant.of(h) if quantised_out else h
    return swiglu_kernel(x, w1, w3, row_weight, tile_group, num_tiles, block_m=block_m, limit=limit,
                         quantised_out=quantised_out, extra=extra, **kernel_options)


def block_m_for(rows: int, groups: int = 1) -> int:
    """Row tile for ``rows`` rows (rows of a plain matmul, or the (token, expert) pairs of a routed
    layer over ``groups`` experts): 16 for decode / verify, where every tile streams its group's
    weights, larger for prefill. Experts: each of an expert's tiles reads its weights and a tile's
    rows cost compute whether used or not, so the tile follows the rows per expert: 16 up to 16,
    32 up to 32, then the plain rule (Flash routed experts, FP8, on an H200: 16-row tiles fastest at
    1.5-9 pairs per expert, 21-45 % faster than 32 / 64; 32 at 18-24; 64 at 48; docs/benchmarks.md)."""
    plain = 16 if rows <= 256 else 32 if rows <= 2048 else 64
    if groups > 1:
        per = rows / groups
        return min(plain, 16 if per <= 16 else 32 if per <= 32 else 64)
    return plain


# The largest row tiles ``plain_linear_tiles`` picks at decode / verify sizes, for quantised rows
# (multiplied as fp8 codes) and for unquantised rows (bf16 values), the programs (row tiles x
# 128-column blocks) a larger tile must leave, and the most rows it treats so (above: prefill
# tiles). Read at the call (``benchmarks/decode.py`` sets them).
LINEAR_CODES_MAX_BLOCK_M = 32
VALUES_MAX_BLOCK_M = 64
LINEAR_MIN_PROGRAMS = 128
LINEAR_VERIFY_MAX_ROWS = 1024


def plain_linear_tiles(rows: int, quantised: bool, n: int, groups: int = 1) -> tuple[int, bool | None]:
    """(row tile, codes) of a plain (or per-group) FP8 linear of ``rows`` rows and ``n`` outputs per
    group: ``quantised`` rows (the reference's FP8 GEMM input, multiplied as fp8 codes) or
    unquantised ones (``wo_a``: the reference multiplies bf16 rows by the dequantised weight).

    Every row tile reads the whole weight, so fewer, larger tiles read less; but a linear with few
    outputs then runs too few programs to keep the GPU busy. At decode / verify sizes (up to
    ``LINEAR_VERIFY_MAX_ROWS`` rows: a verify of 170 slots x 6 tokens) the tile is the largest
    power of two from 16 up to ``LINEAR_CODES_MAX_BLOCK_M`` (codes) or ``VALUES_MAX_BLOCK_M``
    (values), and up to the rows, that leaves at least
    ``LINEAR_MIN_PROGRAMS`` (row tiles x groups x 128-column blocks; an H200 has 132 SMs). On an
    H200 (Flash linears at 32, 192 and 384 rows, ``benchmarks/linear_tiles.py``,
    docs/benchmarks.md) it picks the fastest of the measured tiles in all 20 cases, e.g. wq_b at
    192 rows 67.9 -> 47.7 us, wo_a 133.5 -> 80.3 us; wq_a (1024 outputs) and every linear at 32 rows
    but wq_b keep 16; codes in 64-row tiles were slower than in 32 everywhere. At 384 and 768 rows
    codes in 32-row tiles beat every tile of bf16 values by 1.3-1.9x (wq_b 88.8 against 118-157 us
    at 384 rows), which ``block_m_for``'s tiles took above 256 rows before: the batch-64 Flash
    round got 9 % faster (157.3 -> 142.5 ms, 43 layers). Prefill sizes keep ``block_m_for`` and
    the kernel's own codes rule (``codes`` None)."""
    if rows > LINEAR_VERIFY_MAX_ROWS:
        return block_m_for(rows), None
    cap = min(LINEAR_CODES_MAX_BLOCK_M if quantised else VALUES_MAX_BLOCK_M, 1 << max(rows - 1, 0).bit_length())
    bm = 16
    while bm * 2 <= cap and -(-rows // (bm * 2)) * groups * -(-n // 128) >= LINEAR_MIN_PROGRAMS:
        bm *= 2
    return bm, (True if quantised else None)


def quantised_rows(x: Float[Array, "m k"], block_m: int) -> ActQuant | QuantRows:
    """Padded rows quantised as the reference's FP8 GEMM input: by the kernel itself
    (``QuantRows``) when they are one row tile, as at a decode step (on an H200: device time
    unchanged, 20 fewer launches per 4-layer Flash step), else by XLA first (``ActQuant.of``; with
    every row tile's programs quantising their rows, batch-32 DSpark rounds took 3-4 % longer, in
    runs on another machine: not separated from the machines' spread, so not adopted there)."""
    return QuantRows(x) if x.shape[0] <= block_m else ActQuant.of(x)


def _with_codes(kernel_options: dict, codes: bool | None, impl: str | None) -> dict:
    """The kernel options with ``plain_linear_tiles``'s codes choice (the XLA path takes none)."""
    if codes is None or backend.resolve(impl) == "xla":
        return kernel_options
    return {"codes": codes, **kernel_options}


def batched_matmul(x: Float[Array, "g m k"], w: Weights, *, act_quant: bool = False, out_dtype=None,
                   impl: str | None = None, one_row_gemv: bool = True, **kernel_options) -> Float[Array, "g m n"]:
    """``x[g] @ W[g]^T`` for every group (one group: a plain matmul). One row per group against
    FP8 weights, or bf16 ones without ``act_quant`` (a batch-1 decode step; unless
    ``one_row_gemv`` is False or grouped-matmul ``kernel_options`` are given): ``gemv``'s
    multiply-adds. Otherwise the grouped matmul:
    rows padded to the row tile (``plain_linear_tiles``), every tile in use. ``act_quant``: the
    rows quantised as the reference's FP8 GEMM input (``quantised_rows``)."""
    from pallas_kernels import gemv  # (it imports this module)

    g, m, k = x.shape
    if one_row_gemv and gemv.takes(m, w, impl, act_quant) and not kernel_options:
        rows = x.reshape(g, k)
        groups = np.arange(g, dtype=np.int32)  # (a constant of the program: no iota launch)
        y = gemv.gemv(QuantRows(rows) if act_quant else rows, w, groups, out_dtype=out_dtype)
        return y.reshape(g, 1, -1)
    bm, codes = plain_linear_tiles(m, act_quant, w.shape[1], g)
    mp = -(-m // bm) * bm
    xp = jnp.pad(x, ((0, 0), (0, mp - m), (0, 0))).reshape(g * mp, k)
    xp = quantised_rows(xp, bm) if act_quant else xp
    tile_group, num_tiles = dense_tiles(mp, g, bm)
    kernel_options = _with_codes(kernel_options, codes, impl)
    y = grouped_matmul(xp, w, tile_group, num_tiles, block_m=bm, out_dtype=out_dtype, impl=impl, **kernel_options)
    return y.reshape(g, mp, -1)[:, :m]


def batched_swiglu(x: Float[Array, "m k"], w1: Weights, w3: Weights, *, limit: float, act_quant: bool = False,
                   impl: str | None = None, one_row_gemv: bool = True, **kernel_options) -> Float[Array, "m n"]:
    """``swiglu(x W1^T, x W3^T)`` of one group of weights (a shared expert's first half) through
    the fused kernel (one row: ``gemv_swiglu`` where ``batched_matmul`` takes ``gemv``):
    rows padded to the row tile (and quantised if ``act_quant``, as in ``batched_matmul``), routing
    weight 1, result in x's dtype."""
    from pallas_kernels import gemv  # (it imports this module)

    m, _ = x.shape
    if one_row_gemv and gemv.takes(m, w1, impl, act_quant) and not kernel_options:
        return gemv.gemv_swiglu(QuantRows(x) if act_quant else x, w1, w3, gemv.ONE_GROUP, limit=limit)
    bm, codes = plain_linear_tiles(m, act_quant, w1.shape[1])
    mp = -(-m // bm) * bm
    tile_group, num_tiles = dense_tiles(mp, 1, bm)
    ones = jnp.ones((mp,), jnp.float32)
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    xp = quantised_rows(xp, bm) if act_quant else xp
    kernel_options = _with_codes(kernel_options, codes, impl)
    return grouped_swiglu(xp, w1, w3, ones, tile_group, num_tiles, block_m=bm,
                          limit=limit, impl=impl, **kernel_options)[:m]

