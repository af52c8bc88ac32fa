"""Metadata of the ragged attention kernel: plain int32 arrays, and builders for each caller.

Queries of S requests are flattened into one token axis of T rows: request s owns tokens
``cu_q_lens[s] .. cu_q_lens[s+1] - 1`` (at most ``max_q_len`` of them); tokens from
``cu_q_lens[S]`` to T are padding and get a zero output. The key set of token t of request s is

- window ring rows: ring slot j of request s holds position ``p_j = end - 1 - ((end - 1 - j) mod R)``
  with ``end = ring_end[s]`` (the ring holds every position in [end - R, end)); the row is a key
  iff ``p_j >= 0`` and ``win_lo[t] <= p_j <= win_hi[t]``;
- compressed entries (optional), rows of the request's entries pool, in one of two forms:
  a prefix (Cm layers): token t sees entries ``0 .. comp_count[t] - 1``; or a list per token
  (C4 layers): token t sees the entries ``comp_topk[t, :]`` (negative = none; an entry listed
  twice counts twice, which the indexer's top-k never does).

Builders: ``verify`` (target decode / verify chunks, causal sliding window; ``verify_dense`` for
the batch-dense [S, width] layout with padding rows), ``draft`` (the
drafter's block rows: the last ``window`` committed rows plus the whole block, non-causal), and
``with_prefix_entries`` (Cm layers: every entry w < (p + 1) // m) / ``with_topk_entries`` (C4
layers: the indexer's top-k of each token).

Both entry forms give every token exactly its own keys: a kernel program holding the heads of
one token walks that token's key rows only (no work on keys the token does not see), and the
programs of one request run side by side, so rows shared by its tokens come from the cache.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # shape annotations only; jaxtyping is not needed at run time
    from jaxtyping import Array, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RaggedMeta:
    cu_q_lens: Int[Array, " s1"]  # [S + 1] token offsets of the requests
    win_lo: Int[Array, " t"]  # [T] lowest visible ring position of each token (inclusive)
    win_hi: Int[Array, " t"]  # [T] highest visible ring position of each token (inclusive)
    ring_end: Int[Array, " s"]  # [S] one past the newest position held by the request's ring
    comp_count: Int[Array, " t"] | None = None  # [T] prefix entries: token t sees entries 0 .. count - 1
    comp_topk: Int[Array, "t k"] | None = None  # [T, K] entries of token t, negative = none
    max_q_len: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def num_requests(self) -> int:
        return self.ring_end.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.win_lo.shape[0]

    @property
    def has_entries(self) -> bool:
        return self.entries_kind is not None

    @property
    def entries_kind(self) -> str | None:
        """``"prefix"`` (comp_count), ``"topk"`` (comp_topk) or None (window keys only)."""
        if self.comp_count is not None:
            return "prefix"
        return "topk" if self.comp_topk is not None else None


def _i32(x) -> Array:
    return jnp.asarray(x).astype(jnp.int32)


def check_shapes(meta: RaggedMeta) -> None:
    """Static checks of the metadata shapes and dtypes (clear errors for malformed input)."""
    s, t = meta.num_requests, meta.num_tokens
    if meta.max_q_len < 1:
        raise ValueError(f"max_q_len must be >= 1, got {meta.max_q_len}")
    expect = {"cu_q_lens": (s + 1,), "win_lo": (t,), "win_hi": (t,), "ring_end": (s,)}
    if meta.comp_count is not None and meta.comp_topk is not None:
        raise ValueError("give compressed entries either as comp_count (a prefix) or as comp_topk, not both")
    if meta.comp_count is not None:
        expect["comp_count"] = (t,)
    if meta.comp_topk is not None:
        if meta.comp_topk.ndim != 2:
            raise ValueError(f"metadata comp_topk must be [T, K], got shape {tuple(meta.comp_topk.shape)}")
        expect["comp_topk"] = (t, meta.comp_topk.shape[1])
    for name, shape in expect.items():
        x = getattr(meta, name)
        if tuple(x.shape) != shape:
            raise ValueError(f"metadata {name} must have shape {shape}, got {tuple(x.shape)}")
        if x.dtype != jnp.int32:
            raise ValueError(f"metadata {name} must be int32, got {x.dtype}")


def _concrete(x) -> np.ndarray | None:
    """The values of ``x``, or None when it is traced (inside jit)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_values(meta: RaggedMeta, *, ring: int | None = None, n_entries: int | None = None) -> None:
    """Checks that need the values (skipped for traced metadata, e.g. inside jit)."""
    cu = _concrete(meta.cu_q_lens)
    if cu is None:
        return
    lens = np.diff(cu)
    if cu[0] != 0 or (lens < 0).any():
        raise ValueError(f"cu_q_lens must start at 0 and be non-decreasing, got {cu.tolist()}")
    if cu[-1] > meta.num_tokens:
        raise ValueError(f"cu_q_lens[-1] = {cu[-1]} exceeds the number of tokens {meta.num_tokens}")
    if lens.max(initial=0) > meta.max_q_len:
        raise ValueError(f"a request has {lens.max()} tokens, more than max_q_len = {meta.max_q_len}")
    count = _concrete(meta.comp_count) if meta.comp_count is not None else None
    if count is not None and n_entries is not None and ((count < 0) | (count > n_entries)).any():
        raise ValueError(f"comp_count must lie in [0, {n_entries}] (the entries pool size), "
                         f"got values in [{count.min()}, {count.max()}]")
    topk = _concrete(meta.comp_topk) if meta.comp_topk is not None else None
    if topk is not None and n_entries is not None and (topk >= n_entries).any():
        raise ValueError(f"comp_topk names an entry >= the entries pool size {n_entries}")
    end, lo, hi = _concrete(meta.ring_end), _concrete(meta.win_lo), _concrete(meta.win_hi)
    if ring is not None and end is not None and lo is not None and hi is not None:
        req = np.searchsorted(cu[1:], np.arange(cu[-1]), side="right")
        lo, hi = lo[:cu[-1]], hi[:cu[-1]]
        used = lo <= hi  # an empty window (lo > hi) reads nothing
        if (used & ((lo < end[req] - ring) | (hi >= end[req]))).any():
            raise ValueError(f"a token's window [win_lo, win_hi] reaches outside the ring of {ring} slots "
                             f"(positions [ring_end - {ring}, ring_end))")


