"""The indexer's top-k at decode and verify: the k largest of each row's scores by rank, in one
kernel, beside its reference ``jax.lax.top_k``.

A C4 layer's lightning indexer (``dspark_jax.model.indexer``) picks, for every query, the
``index_topk`` (512) best of its compressed entries: a row of n scores, n = the cache's entries
(512 at a 2k-token context, 8192 at 32k). XLA's TopK of k = 512 sorts each row: 9 us per C4 layer
at one query on an H200, for a few KiB. Here every element's place in the order is counted
directly,

    rank[i] = #{j : s[j] > s[i]} + #{j < i : s[j] == s[i]},

and i is written to output slot rank[i] when rank[i] < k. The ranks are a permutation of 0 .. n-1,
so the k slots are each written once, in ``lax.top_k``'s order: descending, equal scores in index
order. Scores compare in IEEE total order (as ``lax.top_k`` on CPU: +0 above -0, NaN above
everything), through their bits as ordered integers. Grid (rows, blocks of ``block_i`` elements):
a program ranks its elements against the whole row in steps of ``block_j``: n^2 comparisons per
row, so ``top_k`` takes the kernel only for calls of up to ``MAX_SCORES`` scores (rows x n) and
XLA's sort beyond (long contexts, large batches).
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

if TYPE_CHECKING:  # shape annotations only
    from jaxtyping import Array, Float, Int

# The most scores (rows x n) a call ranks in the kernel: beyond, XLA's sort. On an H200
# (``benchmarks/top_k.py``, k = 512, docs/benchmarks.md) the kernel was faster in every measured
# case within it (1 x 512 to 32 x 512, 1 x 2048 and 6 x 2048, 1 x 8192: 2.2 against 6.1 us at
# 1 x 512) and slower in every case beyond (192 x 512, 32 x 2048, 6 x 8192).
MAX_SCORES = 1 << 14


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    """``block_i`` elements ranked per program, against ``block_j`` of the row per loop step
    (powers of two)."""

    # the H200's best or within 10 % of it in each case of ``benchmarks/top_k.py`` within MAX_SCORES
    block_i: int = 16
    block_j: int = 256
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_i", "block_j"):
            if not backend.is_power_of_2(getattr(self, name)):
                raise ValueError(f"TopKConfig.{name} must be a power of two, got {getattr(self, name)}")


def reference(scores: Float[Array, "r n"], k: int, limit: Int[Array, " r"] | None = None) -> Int[Array, "r k"]:
    """``jax.lax.top_k``'s indices (with ``limit``: those >= the row's limit as -1)."""
    _check(scores, k)
    idx = lax.top_k(scores, k)[1].astype(jnp.int32)
    return idx if limit is None else jnp.where(idx < limit[..., None], idx, -1)


def _check(scores, k: int) -> None:
    if scores.ndim < 1 or scores.dtype != jnp.float32:
        raise ValueError(f"scores must be float32 [..., n], got {scores.dtype} {scores.shape}")
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"k must lie in [1, n = {scores.shape[-1]}], got {k}")


def _ordered(s: Array) -> Array:
    """float32 -> int32 keys in IEEE total order (negative floats: the magnitude bits flipped)."""
    bits = lax.bitcast_convert_type(s, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _rank_kernel(s_ref, *refs, n: int, k: int, bi: int, bj: int):
    *lim_ref, o_ref = refs
    row = jnp.full((1,), pl.program_id(0), jnp.int32)[:, None]  # [1, 1]
    i = (pl.program_id(1) * bi + jnp.arange(bi, dtype=jnp.int32))[:, None]  # [bi, 1]
    i_ok = i < n
    key_i = _ordered(pltriton.load(s_ref.at[row, i.T], mask=i_ok.T, other=0.0)).T  # [bi, 1]

    def step(step_j, rank):
        j = (step_j * bj + jnp.arange(bj, dtype=jnp.int32))[None, :]  # [1, bj]
        j_ok = j < n
        key_j = _ordered(pltriton.load(s_ref.at[row, j], mask=j_ok, other=0.0))
        above = j_ok & ((key_j > key_i) | ((key_j == key_i) & (j < i)))  # [bi, bj]
        return rank + jnp.sum(above.astype(jnp.int32), axis=1, keepdims=True)

    rank = lax.fori_loop(0, pl.cdiv(n, bj), step, jnp.zeros((bi, 1), jnp.int32))
    keep = i_ok & (rank < k)
    # unkept elements point one past the row: never accessed on a GPU, and in interpret mode a
    # masked store to a real slot could overwrite it
    out = i if not lim_ref else jnp.where(i < lim_ref[0][pl.program_id(0)], i, -1)  # (the row's limit)
    pltriton.store(o_ref.at[row, jnp.where(keep, rank, k).T], out.T, mask=keep.T)


@functools.partial(jax.jit, static_argnames=("k", "config", "interpret"))
def _top_k_pallas(scores, limit, *, k: int, config: TopKConfig, interpret: bool):
    r, n = scores.shape
    bi = min(config.block_i, backend.next_power_of_2(n))
    bj = min(config.block_j, backend.next_power_of_2(n))
    kernel = functools.partial(_rank_kernel, n=n, k=k, bi=bi, bj=bj)
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=(r, pl.cdiv(n, bi)),
            out_shape=jax.ShapeDtypeStruct((r, k), jnp.int32),
            compiler_params=backend.compiler_params(config.num_warps, config.num_stages),
            interpret=interpret,
            name="top_k_rank",
        )(scores, *(() if limit is None else (limit,)))


def kernel(scores: Float[Array, "... n"], k: int, limit: Int[Array, "..."] | None = None, *,
           config: TopKConfig = TopKConfig(), interpret: bool | None = None) -> Int[Array, "... k"]:
    """The Pallas kernel (same contract as ``reference``, any leading dims; ``limit`` of the
    leading dims' shape)."""
    _check(scores, k)
    lead, n = scores.shape[:-1], scores.shape[-1]
    if limit is not None and limit.shape != lead:
        raise ValueError(f"limit must have the scores' leading shape {lead}, got {limit.shape}")
    if scores.size == 0:
        return reference(scores, k, limit)
    lim = None if limit is None else limit.reshape(-1).astype(jnp.int32)
    out = _top_k_pallas(scores.reshape(-1, n), lim, k=k, config=config, interpret=backend.interpret_mode(interpret))
    return out.reshape(*lead, k)


def top_k(scores: Float[Array, "... n"], k: int, limit: Int[Array, "..."] | None = None, *,
          impl: str | None = None) -> Int[Array, "... k"]:
    """The backend switch: the kernel when ``impl`` resolves to "pallas" and the call has at most
    ``MAX_SCORES`` scores, else XLA's ``lax.top_k``. ``limit`` (per row): indices at or above it
    come back as -1 (the indexer's entries not yet visible)."""
    if backend.resolve(impl) == "pallas" and scores.size <= MAX_SCORES:
        return kernel(scores, k, limit)
    return reference(scores, k, limit)
