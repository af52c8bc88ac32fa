"""The MoE router of a decode step in two Pallas kernels, and its pure-JAX reference.

For tokens x [n, D] and the router weight W [E, D] (the official ``gate.weight``):

    logits = x W^T                                  float32 (``model.common.matmul_f32``)
    scores = route_scores(logits)                   sqrtsoftplus / softmax / sigmoid
    idx    = top_k(scores + bias)                   learned routing (the bias only selects), or given
                                                    (hash routing: the table lookup stays outside)
    w      = scores[idx] (/ their sum) * scale      normalised unless softmax or ``norm`` is off

``logits_kernel`` computes the logits over a grid of expert tiles (the 2 MiB bf16 weight of a
DeepSeek-V4-Flash router streams through many programs at once; one program alone would read it
at a single multiprocessor's bandwidth); ``select_kernel`` does everything after it for a tile of
tokens in one program. The logits accumulate in float32 exactly as ``matmul_f32`` computes them:
bf16 activations and weights in one bf16 dot; fp32 activations with bf16 weights split into three
bf16 parts (three dots, combined as hi + (mid + lo)); fp32 weights in an IEEE fp32 dot (never TF32).
Only the summation order can differ from XLA's GEMM. The top-k is ``jax.lax.top_k``'s: the largest
first, equal values in index order (scores must not be NaN).

``select`` alone takes the logits from elsewhere, also as the float32 partial sums of their K
split (``gemv.Partials``): a batch-1 step's router is ``gemv``'s one-row product with its partial
sums kept, then ``select`` (two launches, where the sums, the scores, the top-k and the weights
took two XLA fusions after the product).
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
from pallas_kernels.gemv import Partials

if TYPE_CHECKING:
    from jaxtyping import Array, Float, Int

SCORE_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
BLOCK_T = 16  # tokens per logits program (the dot's smallest row tile), and at most per selection program


# ------------------------------------------------------------------------------ pure-JAX reference
def route_scores(logits: Float[Array, "n e"], func: str) -> Float[Array, "n e"]:
    if func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def gate_weights(scores: Float[Array, "n e"], idx: Int[Array, "n k"], *, func: str, norm: bool,
                 scale: float) -> Float[Array, "n k"]:
    """The routing weights of the chosen experts: their scores, normalised to sum 1 (unless softmax
    scores or ``norm`` off), times ``scale``."""
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if func != "softmax" and norm:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w * scale


def reference(x: Float[Array, "n d"], weight: Float[Array, "e d"], bias: Float[Array, " e"] | None,
              idx: Int[Array, "n k"] | None, *, top_k: int, func: str, norm: bool,
              scale: float) -> tuple[Float[Array, "n k"], Int[Array, "n k"]]:
    """(w [n, k] fp32, idx [n, k] int32) in plain JAX: learned routing (``bias``) or given ``idx``."""
    from dspark_jax.model.common import matmul_f32

    _check(x, weight, bias, idx, top_k, func)
    scores = route_scores(matmul_f32(x, weight), func)
    if idx is None:
        idx = lax.top_k(scores + bias, top_k)[1]
    return gate_weights(scores, idx, func=func, norm=norm, scale=scale), idx.astype(jnp.int32)


def _check(x, weight, bias, idx, top_k: int, func: str) -> None:
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be a bf16 / fp32 [n, D] matrix, got {x.dtype} {x.shape}")
    if weight.ndim != 2 or weight.shape[1] != x.shape[1] or weight.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"the router weight must be bf16 / fp32 [E, {x.shape[1]}], got {weight.dtype} {weight.shape}")
    _check_selection(x.shape[0], weight.shape[0], bias, idx, top_k, func)


def _check_selection(n: int, e: int, bias, idx, top_k: int, func: str) -> None:
    """The selection's arguments for n tokens over e experts."""
    if func not in SCORE_FUNCS:
        raise ValueError(f"score function must be one of {SCORE_FUNCS}, got {func!r}")
    if (bias is None) == (idx is None):
        raise ValueError("give either the selection bias (learned routing) or the expert indices (hash routing)")
    if bias is not None and bias.shape != (e,):
        raise ValueError(f"the selection bias must be [{e}], got {bias.shape}")
    if idx is not None and (idx.shape != (n, top_k) or not jnp.issubdtype(idx.dtype, jnp.integer)):
        raise ValueError(f"expert indices must be integer [{n}, {top_k}], got {idx.dtype} {idx.shape}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must lie in [1, {e}] experts, got {top_k}")


# ------------------------------------------------------------------------------ Pallas kernels
@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """``block_e`` experts per logits program, ``block_k`` inputs per loop step (powers of two >= 16)."""

    block_e: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3


def _iota(n: int, start=0) -> Array:
    return start + jnp.arange(n, dtype=jnp.int32)


