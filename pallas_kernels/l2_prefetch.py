"""Read weights into the GPU's L2 cache ahead of the kernel that multiplies them.

At a batch-1 decode step a 33 MB one-row linear (wq_b, wo_a) streams at 2.4-3.1 TB/s on an
H200 where a 1 GB read reaches 4.0-4.5 (docs/benchmarks.md): the start and the tail of a short
read cost as much as its bytes. Between such linears the step runs latency-bound kernels (mHC,
the norms, attention) that leave the HBM idle. ``prefetch`` reads a weight in that time, beside
them (the engine's programs run independent kernels concurrently,
``compile_cache.COMPILER_OPTIONS``): the weight then sits in the L2 (50 MB on an H200) when its
linear runs.

Ordering is by data: the prefetch takes ``after`` (an array its launch must wait for, e.g. the
previous linear's output) and returns a token, which the linear takes as an input it does not
read (``gemv(..., after=(token,))``): the prefetch starts once ``after`` is written and the
linear once the prefetch is done. The token is each program's float32 sum of the values it read, so
that no compiler drops the loads; ``checksum`` adds it up (tests: every element
read once).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from pallas_kernels import backend

# Programs of a prefetch launch (an H200 has 132 SMs; other kernels run beside it); the values
# each load takes (rows x lanes of the array's 2-D view, as a ``gemv`` program's weight tile) and
# the loads per loop step.
PROGRAMS = 128
LANES = 128
BLOCK_ROWS = 64
UNROLL = 4


def _view(a: Array) -> tuple[Array, int]:
    """``a`` as a row-major 2-D array of at most ``LANES`` columns (a free reshape) and the rows
    each load takes (a power of two dividing its rows)."""
    lanes = backend.largest_pow2_divisor(a.size, LANES)
    rows = a.size // lanes
    return a.reshape(rows, lanes), backend.largest_pow2_divisor(rows, max(1, BLOCK_ROWS * LANES // lanes))


def _kernel(*refs, programs: int, block_rows: tuple[int, ...]):
    *a_refs, _after_ref, o_ref = refs
    p = pl.program_id(0)
    total = jnp.zeros((), jnp.float32)
    for a_ref, bm in zip(a_refs, block_rows):
        chunks = a_ref.shape[0] // bm
        per = pl.cdiv(chunks, programs)  # program p reads chunks p * per .. (p + 1) * per: one stretch
        first, end = p * per, jnp.minimum((p + 1) * per, chunks)

        def body(i, acc, a_ref=a_ref, bm=bm, chunks=chunks, first=first, end=end):
            for u in range(UNROLL):
                c = first + i * UNROLL + u
                tile = a_ref[pl.ds(jnp.minimum(c, chunks - 1) * bm, bm), :].astype(jnp.float32)
                acc = acc + jnp.where(c < end, tile, 0.0)
            return acc

        acc = jax.lax.fori_loop(0, pl.cdiv(per, UNROLL), body, jnp.zeros((bm, a_ref.shape[1]), jnp.float32))
        total = total + jnp.sum(jnp.sum(acc, axis=0))  # summed across the program's threads once
    o_ref[p] = total


@functools.partial(jax.jit, static_argnames=("programs", "interpret"))
def _pallas(arrays: tuple[Array, ...], after: Array, *, programs: int, interpret: bool) -> Array:
    views, block_rows = zip(*(_view(a) for a in arrays))
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            functools.partial(_kernel, programs=programs, block_rows=block_rows),
            grid=(programs,), out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
            interpret=interpret, compiler_params=backend.compiler_params(4, 3), name="l2_prefetch",
        )(*views, after)


def prefetch(arrays: tuple[Array, ...], after: Array, *, programs: int = PROGRAMS,
             interpret: bool | None = None) -> Float[Array, " p"]:
    """Read every element of ``arrays`` once (each as a 2-D view, chunks of rows spread over
    ``programs`` programs), in one launch that waits for ``after``. Returns the token (each
    program's sum of what it read) for the kernel that should find the arrays in the
    L2 to take as an ordering input."""
    if not arrays:
        raise ValueError("prefetch needs at least one array")
    if programs < 1:
        raise ValueError(f"prefetch needs at least one program, got {programs}")
    for a in arrays:
        if a.size == 0 or not (jnp.issubdtype(a.dtype, jnp.floating) or jnp.issubdtype(a.dtype, jnp.integer)):
            raise ValueError(f"prefetch reads non-empty numeric arrays, got {a.dtype} {a.shape}")
    return _pallas(tuple(arrays), after, programs=programs, interpret=backend.interpret_mode(interpret))


def checksum(token: Float[Array, " p"]) -> Array:
    """The sum of every value the prefetch read (float32; exact for small integers)."""
    return jnp.sum(token)
