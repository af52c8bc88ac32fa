"""The lightning indexer's scores at decode and verify in one kernel, beside its pure-JAX reference.

A C4 layer's indexer (``dspark_jax.model.indexer``) scores every compressed entry s for every
query row r (request b(r), position p(r)):

    w[r, h]     = round(round(weights_proj(x)[r, h]) * scale)       # in the activations' dtype
    score[r, s] = sum_h w[r, h] * relu(q[r, h] . K[b(r), s])        # float32
    score[r, s] = -inf where s >= limit[r] = (p(r) + 1) // 4         # entries not yet visible

then picks its top-k (``top_k``). In XLA at one token that is the q.K dot, the weights' split sums
and scaling fused with relu and the product, the sum over heads and the mask: four launches of
1-2 us for ~200 KB. ``scores_kernel`` does it in one, grid (rows, blocks of ``block_n`` entries):
each program multiplies the row's H queries by its block of keys ([H, D] x [block_n, D]: bf16
operands are exact products summed in float32), then relu, the heads' weighted sum and the mask.
weights_proj(x) may come as the float32 partial sums of its K split (``gemv.Partials``, from the
attention's shared one-row launch), added in order here. The queries may come unfinished
(``kv_rows.QueryRows``: wq_b's output before RoPE, the Hadamard rotation and e2m1): each program
then finishes the row's queries itself (``kv_rows.query_tile``, the code of ``query_rows``), which
takes the ``query_rows`` launch off a C4 layer's chain.

Numerics: the reference's products, float32 sums in another order (the dot's and the heads').
Inference only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels import backend, kv_rows
from pallas_kernels.gemv import Partials, total

BLOCK_N = 64  # entries per program
# The most query rows ``scores`` takes the kernel for: measured on an H200 at one token (a decode
# step) and six (a batch-1 verify); larger verifies (e.g. 32 x 6 rows, ~2 % slower DSpark rounds at
# batch 32 in the run that also moved the indexer's queries into a kernel) not separated: XLA's
# batched GEMM beyond.
KERNEL_MAX_ROWS = 8
# The most programs (query rows x entry blocks) that finish unfinished queries themselves
# (``kv_rows.QueryRows``): each re-reads the row's queries and the signs (~64 KiB from the L2), so
# beyond ~256 programs (16 MiB; e.g. 8 rows at an 8k context) the re-reads would cost about what
# the ``query_rows`` launch they replace costs (~5 us on an H200); there the queries are finished
# in their own launch first. Not yet measured.
QUERIES_MAX_PROGRAMS = 256


def head_weights(w_raw: Array | Partials, scale: float, dtype) -> Float[Array, "... h"]:
    """The model's head weights: weights_proj's output (its parts added, rounded to ``dtype``) times
    ``scale`` in ``dtype`` (a weakly typed scalar: rounded to ``dtype`` first), as float32."""
    return (total(w_raw, dtype) * scale).astype(jnp.float32)


def scores_reference(q: Float[Array, "b t h d"], keys: Float[Array, "b n d"], w_raw: Array | Partials,
                     limit: Int[Array, "b t"], *, scale: float, dtype) -> Float[Array, "b t n"]:
    """Pure JAX: ``indexer.index_scores`` with the head weights and the mask."""
    from dspark_jax.model.indexer import index_scores

    score = index_scores(q, keys.astype(q.dtype), head_weights(w_raw, scale, dtype))
    n = keys.shape[1]
    return jnp.where(jnp.arange(n)[None, None] < limit[..., None], score, -jnp.inf)


def _kernel(lim_ref, q_ref, k_ref, w_ref, *refs, t: int, parts: int, scale: float, bn: int, dt, h: int, d: int,
            raw: tuple | None = None):
    """``raw`` (q_parts, rope_dim, quant, dtype): q_ref holds the unfinished queries [S rows h, d]
    (``kv_rows.QueryRows``), finished here (``kv_rows.query_tile``) with the refs positions,
    inv_freq[, signs] before the output."""
    r, jb = pl.program_id(0), pl.program_id(1)
    rows, n = lim_ref.shape[0], k_ref.shape[1]
    heads = jnp.arange(h, dtype=jnp.int32)
    dims = jnp.arange(d, dtype=jnp.int32)[None, :]
    if raw is None:
        (o_ref,) = refs
        q = pltriton.load(q_ref.at[r, heads[:, None], dims])  # [h, d]
    else:
        (q_parts, rope_dim, quant, q_dt), (pos_ref, freq_ref, *sign_ref, o_ref) = raw, refs
        q = kv_rows.query_tile(kv_rows.rows_loader(q_ref, r * h, h, q_parts), freq_ref,
                               sign_ref[0] if sign_ref else None, pos_ref[r], heads=h, w=d, rope_dim=rope_dim,
                               quant=quant, dt=q_dt)
    j = jb * bn + jnp.arange(bn, dtype=jnp.int32)
    j_ok = j < n
    keys = pltriton.load(k_ref.at[r // t, j[:, None], dims], mask=j_ok[:, None], other=0.0).astype(q.dtype)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # (Triton's default: TF32)
    s = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)  # [h, bn]
    wr = pltriton.load(w_ref.at[r, heads]).astype(jnp.float32)
    for p in range(1, parts):  # the split's parts added in order
        wr = wr + pltriton.load(w_ref.at[p * rows + r, heads])
    scale_dt = jnp.asarray(scale, dt).astype(jnp.float32)
    w = (wr.astype(dt).astype(jnp.float32) * scale_dt).astype(dt).astype(jnp.float32)
    score = jnp.sum(jnp.maximum(s, 0.0) * w[:, None], axis=0)  # [bn]
    score = jnp.where(j < lim_ref[r], score, -jnp.inf)
    pltriton.store(o_ref.at[r, j], score, mask=j_ok)


@functools.partial(jax.jit, static_argnames=("scale", "dtype", "interpret"))
def _pallas(q, keys, w_raw, limit, *, scale: float, dtype, interpret: bool):
    b, t, h, d = q.shape
    n = keys.shape[1]
    if isinstance(w_raw, Partials):
        parts, w = w_raw.parts.shape[0], w_raw.parts.astype(jnp.float32).reshape(-1, h)
    else:
        parts, w = 1, w_raw.reshape(b * t, h)
    raw, extra = None, ()
    if isinstance(q, kv_rows.QueryRows):  # finished in the kernel
        c = q.c.parts if isinstance(q.c, Partials) else q.c[None]
        freq = jnp.asarray(q.inv_freq, jnp.float32)
        raw = (c.shape[0], 2 * freq.shape[0], q.quant, jnp.dtype(q.dtype))
        extra = (q.positions.reshape(-1).astype(jnp.int32), freq, *kv_rows.sign_operands(q.quant, d, q.dtype))
        q_in = c.astype(jnp.float32).reshape(-1, d)
    else:
        q_in = q.reshape(b * t, h, d)
    kernel = functools.partial(_kernel, t=t, parts=parts, scale=scale, bn=BLOCK_N, dt=dtype, h=h, d=d, raw=raw)
    with backend.quiet_triton_deprecation():
        out = pl.pallas_call(
            kernel,
            grid=(b * t, pl.cdiv(n, BLOCK_N)),
            out_shape=jax.ShapeDtypeStruct((b * t, n), jnp.float32),
            compiler_params=backend.compiler_params(4, 1),
            interpret=interpret,
            name="index_scores" + ("_queries" if raw else ""),
        )(limit.reshape(-1).astype(jnp.int32), q_in, keys, w, *extra)
    return out.reshape(b, t, n)


def kernel_takes(q: Array | kv_rows.QueryRows, keys) -> bool:
    """Whether ``scores_kernel`` takes these: plain keys [b, n, d] (not ``cache.Fp8Keys``), at
    least 16 heads, d a power of two >= 16 (the dot's tiles); unfinished queries
    (``kv_rows.QueryRows``) that ``query_tile`` takes."""
    if isinstance(q, kv_rows.QueryRows):
        return q.fit() and kernel_takes(jax.ShapeDtypeStruct(q.shape, jnp.dtype(q.dtype)), keys)
    return (isinstance(keys, jax.Array) and keys.ndim == 3 and q.ndim == 4 and q.shape[0] == keys.shape[0]
            and q.shape[3] == keys.shape[2] and q.shape[2] >= 16 and backend.is_power_of_2(q.shape[2])
            and q.shape[3] >= 16 and backend.is_power_of_2(q.shape[3])
            and q.dtype in (jnp.bfloat16, jnp.float32))


def scores_kernel(q: Float[Array, "b t h d"] | kv_rows.QueryRows, keys: Float[Array, "b n d"],
                  w_raw: Array | Partials, limit: Int[Array, "b t"], *, scale: float, dtype,
                  interpret: bool | None = None) -> Float[Array, "b t n"]:
    """The Pallas kernel (same contract as ``scores_reference``; queries may come unfinished,
    ``kv_rows.QueryRows``: finished as ``query_rows`` finishes them, in this launch)."""
    if not kernel_takes(q, keys):
        raise ValueError(f"index scores kernel needs queries [b, t, h, d] (bf16 / fp32, h and d powers of two >= 16) "
                         f"and plain keys [b, n, d]; got {jnp.dtype(q.dtype)} {q.shape} and "
                         f"{getattr(keys, 'dtype', type(keys).__name__)} {getattr(keys, 'shape', None)}")
    w_shape = tuple(w_raw.parts.shape[1:]) if isinstance(w_raw, Partials) else tuple(w_raw.shape)
    if w_shape != q.shape[:3] or limit.shape != q.shape[:2]:
        raise ValueError(f"head weights must be {q.shape[:3]} (or partial sums [S, *{q.shape[:3]}]) and limit "
                         f"{q.shape[:2]}, got {w_shape} and {limit.shape}")
    return _pallas(q, keys, w_raw, limit, scale=float(scale), dtype=jnp.dtype(dtype),
                   interpret=backend.interpret_mode(interpret))


def scores(q: Float[Array, "b t h d"] | kv_rows.QueryRows, keys, w_raw: Array | Partials, limit: Int[Array, "b t"],
           *, scale: float, dtype, impl: str | None = None) -> Float[Array, "b t n"]:
    """The backend switch: the kernel when ``impl`` resolves to "pallas", it takes the keys and
    there are at most ``KERNEL_MAX_ROWS`` query rows, else the reference (fp8 keys dequantised to
    the queries' dtype). Unfinished queries are finished in the kernel where it takes them and
    runs at most ``QUERIES_MAX_PROGRAMS`` programs, else first (``query_rows``)."""
    kernel = backend.resolve(impl) == "pallas" and kernel_takes(q, keys) and q.shape[0] * q.shape[1] <= KERNEL_MAX_ROWS
    if isinstance(q, kv_rows.QueryRows):
        programs = q.shape[0] * q.shape[1] * pl.cdiv(keys.shape[1], BLOCK_N)
        if not (kernel and programs <= QUERIES_MAX_PROGRAMS):
            q = q.finish(impl)
            kernel = kernel and kernel_takes(q, keys)
    if kernel:
        return scores_kernel(q, keys, w_raw, limit, scale=scale, dtype=dtype)
    from dspark_jax.cache import read_kv

    return scores_reference(q, read_kv(keys, q.dtype), w_raw, limit, scale=scale, dtype=dtype)


kernel = scores_kernel
reference = scores_reference
