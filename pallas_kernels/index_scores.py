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
attention's shared one-row launch), added in order here.

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

from pallas_kernels import backend
from pallas_kernels.gemv import Partials, total

BLOCK_N = 64  # entries per program
# The most query rows ``scores`` takes the kernel for: measured on an H200 at one token (a decode
# step) and six (a batch-1 verify); larger verifies (e.g. 32 x 6 rows, ~2 % slower DSpark rounds at
# batch 32 in the run that also moved the indexer's queries into a kernel) not separated: XLA's
# batched GEMM beyond.
KERNEL_MAX_ROWS = 8


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


def _kernel(lim_ref, q_ref, k_ref, w_ref, o_ref, *, t: int, parts: int, scale: float, bn: int, dt):
    r, jb = pl.program_id(0), pl.program_id(1)
    rows, h, d = q_ref.shape
    n = k_ref.shape[1]
    heads = jnp.arange(h, dtype=jnp.int32)
    dims = jnp.arange(d, dtype=jnp.int32)[None, :]
    q = pltriton.load(q_ref.at[r, heads[:, None], dims])  # [h, d]
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
    kernel = functools.partial(_kernel, t=t, parts=parts, scale=scale, bn=BLOCK_N, dt=dtype)
    with backend.quiet_triton_deprecation():
        out = pl.pallas_call(
            kernel,
            grid=(b * t, pl.cdiv(n, BLOCK_N)),
            out_shape=jax.ShapeDtypeStruct((b * t, n), jnp.float32),
            compiler_params=backend.compiler_params(4, 1),
            interpret=interpret,
            name="index_scores",
        )(limit.reshape(-1).astype(jnp.int32), q.reshape(b * t, h, d), keys, w)
    return out.reshape(b, t, n)


def kernel_takes(q: Array, keys) -> bool:
    """Whether ``scores_kernel`` takes these: plain keys [b, n, d] (not ``cache.Fp8Keys``), at
    least 16 heads, d a power of two >= 16 (the dot's tiles)."""
    return (isinstance(keys, jax.Array) and keys.ndim == 3 and q.ndim == 4 and q.shape[0] == keys.shape[0]
            and q.shape[3] == keys.shape[2] and q.shape[2] >= 16 and backend.is_power_of_2(q.shape[2])
            and q.shape[3] >= 16 and backend.is_power_of_2(q.shape[3])
            and q.dtype in (jnp.bfloat16, jnp.float32))


def scores_kernel(q: Float[Array, "b t h d"], keys: Float[Array, "b n d"], w_raw: Array | Partials,
                  limit: Int[Array, "b t"], *, scale: float, dtype, interpret: bool | None = None
                  ) -> Float[Array, "b t n"]:
    """The Pallas kernel (same contract as ``scores_reference``)."""
    if not kernel_takes(q, keys):
        raise ValueError(f"index scores kernel needs queries [b, t, h, d] (bf16 / fp32, h and d powers of two >= 16) "
                         f"and plain keys [b, n, d]; got {q.dtype} {q.shape} and "
                         f"{getattr(keys, 'dtype', type(keys).__name__)} {getattr(keys, 'shape', None)}")
    w_shape = tuple(w_raw.parts.shape[1:]) if isinstance(w_raw, Partials) else tuple(w_raw.shape)
    if w_shape != q.shape[:3] or limit.shape != q.shape[:2]:
        raise ValueError(f"head weights must be {q.shape[:3]} (or partial sums [S, *{q.shape[:3]}]) and limit "
                         f"{q.shape[:2]}, got {w_shape} and {limit.shape}")
    return _pallas(q, keys, w_raw, limit, scale=float(scale), dtype=jnp.dtype(dtype),
                   interpret=backend.interpret_mode(interpret))


def scores(q: Float[Array, "b t h d"], keys, w_raw: Array | Partials, limit: Int[Array, "b t"], *, scale: float,
           dtype, impl: str | None = None) -> Float[Array, "b t n"]:
    """The backend switch: the kernel when ``impl`` resolves to "pallas", it takes the keys and
    there are at most ``KERNEL_MAX_ROWS`` query rows, else the reference (fp8 keys dequantised to
    the queries' dtype)."""
    if backend.resolve(impl) == "pallas" and kernel_takes(q, keys) and q.shape[0] * q.shape[1] <= KERNEL_MAX_ROWS:
        return scores_kernel(q, keys, w_raw, limit, scale=scale, dtype=dtype)
    from dspark_jax.cache import read_kv

    return scores_reference(q, read_kv(keys, q.dtype), w_raw, limit, scale=scale, dtype=dtype)


kernel = scores_kernel
reference = scores_reference
