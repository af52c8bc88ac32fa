"""The routed experts of a decode step, one (token, expert) pair at a time, in two Pallas kernels
that read the routing (idx, w) directly, and their pure-JAX reference.

For tokens x [n, D], the routing idx / w [n, k] and the pairs p = t * k + j (token t, expert
e = idx[t, j]):

    h[p] = swiglu(q(x[t]) W1[e]^T, q(x[t]) W3[e]^T) * w[t, j]      ``up_kernel``: grid pairs x I tiles
    y[t] = sum_j r(q(h[t * k + j]) W2[e]^T)                         ``down_kernel``: grid tokens x D tiles

with ``q`` the activation fake-quantisation ``fp8_sim(., 128)`` when ``quant_sim`` (done in the
kernels) and the roundings of ``model.moe.grouped_experts``: the products rounded to the activation
dtype, SwiGLU and the routing weight in fp32, h in the activation dtype, each pair's output ``r``
rounded to the activation dtype and summed in fp32 over j = 0 .. k - 1 in order.

Optionally the shared expert comes along as one more pair per token (rows n * k + t of h) with
routing weight 1 and weights of its own format (``shared``): y[t] += r(q(h_s[t]) S2^T). Then the
two kernels are the whole expert computation of a MoE layer.

No tile metadata: the pair's expert index is read in the kernel, its one row broadcast to the
16-row tile of a dot. Weights in any ``grouped_matmul`` format, decoded in registers by its
``weight_tiles``. For a few pairs only (a decode step): every pair reads its expert's weights,
even when two pairs share an expert.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend
from pallas_kernels import grouped_matmul as gm

if TYPE_CHECKING:
    from jaxtyping import Array, Float, Int

ROWS = 16  # rows of a dot: a pair's row broadcast (the smallest tensor-core tile)
QUANT_BLOCK = 128  # activation fake-quantisation block (``fp8_sim(., 128)``)


# ------------------------------------------------------------------------------ pure-JAX reference
def reference(x: Float[Array, "n d"], w: Float[Array, "n k"], idx: Int[Array, "n k"], w1: gm.Weights,
              w2: gm.Weights, w3: gm.Weights, *, limit: float, quant_sim: bool,
              shared: tuple[gm.Weights, gm.Weights, gm.Weights] | None = None, out_dtype=jnp.float32
              ) -> Float[Array, "n d"]:
    """The same computation in plain JAX, one pair at a time (``lax.map``)."""
    from dspark_jax.model.quant import fp8_sim

    check_inputs(x, w, idx, w1, w2, w3, shared, quant_sim)
    dt = x.dtype
    q = (lambda a: fp8_sim(a, QUANT_BLOCK)) if quant_sim else (lambda a: a)
    n, k = idx.shape

    def expert(ws, g, xr, rw):
        v1, v2, v3 = (gm.dequantize(wt.group(g), dt)[0] for wt in ws)
        xq = q(xr)
        gate = jnp.dot(v1, xq, preferred_element_type=jnp.float32).astype(dt)
        up = jnp.dot(v3, xq, preferred_element_type=jnp.float32).astype(dt)
        h = (gm.swiglu(gate, up, limit) * rw.astype(dt).astype(jnp.float32)).astype(dt)
        return jnp.dot(v2, q(h), preferred_element_type=jnp.float32).astype(dt).astype(jnp.float32)

    routed = lax.map(lambda a: expert((w1, w2, w3), *a), (idx.reshape(-1), jnp.repeat(x, k, axis=0), w.reshape(-1)))
    y = jnp.zeros((n, x.shape[1]), jnp.float32)
    for j in range(k):  # in order, like the kernel
        y = y + routed.reshape(n, k, -1)[:, j]
    if shared is not None:
        y = y + lax.map(lambda xr: expert(shared, 0, xr, jnp.float32(1)), x)
    return y.astype(out_dtype)


def check_inputs(x, w, idx, w1: gm.Weights, w2: gm.Weights, w3: gm.Weights, shared, quant_sim: bool) -> None:
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be a bf16 / fp32 [n, D] matrix, got {x.dtype} {x.shape}")
    n, d = x.shape
    if idx.ndim != 2 or idx.shape[0] != n or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"expert indices must be integer [{n}, k], got {idx.dtype} {idx.shape}")
    if w.shape != idx.shape:
        raise ValueError(f"routing weights {w.shape} must have the indices' shape {idx.shape}")
    sets = [("routed", (w1, w2, w3))] + ([("shared", shared)] if shared is not None else [])
    for name, (a, b, c) in sets:
        for wt in (a, b, c):
            gm.check_weights(wt)
        i = a.shape[1]
        if a.shape[2] != d or c.shape != a.shape or b.shape != (a.shape[0], d, i):
            raise ValueError(f"{name} weights must be w1, w3 [G, I, {d}] and w2 [G, {d}, I], got {a.shape}, "
                             f"{c.shape}, {b.shape}")
        if a.fmt != c.fmt:
            raise ValueError(f"{name} w1 and w3 must share their format, got {a.fmt} and {c.fmt}")
    if shared is not None and (shared[0].shape[:2] != (1, w1.shape[1])):
        raise ValueError(f"the shared expert must be one group of I = {w1.shape[1]}, got w1 {shared[0].shape}")
    if quant_sim and (d % QUANT_BLOCK or w1.shape[1] % QUANT_BLOCK):
        raise ValueError(f"quant_sim needs D and I multiples of {QUANT_BLOCK}, got D = {d}, I = {w1.shape[1]}")


# ------------------------------------------------------------------------------ Pallas kernels
def _row_operands(ref, row, k0, bk: int, fmt: str, quant_sim: bool) -> tuple[Array, ...]:
    """Inputs k0 .. k0 + bk of one row as dot operands [ROWS, bk] (fp4: even and odd columns)."""
    v = ref[row, pl.ds(k0, bk)][None, :]
    if quant_sim:
        from dspark_jax.model.quant import fp8_sim

        v = fp8_sim(v, QUANT_BLOCK)
    parts = jnp.unstack(v.reshape(1, bk // 2, 2), axis=-1) if fmt == "fp4" else (v,)
    return tuple(jnp.broadcast_to(a, (ROWS, a.shape[1])) for a in parts)


def _first_row(a: Array) -> Array:
    """Row 0 of a [ROWS, bn] tile (every row holds the same values) as [bn]: a masked sum (exact)."""
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, a.shape, 0) == 0, a, 0.0), axis=0)


def _weight_refs(refs, fmts: tuple[str, ...]) -> tuple[list[tuple], tuple]:
    """The refs of weights in formats ``fmts`` (values, and scales unless dense), and the rest."""
    out = []
    for fmt in fmts:
        per = 1 if fmt == "dense" else 2
        out.append(tuple(refs[:per]))
        refs = refs[per:]
    return out, refs


def _up_kernel(idx_ref, w_ref, x_ref, *refs, fmts: tuple[str, ...], bks: tuple[int, ...], k: int, pairs: int,
               i: int, d: int, bn: int, limit: float, quant_sim: bool):
    ws, (o_ref,) = _weight_refs(refs, tuple(f for f in fmts for _ in range(2)))  # w1, w3 of each set
    sets = [ws[:2], ws[2:]]
    p, n0 = pl.program_id(0), pl.program_id(1) * bn
    dt = x_ref.dtype

    def pair(ws, fmt: str, bk: int, token, g, rw):
        def body(step, accs):
            k0 = step * bk
            xs = _row_operands(x_ref, token, k0, bk, fmt, quant_sim)
            return tuple(a + gm.step_product(xs, wr, fmt, g, i, d, n0, k0, bn, bk, dt) for a, wr in zip(accs, ws))

        zero = jnp.zeros((ROWS, bn), jnp.float32)
        gate, up = lax.fori_loop(0, d // bk, body, (zero, zero))
        h = gm.swiglu(gate.astype(dt), up.astype(dt), limit) * rw.astype(dt).astype(jnp.float32)
        o_ref[p, pl.ds(n0, bn)] = _first_row(h).astype(o_ref.dtype)

    if len(fmts) == 1:
        pair(sets[0], fmts[0], bks[0], lax.div(p, k), idx_ref[p], w_ref[p])
        return

    @pl.when(p < pairs)
    def _routed():
        pair(sets[0], fmts[0], bks[0], lax.div(p, k), idx_ref[p], w_ref[p])

    @pl.when(p >= pairs)
    def _shared():
        pair(sets[1], fmts[1], bks[1], p - pairs, 0, jnp.float32(1))


def _down_kernel(idx_ref, h_ref, *refs, fmts: tuple[str, ...], bks: tuple[int, ...], k: int, pairs: int, i: int,
                 d: int, bn: int, quant_sim: bool):
    w2s, (o_ref,) = _weight_refs(refs, fmts)  # w2 of each set
    t, n0 = pl.program_id(0), pl.program_id(1) * bn
    dt = h_ref.dtype
    rounded = lambda a: a.astype(dt).astype(jnp.float32)  # noqa: E731
    zero = jnp.zeros((ROWS, bn), jnp.float32)
    fmt, bk = fmts[0], bks[0]
    steps = i // bk

    def body(s, carry):  # one loop over the k pairs' input steps (pipelined across pairs)
        acc, total = carry
        j, kk = lax.div(s, steps), lax.rem(s, steps)  # (non-negative: no floor correction)
        p, k0 = t * k + j, kk * bk
        xs = _row_operands(h_ref, p, k0, bk, fmt, quant_sim)
        acc = acc + gm.step_product(xs, w2s[0], fmt, idx_ref[p], d, i, n0, k0, bn, bk, dt)
        last = kk == steps - 1
        return jnp.where(last, 0.0, acc), jnp.where(last, total + rounded(acc), total)

    _, total = lax.fori_loop(0, k * steps, body, (zero, zero))
    if len(fmts) > 1:
        fmt, bk = fmts[1], bks[1]

        def shared_body(step, acc):
            xs = _row_operands(h_ref, pairs + t, step * bk, bk, fmt, quant_sim)
            return acc + gm.step_product(xs, w2s[1], fmt, 0, d, i, n0, step * bk, bn, bk, dt)

        total = total + rounded(lax.fori_loop(0, i // bk, shared_body, zero))
    o_ref[t, pl.ds(n0, bn)] = _first_row(total).astype(o_ref.dtype)


def _fit(cfg: gm.GemmConfig, n: int, k: int, fmts: tuple[str, ...], quant_sim: bool
         ) -> tuple[int, tuple[int, ...], gm.GemmConfig]:
    """One column tile for all weight sets, an input tile per set (whole quantisation blocks)."""
    if quant_sim:
        cfg = dataclasses.replace(cfg, block_k=max(cfg.block_k, QUANT_BLOCK))
    fits = [cfg.fit(n, k, f) for f in fmts]
    bn = min(c.block_n for c in fits)
    bks = tuple(c.block_k for c in fits)
    if quant_sim and any(b % QUANT_BLOCK for b in bks):
        raise ValueError(f"quant_sim needs input tiles of whole {QUANT_BLOCK}-blocks, got block_k {bks} "
                         f"(K = {k}, formats {fmts})")
    return bn, bks, fits[0]


def _flat_sets(weights) -> list[Array]:
    return [a for wt in weights for a in gm.flat_operands(wt)]


@functools.partial(jax.jit, static_argnames=("limit", "quant_sim", "cfg", "interpret"))
def _up_pallas(x, w, idx, w1, w3, shared, *, limit: float, quant_sim: bool, cfg: gm.GemmConfig, interpret: bool):
    n, d = x.shape
    k = idx.shape[1]
    i = w1.shape[1]
    fmts = (w1.fmt,) + ((shared[0].fmt,) if shared is not None else ())
    bn, bks, c = _fit(cfg, i, d, fmts, quant_sim)
    weights = [w1, w3] + (list(shared) if shared is not None else [])
    rows = n * k + (n if shared is not None else 0)
    kernel = functools.partial(_up_kernel, fmts=fmts, bks=bks, k=k, pairs=n * k, i=i, d=d, bn=bn, limit=limit,
                               quant_sim=quant_sim)
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=(rows, i // bn),
            out_shape=jax.ShapeDtypeStruct((rows, i), x.dtype),
            compiler_params=backend.compiler_params(c.num_warps, c.num_stages),
            interpret=interpret,
            name="pair_experts_up",
        )(idx.reshape(-1).astype(jnp.int32), w.reshape(-1).astype(jnp.float32), x, *_flat_sets(weights))


@functools.partial(jax.jit, static_argnames=("k", "quant_sim", "cfg", "out_dtype", "interpret"))
def _down_pallas(h, idx, w2, shared_w2, *, k: int, quant_sim: bool, cfg: gm.GemmConfig, out_dtype, interpret: bool):
    n = idx.shape[0]
    d, i = w2.shape[1], w2.shape[2]
    fmts = (w2.fmt,) + ((shared_w2.fmt,) if shared_w2 is not None else ())
    bn, bks, c = _fit(cfg, d, i, fmts, quant_sim)
    weights = [w2] + ([shared_w2] if shared_w2 is not None else [])
    kernel = functools.partial(_down_kernel, fmts=fmts, bks=bks, k=k, pairs=n * k, i=i, d=d, bn=bn,
                               quant_sim=quant_sim)
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=(n, d // bn),
            out_shape=jax.ShapeDtypeStruct((n, d), out_dtype),
            compiler_params=backend.compiler_params(c.num_warps, c.num_stages),
            interpret=interpret,
            name="pair_experts_down",
        )(idx.reshape(-1).astype(jnp.int32), h, *_flat_sets(weights))


def default_configs(fmt: str) -> tuple[gm.GemmConfig, gm.GemmConfig]:
    """(up, down) tiles: the grouped kernel's decode tiles for the up kernel (many programs: pairs x
    I tiles); narrower column tiles for the down kernel, whose grid has only tokens x D tiles."""
    up = gm.default_config(16, fmt)
    return up, dataclasses.replace(up, block_n=32)


def kernel(x: Float[Array, "n d"], w: Float[Array, "n k"], idx: Int[Array, "n k"], w1: gm.Weights,
           w2: gm.Weights, w3: gm.Weights, *, limit: float, quant_sim: bool,
           shared: tuple[gm.Weights, gm.Weights, gm.Weights] | None = None, out_dtype=jnp.float32,
           up_config: gm.GemmConfig | None = None, down_config: gm.GemmConfig | None = None,
           interpret: bool | None = None) -> Float[Array, "n d"]:
    """The two Pallas kernels (same contract as ``reference``)."""
    check_inputs(x, w, idx, w1, w2, w3, shared, quant_sim)
    up, down = default_configs(w1.fmt)
    interpret = backend.interpret_mode(interpret)
    sh13 = None if shared is None else (shared[0], shared[2])
    h = _up_pallas(x, w, idx, w1, w3, sh13, limit=float(limit), quant_sim=bool(quant_sim), cfg=up_config or up,
                   interpret=interpret)
    return _down_pallas(h, idx, w2, None if shared is None else shared[1], k=idx.shape[1], quant_sim=bool(quant_sim),
                        cfg=down_config or down, out_dtype=jnp.dtype(out_dtype), interpret=interpret)