def _logits_kernel(x_ref, w_ref, o_ref, *, n: int, e: int, d: int, be: int, bk: int):
    from dspark_jax.model.common import bf16_parts

    rows = _iota(BLOCK_T, pl.program_id(0) * BLOCK_T)[:, None]
    experts = _iota(be, pl.program_id(1) * be)[:, None]
    row_ok, expert_ok = rows < n, experts < e
    exact_f32 = w_ref.dtype == jnp.float32

    def dot(a, b):
        prec = lax.Precision.HIGHEST if exact_f32 else None  # IEEE fp32 for fp32 weights, never TF32
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)

    def body(step, accs):
        cols = _iota(bk, step * bk)[None, :]
        x = pltriton.load(x_ref.at[rows, cols], mask=jnp.broadcast_to(row_ok, (BLOCK_T, bk)), other=0.0)
        w = pltriton.load(w_ref.at[experts, cols], mask=jnp.broadcast_to(expert_ok, (be, bk)), other=0.0)
        if exact_f32:
            parts = (x.astype(jnp.float32),)
        elif x.dtype == jnp.float32:
            parts = bf16_parts(x)
        else:
            parts = (x,)
        return tuple(a + dot(p, w) for a, p in zip(accs, parts))

    n_parts = 3 if x_ref.dtype == jnp.float32 and not exact_f32 else 1
    accs = lax.fori_loop(0, d // bk, body, (jnp.zeros((BLOCK_T, be), jnp.float32),) * n_parts)
    y = accs[0] if n_parts == 1 else accs[0] + (accs[1] + accs[2])  # as matmul_f32 combines them
    pltriton.store(o_ref.at[rows, experts.T], y, mask=row_ok & expert_ok.T)


def select_rows(l_ref, sel_ref, rows: Array, *, n: int, e: int, k: int, func: str, norm: bool, scale: float,
                learned: bool, parts: int) -> tuple[Array, Array, Array]:
    """The selection of the tokens ``rows`` [bt, 1] (inside a kernel): (w [bt, kp] times ``scale``,
    idx [bt, kp], the slots [1, kp]; kp = k to a power of two, slots >= k unused) from the logits
    ``l_ref`` (or, ``parts`` > 1, their K split's partial sums [parts n, e], added in order) and
    ``sel_ref``: the selection bias [e] (``learned``) or the given experts [n, k]."""
    bt = rows.shape[0]
    ep, kp = backend.next_power_of_2(e), backend.next_power_of_2(k)
    cols, slots = _iota(ep)[None, :], _iota(kp)[None, :]
    row_ok, col_ok = rows < n, cols < e
    logits = pltriton.load(l_ref.at[rows, cols], mask=row_ok & col_ok, other=0.0)
    for s in range(1, parts):
        logits = logits + pltriton.load(l_ref.at[s * n + rows, cols], mask=row_ok & col_ok, other=0.0)
    scores = route_scores(jnp.where(col_ok, logits, -jnp.inf), func)  # padded experts score 0
    if learned:
        biased = scores + pltriton.load(sel_ref.at[cols], mask=col_ok, other=0.0)
        taken = ~col_ok
    else:
        given = pltriton.load(sel_ref.at[rows, slots], mask=row_ok & (slots < k), other=0)
    idx = jnp.zeros((bt, kp), jnp.int32)
    w = jnp.zeros((bt, kp), jnp.float32)
    total = jnp.zeros((bt, 1), jnp.float32)
    for j in range(k):
        if learned:  # the largest remaining biased score, the lowest index among equals (lax.top_k)
            best = jnp.max(jnp.where(taken, -jnp.inf, biased), axis=1, keepdims=True)
            pick = jnp.min(jnp.where(~taken & (biased == best), cols, ep), axis=1, keepdims=True)
            taken = taken | (cols == pick)
        else:
            pick = jnp.sum(jnp.where(slots == j, given, 0), axis=1, keepdims=True)
        wj = jnp.sum(jnp.where(cols == pick, scores, 0.0), axis=1, keepdims=True)  # one term: exact
        idx = jnp.where(slots == j, pick, idx)
        w = jnp.where(slots == j, wj, w)
        total = total + wj
    if func != "softmax" and norm:
        w = w / total
    return w * scale, idx, slots


def _select_kernel(*refs, n: int, e: int, k: int, func: str, norm: bool, scale: float, learned: bool, parts: int,
                   bt: int):
    l_ref, sel_ref, w_ref, idx_ref = refs
    rows = _iota(bt, pl.program_id(0) * bt)[:, None]
    w, idx, slots = select_rows(l_ref, sel_ref, rows, n=n, e=e, k=k, func=func, norm=norm, scale=scale,
                                learned=learned, parts=parts)
    out_ok = (rows < n) & (slots < k)
    pltriton.store(w_ref.at[rows, slots], w, mask=out_ok)
    pltriton.store(idx_ref.at[rows, slots], idx, mask=out_ok)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _logits_pallas(x, weight, *, cfg: RouterConfig, interpret: bool):
    n, d = x.shape
    e = weight.shape[0]
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            functools.partial(_logits_kernel, n=n, e=e, d=d, be=cfg.block_e, bk=cfg.block_k),
            grid=(pl.cdiv(n, BLOCK_T), pl.cdiv(e, cfg.block_e)),
            out_shape=jax.ShapeDtypeStruct((n, e), jnp.float32),
            compiler_params=backend.compiler_params(cfg.num_warps, cfg.num_stages),
            interpret=interpret,
            name="router_logits",
        )(x, weight)


