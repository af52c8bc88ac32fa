"""mHC units in fused Pallas kernels, beside their references: hc_pre (optionally after the
previous unit's hc_post, optionally followed by the sub-block's RMSNorm), hc_post and hc_head.

An mHC unit (``dspark_jax.model.hyper``) keeps n residual streams of width d per token. Here the
caller's leading dims are flattened to T tokens and a token's streams lie side by side:
x_flat [T, K], K = n * d, stream i in columns [i d, (i + 1) d). In plain XLA one unit is a chain of
small kernels (the RMS statistic, the mixes GEMV, scale / base, gates + Sinkhorn, the collapse, the
expansion, the sub-block's norm): about 10 launches per unit on a GPU for almost no bytes. Here:

- ``pre_kernel`` (hc_pre [+ RMSNorm]) and ``post_pre_kernel`` (hc_post of the previous unit, then
  hc_pre [+ RMSNorm] of the next), two launches each:

  1. ``_mixes_kernel``, grid (token tiles, d splits): over its columns of every stream, partial sums
     of the mixes x_flat @ fn^T (M = (2 + n) n columns) and of x_flat^2, stored as partials
     [T, S * MP] float32: split s in columns [s MP, (s + 1) MP), MP a power of two > M (at least
     16), column M of each split holding its sum of squares. ``post_pre_kernel``'s version first
     expands its columns, X'_j = post_j f + sum_i C[i, j] X_i, writes them (rounded to x's dtype)
     and takes the mixes of the rounded values, as the reference does. Calls of up to
     ``HcConfig.fma_tokens`` tokens (decode, a batch-1 verify) take the products as float32
     multiply-adds held per column and summed once per program, all tokens in one tile: a chain
     of small dots on a mostly empty 16-row tile was the kernel's latency (``_mixes_fma``); one
     token's as [MP, columns] products in the weights' own layout, over d / ``one_block_k``
     programs per stream width (128 at Flash widths). Each loop step loads its fn columns first,
     before the expansion's loads and stores: in a decode step fn comes from memory (its 1.5 MiB
     per unit are read once per step), and those loads are the kernel's longest wait;
  2. ``_collapse_kernel``, grid (tokens, 2): the S partials summed,
     rsqrt(mean(x^2) + eps), scale and base, the gates; then the first program of a token the
     collapse y = sum_i pre_i X_i of whole rows, which the RMSNorm (when given its weight) needs:
     y rounded to x's dtype, then ``(w * (y * 1 / sqrt(mean(y^2) + eps)))`` as
     ``norms_rope.rms_norm``; the second, at the same time, post [T, n] and the Sinkhorn iterations
     on per-entry vectors (``hc_weights``: no cross-lane work) -> comb [T, n n].

- ``head_kernel`` (hc_head [+ RMSNorm]): the same two kernels with M = n sigmoid gates, no post,
  no comb.
- ``post_kernel`` (hc_post), one launch, grid (token tiles, d chunks):
  X'_j = post_j f + sum_i C[i, j] X_i.

Why the mixes take a launch of their own: at decode (T = 1 to a few hundred tokens) the bytes of
hc_pre are fn [M, K] float32 (1.5 MiB per unit at Flash dims); one program per token tile would
stream all of it through one SM. Split over d it streams through S SMs at once, and adding the S
partial sums up needs a second launch (float atomics would make the result depend on timing).
A unit in one launch, the collapse run by the mixes program that counted itself done last (an
integer atomic count), was slower on an H200: 11.2-11.6 us per unit at one token against
9.9-10.0 for the two launches, and the DSpark round 40 % slower with a verify's six tokens
collapsed one after the other (docs/benchmarks.md, 2026-12-05); it was removed. S
depends on d (and on whether the call takes the multiply-adds), not otherwise on T. The collapse
holds a token's n whole streams in registers (one token per program: 16 Ki values at Flash dims),
so the norm's statistic and its output take one pass.

Numerics: float32 as the references; the mixes' dot has float32 products and sums (bf16 streams:
fn split into three bf16 parts, each product exact; float32 streams: an IEEE float32 dot, precision
HIGHEST, where Triton's default for float32 operands is TF32; few tokens: float32 multiply-adds),
the rest elementwise. Results differ from the references (``pre_reference`` etc.:
``hyper.hc_pre`` / ``hc_post`` / ``hc_head`` and
``norms_rope.rms_norm``) only by the order of float32 sums. Outputs keep the references' dtypes:
y and X' in x's dtype, post and comb float32. Inference only (no gradient).

Refs are whole arrays indexed with broadcast integer arrays and masks (``pltriton.load`` /
``store``), which the Triton lowering and interpret mode both take; token tiles past T and
columns past d are masked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend
from pallas_kernels.gemv import ExpertRows, Partials, total
from pallas_kernels.hc_weights import sinkhorn_lists

if TYPE_CHECKING:
    from jaxtyping import Array, Float


@dataclasses.dataclass(frozen=True)
class HcConfig:
    """Tiles (powers of two). ``block_t``: most tokens per mixes program (a call with fewer tokens
    takes the next power of two >= T, at least 16: the mixes' dot needs 16 rows); ``block_k``:
    columns of each stream per step of the mixes' loop; ``split_k``: at most this many columns of
    x_flat (split_k / n of each stream) per program of the mixes (d is split over S >= K / split_k
    programs per token tile, a whole number of loop steps each); ``block_d``: stream columns per
    program of the expansion (``post_kernel``). ``num_warps`` / ``num_stages``: the mixes' and the
    expansion's; ``collapse_warps``: the collapse's (one token's whole streams per program).

    Calls of at most ``fma_tokens`` tokens (0: none) take the mixes as float32 multiply-adds
    instead of dots (``_mixes_fma``): all T tokens in one tile, each program over at most
    ``fma_split_k`` columns of x_flat, in steps holding ``fma_block`` products (T x MP x columns);
    one token's in ``one_block_k`` columns of each stream per step."""

    # measured on the H200 (docs/benchmarks.md): the best of six tilings at 1, 32 and 192 tokens;
    # split_k 256 and the multiply-adds up to 8 tokens from a later sweep at 1, 6, 16, 32 and 192;
    # one_block_k 32 (128 programs at Flash widths, against 32 before) timed in the step on an H100
    block_t: int = 16
    block_k: int = 32
    split_k: int = 256
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 2
    collapse_warps: int = 4
    fma_tokens: int = 8
    fma_split_k: int = 128
    fma_block: int = 4096
    one_block_k: int = 32

    def __post_init__(self):
        for name in ("block_t", "block_k", "split_k", "block_d", "fma_split_k", "fma_block", "one_block_k"):
            if not backend.is_power_of_2(getattr(self, name)):
                raise ValueError(f"HcConfig.{name} must be a power of two, got {getattr(self, name)}")
        if self.block_t < 16 or self.block_k < 16:
            raise ValueError(f"HcConfig needs block_t >= 16 and block_k >= 16 (dot tiles), got {self}")
        if not 0 <= self.fma_tokens <= 64:
            raise ValueError(f"HcConfig.fma_tokens must be in [0, 64], got {self.fma_tokens}")


# The tiles of calls given no ``config`` (the model's): a benchmark may set another before tracing
CONFIG = HcConfig()


@dataclasses.dataclass(frozen=True)
class _Tiles:
    fma: bool  # the mixes as multiply-adds (``_mixes_fma``), not dots
    one: bool  # one token's multiply-adds: [mp, bk] products (the weights' layout), bk = ``one_block_k``
    bt: int  # tokens per mixes / expansion program
    bk: int  # columns of each stream per step of the mixes' loop
    steps: int  # loop steps per mixes program
    splits: int  # S: mixes programs per token tile
    bd: int  # stream columns per expansion program
    mp: int  # MP: padded mixes per split (column M: the sum of squares)
    dp: int  # d padded to a power of two: the collapse's columns


def _tiles(tokens: int, n: int, d: int, m: int, config: HcConfig) -> _Tiles:
    """The tiles of a call of T = ``tokens`` tokens, n streams of d and M = ``m`` mixes."""
    if not backend.is_power_of_2(n):
        raise ValueError(f"mHC kernels need a power-of-two number of streams, got n = {n}")
    mp = max(16, backend.next_power_of_2(m + 1))
    bd = backend.largest_pow2_divisor(d, config.block_d)
    if d % 16 or bd < 16:
        raise ValueError(f"mHC kernels need the stream width d to be a multiple of 16, got n = {n}, d = {d}")
    fma = tokens <= config.fma_tokens
    if fma:  # all tokens in one tile; a step's products bt x mp x bk within fma_block (one token: one_block_k)
        bt = backend.next_power_of_2(tokens)
        bk = backend.largest_pow2_divisor(d, config.one_block_k if bt == 1 else max(1, config.fma_block // (bt * mp)))
        split = config.fma_split_k
    else:
        bt = min(config.block_t, max(16, backend.next_power_of_2(tokens)))
        bk = backend.largest_pow2_divisor(d, config.block_k)
        split = config.split_k
    chunks = d // bk
    steps = max(s for s in range(1, max(1, split // n // bk) + 1) if chunks % s == 0)
    return _Tiles(fma=fma, one=fma and bt == 1, bt=bt, bk=bk, steps=steps,
                  splits=chunks // steps, bd=bd, mp=mp, dp=backend.next_power_of_2(d))


# ------------------------------------------------------------------------------ kernel helpers
def _iota(n: int) -> Array:
    return jnp.arange(n, dtype=jnp.int32)


def _rows(bt: int, tokens: int) -> tuple[Array, Array]:
    """This program's token rows [bt] and which of them exist."""
    rows = pl.program_id(0) * bt + _iota(bt)
    return rows, rows < tokens


def _at(ref, rows: Array, ok: Array, cols: Array, col_ok: Array | None = None):
    """(``ref.at[rows, cols]``, its mask) for an integer array of columns of any shape: a
    [len(rows), *cols.shape] block; ``col_ok`` (cols' shape) masks columns too."""
    lead = (slice(None),) + (None,) * cols.ndim
    mask = ok[lead] if col_ok is None else ok[lead] & col_ok[None]
    return ref.at[rows[lead], cols[None]], mask


def _load(ref, rows: Array, ok: Array, cols: Array, col_ok: Array | None = None) -> Array:
    """``ref[rows, cols]`` as float32 [len(rows), *cols.shape], zero where masked."""
    at, mask = _at(ref, rows, ok, cols, col_ok)
    return pltriton.load(at, mask=mask, other=0).astype(jnp.float32)


def _store(ref, rows: Array, ok: Array, cols: Array, value: Array, col_ok: Array | None = None):
    at, mask = _at(ref, rows, ok, cols, col_ok)
    pltriton.store(at, value.astype(ref.dtype), mask=mask)


def _rounded(value: Array, dtype) -> Array:
    """float32 ``value`` rounded to ``dtype`` and back (what a store and reload would give)."""
    return value.astype(dtype).astype(jnp.float32)


def _expand(comb: list[Array], post: list[Array], f: Array, x: list[Array]) -> list[Array]:
    """hc_post on [bt, cols] blocks: X'_j = post_j f + sum_i C[i, j] X_i (comb[i * n + j] and
    post[j] are [bt] vectors), in float32."""
    n = len(x)
    out = []
    for j in range(n):
        mixed = comb[j][:, None] * x[0]
        for i in range(1, n):
            mixed = mixed + comb[i * n + j][:, None] * x[i]
        out.append(post[j][:, None] * f + mixed)
    return out


def _columns(ref, rows: Array, ok: Array, count: int) -> list[Array]:
    """Columns 0 .. count - 1 of ``ref``'s rows, each a float32 [len(rows)] vector."""
    return [_load(ref, rows, ok, jnp.full((1,), c, jnp.int32))[:, 0] for c in range(count)]


def _mixes_dot(x: Array, w: Array, *, exact_bf16: bool) -> Array:
    """x [bt, bk] @ w [mp, bk]^T with float32 products and sums. For ``exact_bf16`` x (float32
    values that are bf16 numbers) w is split into three bf16 parts (hi + mid + lo = w: 8 + 8 + 8
    mantissa bits) and each product x * part is exact in the tensor cores' float32 accumulation:
    three bf16 dots instead of one IEEE float32 dot, which the Triton lowering runs on the CUDA
    cores, ~20x slower (on the H200: 22 us for hc_pre's mixes at 1 token, against XLA's 2.5 us)."""
    dims = (((1,), (1,)), ((), ()))
    if not exact_bf16:
        return lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    xb = x.astype(jnp.bfloat16)
    hi = w.astype(jnp.bfloat16)
    rest = w - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    out = None
    for part in (hi, mid, lo):
        term = lax.dot_general(xb, part, dims, preferred_element_type=jnp.float32)
        out = term if out is None else out + term
    return out


def _mixes_fma(x: Array, w: Array) -> Array:
    """x [bt, bk] times w [mp, bk] as float32 products [bt, mp, bk], summed over the columns by the
    caller once per program (``_mixes_kernel``): at a few tokens the dots' tiles would be mostly
    padding, and a program's chain of small dots takes longer than the multiply-adds."""
    return x[:, None, :] * w[None, :, :]


# ------------------------------------------------------------------------------ kernels
def _f_columns(f_ref, rows: Array, ok: Array, cols: Array, f_parts: int, dtype, pairs: tuple[int, int, bool] = (),
               extra_ref=None) -> Array:
    """The sub-block output f at ``cols`` (float32): as stored, or with ``f_parts`` its linear's
    float32 partial sums [S T, d] added in order and rounded to ``dtype`` (the linear's output);
    with ``pairs`` = (k, stride, extra) a MoE's ``gemv.ExpertRows``: f_ref its rows (token t's at
    rows (t k + j) stride), added in order, plus with ``extra`` ``extra_ref`` (the shared expert's
    output, as stored or as ``f_parts`` partial sums), the sum rounded to ``dtype``."""
    if pairs:
        k, stride, extra = pairs
        f = _load(f_ref, rows * (k * stride), ok, cols)
        for j in range(1, k):
            f = f + _load(f_ref, (rows * k + j) * stride, ok, cols)
        if extra:
            f = f + _f_columns(extra_ref, rows, ok, cols, f_parts, dtype)
        return _rounded(f, dtype)
    if not f_parts:
        return _load(f_ref, rows, ok, cols)
    tokens = f_ref.shape[0] // f_parts
    f = _load(f_ref, rows, ok, cols)
    for s in range(1, f_parts):
        f = f + _load(f_ref, s * tokens + rows, ok, cols)
    return _rounded(f, dtype)


def _mixes_kernel(x_ref, fn_ref, *refs, n: int, m: int, t: _Tiles, expand: bool, f_parts: int = 0,
                  f_pairs: tuple[int, int, bool] = ()):
    """Partial mixes and sum of squares of this program's columns (see the module docstring);
    with ``expand`` (refs f [, the expert rows' extra], post, comb, then outputs partials, X') the
    columns are first expanded by the previous unit's hc_post (f as stored, as its ``f_parts``
    partial sums, or as ``f_pairs`` expert rows: ``_f_columns``)."""
    extra_ref = None
    if expand and f_pairs and f_pairs[2]:
        f_ref, extra_ref, post_ref, comb_ref, part_ref, xo_ref = refs
    elif expand:
        f_ref, post_ref, comb_ref, part_ref, xo_ref = refs
    else:
        (part_ref,) = refs
    tokens, k = x_ref.shape
    d = k // n
    rows, ok = _rows(t.bt, tokens)
    split = pl.program_id(1)
    w_rows = _iota(t.mp)
    x_dtype = (xo_ref if expand else x_ref).dtype  # the values the mixes read: bf16 ones are exact in bf16
    if expand:
        post = _columns(post_ref, rows, ok, n)
        comb = _columns(comb_ref, rows, ok, n * n)

    def step(i, carry):
        acc, sq = carry
        cols = (split * t.steps + i) * t.bk + _iota(t.bk)
        # the weights [mp, bk] of each stream (zero rows past M), issued before the expansion's loads and stores
        ws = [_load(fn_ref, w_rows, w_rows < m, j * d + cols) for j in range(n)]
        if expand:
            xs = [_load(x_ref, rows, ok, j * d + cols) for j in range(n)]  # [bt, bk] each
            f = _f_columns(f_ref, rows, ok, cols, f_parts, xo_ref.dtype, f_pairs, extra_ref)
            xs = [_rounded(v, xo_ref.dtype) for v in _expand(comb, post, f, xs)]
            for j, v in enumerate(xs):
                _store(xo_ref, rows, ok, j * d + cols, v)
        for j in range(n):
            xj = xs[j] if expand else _load(x_ref, rows, ok, j * d + cols)
            w = ws[j]
            if t.one:  # one token: [mp, bk] products, in the weights' own layout
                xr = xj.reshape(t.bk)
                acc, sq = acc + w * xr[None, :], sq + xr * xr
            elif t.fma:  # products kept per column, summed after the loop
                acc, sq = acc + _mixes_fma(xj, w), sq + xj * xj
            else:
                acc = acc + _mixes_dot(xj, w, exact_bf16=x_dtype == jnp.bfloat16)
                sq = sq + jnp.sum(xj * xj, axis=1)
        return acc, sq

    if t.one:
        init = (jnp.zeros((t.mp, t.bk), jnp.float32), jnp.zeros((t.bk,), jnp.float32))
    elif t.fma:
        init = (jnp.zeros((t.bt, t.mp, t.bk), jnp.float32), jnp.zeros((t.bt, t.bk), jnp.float32))
    else:
        init = (jnp.zeros((t.bt, t.mp), jnp.float32), jnp.zeros((t.bt,), jnp.float32))
    acc, sq = lax.fori_loop(0, t.steps, step, init)
    if t.one:
        acc, sq = jnp.sum(acc, axis=1)[None, :], jnp.sum(sq)[None]
    elif t.fma:
        acc, sq = jnp.sum(acc, axis=2), jnp.sum(sq, axis=1)
    _store(part_ref, rows, ok, split * t.mp + w_rows, jnp.where(w_rows[None, :] == m, sq[:, None], acc))


def _collapse_kernel(part_ref, scale_ref, base_ref, x_ref, *refs, n: int, m: int, t: _Tiles, iters: int,
                     hc_eps: float, norm_eps: float, out_eps: float | None):
    """hc_pre (outputs y, post, comb) or hc_head (output y), one token per program, y followed by
    the RMSNorm when ``out_eps`` is set (then the first ref is its weight): see the module
    docstring. The token's first program runs the collapse, the second post and the Sinkhorn."""
    w_ref, (y_ref, *weight_refs) = (refs[0], refs[1:]) if out_eps is not None else (None, refs)
    _collapse_token(part_ref, scale_ref, base_ref, x_ref, w_ref, y_ref, weight_refs, pl.program_id(0),
                    pl.program_id(1) == 0, pl.program_id(1) == 1, n=n, m=m, t=t, iters=iters, hc_eps=hc_eps,
                    norm_eps=norm_eps, out_eps=out_eps)


def _collapse_token(part_ref, scale_ref, base_ref, x_ref, w_ref, y_ref, weight_refs, token, collapse, weights, *,
                    n: int, m: int, t: _Tiles, iters: int, hc_eps: float, norm_eps: float, out_eps: float | None):
    """Token ``token``'s gates from the S partials, then where ``collapse`` holds y (through the
    RMSNorm of weight ``w_ref`` when ``out_eps`` is set) and where ``weights`` holds post and the
    Sinkhorn iterations -> comb (``weight_refs``; none for hc_head)."""
    tokens, k = x_ref.shape
    d = k // n
    rows = token + _iota(1)
    ok = rows < tokens
    cols = _iota(t.mp)
    splits = _iota(backend.next_power_of_2(t.splits))
    dcols = _iota(t.dp)
    dok = dcols < d
    if out_eps is not None:  # the norm weight, issued first (masked off in the Sinkhorn program)
        norm_w = pltriton.load(w_ref.at[dcols], mask=dok & collapse, other=0)
    # the S splits' partials in one load [1, S, MP] (all in flight at once), then added up
    sums = jnp.sum(_load(part_ref, rows, ok, splits[:, None] * t.mp + cols[None, :],
                         (splits[:, None] < t.splits) & (cols[None, :] >= 0)), axis=1)

    def column(c: int) -> Array:
        return jnp.sum(jnp.where(cols[None, :] == c, sums, 0.0), axis=1)  # [1]

    r = lax.rsqrt(column(m) / k + norm_eps)
    # the reference's order: (mixes * r) * scale + base, scale per gate group (pre, post, comb)
    z = [(column(c) * r) * scale_ref[0 if c < n else 1 if c < 2 * n else 2] + base_ref[c] for c in range(m)]
    pre = [jax.nn.sigmoid(v) + hc_eps for v in z[:n]]

    def _collapse():
        y = None  # sum_i pre_i X_i, the streams added in order: [1, dp]
        for i in range(n):
            term = pre[i][:, None] * _load(x_ref, rows, ok, d * i + dcols, dok)
            y = term if y is None else y + term
        if out_eps is None:
            _store(y_ref, rows, ok, dcols, y, dok)
        else:
            yr = _rounded(y, y_ref.dtype)
            inv = 1.0 / jnp.sqrt(jnp.sum(yr * yr, axis=1) / d + out_eps)
            _store(y_ref, rows, ok, dcols, norm_w.astype(jnp.float32)[None, :] * (yr * inv[:, None]), dok)

    pl.when(collapse)(_collapse)
    if weight_refs:  # post and the Sinkhorn iterations (hc_pre)
        post_ref, comb_ref = weight_refs

        def _weights():
            for j, v in enumerate(z[n:2 * n]):
                _store(post_ref, rows, ok, jnp.full((1,), j, jnp.int32), (2.0 * jax.nn.sigmoid(v))[:, None])
            comb = sinkhorn_lists([z[2 * n + i * n:2 * n + (i + 1) * n] for i in range(n)], iters, hc_eps)
            for c, v in enumerate(x for row in comb for x in row):
                _store(comb_ref, rows, ok, jnp.full((1,), c, jnp.int32), v[:, None])

        pl.when(weights)(_weights)


def _post_kernel(f_ref, x_ref, post_ref, comb_ref, o_ref, *, n: int, t: _Tiles):
    tokens, k = x_ref.shape
    d = k // n
    rows, ok = _rows(t.bt, tokens)
    cols = pl.program_id(1) * t.bd + _iota(t.bd)
    xs = [_load(x_ref, rows, ok, d * i + cols) for i in range(n)]
    comb, post = _columns(comb_ref, rows, ok, n * n), _columns(post_ref, rows, ok, n)
    out = _expand(comb, post, _load(f_ref, rows, ok, cols), xs)
    for j, v in enumerate(out):
        _store(o_ref, rows, ok, d * j + cols, v)


# ------------------------------------------------------------------------------ pallas calls
def _call(kernel, grid, out_shape, warps: int, config: HcConfig, interpret: bool, name: str, *args):
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                              compiler_params=backend.compiler_params(warps, config.num_stages))(*args)


@functools.partial(jax.jit, static_argnames=("n", "iters", "hc_eps", "norm_eps", "out_eps", "config", "f_parts",
                                             "f_pairs", "interpret"))
def _unit(x_flat, fn, base, scale, norm_w, prev, *, n: int, iters: int, hc_eps: float, norm_eps: float,
          out_eps: float | None, config: HcConfig, f_parts: int = 0, f_pairs: tuple[int, int, bool] = (),
          interpret: bool):
    """Both launches of hc_pre (fn with (2 + n) n rows: returns y, post, comb) or of hc_head (n rows:
    returns y), the RMSNorm with weight ``norm_w`` folded in when ``out_eps`` is set; with ``prev`` =
    (f, post, comb) the mixes kernel first expands x_flat by that hc_post and X' comes first in the
    result (``f_parts``: f given as that many partial sums [S T, d]; ``f_pairs``: as expert rows,
    prev = (rows, extra, post, comb), or (rows, post, comb) without an extra: ``_f_columns``)."""
    tokens, k = x_flat.shape
    m = fn.shape[0]
    t = _tiles(tokens, n, k // n, m, config)
    part_shape = jax.ShapeDtypeStruct((tokens, t.splits * t.mp), jnp.float32)
    grid = (pl.cdiv(tokens, t.bt), t.splits)
    outs = [jax.ShapeDtypeStruct((tokens, k // n), x_flat.dtype)]
    if m != n:
        outs += [jax.ShapeDtypeStruct((tokens, n), jnp.float32), jax.ShapeDtypeStruct((tokens, n * n), jnp.float32)]
    name = ("hc_pre" if m != n else "hc_head") + ("" if out_eps is None else "_norm")
    mixes = functools.partial(_mixes_kernel, n=n, m=m, t=t, expand=prev is not None, f_parts=f_parts,
                              f_pairs=f_pairs)
    if prev is None:
        part = _call(mixes, grid, part_shape, config.num_warps, config, interpret, "hc_mixes", x_flat, fn)
        expanded = ()
    else:
        part, x_flat = _call(mixes, grid, (part_shape, jax.ShapeDtypeStruct(x_flat.shape, x_flat.dtype)),
                             config.num_warps, config, interpret, "hc_post_mixes", x_flat, fn, *prev)
        expanded = (x_flat,)
    kernel = functools.partial(_collapse_kernel, n=n, m=m, t=t, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                               out_eps=out_eps)
    args = (part, scale, base, x_flat) + (() if out_eps is None else (norm_w,))
    grid = (tokens, 2 if m != n else 1)  # a token's collapse, and its Sinkhorn program beside it (hc_pre)
    return expanded + tuple(_call(kernel, grid, tuple(outs), config.collapse_warps, config, interpret, name, *args))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _expand_call(f, x_flat, post, comb, *, config: HcConfig, interpret: bool):
    tokens, k = x_flat.shape
    n = post.shape[1]
    t = _tiles(tokens, n, k // n, n, config)
    return _call(functools.partial(_post_kernel, n=n, t=t), (pl.cdiv(tokens, t.bt), k // n // t.bd),
                 jax.ShapeDtypeStruct(x_flat.shape, x_flat.dtype), config.num_warps, config, interpret, "hc_post",
                 f, x_flat, post, comb)


# ------------------------------------------------------------------------------ entry points
def _check_unit(x, fn, base, scale, rows: int, n_scale: int, norm_weight):
    if x.ndim < 2:
        raise ValueError(f"x must be [..., n, d] streams, got shape {x.shape}")
    n, d = x.shape[-2:]
    if fn.shape != (rows, n * d) or base.shape != (rows,) or scale.shape != (n_scale,):
        raise ValueError(f"for n = {n} streams of d = {d}: fn must be [{rows}, {n * d}], base [{rows}] and scale "
                         f"[{n_scale}], got {fn.shape}, {base.shape} and {scale.shape}")
    if norm_weight is not None and norm_weight.shape != (d,):
        raise ValueError(f"the norm weight must be [{d}] for streams of d = {d}, got {norm_weight.shape}")


def _check_prev(f, x, post, comb):
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    f_shape = f.parts.shape[1:] if isinstance(f, Partials) else f.shape
    if isinstance(f, ExpertRows):
        extra = (math.prod(lead), d) if f.extra is None else (
            f.extra.parts.shape[1:] if isinstance(f.extra, Partials) else f.extra.shape)
        tokens = math.prod(lead)
        if (f.rows.shape != (tokens * f.k * f.stride, d) or math.prod(extra) != tokens * d
                or f.rows.dtype != x.dtype):
            raise ValueError(f"for x of shape {x.shape}: expert rows must be {x.dtype} "
                             f"[{tokens * f.k * f.stride}, {d}] (k = {f.k}, stride = {f.stride}) with an extra "
                             f"of {tokens} x {d} values, got {f.rows.dtype} {f.rows.shape} and {extra}")
    if f_shape != (*lead, d) or post.shape != (*lead, n) or comb.shape != (*lead, n, n):
        raise ValueError(f"for x of shape {x.shape}: f must be {(*lead, d)} (or partial sums [S, *{(*lead, d)}]), "
                         f"post {(*lead, n)} and comb {(*lead, n, n)}, got {f_shape}, {post.shape} and {comb.shape}")


def _flat_prev(f, post, comb, n: int, d: int) -> tuple:
    """(f [T, d] or its partial sums [S T, d] float32 (expert rows: their rows and extra), post [T, n],
    comb [T, n n]), S (0: f itself; expert rows: their extra's) and the expert rows' (k, stride,
    whether they have an extra) or ()."""
    weights = (post.reshape(-1, n).astype(jnp.float32), comb.reshape(-1, n * n).astype(jnp.float32))
    if isinstance(f, ExpertRows) and f.extra is None:
        return (f.rows, *weights), 0, (f.k, f.stride, False)
    if isinstance(f, ExpertRows):
        (extra, *_), parts, _ = _flat_prev(f.extra, post, comb, n, d)
        return (f.rows, extra, *weights), parts, (f.k, f.stride, True)
    f_flat = f.parts.astype(jnp.float32).reshape(-1, d) if isinstance(f, Partials) else f.reshape(-1, d)
    return (f_flat, *weights), (f.parts.shape[0] if isinstance(f, Partials) else 0), ()


def pre_kernel(x: Float[Array, "... n d"], fn: Float[Array, "m k"], base: Float[Array, " m"],
               scale: Float[Array, " 3"], *, iters: int, hc_eps: float, norm_eps: float,
               norm_weight: Float[Array, " d"] | None = None, out_eps: float | None = None,
               config: HcConfig | None = None, interpret: bool | None = None
               ) -> tuple[Float[Array, "... d"], Float[Array, "... n"], Float[Array, "... n n"]]:
    """hc_pre in two launches: (block input y [..., d] in x's dtype, post [..., n], comb [..., n, n]);
    with ``norm_weight`` (and its ``out_eps``) y comes out through that RMSNorm."""
    n, d = x.shape[-2:] if x.ndim >= 2 else (0, 0)
    _check_unit(x, fn, base, scale, (2 + n) * n, 3, norm_weight)
    if iters < 1:
        raise ValueError(f"Sinkhorn needs iters >= 1, got {iters}")
    lead = x.shape[:-2]
    if x.size == 0:
        return pre_reference(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                             norm_weight=norm_weight, out_eps=out_eps)
    y, post, comb = _unit(x.reshape(-1, n * d), fn, base, scale, norm_weight, None, n=n, iters=iters, hc_eps=hc_eps,
                          norm_eps=norm_eps, out_eps=_out_eps(norm_weight, out_eps), config=config or CONFIG,
                          interpret=backend.interpret_mode(interpret))
    return y.reshape(*lead, d), post.reshape(*lead, n), comb.reshape(*lead, n, n)


def post_pre_kernel(f: Float[Array, "... d"], x: Float[Array, "... n d"], post: Float[Array, "... n"],
                    comb: Float[Array, "... n n"], fn: Float[Array, "m k"], base: Float[Array, " m"],
                    scale: Float[Array, " 3"], *, iters: int, hc_eps: float, norm_eps: float,
                    norm_weight: Float[Array, " d"] | None = None, out_eps: float | None = None,
                    config: HcConfig | None = None, interpret: bool | None = None):
    """hc_post(f, x, post, comb) -> X', then hc_pre of X' (with the RMSNorm as in ``pre_kernel``), in
    two launches: (X' [..., n, d] in x's dtype, y [..., d], post' [..., n], comb' [..., n, n])."""
    n, d = x.shape[-2:] if x.ndim >= 2 else (0, 0)
    _check_unit(x, fn, base, scale, (2 + n) * n, 3, norm_weight)
    _check_prev(f, x, post, comb)
    if iters < 1:
        raise ValueError(f"Sinkhorn needs iters >= 1, got {iters}")
    lead = x.shape[:-2]
    if x.size == 0:
        return post_pre_reference(f, x, post, comb, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                                  norm_weight=norm_weight, out_eps=out_eps)
    prev, f_parts, f_pairs = _flat_prev(f, post, comb, n, d)
    xo, y, post2, comb2 = _unit(x.reshape(-1, n * d), fn, base, scale, norm_weight, prev, n=n, iters=iters,
                                hc_eps=hc_eps, norm_eps=norm_eps, out_eps=_out_eps(norm_weight, out_eps),
                                config=config or CONFIG, f_parts=f_parts, f_pairs=f_pairs,
                                interpret=backend.interpret_mode(interpret))
    return xo.reshape(x.shape), y.reshape(*lead, d), post2.reshape(*lead, n), comb2.reshape(*lead, n, n)


def head_kernel(x: Float[Array, "... n d"], fn: Float[Array, "n k"], base: Float[Array, " n"],
                scale: Float[Array, " 1"], *, hc_eps: float, norm_eps: float,
                norm_weight: Float[Array, " d"] | None = None, out_eps: float | None = None,
                config: HcConfig | None = None, interpret: bool | None = None) -> Float[Array, "... d"]:
    """hc_head in two launches: the sigmoid-gated collapse [..., d] in x's dtype (through the RMSNorm
    as in ``pre_kernel``)."""
    n, d = x.shape[-2:] if x.ndim >= 2 else (0, 0)
    _check_unit(x, fn, base, scale, n, 1, norm_weight)
    if x.size == 0:
        return head_reference(x, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps, norm_weight=norm_weight,
                              out_eps=out_eps)
    (y,) = _unit(x.reshape(-1, n * d), fn, base, scale, norm_weight, None, n=n, iters=1, hc_eps=hc_eps,
                 norm_eps=norm_eps, out_eps=_out_eps(norm_weight, out_eps), config=config or CONFIG,
                 interpret=backend.interpret_mode(interpret))
    return y.reshape(*x.shape[:-2], d)


def post_kernel(f: Float[Array, "... d"], x: Float[Array, "... n d"], post: Float[Array, "... n"],
                comb: Float[Array, "... n n"], *, config: HcConfig | None = None, interpret: bool | None = None
                ) -> Float[Array, "... n d"]:
    """hc_post in one launch: X'_j = post_j f + sum_i C[i, j] X_i, in x's dtype (f's partial sums or
    expert rows added first, in XLA)."""
    if isinstance(f, (Partials, ExpertRows)):
        f = total(f, x.dtype)
    if x.ndim < 2:
        raise ValueError(f"x must be [..., n, d] streams, got shape {x.shape}")
    _check_prev(f, x, post, comb)
    if x.size == 0:
        return post_reference(f, x, post, comb)
    n, d = x.shape[-2:]
    (f_flat, post_flat, comb_flat), *_ = _flat_prev(f, post, comb, n, d)
    out = _expand_call(f_flat, x.reshape(-1, n * d), post_flat, comb_flat, config=config or CONFIG,
                       interpret=backend.interpret_mode(interpret))
    return out.reshape(x.shape)


def _out_eps(norm_weight, out_eps: float | None) -> float | None:
    if (norm_weight is None) != (out_eps is None):
        raise ValueError("the RMSNorm after the collapse needs both norm_weight and out_eps (or neither)")
    return None if out_eps is None else float(out_eps)


def pre_reference(x, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float, norm_weight=None,
                  out_eps: float | None = None):
    """Pure JAX: ``model.hyper.hc_pre`` with the Sinkhorn iterations as a loop (with a norm weight:
    ``hyper.hc_pre_norm``, i.e. followed by ``norms_rope.rms_norm``)."""
    from dspark_jax.model.hyper import hc_pre, hc_pre_norm

    kw = dict(iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, sinkhorn_impl="loop")
    if norm_weight is None:
        return hc_pre(x, fn, base, scale, **kw)
    return hc_pre_norm(x, fn, base, scale, norm_weight, out_eps=out_eps, **kw)


def post_pre_reference(f, x, post, comb, fn, base, scale, **kw):
    """Pure JAX: ``post_reference`` (f's partial sums added first, rounded to x's dtype) then
    ``pre_reference``."""
    xo = post_reference(total(f, x.dtype) if isinstance(f, (Partials, ExpertRows)) else f, x, post, comb)
    return (xo, *pre_reference(xo, fn, base, scale, **kw))


def head_reference(x, fn, base, scale, *, hc_eps: float, norm_eps: float, norm_weight=None,
                   out_eps: float | None = None):
    """Pure JAX: ``model.hyper.hc_head`` (with a norm weight followed by ``norms_rope.rms_norm``)."""
    from dspark_jax.model.hyper import hc_head

    return hc_head(x, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps, norm_weight=norm_weight, out_eps=out_eps)


def post_reference(f, x, post, comb):
    """Pure JAX: ``model.hyper.hc_post``."""
    from dspark_jax.model.hyper import hc_post

    return hc_post(f, x, post, comb)
