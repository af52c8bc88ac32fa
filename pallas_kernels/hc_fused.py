"""mHC units in fused Pallas kernels: hc_pre, hc_post and hc_head, beside their references.

An mHC unit (``dspark_jax.model.hyper``) keeps n residual streams of width d per token. Here the
caller's leading dims are flattened to T tokens and a token's streams lie side by side:
x_flat [T, K], K = n * d, stream i in columns [i d, (i + 1) d). In plain XLA one unit is a chain of
small kernels (the RMS statistic, the mixes GEMV, scale / base, gates + Sinkhorn, the collapse, the
expansion): about 7 launches per unit on a GPU for almost no bytes. Here:

- ``pre_kernel`` (hc_pre), two launches:

  1. ``_mixes_kernel``, grid (token tiles, K splits): over its range of K, partial sums of the
     mixes x_flat @ fn^T (M = (2 + n) n columns) and of x_flat^2, stored as partials
     [T, S * MP] float32: split s in columns [s MP, (s + 1) MP), MP a power of two > M (at least
     16), column M of each split holding its sum of squares;
  2. ``_collapse_kernel``, grid (token tiles, d chunks): the S partials summed in order,
     rsqrt(mean(x^2) + eps), scale and base, the gates, and the collapse y = sum_i pre_i X_i of its
     d chunk; the first chunk of each token tile also runs the Sinkhorn iterations
     (``hyper.sinkhorn`` itself, on a [tokens, n, n] tile in registers) and writes post [T, n] and
     comb [T, n n].

- ``head_kernel`` (hc_head): the same two kernels with M = n sigmoid gates, no post, no comb.
- ``post_kernel`` (hc_post), one launch, grid (token tiles, d chunks):
  X'_j = post_j f + sum_i C[i, j] X_i.

Why the mixes take a launch of their own: at decode (T = 1 to a few hundred tokens) the bytes of
hc_pre are fn [M, K] float32 (1.5 MiB per unit at Flash dims); one program per token tile would
stream all of it through one SM. Split over K it streams through S SMs at once, and adding the S
partial sums up needs a second launch (float atomics would make the result depend on timing). S
depends on K only, not on T.

Numerics: float32 as the references; the mixes' dot is an IEEE float32 dot (precision HIGHEST:
Triton's default for float32 operands is TF32), the rest elementwise. Results differ from the
references (``pre_reference`` etc.: ``hyper.hc_pre`` / ``hc_post`` / ``hc_head``) only by the
order of float32 sums. Outputs keep the references' dtypes: y and X' in x's dtype, post and comb
float32. Inference only (no gradient).

Refs are whole arrays indexed with broadcast integer arrays and masks (``pltriton.load`` /
``store``), which the Triton lowering and interpret mode both take; token tiles past T are masked.
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

if TYPE_CHECKING:
    from jaxtyping import Array, Float


@dataclasses.dataclass(frozen=True)
class HcConfig:
    """Tiles (powers of two). ``block_t``: most tokens per program (a call with fewer tokens takes
    the next power of two >= T, at least 16: the mixes' dot needs 16 rows); ``block_k``: columns
    of x_flat per step of the mixes' loop; ``split_k``: at most this many columns per program of
    the mixes (K is split over S >= K / split_k programs per token tile, a whole number of loop
    steps each); ``block_d``: stream columns per program of the collapse and the expansion. The
    tiles shrink to divide K and d."""

    block_t: int = 32
    block_k: int = 128
    split_k: int = 512  # measured on the H200 at 1 token: 25 us per hc_pre against 44 us with 1024
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_t", "block_k", "split_k", "block_d"):
            if not backend.is_power_of_2(getattr(self, name)):
                raise ValueError(f"HcConfig.{name} must be a power of two, got {getattr(self, name)}")
        if self.block_t < 16 or self.block_k < 16:
            raise ValueError(f"HcConfig needs block_t >= 16 and block_k >= 16 (dot tiles), got {self}")


@dataclasses.dataclass(frozen=True)
class _Tiles:
    bt: int  # tokens per program
    bk: int  # columns per step of the mixes' loop
    steps: int  # loop steps per mixes program
    splits: int  # S: mixes programs per token tile
    bd: int  # stream columns per collapse / expansion program
    mp: int  # MP: padded mixes per split (column M: the sum of squares)


def _tiles(tokens: int, n: int, d: int, m: int, config: HcConfig) -> _Tiles:
    """The tiles of a call of T = ``tokens`` tokens, n streams of d and M = ``m`` mixes."""
    if not backend.is_power_of_2(n):
        raise ValueError(f"mHC kernels need a power-of-two number of streams, got n = {n}")
    k = n * d
    bk = backend.largest_pow2_divisor(k, config.block_k)
    bd = backend.largest_pow2_divisor(d, config.block_d)
    if bk < 16 or bd < 16:
        raise ValueError(f"mHC kernels need the stream width d to be a multiple of 16, got n = {n}, d = {d}")
    chunks = k // bk
    steps = max(s for s in range(1, max(1, config.split_k // bk) + 1) if chunks % s == 0)
    bt = min(config.block_t, max(16, backend.next_power_of_2(tokens)))
    return _Tiles(bt=bt, bk=bk, steps=steps, splits=chunks // steps, bd=bd, mp=max(16, backend.next_power_of_2(m + 1)))


# ------------------------------------------------------------------------------ kernel helpers
def _iota(n: int) -> Array:
    return jnp.arange(n, dtype=jnp.int32)


def _rows(bt: int, tokens: int) -> tuple[Array, Array]:
    """This program's token rows [bt] and which of them exist."""
    rows = pl.program_id(0) * bt + _iota(bt)
    return rows, rows < tokens


def _at(ref, rows: Array, ok: Array, cols: Array):
    """(``ref.at[rows, cols]``, its row mask) for an integer array of columns of any shape: a
    [len(rows), *cols.shape] block."""
    lead = (slice(None),) + (None,) * cols.ndim
    return ref.at[rows[lead], cols[None]], ok[lead]


def _load(ref, rows: Array, ok: Array, cols: Array) -> Array:
    """``ref[rows, cols]`` as float32 [len(rows), *cols.shape], zero on rows that are not ``ok``."""
    at, mask = _at(ref, rows, ok, cols)
    return pltriton.load(at, mask=mask, other=0).astype(jnp.float32)


def _store(ref, rows: Array, ok: Array, cols: Array, value: Array):
    at, mask = _at(ref, rows, ok, cols)
    pltriton.store(at, value.astype(ref.dtype), mask=mask)


# ------------------------------------------------------------------------------ kernels
def _mixes_kernel(x_ref, fn_ref, part_ref, *, m: int, t: _Tiles):
    rows, ok = _rows(t.bt, x_ref.shape[0])
    split = pl.program_id(1)
    w_rows = _iota(t.mp)

    def step(i, carry):
        acc, sq = carry
        cols = (split * t.steps + i) * t.bk + _iota(t.bk)
        xk = _load(x_ref, rows, ok, cols)  # [bt, bk]
        w = _load(fn_ref, w_rows, w_rows < m, cols)  # [mp, bk], zero rows past M
        acc = acc + lax.dot_general(xk, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32)
        return acc, sq + jnp.sum(xk * xk, axis=1)

    acc, sq = lax.fori_loop(0, t.steps, step, (jnp.zeros((t.bt, t.mp), jnp.float32), jnp.zeros((t.bt,), jnp.float32)))
    _store(part_ref, rows, ok, split * t.mp + w_rows, jnp.where(w_rows[None, :] == m, sq[:, None], acc))


def _collapse_kernel(part_ref, scale_ref, base_ref, x_ref, y_ref, *weight_refs, n: int, m: int, t: _Tiles,
                     iters: int, hc_eps: float, norm_eps: float):
    """hc_pre (``weight_refs`` = post, comb) or hc_head (no ``weight_refs``): see the module docstring."""
    from dspark_jax.model.hyper import sinkhorn

    tokens, k = x_ref.shape
    d = k // n
    rows, ok = _rows(t.bt, tokens)
    streams = _iota(n)
    # the partials' columns: sum of squares, then the mixes of each gate group (comb as [n, n])
    groups = [jnp.full((1,), m, jnp.int32), streams]
    if weight_refs:
        groups += [n + streams, 2 * n + n * streams[:, None] + streams[None, :]]
    sums = [_load(part_ref, rows, ok, c) for c in groups]
    for s in range(1, t.splits):  # the S splits added in order (unrolled: all loads in flight at once)
        sums = [a + _load(part_ref, rows, ok, s * t.mp + c) for a, c in zip(sums, groups)]
    r = lax.rsqrt(jnp.sum(sums[0], axis=1) / k + norm_eps)  # [bt]
    # the reference's order: (mixes * r) * scale + base
    z = [(a * r.reshape(-1, *(1,) * (a.ndim - 1))) * scale_ref[g] + pltriton.load(base_ref.at[c])[None]
         for g, (a, c) in enumerate(zip(sums[1:], groups[1:]))]
    pre = jax.nn.sigmoid(z[0]) + hc_eps  # [bt, n]

    cols = pl.program_id(1) * t.bd + _iota(t.bd)
    x = _load(x_ref, rows, ok, d * streams[:, None] + cols[None, :])  # [bt, n, bd]
    _store(y_ref, rows, ok, cols, jnp.sum(pre[:, :, None] * x, axis=1))

    if weight_refs:
        post_ref, comb_ref = weight_refs

        @pl.when(pl.program_id(1) == 0)
        def _weights():
            _store(post_ref, rows, ok, streams, 2.0 * jax.nn.sigmoid(z[1]))
            _store(comb_ref, rows, ok, groups[3] - 2 * n, sinkhorn(z[2], iters, hc_eps, unroll=False))


def _post_kernel(f_ref, x_ref, post_ref, comb_ref, o_ref, *, n: int, t: _Tiles):
    tokens, k = x_ref.shape
    d = k // n
    rows, ok = _rows(t.bt, tokens)
    streams = _iota(n)
    cols = pl.program_id(1) * t.bd + _iota(t.bd)
    mixed = None  # sum_i C[i, :] X_i: [bt, n, bd]
    for i in range(n):
        term = _load(comb_ref, rows, ok, n * i + streams)[:, :, None] * _load(x_ref, rows, ok, d * i + cols)[:, None, :]
        mixed = term if mixed is None else mixed + term
    post_f = _load(post_ref, rows, ok, streams)[:, :, None] * _load(f_ref, rows, ok, cols)[:, None, :]
    _store(o_ref, rows, ok, d * streams[:, None] + cols[None, :], post_f + mixed)


# ------------------------------------------------------------------------------ pallas calls
def _call(kernel, grid, out_shape, config: HcConfig, interpret: bool, name: str, *args):
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                              compiler_params=backend.compiler_params(config.num_warps, config.num_stages))(*args)