@functools.partial(jax.jit, static_argnames=("k", "func", "norm", "scale", "interpret"))
def _select_pallas(logits, sel, *, k: int, func: str, norm: bool, scale: float, interpret: bool):
    parts, n, e = logits.shape if logits.ndim == 3 else (1, *logits.shape)
    logits = logits.reshape(parts * n, e)
    # the tokens' rows in tiles of up to 16 (a decode step's one token: one row, one warp, so that the
    # top-k's reductions run on one row's lanes)
    bt = min(BLOCK_T, backend.next_power_of_2(max(n, 1)))
    kernel = functools.partial(_select_kernel, n=n, e=e, k=k, func=func, norm=norm, scale=scale,
                               learned=sel.ndim == 1, parts=parts, bt=bt)
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=(pl.cdiv(n, bt),),
            out_shape=(jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.int32)),
            compiler_params=backend.compiler_params(max(1, bt // 4), 1),
            interpret=interpret,
            name="router_select",
        )(logits, sel)


def selection_operands(logits: Float[Array, "n e"] | Partials, bias: Float[Array, " e"] | None,
                       idx: Int[Array, "n k"] | None, *, top_k: int, func: str) -> tuple[Array, Array]:
    """The selection kernels' operands, checked: the logits' parts [S, n, e] (S = 1: the logits) and
    the selection (the bias [e] as float32, or the given experts [n, k] as int32)."""
    parts = logits.parts if isinstance(logits, Partials) else logits
    if parts.dtype != jnp.float32 or parts.ndim != (3 if isinstance(logits, Partials) else 2):
        raise ValueError(f"router logits must be float32 [n, e] (or partial sums [S, n, e]), got {parts.dtype} "
                         f"{parts.shape}")
    _check_selection(*parts.shape[-2:], bias, idx, top_k, func)
    return parts, bias.astype(jnp.float32) if idx is None else idx.astype(jnp.int32)


def select(logits: Float[Array, "n e"] | Partials, bias: Float[Array, " e"] | None, idx: Int[Array, "n k"] | None, *,
           top_k: int, func: str, norm: bool, scale: float, interpret: bool | None = None
           ) -> tuple[Float[Array, "n k"], Int[Array, "n k"]]:
    """Everything after the logits in one launch (``select_kernel``): the logits as an array, or as
    the float32 partial sums of their K split (``gemv.Partials`` [S, n, e], e.g. ``gemv_many``'s
    with ``partials``), added in order in the kernel. Same contract as ``reference`` from the
    logits on."""
    parts, sel = selection_operands(logits, bias, idx, top_k=top_k, func=func)
    return _select_pallas(parts, sel, k=top_k, func=func, norm=bool(norm), scale=float(scale),
                          interpret=backend.interpret_mode(interpret))


def kernel(x: Float[Array, "n d"], weight: Float[Array, "e d"], bias: Float[Array, " e"] | None,
           idx: Int[Array, "n k"] | None, *, top_k: int, func: str, norm: bool, scale: float,
           config: RouterConfig | None = None, interpret: bool | None = None
           ) -> tuple[Float[Array, "n k"], Int[Array, "n k"]]:
    """The Pallas kernels (same contract as ``reference``)."""
    _check(x, weight, bias, idx, top_k, func)
    cfg = config or RouterConfig()
    d = x.shape[1]
    bk = 1
    while bk * 2 <= cfg.block_k and d % (bk * 2) == 0:
        bk *= 2
    if bk < 16 or not backend.is_power_of_2(cfg.block_e) or cfg.block_e < 16:
        raise ValueError(f"no legal router tiles: need D % 16 == 0 (D = {d}) and block_e a power of two >= 16 "
                         f"(got {cfg.block_e})")
    interpret = backend.interpret_mode(interpret)
    logits = _logits_pallas(x, weight, cfg=dataclasses.replace(cfg, block_k=bk), interpret=interpret)
    return select(logits, bias, idx, top_k=top_k, func=func, norm=norm, scale=scale, interpret=interpret)