def ring_positions(ring_end: Int[Array, " s"], ring: int) -> Int[Array, "s r"]:
    """Position held by each slot of a ring whose newest position is ``ring_end - 1``
    (slot = position mod ring); negative = never written."""
    slot = jnp.arange(ring, dtype=jnp.int32)[None]
    last = ring_end[:, None] - 1
    return last - jnp.mod(last - slot, ring)


def cu_from_lens(q_lens: Int[Array, " s"]) -> Int[Array, " s1"]:
    q_lens = _i32(q_lens)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])


def token_request(cu_q_lens: Int[Array, " s1"], num_tokens: int) -> Int[Array, " t"]:
    """Request of every token (S for padding tokens)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)


def verify(q_lens: Int[Array, " s"], lengths: Int[Array, " s"], *, window: int, num_tokens: int,
           max_q_len: int) -> tuple[RaggedMeta, Int[Array, " t"]]:
    """Target decode / verify: request s has ``q_lens[s]`` new tokens at positions
    ``lengths[s] ..`` (lengths = committed tokens before the chunk), already written into its ring.
    Each token sees the ``window`` latest positions up to and including itself.

    Returns the metadata and the position of every token (-1 for padding tokens).
    """
    q_lens, lengths = _i32(q_lens), _i32(lengths)
    cu = cu_from_lens(q_lens)
    req = token_request(cu, num_tokens)
    valid = req < q_lens.shape[0]
    rc = jnp.minimum(req, q_lens.shape[0] - 1)
    pos = jnp.where(valid, lengths[rc] + jnp.arange(num_tokens, dtype=jnp.int32) - cu[rc], -1)
    lo = jnp.where(valid, pos - window + 1, 1)  # padding tokens: empty window (lo > hi)
    hi = jnp.where(valid, pos, 0)
    meta = RaggedMeta(cu_q_lens=cu, win_lo=lo, win_hi=hi, ring_end=lengths + q_lens, max_q_len=max_q_len)
    return meta, pos


def verify_dense(n_valid: Int[Array, " s"], lengths: Int[Array, " s"], *, width: int,
                 window: int) -> tuple[RaggedMeta, Int[Array, " t"]]:
    """``verify`` for the batch-dense layout ``[S, width]`` flattened to T = S * width tokens (what
    the model's ``Chunk`` uses): row t of request s is a real token iff t < n_valid[s]; the other
    rows get no key and a zero output. Returns the metadata and positions (-1 for padding rows)."""
    n_valid, lengths = _i32(n_valid), _i32(lengths)
    s = n_valid.shape[0]
    row = jnp.arange(width, dtype=jnp.int32)[None]
    valid = (row < n_valid[:, None]).reshape(-1)
    pos = jnp.where(valid, (lengths[:, None] + row).reshape(-1), -1)
    # (numpy: a constant of the program; as a jnp iota XLA launched a kernel for it at every layer)
    meta = RaggedMeta(cu_q_lens=np.arange(s + 1, dtype=np.int32) * width,
                      win_lo=jnp.where(valid, pos - window + 1, 1), win_hi=jnp.where(valid, pos, 0),
                      ring_end=lengths + n_valid, max_q_len=width)
    return meta, pos


def draft(lengths: Int[Array, " s"], *, block: int, window: int) -> RaggedMeta:
    """The drafter's block of ``block`` rows per request at positions lengths[s] .. + block - 1,
    written into the (transient part of the) context ring before attending. Every block row sees
    the ``window`` committed positions before the block and all rows of the block (non-causal)."""
    lengths = _i32(lengths)
    s = lengths.shape[0]
    cu = np.arange(s + 1, dtype=np.int32) * block  # (a constant of the program, as in ``verify_dense``)
    per_tok = jnp.repeat(lengths, block, total_repeat_length=s * block)
    return RaggedMeta(cu_q_lens=cu, win_lo=per_tok - window, win_hi=per_tok + block - 1,
                      ring_end=lengths + block, max_q_len=block)


def with_prefix_entries(meta: RaggedMeta, positions: Int[Array, " t"], *, ratio: int,
                        num_slots: int) -> RaggedMeta:
    """Cm layers: token at position p sees every entry w < (p + 1) // ratio (in slots 0..num_slots-1
    of the entries pool). ``positions`` as returned by ``verify`` (-1 = padding token)."""
    positions = _i32(positions)
    count = jnp.where(positions >= 0, jnp.minimum((positions + 1) // ratio, num_slots), 0)
    return dataclasses.replace(meta, comp_count=count.astype(jnp.int32), comp_topk=None)


def with_topk_entries(meta: RaggedMeta, topk: Int[Array, "t k"],
                      positions: Int[Array, " t"] | None = None) -> RaggedMeta:
    """C4 layers: token t sees the entries ``topk[t]`` (negative = none). The picks of padding
    tokens (after the last request, or with position -1 when ``positions`` is given) are dropped."""
    topk = _i32(topk)
    keep = token_request(meta.cu_q_lens, meta.num_tokens) < meta.num_requests
    if positions is not None:
        keep &= _i32(positions) >= 0
    return dataclasses.replace(meta, comp_count=None, comp_topk=jnp.where(keep[:, None], topk, -1))