@functools.partial(jax.jit, static_argnames=("n", "iters", "hc_eps", "norm_eps", "config", "interpret"))
def _gates_and_collapse(x_flat, fn, base, scale, *, n: int, iters: int, hc_eps: float, norm_eps: float,
                        config: HcConfig, interpret: bool):
    """Both launches of hc_pre (fn with (2 + n) n rows: returns y, post, comb) or of hc_head (n rows:
    returns y)."""
    tokens, k = x_flat.shape
    m = fn.shape[0]
    t = _tiles(tokens, n, k // n, m, config)
    tiles = pl.cdiv(tokens, t.bt)
    part = _call(functools.partial(_mixes_kernel, m=m, t=t), (tiles, t.splits),
                 jax.ShapeDtypeStruct((tokens, t.splits * t.mp), jnp.float32), config, interpret, "hc_mixes",
                 x_flat, fn)
    outs = [jax.ShapeDtypeStruct((tokens, k // n), x_flat.dtype)]
    if m != n:
        outs += [jax.ShapeDtypeStruct((tokens, n), jnp.float32), jax.ShapeDtypeStruct((tokens, n * n), jnp.float32)]
    kernel = functools.partial(_collapse_kernel, n=n, m=m, t=t, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    return _call(kernel, (tiles, k // n // t.bd), tuple(outs), config, interpret,
                 "hc_pre" if m != n else "hc_head", part, scale, base, x_flat)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _expand(f, x_flat, post, comb, *, config: HcConfig, interpret: bool):
    tokens, k = x_flat.shape
    n = post.shape[1]
    t = _tiles(tokens, n, k // n, n, config)
    return _call(functools.partial(_post_kernel, n=n, t=t), (pl.cdiv(tokens, t.bt), k // n // t.bd),
                 jax.ShapeDtypeStruct(x_flat.shape, x_flat.dtype), config, interpret, "hc_post", f, x_flat, post, comb)


# ------------------------------------------------------------------------------ entry points
def _check_unit(x, fn, base, scale, rows: int, n_scale: int):
    if x.ndim < 2:
        raise ValueError(f"x must be [..., n, d] streams, got shape {x.shape}")
    n, d = x.shape[-2:]
    if fn.shape != (rows, n * d) or base.shape != (rows,) or scale.shape != (n_scale,):
        raise ValueError(f"for n = {n} streams of d = {d}: fn must be [{rows}, {n * d}], base [{rows}] and scale "
                         f"[{n_scale}], got {fn.shape}, {base.shape} and {scale.shape}")


def pre_kernel(x: Float[Array, "... n d"], fn: Float[Array, "m k"], base: Float[Array, " m"],
               scale: Float[Array, " 3"], *, iters: int, hc_eps: float, norm_eps: float, config: HcConfig = HcConfig(),
               interpret: bool | None = None
               ) -> tuple[Float[Array, "... d"], Float[Array, "... n"], Float[Array, "... n n"]]:
    """hc_pre in two launches: (block input y [..., d] in x's dtype, post [..., n], comb [..., n, n])."""
    n, d = x.shape[-2:] if x.ndim >= 2 else (0, 0)
    _check_unit(x, fn, base, scale, (2 + n) * n, 3)
    if iters < 1:
        raise ValueError(f"Sinkhorn needs iters >= 1, got {iters}")
    lead = x.shape[:-2]
    if x.size == 0:
        return pre_reference(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    y, post, comb = _gates_and_collapse(x.reshape(-1, n * d), fn, base, scale, n=n, iters=iters, hc_eps=hc_eps,
                                        norm_eps=norm_eps, config=config, interpret=backend.interpret_mode(interpret))
    return y.reshape(*lead, d), post.reshape(*lead, n), comb.reshape(*lead, n, n)


def head_kernel(x: Float[Array, "... n d"], fn: Float[Array, "n k"], base: Float[Array, " n"],
                scale: Float[Array, " 1"], *, hc_eps: float, norm_eps: float, config: HcConfig = HcConfig(),
                interpret: bool | None = None) -> Float[Array, "... d"]:
    """hc_head in two launches: the sigmoid-gated collapse [..., d] in x's dtype."""
    n, d = x.shape[-2:] if x.ndim >= 2 else (0, 0)
    _check_unit(x, fn, base, scale, n, 1)
    if x.size == 0:
        return head_reference(x, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps)
    (y,) = _gates_and_collapse(x.reshape(-1, n * d), fn, base, scale, n=n, iters=1, hc_eps=hc_eps, norm_eps=norm_eps,
                               config=config, interpret=backend.interpret_mode(interpret))
    return y.reshape(*x.shape[:-2], d)


def post_kernel(f: Float[Array, "... d"], x: Float[Array, "... n d"], post: Float[Array, "... n"],
                comb: Float[Array, "... n n"], *, config: HcConfig = HcConfig(), interpret: bool | None = None
                ) -> Float[Array, "... n d"]:
    """hc_post in one launch: X'_j = post_j f + sum_i C[i, j] X_i, in x's dtype."""
    if x.ndim < 2:
        raise ValueError(f"x must be [..., n, d] streams, got shape {x.shape}")
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    if f.shape != (*lead, d) or post.shape != (*lead, n) or comb.shape != (*lead, n, n):
        raise ValueError(f"for x of shape {x.shape}: f must be {(*lead, d)}, post {(*lead, n)} and comb "
                         f"{(*lead, n, n)}, got {f.shape}, {post.shape} and {comb.shape}")
    if x.size == 0:
        return post_reference(f, x, post, comb)
    out = _expand(f.reshape(-1, d), x.reshape(-1, n * d), post.reshape(-1, n).astype(jnp.float32),
                  comb.reshape(-1, n * n).astype(jnp.float32), config=config,
                  interpret=backend.interpret_mode(interpret))
    return out.reshape(x.shape)


def pre_reference(x, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float):
    """Pure JAX: ``model.hyper.hc_pre`` with the Sinkhorn iterations as a loop."""
    from dspark_jax.model.hyper import hc_pre

    return hc_pre(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, sinkhorn_impl="loop")


def head_reference(x, fn, base, scale, *, hc_eps: float, norm_eps: float):
    """Pure JAX: ``model.hyper.hc_head``."""
    from dspark_jax.model.hyper import hc_head

    return hc_head(x, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps)


def post_reference(f, x, post, comb):
    """Pure JAX: ``model.hyper.hc_post``."""
    from dspark_jax.model.hyper import hc_post

    return hc_post(f, x, post, comb)
