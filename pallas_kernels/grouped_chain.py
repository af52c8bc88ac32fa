"""A decode step's routed experts in one launch: the SwiGLU of w1 and w3, then w2 on its quantised
output, each pair of (token, expert) in its own row tile (``group_metadata.pair_tiles``).

As ``grouped_matmul`` launches them, a one-token step's routed experts take three launches: the
SwiGLU's two products with K split (float32 partial sums), ``swiglu_quantise`` (the halves added,
the SwiGLU, the quantisation of w2's input), then w2. Here one grid holds both products, as in
``gemv_chain`` (``tickets``): the SwiGLU's programs first (tile by tile), then w2's (tile by tile).
A w2 program waits until every SwiGLU program of its tile has counted itself done, then adds the
SwiGLU's partial sums of its inputs, applies the SwiGLU and the routing weight, rounds and
quantises them per 128 inputs as ``swiglu_quantise`` does and multiplies them by w2 as
``grouped_matmul`` does. The first tiles' w2 programs start while the last tiles' SwiGLU programs
still run.

The values equal the three launches' bit for bit (the same tiles, products and sums: the
grouped-matmul kernel's ``_weight_step`` / ``_code_dots_step``). Rows are taken as fp8 codes
(``ActQuant`` / ``QuantRows`` against ``fp8`` / ``fp8_k128`` weights). The count buffer holds one
count per tile and the tickets' count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels import backend, tickets
from pallas_kernels import grouped_matmul as gm


def _kernel(tile_group_ref, num_tiles_ref, *refs, fmt1: str, fmt2: str, n1: int, k1: int, n2: int, m: int, bm: int,
            cfg1: gm.GemmConfig, cfg2: gm.GemmConfig, n_x: int, quantise: bool, limit: float, dt, interpret: bool):
    x_refs, refs = refs[:n_x], refs[n_x:]
    w1, w3, rw_ref, w2 = refs[0:2], refs[2:4], refs[4], refs[5:7]
    _count_in, mid_ref, out_ref, count_ref = refs[7:]
    tiles = tile_group_ref.shape[0]
    bn1, bk1, split1 = cfg1.block_n, cfg1.block_k, cfg1.split_k
    bn2, bk2, split2 = cfg2.block_n, cfg2.block_k, cfg2.split_k
    cols1, cols2 = n1 // bn1, n2 // bn2
    steps1, steps2 = k1 // bk1 // split1, n1 // bk2 // split2
    firsts = tiles * cols1 * split1  # the SwiGLU's programs; a tile's count ends at cols1 * split1
    ticket = tickets.take(count_ref, tiles)
    used = num_tiles_ref[0]

    @pl.when(ticket < firsts)
    def _swiglu():
        t = ticket // (cols1 * split1)
        n0 = ticket // split1 % cols1 * bn1
        s = ticket % split1
        r0 = t * bm

        def body(step, accs):
            k0 = (s * steps1 + step) * bk1
            return tuple(a + gm._weight_step(x_refs, w, fmt1, tile_group_ref[t], n1, k1, r0, n0, k0, bm, bn1, bk1, dt,
                                             True, quantise) for a, w in zip(accs, (w1, w3)))

        zero = jnp.zeros((bm, bn1), jnp.float32)
        gate, up = lax.cond(t < used, lambda: lax.fori_loop(0, steps1, body, (zero, zero)), lambda: (zero, zero))
        for i, part in enumerate((gate, up)):  # split s at rows s M.., gate at columns 0.., up at N1..
            mid_ref[pl.ds(s * m + r0, bm), pl.ds(i * n1 + n0, bn1)] = part
        tickets.count_done(count_ref, t, interpret)

    @pl.when(ticket >= firsts)
    def _down():
        u = ticket - firsts
        t = u // (cols2 * split2)
        n0 = u // split2 % cols2 * bn2
        s = u % split2
        r0 = t * bm
        rows = pl.ds(r0, bm)

        def compute():
            tickets.wait_for(count_ref, t, cols1 * split1, interpret)
            rw = rw_ref[rows]

            def x_block(kb):  # the SwiGLU of the partial sums at inputs kb.. (added in order), rounded to dt
                gate, up = mid_ref[rows, pl.ds(kb, gm.FP8_BLOCK)], mid_ref[rows, pl.ds(n1 + kb, gm.FP8_BLOCK)]
                for p in range(1, split1):
                    gate = gate + mid_ref[pl.ds(p * m + r0, bm), pl.ds(kb, gm.FP8_BLOCK)]
                    up = up + mid_ref[pl.ds(p * m + r0, bm), pl.ds(n1 + kb, gm.FP8_BLOCK)]
                return gm._swiglu_rows(gate, up, rw, limit, dt).astype(dt)

            def body(step, acc):
                k0 = (s * steps2 + step) * bk2
                return acc + gm._code_dots_step((), w2, fmt2, tile_group_ref[t], n2, r0, n0, k0, bm, bn2, bk2, False,
                                                x_block=x_block)

            return lax.fori_loop(0, steps2, body, jnp.zeros((bm, bn2), jnp.float32))

        y = lax.cond(t < used, compute, lambda: jnp.zeros((bm, bn2), jnp.float32))
        if split2 == 1:
            out_ref[rows, pl.ds(n0, bn2)] = y.astype(out_ref.dtype)
        else:
            out_ref[pl.ds(s * m + r0, bm), pl.ds(n0, bn2)] = y



def configs(w1: gm.Weights, w2: gm.Weights, tiles: int, block_m: int) -> tuple[gm.GemmConfig, gm.GemmConfig]:
    """The SwiGLU's and w2's tiles: ``grouped_matmul``'s defaults for the same shapes, fitted."""
    _, n1, k1 = w1.shape
    n2 = w2.shape[1]
    cfg1 = gm.default_config(block_m, w1.fmt, n=n1, k=k1, tiles=tiles, weights=2).fit(n1, k1, w1.fmt, True)
    cfg2 = gm.default_config(block_m, w2.fmt, n=n2, k=n1, tiles=tiles).fit(n2, n1, w2.fmt, True)
    return cfg1, cfg2


