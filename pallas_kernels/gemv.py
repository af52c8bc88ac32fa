"""One row per weight group times FP8 or bf16 weights, as float32 multiply-adds (a matrix-vector
product).

At a batch-1 decode step each FP8 linear multiplies one row by its weight. The grouped-matmul
kernel does that with tensor-core dots on a 16-row tile (the row padded by XLA first, 15 rows of
zeros multiplied), at 2.0-2.8 TB/s on an H200 for the largest Flash linears. Here each program
holds a ``[block_n, 128]`` float32 tile of running products for its ``block_n`` output columns:
every loop step loads the weights' next 128-input blocks, converts them in registers and adds
``w * x`` into the tile; the tile is summed over its 128 lanes once, at the end.

Numerics are the grouped-matmul kernel's (``grouped_matmul.reference``): quantised rows
(``QuantRows``, the reference's FP8 GEMM input) are quantised per 128-input block in registers and
each product ``w * (code * row scale * weight scale)`` is exact in float32 (an e4m3 value times an
e4m3 value times powers of two); unquantised bf16 rows times e4m3 weights times a power of two
are exact too. bf16 weights (format ``dense``: the compressors' and the router's, which the
reference applies in float32, ``model.common.matmul_f32``) take bf16 rows as they are (each
product exact) and float32 rows as three bf16 parts (``bf16_parts``: three exact products per
weight). Only the order of the float32 sums differs from a dot's.

Operands: rows ``x [R, K]`` (row r multiplies weight group ``group[r]``) and weights ``Weights``
of format ``fp8`` (128 x 128 block scales: one scale per block and program) or ``dense`` (bf16).
Several weights of one K (``gemv_many``: each program's tile in one weight's columns, one output
each, the rows quantised for some weights and not for others), or w1 and w3 of a shared expert
(``gemv_swiglu``: both in every program, one SwiGLU output). Not for the routed experts
(``fp8_k128``: a scale per output column and 128 inputs): with those scales applied per step the
routed SwiGLU at one token took 104 us against the grouped matmul's 30 us on an H200
(docs/benchmarks.md). K may be split over programs (``GemvConfig.split_k``): their float32
partial sums are added after the kernel (XLA).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels import backend
from pallas_kernels.grouped_matmul import (FP8_BLOCK, QuantRows, Weights, _quantise_block,
                                           _scale_f32, _swiglu_rows, split_for, swiglu)

FORMATS = ("fp8", "dense")  # dense: bf16 values, no scales


# The group index of one row against one weight (a constant of the program: no launch makes it)
ONE_GROUP = np.zeros((1,), np.int32)


# Automatic tiles (``GemvConfig.fit``): programs to reach (rows x column tiles x splits) and the
# largest split.
SPLIT_TARGET_PROGRAMS = 512
MAX_AUTO_SPLIT = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Partials:
    """A product left as the float32 partial sums of its K split, ``parts [S, ..., N]``: the
    product is their sum (``total``). For a consumer kernel that adds them as it loads them (the
    q / kv norms, ``rms_norms``) instead of an XLA launch adding them first."""

    parts: Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The product's shape (the parts' without the split)."""
        return tuple(self.parts.shape[1:])

    def total(self, dtype=jnp.float32) -> Array:
        return jnp.sum(self.parts, axis=0).astype(dtype)

    def reshape(self, *shape: int) -> "Partials":
        return Partials(self.parts.reshape(self.parts.shape[0], *shape))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SwiGLUPartials:
    """Rows given as the SwiGLU of two products' partial sums (a shared expert's w1 and w3 at one
    row, ``model.moe.SharedExpert.down``): ``swiglu(gate.total(dtype), up.total(dtype), limit)``
    rounded to dtype (the rows' dtype, their consumer's). For ``gemv``, whose programs add both
    products' parts in order as they load their inputs and apply the SwiGLU there, instead of an
    XLA launch making the rows first."""

    gate: Partials
    up: Partials
    limit: float = dataclasses.field(metadata=dict(static=True), default=0.0)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.gate.shape

    def total(self, dtype) -> Array:
        return swiglu(self.gate.total(dtype), self.up.total(dtype), self.limit).astype(dtype)

    def reshape(self, *shape: int) -> "SwiGLUPartials":
        return SwiGLUPartials(self.gate.reshape(*shape), self.up.reshape(*shape), self.limit)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertRows:
    """A MoE layer's output left as its terms, for a consumer kernel that adds them as it loads them
    (mHC's expansion, ``pallas_kernels.hc_fused``) instead of an XLA launch adding them first.
    Token t's output is ``sum_j rows[(t k + j) stride]`` over its k routed experts (the w2 kernel's
    rows in the activations' ``dtype``, one pair per tile of ``stride`` rows:
    ``group_metadata.pair_tiles``), added in order in float32, plus ``extra`` (the shared expert's
    w2 as its ``Partials``, their sum rounded to ``dtype``, or an array; None where the shared
    expert's output is the last of the k rows), the whole rounded to ``dtype``: the roundings of
    ``model.moe.MoE``'s sum. ``shape``: the output's [..., d]."""

    rows: Array
    extra: Partials | Array | None
    k: int = dataclasses.field(metadata=dict(static=True), default=1)
    stride: int = dataclasses.field(metadata=dict(static=True), default=1)
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True), default=())

    @property
    def dtype(self):
        return self.rows.dtype

    def routed(self) -> Float[Array, "t k d"]:
        """Each token's k rows as float32 [T, k, d]."""
        d = self.rows.shape[-1]
        return self.rows.reshape(-1, self.stride, d)[:, 0].astype(jnp.float32).reshape(-1, self.k, d)

    def total(self, dtype=None) -> Array:
        rows = self.routed()
        acc = rows[:, 0]
        for j in range(1, self.k):  # in order, as the consumer kernels add them
            acc = acc + rows[:, j]
        if self.extra is not None:
            acc = acc + total(self.extra, self.dtype).reshape(acc.shape).astype(jnp.float32)
        return acc.astype(self.dtype).astype(dtype or self.dtype).reshape(self.shape)

    def reshape(self, *shape: int) -> "ExpertRows":
        return dataclasses.replace(self, shape=tuple(shape))


