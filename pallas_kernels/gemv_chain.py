"""Two one-row linears in one launch, the second on the first's output: ``(x W1^T) W2^T`` at a
batch-1 step (the attention's grouped output projection: wo_a per head group, then wo_b).

As two ``gemv`` launches each linear reads its weight (33 MB each for Flash's wo_a and wo_b) with
a ramp at its start and a tail at its end, and the second starts only when the first has ended.
Here one grid holds both (``tickets``: a program's ticket, not its id, says what it computes):
the first linear's programs come first, row (weight group) by row, then the second's, K range by
K range. A second-linear program reads the first's output rows that its K range covers, so it
first waits until every first-linear program of those rows has counted itself done. The first
rows' programs end first, so the second linear's first programs start while the first linear's
last ones still run.

The products and their summation order are ``gemv``'s (``gemv._products``) for the same tiles, so
the result equals the two launches' bit for bit: the first linear's float32 partial sums of its K
split, added in order by the second's programs and rounded to ``mid_dtype``, quantised per 128
inputs when ``quantise2`` (the reference's FP8 GEMM input), the second's output as the float32
partial sums of its K split (``gemv.Partials``, for a consumer that adds them: mHC's expansion).
The count buffer holds one count per first-linear row and the tickets' count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from pallas_kernels import backend, tickets
from pallas_kernels.gemv import GemvConfig, Partials, _products, default_config
from pallas_kernels.grouped_matmul import FP8_BLOCK, Weights


def _kernel(x_ref, w1_ref, s1_ref, w2_ref, s2_ref, _count_in, mid_ref, out_ref, count_ref, *, rows: int,
            cfg1: GemvConfig, cfg2: GemvConfig, quantise1: bool, quantise2: bool, mid_dtype, interpret: bool):
    n1, n2 = mid_ref.shape[1], out_ref.shape[1]
    bn1, bk1, split1 = cfg1.block_n, cfg1.block_k, cfg1.split_k
    bn2, bk2, split2 = cfg2.block_n, cfg2.block_k, cfg2.split_k
    tiles1, tiles2 = n1 // bn1, n2 // bn2
    steps1 = x_ref.shape[1] // bk1 // split1
    steps2 = rows * n1 // bk2 // split2
    firsts = rows * tiles1 * split1  # the first linear's programs; each row's count ends at tiles1 * split1
    ticket = tickets.take(count_ref, rows)

    @pl.when(ticket < firsts)
    def _first():
        r = ticket // (tiles1 * split1)
        j = ticket // split1 % tiles1
        s = ticket % split1
        (y,) = _products(x_ref, [(w1_ref, s1_ref)], ("fp8",), (quantise1,), (n1,), r, r, j * bn1, s * steps1 * bk1,
                         steps1, bk1, bn1)
        mid_ref[pl.ds(s * rows + r, 1), pl.ds(j * bn1, bn1)] = y
        tickets.count_done(count_ref, r, interpret)

    @pl.when(ticket >= firsts)
    def _second():
        t = ticket - firsts
        s = t // tiles2
        j = t % tiles2
        k0 = s * steps2 * bk2

        def wait(r, carry):  # for every first-linear row that this K range reads
            tickets.wait_for(count_ref, r, tiles1 * split1, interpret)
            return carry

        lax.fori_loop(k0 // n1, (k0 + steps2 * bk2 - 1) // n1 + 1, wait, 0)

        def row_block(kb):  # the first linear's output at inputs kb.. of the second: parts added in order, rounded
            r, c = kb // n1, kb % n1
            xb = mid_ref[pl.ds(r, 1), pl.ds(c, FP8_BLOCK)]
            for p in range(1, split1):
                xb = xb + mid_ref[pl.ds(p * rows + r, 1), pl.ds(c, FP8_BLOCK)]
            return xb.astype(mid_dtype)

        (y,) = _products(mid_ref, [(w2_ref, s2_ref)], ("fp8",), (quantise2,), (n2,), 0, 0, j * bn2, k0, steps2, bk2,
                         bn2, x_dtype=mid_dtype, row_block=row_block)
        out_ref[pl.ds(s, 1), pl.ds(j * bn2, bn2)] = y


def configs(rows: int, w1: Weights, w2: Weights, config1: GemvConfig | None = None,
            config2: GemvConfig | None = None) -> tuple[GemvConfig, GemvConfig]:
    """The two linears' tiles: ``gemv``'s for the same shapes (``GemvConfig.fit``)."""
    return ((config1 or default_config()).fit(rows, (w1.shape[1],), w1.shape[2]),
            (config2 or default_config()).fit(1, (w2.shape[1],), w2.shape[2]))


@functools.partial(jax.jit, static_argnames=("quantise1", "quantise2", "mid_dtype", "config1", "config2",
                                             "interpret"))
def _pallas(x, w1: Weights, w2: Weights, *, quantise1: bool, quantise2: bool, mid_dtype, config1, config2,
            interpret: bool) -> Partials:
    rows, k1 = x.shape
    n1, n2 = w1.shape[1], w2.shape[1]
    cfg1, cfg2 = configs(rows, w1, w2, config1, config2)
    kernel = functools.partial(_kernel, rows=rows, cfg1=cfg1, cfg2=cfg2, quantise1=quantise1, quantise2=quantise2,
                               mid_dtype=mid_dtype, interpret=interpret)
    programs = rows * (n1 // cfg1.block_n) * cfg1.split_k + (n2 // cfg2.block_n) * cfg2.split_k
    out_shape = (jax.ShapeDtypeStruct((cfg1.split_k * rows, n1), jnp.float32),
                 jax.ShapeDtypeStruct((cfg2.split_k, n2), jnp.float32),
                 jax.ShapeDtypeStruct((rows + 1,), jnp.int32))
    args = (x, w1.values.reshape(-1, k1), w1.scales.reshape(-1, w1.scales.shape[-1]),
            w2.values.reshape(-1, w2.shape[2]), w2.scales.reshape(-1, w2.scales.shape[-1]),
            jnp.zeros((rows + 1,), jnp.int32))
    with backend.quiet_triton_deprecation():
        _, out, _ = pl.pallas_call(
            kernel, grid=(programs,), out_shape=out_shape, interpret=interpret,
            input_output_aliases={len(args) - 1: 2},
            compiler_params=backend.compiler_params(max(cfg1.num_warps, cfg2.num_warps),
                                                    max(cfg1.num_stages, cfg2.num_stages)),
            name="gemv_chain_fp8" + ("_q" if quantise2 else "") + f"_split{cfg1.split_k}_{cfg2.split_k}",
        )(*args)
    return Partials(out.reshape(cfg2.split_k, 1, n2))


def gemv_chain(x: Float[Array, "r k"], w1: Weights, w2: Weights, *, mid_dtype, quantise1: bool = False,
               quantise2: bool = True, config1: GemvConfig | None = None, config2: GemvConfig | None = None,
               interpret: bool | None = None) -> Partials:
    """``(x[r] @ W1[r]^T for every row r, side by side) @ W2^T`` in one launch: x [R, K1] (row r
    times weight group r of ``w1`` [R, N1, K1], quantised first when ``quantise1``), its outputs
    laid side by side as one row of R N1 inputs, rounded to ``mid_dtype`` (and quantised when
    ``quantise2``) times ``w2`` [1, N2, R N1]. Both weights FP8 (128 x 128 block scales). Returns
    the second product as its K split's float32 partial sums ``Partials`` [S, 1, N2]: the same
    values as ``gemv_many(x, (w1,), arange(R), partials=(True,))`` followed by ``gemv_many`` of
    those partial sums (``rows_dtype=mid_dtype``) on ``w2`` with ``partials=(True,)``, bit for bit."""
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"gemv_chain rows must be bf16 / fp32 [R, K], got {x.dtype} {x.shape}")
    if w1.fmt != "fp8" or w2.fmt != "fp8":
        raise ValueError(f"gemv_chain takes FP8 weights, got {w1.fmt!r} and {w2.fmt!r}")
    rows, k1 = x.shape
    if w1.shape[0] != rows or w1.shape[2] != k1 or k1 % FP8_BLOCK:
        raise ValueError(f"gemv_chain's first weight must be [R = {rows}, N1, K1 = {k1}] (K1 a multiple of "
                         f"{FP8_BLOCK}), got {w1.shape}")
    n1 = w1.shape[1]
    if n1 % FP8_BLOCK or w2.shape[0] != 1 or w2.shape[2] != rows * n1 or w2.shape[1] % 16:
        raise ValueError(f"gemv_chain's second weight must be [1, N2, R N1 = {rows * n1}] (N1 a multiple of "
                         f"{FP8_BLOCK}, N2 of 16), got {w2.shape} after a first of N1 = {n1}")
    return _pallas(x, w1, w2, quantise1=bool(quantise1), quantise2=bool(quantise2), mid_dtype=jnp.dtype(mid_dtype),
                   config1=config1, config2=config2, interpret=backend.interpret_mode(interpret))


def reference(x: Float[Array, "r k"], w1: Weights, w2: Weights, *, mid_dtype, quantise1: bool = False,
              quantise2: bool = True, config1: GemvConfig | None = None, config2: GemvConfig | None = None,
              interpret: bool | None = None) -> Partials:
    """The same product as two ``gemv`` launches (what the model ran before)."""
    import numpy as np

    from pallas_kernels.gemv import ONE_GROUP, gemv_many

    cfg1, cfg2 = configs(x.shape[0], w1, w2, config1, config2)
    (mid,) = gemv_many(x, (w1,), np.arange(x.shape[0], dtype=np.int32), quantise=(quantise1,), partials=(True,),
                       config=cfg1, interpret=interpret)
    (out,) = gemv_many(mid.reshape(1, -1), (w2,), ONE_GROUP, quantise=(quantise2,), partials=(True,),
                       rows_dtype=mid_dtype, config=cfg2, interpret=interpret)
    return out