# The pipeline's depth for both products. Each product alone takes 4 stages (``gm.default_config``),
# but one kernel holding both pipelines at 4 asked for 244 KB of shared memory on an H100 (227 KB
# there): Triton gave the two loops' buffers no common space.
NUM_STAGES = 3


@functools.partial(jax.jit, static_argnames=("block_m", "limit", "out_dtype", "num_stages", "interpret"))
def _pallas(x, w1, w3, w2, row_weight, tile_group, num_tiles, *, block_m: int, limit: float, out_dtype,
            num_stages: int, interpret: bool):
    _, n1, k1 = w1.shape
    n2 = w2.shape[1]
    m, tiles = x.shape[0], tile_group.shape[0]
    cfg1, cfg2 = configs(w1, w2, tiles, block_m)
    x_ops = gm._x_operands(x, w1.fmt)
    kernel = functools.partial(
        _kernel, fmt1=w1.fmt, fmt2=w2.fmt, n1=n1, k1=k1, n2=n2, m=m, bm=block_m, cfg1=cfg1, cfg2=cfg2,
        n_x=len(x_ops), quantise=isinstance(x, gm.QuantRows), limit=limit, dt=jnp.dtype(x.dtype), interpret=interpret)
    programs = tiles * (n1 // cfg1.block_n * cfg1.split_k + n2 // cfg2.block_n * cfg2.split_k)
    args = (tile_group, num_tiles, *x_ops, *gm.flat_operands(w1), *gm.flat_operands(w3),
            row_weight.astype(jnp.float32), *gm.flat_operands(w2), jnp.zeros((tiles + 1,), jnp.int32))
    out_shape = (jax.ShapeDtypeStruct((cfg1.split_k * m, 2 * n1), jnp.float32),
                 jax.ShapeDtypeStruct((m, n2), out_dtype) if cfg2.split_k == 1
                 else jax.ShapeDtypeStruct((cfg2.split_k * m, n2), jnp.float32),
                 jax.ShapeDtypeStruct((tiles + 1,), jnp.int32))
    with backend.quiet_triton_deprecation():
        _, y, _ = pl.pallas_call(
            kernel, grid=(programs,), out_shape=out_shape, interpret=interpret,
            input_output_aliases={len(args) - 1: 2},
            compiler_params=backend.compiler_params(max(cfg1.num_warps, cfg2.num_warps), num_stages),
            name=f"grouped_chain_{w1.fmt}_a8{'q' if isinstance(x, gm.QuantRows) else ''}_swiglu_down"
                 f"_split{cfg1.split_k}_{cfg2.split_k}",
        )(*args)
    if cfg2.split_k == 1:
        return y
    return jnp.sum(y.reshape(cfg2.split_k, m, n2), axis=0).astype(out_dtype)


def takes(x, w1: gm.Weights, w2: gm.Weights, block_m: int) -> bool:
    """Whether the experts can run here: rows taken as fp8 codes (``ActQuant`` / ``QuantRows``)
    against ``fp8`` / ``fp8_k128`` w1, w3 and w2 in 16-row tiles, N1 a multiple of 128."""
    return (isinstance(x, (gm.ActQuant, gm.QuantRows)) and w1.fmt in ("fp8", "fp8_k128") and w2.fmt == w1.fmt
            and gm.fp8_dots(x, w1, block_m) and block_m == 16 and w1.shape[1] % gm.FP8_BLOCK == 0)


def swiglu_down(x: gm.ActQuant | gm.QuantRows, w1: gm.Weights, w3: gm.Weights, w2: gm.Weights,
                row_weight: Float[Array, " m"], tile_group: Int[Array, " t"], num_tiles: Int[Array, " 1"], *,
                block_m: int, limit: float, out_dtype=None, num_stages: int = NUM_STAGES,
                interpret: bool | None = None) -> Float[Array, "m n"]:
    """``grouped_matmul(grouped_swiglu(x, w1, w3, row_weight, ..., quantised_out=True), w2, ...)``
    in one launch, bit for bit (``grouped_matmul``'s default tiles for both); rows ``x`` as fp8
    codes (``takes``). Returns w2's output [M, N2] in ``out_dtype`` (default: x's dtype);
    ``num_stages``: the pipeline's depth (``NUM_STAGES``)."""
    gm.check_inputs(x, w1, tile_group, block_m)
    if w3.shape != w1.shape or w3.fmt != w1.fmt or w2.shape[0] != w1.shape[0] or w2.shape[2] != w1.shape[1]:
        raise ValueError(f"grouped_chain needs w1, w3 [G, N1, K] of one format and w2 [G, N2, N1], got {w1.shape} / "
                         f"{w3.shape} / {w2.shape}")
    if not takes(x, w1, w2, block_m):
        raise ValueError(f"grouped_chain takes rows as fp8 codes against fp8 / fp8_k128 weights in 16-row tiles, "
                         f"got {type(x).__name__}, {w1.fmt} / {w2.fmt}, block_m {block_m}")
    return _pallas(x, w1, w3, w2, row_weight, tile_group, num_tiles, block_m=block_m, limit=float(limit),
                   out_dtype=jnp.dtype(out_dtype or x.dtype), num_stages=int(num_stages),
                   interpret=backend.interpret_mode(interpret))


def reference(x, w1: gm.Weights, w3: gm.Weights, w2: gm.Weights, row_weight, tile_group, num_tiles, *,
              block_m: int, limit: float, out_dtype=None, interpret: bool | None = None) -> Float[Array, "m n"]:
    """The same product in ``grouped_matmul``'s launches (what the model ran before)."""
    h = gm.swiglu_kernel(x, w1, w3, row_weight, tile_group, num_tiles, block_m=block_m, limit=limit,
                         quantised_out=True, interpret=interpret)
    return gm.kernel(h, w2, tile_group, num_tiles, block_m=block_m, out_dtype=out_dtype or x.dtype,
                     interpret=interpret)