def total(y: Array | Partials | ExpertRows | SwiGLUPartials, dtype=None) -> Array:
    """``y`` as one array (the sum of a ``Partials``' parts or of ``ExpertRows``' terms, the SwiGLU
    of ``SwiGLUPartials``), in ``dtype`` (default: float32 for partials, y's own for an array or
    expert rows; SwiGLU partials need one)."""
    if isinstance(y, SwiGLUPartials):
        if dtype is None:
            raise ValueError("the SwiGLU of partial sums is rounded to a dtype: pass one")
        return y.total(dtype)
    if isinstance(y, Partials):
        return y.total(dtype or jnp.float32)
    if isinstance(y, ExpertRows):
        return y.total(dtype)
    return y if dtype is None else y.astype(dtype)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """``block_n`` output columns per program (a power of two, at most 128: the weights' scale
    blocks), ``block_k`` inputs per loop step (a power of two, at least 128), ``split_k`` programs
    per output tile (a power of two; 0: automatic, see ``fit``)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            if not backend.is_power_of_2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        if self.block_k < FP8_BLOCK:
            raise ValueError(f"block_k must be at least {FP8_BLOCK} (one scale block), got {self.block_k}")
        if self.split_k and not backend.is_power_of_2(self.split_k):
            raise ValueError(f"split_k must be 0 or a power of two, got {self.split_k}")

    def fit(self, rows: int, ns: tuple[int, ...], k: int) -> "GemvConfig":
        """Tiles that divide every weight's N (``ns``: the output columns one program's tiles
        range over, e.g. two weights' outputs side by side) and K. Automatic split: K is split
        (up to ``MAX_AUTO_SPLIT``) until the kernel runs ``SPLIT_TARGET_PROGRAMS`` programs, then
        the column tile halves (down to 16) until it does. The partial sums' addition fuses into
        the consumer (a norm after wq_a / wkv), where 16 partials of a 1024-wide row cost 3-5 us on
        an H200 against 1.3 for 8."""
        bn = min(backend.largest_pow2_divisor(n, min(self.block_n, FP8_BLOCK)) for n in ns)
        bk = FP8_BLOCK * backend.largest_pow2_divisor(k // FP8_BLOCK, self.block_k // FP8_BLOCK)
        steps = k // bk
        if self.split_k:
            return dataclasses.replace(self, block_n=bn, block_k=bk,
                                       split_k=backend.largest_pow2_divisor(steps, self.split_k))
        tiles = lambda bn: rows * sum(n // bn for n in ns)  # noqa: E731
        split = min(split_for(tiles(bn), steps, target=SPLIT_TARGET_PROGRAMS, min_steps=1), MAX_AUTO_SPLIT)
        while tiles(bn) * split < SPLIT_TARGET_PROGRAMS and bn > 16:
            bn //= 2
        return dataclasses.replace(self, block_n=bn, block_k=bk, split_k=split)


def default_config(swiglu: bool = False) -> GemvConfig:
    """64 columns x 256 inputs per step on 4 warps, automatic split; the fused SwiGLU's two tiles
    of products 128 columns on 8 warps, K in 16 (Flash's shared expert: 256 programs of one step).
    On an H200 (``benchmarks/gemv.py --sweep``, docs/benchmarks.md) within 0.7 us of the best of
    37 tilings for each of the four Flash linears swept (wq_b, wo_b, the shared SwiGLU, the
    indexer's wq_b) at one row."""
    return GemvConfig(block_n=128, split_k=16, num_warps=8) if swiglu else GemvConfig()


def takes(rows_per_group: int, w: Weights, impl: str | None, quantise: bool = False) -> bool:
    """Whether a linear of ``rows_per_group`` rows per weight group runs here: one row against
    ``fp8`` weights, or bf16 ``dense`` ones with unquantised rows (K a multiple of 128, N of 16),
    on the Pallas backend."""
    _, n, k = w.shape
    fmt_ok = w.fmt == "fp8" or (w.fmt == "dense" and not quantise and w.values.dtype == jnp.bfloat16)
    return (rows_per_group == 1 and fmt_ok and k % FP8_BLOCK == 0 and n % 16 == 0
            and backend.resolve(impl) == "pallas")


def check_inputs(x: Array | QuantRows, ws: tuple[Weights, ...], group: Array, same_n: bool,
                 quantise: tuple[bool, ...]) -> None:
    rows = x.rows if isinstance(x, QuantRows) else x
    if rows.ndim != 2 or jnp.dtype(rows.dtype) not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"gemv rows must be bf16 / fp32 [R, K], got {rows.dtype} {rows.shape}")
    if len(quantise) != len(ws):
        raise ValueError(f"gemv needs one quantise flag per weight ({len(ws)}), got {quantise}")
    g, _, k = ws[0].shape
    for w, q in zip(ws, quantise):
        if w.fmt not in FORMATS:
            raise ValueError(f"gemv takes weights of format {FORMATS}, got {w.fmt!r}")
        if w.fmt == "dense" and (q or w.values.dtype != jnp.bfloat16):
            raise ValueError(f"gemv takes dense weights in bf16 with unquantised rows, got {w.values.dtype}"
                             f"{' and quantised rows' if q else ''}")
        if (w.shape if same_n else (w.shape[0], w.shape[2])) != (ws[0].shape if same_n else (g, k)):
            raise ValueError(f"gemv weights must share their groups and K{' and N' if same_n else ''}, got "
                             f"{[w.shape for w in ws]}")
        if k != rows.shape[1] or k % FP8_BLOCK or w.shape[1] % 16:
            raise ValueError(f"gemv needs rows [R, {k}] with K a multiple of {FP8_BLOCK} and N a multiple of 16; "
                             f"got rows {rows.shape}, weights N = {w.shape[1]}, K = {k}")
    if group.shape != (rows.shape[0],) or not jnp.issubdtype(group.dtype, jnp.integer):
        raise ValueError(f"gemv group must be an int vector of one entry per row ({rows.shape[0]}), got "
                         f"{group.dtype} {group.shape}")


def _row_views(xb: Array, quantised: bool, parts: bool) -> dict:
    """One 128-input block of the row [1, 128] as the weights take it (float32 values): "plain"
    (as it is), "quantised" (the reference's FP8 GEMM input: an e4m3 value times a power of two)
    and, for float32 rows times bf16 weights, "parts" (three bf16 numbers adding up to it)."""
    from dspark_jax.model.common import bf16_parts

    views = {"plain": xb.astype(jnp.float32)}
    if quantised:
        codes, sx = _quantise_block(xb)
        views["quantised"] = codes.astype(jnp.float32) * sx
    if parts:
        views["parts"] = [p.astype(jnp.float32) for p in bf16_parts(views["plain"])]
    return views


def _products(x_ref, w_sets, fmts, quantise, ns, r, g, n0, k_base, steps: int, bk: int, bn: int,
              x_parts: int = 0, x_dtype=None, up_ref=None, limit: float = 0.0) -> list[Array]:
    """float32 [1, bn] products of row r with output columns n0 .. n0 + bn of each weight set
    (format ``fmts[i]``, the row quantised iff ``quantise[i]``, group g, N ``ns[i]``) over inputs
    k_base .. k_base + steps * bk. ``x_parts``: the rows come as that many partial sums [S R, K]
    (float32), added in order and rounded to ``x_dtype`` (their producer's output); with ``up_ref``
    (``SwiGLUPartials``) x_ref's are the gate's, up_ref's the up product's, the rows their SwiGLU
    with ``limit``, rounded to ``x_dtype``."""
    rows = x_ref.shape[0] // max(x_parts, 1)
    dt = x_dtype if x_parts else x_ref.dtype
    parts = dt == jnp.float32 and "dense" in fmts  # bf16 rows times bf16 weights: exact already

    def summed(ref, kb):
        xb = ref[pl.ds(r, 1), pl.ds(kb, FP8_BLOCK)]
        for s in range(1, x_parts):
            xb = xb + ref[pl.ds(s * rows + r, 1), pl.ds(kb, FP8_BLOCK)]
        return xb.astype(dt) if x_parts else xb

    def row_block(kb):
        if up_ref is None:
            return summed(x_ref, kb)
        return _swiglu_rows(summed(x_ref, kb), summed(up_ref, kb), jnp.ones((1,), jnp.float32), limit, dt).astype(dt)

    def body(step, accs):
        accs = list(accs)
        for c in range(0, bk, FP8_BLOCK):
            kb = k_base + step * bk + c
            views = _row_views(row_block(kb), any(quantise), parts)
            for i, ((w_ref, s_ref), fmt, q, n) in enumerate(zip(w_sets, fmts, quantise, ns)):
                w = w_ref[pl.ds(g * n + n0, bn), pl.ds(kb, FP8_BLOCK)].astype(jnp.float32)
                if fmt == "fp8":
                    xs = views["quantised" if q else "plain"]
                    blocks = -(-n // FP8_BLOCK)
                    accs[i] = accs[i] + w * (xs * _scale_f32(s_ref[g * blocks + n0 // FP8_BLOCK, kb // FP8_BLOCK]))
                elif parts:  # exact products of each part, hi first
                    for xp in views["parts"]:
                        accs[i] = accs[i] + w * xp
                else:
                    accs[i] = accs[i] + w * views["plain"]
        return tuple(accs)

    zero = jnp.zeros((bn, FP8_BLOCK), jnp.float32)
    accs = lax.fori_loop(0, steps, body, (zero,) * len(w_sets))
    return [jnp.sum(a, axis=1)[None, :] for a in accs]  # summed over the 128 lanes once


def _kernel(group_ref, x_ref, *refs, rows: int, ns: tuple[int, ...], fmts: tuple[str, ...],
            quantise: tuple[bool, ...], cfg: GemvConfig, limit: float | None, dt, x_parts: int = 0,
            x_limit: float | None = None):
    up = {}
    if x_limit is not None:  # rows as ``SwiGLUPartials``: the up product's parts next
        up, refs = dict(up_ref=refs[0], limit=x_limit), refs[1:]
    w_sets = []
    for fmt in fmts:  # fp8: values and scales; dense: values
        w_sets.append((refs[0], refs[1]) if fmt == "fp8" else (refs[0], None))
        refs = refs[2 if fmt == "fp8" else 1:]
    o_refs = refs
    r, j = pl.program_id(0), pl.program_id(1)
    s_id = pl.program_id(2) if cfg.split_k > 1 else 0  # (read here: interpret mode has none in branches)
    bn, bk, split = cfg.block_n, cfg.block_k, cfg.split_k
    g = group_ref[r]
    steps = x_ref.shape[1] // bk // split
    k_base = s_id * steps * bk
    out_row = r if split == 1 else s_id * rows + r  # split: float32 partial sums, split s at rows s * R..

    if limit is not None:  # the SwiGLU: both weights' columns n0.. in one program
        n0 = j * bn
        gate, up_y = _products(x_ref, w_sets, fmts, quantise, ns * 2, r, g, n0, k_base, steps, bk, bn, x_parts, dt,
                               **up)
        if split == 1:
            y = _swiglu_rows(gate, up_y, jnp.ones((1,), jnp.float32), limit, dt)
            o_refs[0][pl.ds(r, 1), pl.ds(n0, bn)] = y.astype(o_refs[0].dtype)
        else:  # gate at columns 0.., up at N..
            for i, part in enumerate((gate, up_y)):
                o_refs[0][pl.ds(out_row, 1), pl.ds(i * ns[0] + n0, bn)] = part
        return

    start = 0  # one output per weight: program j's tile among the weights' columns side by side
    for i, n in enumerate(ns):
        @pl.when((j >= start // bn) & (j < (start + n) // bn))
        def _one(i=i, n=n, start=start):
            n0 = j * bn - start
            (y,) = _products(x_ref, [w_sets[i]], fmts[i:i + 1], quantise[i:i + 1], (n,), r, g, n0, k_base, steps,
                             bk, bn, x_parts, dt, **up)
            o_refs[i][pl.ds(out_row, 1), pl.ds(n0, bn)] = y.astype(o_refs[i].dtype)
        start += n


def _name(fmts: tuple[str, ...], quantise: tuple[bool, ...], swiglu: bool, split: int) -> str:
    kinds = "_".join(dict.fromkeys("bf16" if f == "dense" else f for f in fmts))  # e.g. fp8, bf16, fp8_bf16
    return ("gemv_" + kinds + ("_q" if any(quantise) else "") + ("_swiglu" if swiglu else "")
            + (f"_x{len(fmts)}" if not swiglu and len(fmts) > 1 else "") + (f"_split{split}" if split > 1 else ""))


@functools.partial(jax.jit, static_argnames=("quantise", "cfg", "limit", "out_dtype", "partials", "rows_dtype",
                                             "interpret"))
def _pallas(rows_in, ws, group, *, quantise: tuple[bool, ...], cfg: GemvConfig, limit, out_dtype,
            partials: tuple[bool, ...] = (), rows_dtype=None, interpret: bool) -> tuple[Array | Partials, ...]:
    """``rows_in``: rows [R, K], or (``Partials``) their producer's partial sums, rounded to
    ``rows_dtype`` once added (in the kernel), or (``SwiGLUPartials``) the SwiGLU of two such.
    ``out_dtype``: one dtype, or (without ``limit``) one per weight."""
    swiglu_in = rows_in if isinstance(rows_in, SwiGLUPartials) else None
    if swiglu_in is not None:
        rows_in = swiglu_in.gate
    flat = lambda p: p.parts.reshape(-1, p.parts.shape[-1]).astype(jnp.float32)  # noqa: E731
    x_parts = rows_in.parts.shape[0] if isinstance(rows_in, Partials) else 0
    x = flat(rows_in) if x_parts else rows_in
    k, r = ws[0].shape[2], x.shape[0] // max(x_parts, 1)
    ns = (ws[0].shape[1],) if limit is not None else tuple(w.shape[1] for w in ws)
    fmts = tuple(w.fmt for w in ws)
    cfg = cfg.fit(r, ns, k)
    split, dt = cfg.split_k, jnp.dtype(rows_dtype if x_parts else x.dtype)
    args = [group.astype(jnp.int32), x] + ([flat(swiglu_in.up)] if swiglu_in is not None else [])
    for w in ws:
        args += [w.values.reshape(-1, k)] + ([w.scales.reshape(-1, w.scales.shape[-1])] if w.fmt == "fp8" else [])
    kernel = functools.partial(_kernel, rows=r, ns=ns, fmts=fmts, quantise=quantise, cfg=cfg, limit=limit, dt=dt,
                               x_parts=x_parts, x_limit=None if swiglu_in is None else swiglu_in.limit)
    grid = (r, sum(ns) // cfg.block_n) + ((split,) if split > 1 else ())
    if limit is not None:
        out_shape = [jax.ShapeDtypeStruct((r, ns[0]), out_dtype) if split == 1
                     else jax.ShapeDtypeStruct((split * r, 2 * ns[0]), jnp.float32)]
    else:
        keep = partials or (False,) * len(ns)
        dts = out_dtype if isinstance(out_dtype, tuple) else (out_dtype,) * len(ns)
        out_shape = [jax.ShapeDtypeStruct((split * r, n), jnp.float32 if split > 1 or kp else dtype)
                     for n, kp, dtype in zip(ns, keep, dts)]
    with backend.quiet_triton_deprecation():
        ys = pl.pallas_call(
            kernel, grid=grid, out_shape=out_shape, interpret=interpret,
            compiler_params=backend.compiler_params(cfg.num_warps, cfg.num_stages),
            name=_name(fmts, quantise, limit is not None, split),
        )(*args)
    if limit is None and any(partials):  # those flagged as float32 partial sums [S, R, N]
        return tuple(Partials(y.reshape(split, r, -1)) if kp
                     else (y if split == 1 else jnp.sum(y.reshape(split, r, -1), axis=0).astype(dtype))
                     for y, kp, dtype in zip(ys, partials, dts))
    if split == 1:
        return tuple(ys)
    parts = [jnp.sum(y.reshape(split, r, -1), axis=0) for y in ys]  # float32 sums of the splits
    if limit is None:
        return tuple(p.astype(dtype) for p, dtype in zip(parts, dts))
    n = ns[0]
    return (_swiglu_rows(parts[0][:, :n], parts[0][:, n:], jnp.ones((r,), jnp.float32), limit, dt).astype(out_dtype),)


def _rows_and_flags(x: Array | QuantRows | Partials, count: int, quantise: tuple[bool, ...] | None):
    if isinstance(x, QuantRows) and isinstance(x.rows, (Partials, SwiGLUPartials)):
        raise ValueError("gemv: pass partial sums as they are with quantise flags, not in QuantRows")
    if isinstance(x, QuantRows):
        if quantise is not None:
            raise ValueError("gemv: QuantRows quantise the rows for every weight; pass plain rows with quantise")
        return x.rows, (True,) * count
    return x, tuple(bool(q) for q in quantise) if quantise is not None else (False,) * count


def gemv(x: Float[Array, "r k"] | QuantRows, w: Weights, group: Int[Array, " r"], *, out_dtype=None,
         config: GemvConfig | None = None, interpret: bool | None = None) -> Float[Array, "r n"]:
    """``x[r] @ W[group[r]]^T`` for every row r (``QuantRows``: the rows quantised as the reference's
    FP8 GEMM input first)."""
    return gemv_many(x, (w,), group, out_dtype=out_dtype, config=config, interpret=interpret)[0]


def gemv_many(x: Float[Array, "r k"] | QuantRows | Partials | SwiGLUPartials, ws: tuple[Weights, ...],
              group: Int[Array, " r"], *,
              quantise: tuple[bool, ...] | None = None, out_dtype=None, partials: tuple[bool, ...] | None = None,
              rows_dtype=None, config: GemvConfig | None = None, interpret: bool | None = None
              ) -> tuple[Float[Array, "r n"] | Partials, ...]:
    """``gemv`` of the same rows with several weights (same groups and K, any N and format) in one
    launch: the rows read by every program, each program's tile in one weight's columns (e.g. an
    attention layer's wq_a and wkv and its compressors' wkv and wgate). ``QuantRows`` quantise the
    rows for every weight; plain rows with ``quantise`` (one flag per weight) for those flagged.
    ``partials`` (one flag per weight): those flagged come back as ``Partials`` (float32, one part
    when K is not split), the others summed in float32 and rounded to ``out_dtype`` (one dtype, or
    one per weight: a launch's outputs may differ, each rounded in the kernel when K is not split,
    as a rounding of the float32 result after the launch would). x may itself be a producer's
    ``Partials`` [S, R, K]: each program adds the parts of its inputs and rounds them to
    ``rows_dtype`` (the producer's output dtype) before using them; or ``SwiGLUPartials`` (a
    shared expert's w1 and w3): the same for both, then their SwiGLU, rounded to ``rows_dtype``."""
    rows, flags = _rows_and_flags(x, len(ws), quantise)
    if isinstance(rows, SwiGLUPartials) and rows.gate.parts.shape != rows.up.parts.shape:
        raise ValueError(f"gemv rows as the SwiGLU of partial sums need gate and up parts of one shape, got "
                         f"{rows.gate.parts.shape} and {rows.up.parts.shape}")
    if isinstance(rows, (Partials, SwiGLUPartials)):
        if rows_dtype is None or len(rows.shape) != 2:
            raise ValueError(f"gemv rows as partial sums need parts [S, R, K] and rows_dtype, got "
                             f"{rows.shape} rows and {rows_dtype}")
        view = jax.ShapeDtypeStruct(rows.shape, jnp.dtype(rows_dtype))
    else:
        view = rows
    check_inputs(view, tuple(ws), group, same_n=False, quantise=flags)
    keep = () if partials is None else tuple(bool(p) for p in partials)
    if keep and len(keep) != len(ws):
        raise ValueError(f"gemv needs one partials flag per weight ({len(ws)}), got {partials}")
    if isinstance(out_dtype, (tuple, list)):
        if len(out_dtype) != len(ws):
            raise ValueError(f"gemv needs one out_dtype per weight ({len(ws)}) or one for all, got {out_dtype}")
        dtype = tuple(jnp.dtype(d or view.dtype) for d in out_dtype)
    else:
        dtype = jnp.dtype(out_dtype or view.dtype)
    return _pallas(rows, tuple(ws), group, quantise=flags, cfg=config or default_config(), limit=None,
                   out_dtype=dtype, partials=keep, rows_dtype=None if view is rows else jnp.dtype(rows_dtype),
                   interpret=backend.interpret_mode(interpret))


def gemv_swiglu(x: Float[Array, "r k"] | QuantRows, w1: Weights, w3: Weights, group: Int[Array, " r"], *,
                limit: float, config: GemvConfig | None = None,
                interpret: bool | None = None) -> Float[Array, "r n"]:
    """``swiglu(x W1^T, x W3^T)`` per row (routing weight 1) in x's dtype: the grouped-matmul
    SwiGLU's roundings."""
    rows, flags = _rows_and_flags(x, 2, None)
    check_inputs(rows, (w1, w3), group, same_n=True, quantise=flags)
    return _pallas(rows, (w1, w3), group, quantise=flags, cfg=config or default_config(swiglu=True),
                   limit=float(limit), out_dtype=jnp.dtype(rows.dtype), interpret=backend.interpret_mode(interpret))[0]
