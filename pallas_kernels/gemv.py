"""One row per weight group times FP8 weights, as float32 multiply-adds (a matrix-vector product).

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
are exact too. Only the order of the float32 sums differs from a dot's.

Operands: rows ``x [R, K]`` (row r multiplies weight group ``group[r]``) and weights ``Weights``
of format ``fp8`` (128 x 128 block scales: one scale per block and program). Several weights of
one K (``gemv_many``: each program's tile in one weight's columns, one output each), or w1 and w3
of a shared expert (``gemv_swiglu``: both in every program, one SwiGLU output). Not for the
routed experts (``fp8_k128``: a scale per output column and 128 inputs): with those scales
applied per step the routed SwiGLU at one token took 104 us against the grouped matmul's 30 us on
an H200 (docs/benchmarks.md). K may be split over programs (``GemvConfig.split_k``): their float32
partial sums are added after the kernel (XLA).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels import backend
from pallas_kernels.grouped_matmul import (FP8_BLOCK, QuantRows, Weights, _quantise_block,
                                           _scale_f32, _swiglu_rows, split_for)

FORMATS = ("fp8",)


# Automatic tiles (``GemvConfig.fit``): programs to reach (rows x column tiles x splits) and the
# largest split.
SPLIT_TARGET_PROGRAMS = 512
MAX_AUTO_SPLIT = 8


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


def takes(rows_per_group: int, w: Weights, impl: str | None) -> bool:
    """Whether a linear of ``rows_per_group`` rows per weight group runs here: one row against
    ``fp8`` weights (K a multiple of 128, N of 16) on the Pallas backend."""
    _, n, k = w.shape
    return (rows_per_group == 1 and w.fmt in FORMATS and k % FP8_BLOCK == 0 and n % 16 == 0
            and backend.resolve(impl) == "pallas")


def check_inputs(x: Array | QuantRows, ws: tuple[Weights, ...], group: Array, same_n: bool) -> None:
    rows = x.rows if isinstance(x, QuantRows) else x
    if rows.ndim != 2 or jnp.dtype(rows.dtype) not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"gemv rows must be bf16 / fp32 [R, K], got {rows.dtype} {rows.shape}")
    g, _, k = ws[0].shape
    for w in ws:
        if w.fmt not in FORMATS:
            raise ValueError(f"gemv takes weights of format {FORMATS}, got {w.fmt!r}")
        if (w.shape if same_n else (w.shape[0], w.shape[2])) != (ws[0].shape if same_n else (g, k)):
            raise ValueError(f"gemv weights must share their groups and K{' and N' if same_n else ''}, got "
                             f"{[w.shape for w in ws]}")
        if k != rows.shape[1] or k % FP8_BLOCK or w.shape[1] % 16:
            raise ValueError(f"gemv needs rows [R, {k}] with K a multiple of {FP8_BLOCK} and N a multiple of 16; "
                             f"got rows {rows.shape}, weights N = {w.shape[1]}, K = {k}")
    if group.shape != (rows.shape[0],) or not jnp.issubdtype(group.dtype, jnp.integer):
        raise ValueError(f"gemv group must be an int vector of one entry per row ({rows.shape[0]}), got "
                         f"{group.dtype} {group.shape}")


def _products(x_ref, w_sets, ns, r, g, n0, k_base, steps: int, bk: int, bn: int, quantise: bool) -> list[Array]:
    """float32 [1, bn] products of row r with output columns n0 .. n0 + bn of each weight set
    (group g, N ``ns[i]``) over inputs k_base .. k_base + steps * bk."""
    def body(step, accs):
        accs = list(accs)
        for c in range(0, bk, FP8_BLOCK):
            kb = k_base + step * bk + c
            xb = x_ref[pl.ds(r, 1), pl.ds(kb, FP8_BLOCK)]
            if quantise:
                codes, sx = _quantise_block(xb)
                xs = codes.astype(jnp.float32) * sx  # [1, 128], exact: an e4m3 value times a power of two
            else:
                xs = xb.astype(jnp.float32)
            for i, ((w_ref, s_ref), n) in enumerate(zip(w_sets, ns)):
                w = w_ref[pl.ds(g * n + n0, bn), pl.ds(kb, FP8_BLOCK)].astype(jnp.float32)
                blocks = -(-n // FP8_BLOCK)
                accs[i] = accs[i] + w * (xs * _scale_f32(s_ref[g * blocks + n0 // FP8_BLOCK, kb // FP8_BLOCK]))
        return tuple(accs)

    zero = jnp.zeros((bn, FP8_BLOCK), jnp.float32)
    accs = lax.fori_loop(0, steps, body, (zero,) * len(w_sets))
    return [jnp.sum(a, axis=1)[None, :] for a in accs]  # summed over the 128 lanes once


def _kernel(group_ref, x_ref, *refs, rows: int, ns: tuple[int, ...], cfg: GemvConfig, quantise: bool,
            limit: float | None, dt):
    n_weights = 2 if limit is not None else len(ns)  # the SwiGLU: w1 and w3 over the same columns
    w_sets = [refs[2 * i:2 * i + 2] for i in range(n_weights)]
    o_refs = refs[2 * n_weights:]
    r, j = pl.program_id(0), pl.program_id(1)
    s_id = pl.program_id(2) if cfg.split_k > 1 else 0  # (read here: interpret mode has none in branches)
    bn, bk, split = cfg.block_n, cfg.block_k, cfg.split_k
    g = group_ref[r]
    steps = x_ref.shape[1] // bk // split
    k_base = s_id * steps * bk
    out_row = r if split == 1 else s_id * rows + r  # split: float32 partial sums, split s at rows s * R..

    if limit is not None:  # the SwiGLU: both weights' columns n0.. in one program
        n0 = j * bn
        gate, up = _products(x_ref, w_sets, ns * 2, r, g, n0, k_base, steps, bk, bn, quantise)
        if split == 1:
            y = _swiglu_rows(gate, up, jnp.ones((1,), jnp.float32), limit, dt)
            o_refs[0][pl.ds(r, 1), pl.ds(n0, bn)] = y.astype(o_refs[0].dtype)
        else:  # gate at columns 0.., up at N..
            for i, part in enumerate((gate, up)):
                o_refs[0][pl.ds(out_row, 1), pl.ds(i * ns[0] + n0, bn)] = part
        return

    start = 0  # one output per weight: program j's tile among the weights' columns side by side
    for i, n in enumerate(ns):
        @pl.when((j >= start // bn) & (j < (start + n) // bn))
        def _one(i=i, n=n, start=start):
            n0 = j * bn - start
            (y,) = _products(x_ref, [w_sets[i]], (n,), r, g, n0, k_base, steps, bk, bn, quantise)
            o_refs[i][pl.ds(out_row, 1), pl.ds(n0, bn)] = y.astype(o_refs[i].dtype)
        start += n


@functools.partial(jax.jit, static_argnames=("cfg", "limit", "out_dtype", "interpret"))
def _pallas(x, ws, group, *, cfg: GemvConfig, limit, out_dtype, interpret: bool) -> tuple[Array, ...]:
    quantise = isinstance(x, QuantRows)
    rows_in = x.rows if quantise else x
    k, r = ws[0].shape[2], rows_in.shape[0]
    ns = (ws[0].shape[1],) if limit is not None else tuple(w.shape[1] for w in ws)
    cfg = cfg.fit(r, ns, k)
    split, dt = cfg.split_k, jnp.dtype(rows_in.dtype)
    args = [group.astype(jnp.int32), rows_in]
    for w in ws:
        args += [w.values.reshape(-1, k), w.scales.reshape(-1, w.scales.shape[-1])]
    kernel = functools.partial(_kernel, rows=r, ns=ns, cfg=cfg, quantise=quantise, limit=limit, dt=dt)
    grid = (r, sum(ns) // cfg.block_n) + ((split,) if split > 1 else ())
    if limit is not None:
        out_shape = [jax.ShapeDtypeStruct((r, ns[0]), out_dtype) if split == 1
                     else jax.ShapeDtypeStruct((split * r, 2 * ns[0]), jnp.float32)]
    else:
        out_shape = [jax.ShapeDtypeStruct((split * r, n), out_dtype if split == 1 else jnp.float32) for n in ns]
    with backend.quiet_triton_deprecation():
        ys = pl.pallas_call(
            kernel, grid=grid, out_shape=out_shape, interpret=interpret,
            compiler_params=backend.compiler_params(cfg.num_warps, cfg.num_stages),
            name="gemv_fp8" + ("_q" if quantise else "") + ("_swiglu" if limit is not None else "")
                 + (f"_x{len(ws)}" if limit is None and len(ws) > 1 else "") + (f"_split{split}" if split > 1 else ""),
        )(*args)
    if split == 1:
        return tuple(ys)
    parts = [jnp.sum(y.reshape(split, r, -1), axis=0) for y in ys]  # float32 sums of the splits
    if limit is None:
        return tuple(p.astype(out_dtype) for p in parts)
    n = ns[0]
    return (_swiglu_rows(parts[0][:, :n], parts[0][:, n:], jnp.ones((r,), jnp.float32), limit, dt).astype(out_dtype),)


def gemv(x: Float[Array, "r k"] | QuantRows, w: Weights, group: Int[Array, " r"], *, out_dtype=None,
         config: GemvConfig | None = None, interpret: bool | None = None) -> Float[Array, "r n"]:
    """``x[r] @ W[group[r]]^T`` for every row r (``QuantRows``: the rows quantised as the reference's
    FP8 GEMM input first)."""
    return gemv_many(x, (w,), group, out_dtype=out_dtype, config=config, interpret=interpret)[0]


def gemv_many(x: Float[Array, "r k"] | QuantRows, ws: tuple[Weights, ...], group: Int[Array, " r"], *,
              out_dtype=None, config: GemvConfig | None = None,
              interpret: bool | None = None) -> tuple[Float[Array, "r n"], ...]:
    """``gemv`` of the same rows with several weights (same groups and K, any N) in one launch: the
    rows read and quantised by every program, each program's tile in one weight's columns (e.g.
    wq_a and wkv of an attention layer)."""
    check_inputs(x, tuple(ws), group, same_n=False)
    dtype = jnp.dtype(out_dtype or x.dtype)
    return _pallas(x, tuple(ws), group, cfg=config or default_config(), limit=None, out_dtype=dtype,
                   interpret=backend.interpret_mode(interpret))


def gemv_swiglu(x: Float[Array, "r k"] | QuantRows, w1: Weights, w3: Weights, group: Int[Array, " r"], *,
                limit: float, config: GemvConfig | None = None,
                interpret: bool | None = None) -> Float[Array, "r n"]:
    """``swiglu(x W1^T, x W3^T)`` per row (routing weight 1) in x's dtype: the grouped-matmul
    SwiGLU's roundings."""
    check_inputs(x, (w1, w3), group, same_n=True)
    return _pallas(x, (w1, w3), group, cfg=config or default_config(swiglu=True), limit=float(limit),
                   out_dtype=jnp.dtype(x.dtype), interpret=backend.interpret_mode(interpret))[0]
