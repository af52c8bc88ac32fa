"""Metadata of the ragged attention kernel: plain int32 arrays, and builders for each caller.

Queries of S requests are flattened into one token axis of T rows: request s owns tokens
``cu_q_lens[s] .. cu_q_lens[s+1] - 1`` (at most ``max_q_len`` of them); tokens from
``cu_q_lens[S]`` to T are padding and get a zero output. The key set of token t of request s is

- window ring rows: ring slot j of request s holds position ``p_j = end - 1 - ((end - 1 - j) mod R)``
  with ``end = ring_end[s]`` (the ring holds every position in [end - R, end)); the row is a key
  iff ``p_j >= 0`` and ``win_lo[t] <= p_j <= win_hi[t]``;
- compressed entries (optional): slot u < ``comp_len[s]`` of the request's list names entry
  ``comp_idx[s, u]`` (-1 = empty); it is a key of token t iff ``comp_mask[t, u] != 0``.

Builders: ``verify`` (target decode / verify chunks, causal sliding window; ``verify_dense`` for
the batch-dense [S, width] layout with padding rows), ``draft`` (the
drafter's block rows: the last ``window`` committed rows plus the whole block, non-causal), and
``with_prefix_entries`` (Cm layers: every entry w < (p + 1) // m) / ``with_topk_entries`` (C4
layers: the indexer's top-k, merged into one list per request so that each entry row is read
once per request, with a per-token membership mask).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # shape annotations only; jaxtyping is not needed at run time
    from jaxtyping import Array, Int, Int8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RaggedMeta:
    cu_q_lens: Int[Array, " s1"]  # [S + 1] token offsets of the requests
    win_lo: Int[Array, " t"]  # [T] lowest visible ring position of each token (inclusive)
    win_hi: Int[Array, " t"]  # [T] highest visible ring position of each token (inclusive)
    ring_end: Int[Array, " s"]  # [S] one past the newest position held by the request's ring
    comp_idx: Int[Array, "s u"] | None = None  # [S, U] entry numbers, -1 = empty
    comp_len: Int[Array, " s"] | None = None  # [S] used slots of comp_idx
    comp_mask: Int8[Array, "t u"] | None = None  # [T, U] 1 where slot u is a key of token t
    max_q_len: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def num_requests(self) -> int:
        return self.ring_end.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.win_lo.shape[0]

    @property
    def has_entries(self) -> bool:
        return self.comp_idx is not None


def _i32(x) -> Array:
    return jnp.asarray(x).astype(jnp.int32)


def check_shapes(meta: RaggedMeta) -> None:
    """Static checks of the metadata shapes and dtypes (clear errors for malformed input)."""
    s, t = meta.num_requests, meta.num_tokens
    if meta.max_q_len < 1:
        raise ValueError(f"max_q_len must be >= 1, got {meta.max_q_len}")
    expect = {"cu_q_lens": (s + 1,), "win_lo": (t,), "win_hi": (t,), "ring_end": (s,)}
    if meta.has_entries:
        if meta.comp_len is None or meta.comp_mask is None:
            raise ValueError("comp_idx, comp_len and comp_mask must be given together")
        u = meta.comp_idx.shape[-1]
        expect.update(comp_idx=(s, u), comp_len=(s,), comp_mask=(t, u))
    elif meta.comp_len is not None or meta.comp_mask is not None:
        raise ValueError("comp_len / comp_mask given without comp_idx")
    for name, shape in expect.items():
        x = getattr(meta, name)
        if tuple(x.shape) != shape:
            raise ValueError(f"metadata {name} must have shape {shape}, got {tuple(x.shape)}")
        want = jnp.int8 if name == "comp_mask" else jnp.int32
        if x.dtype != want:
            raise ValueError(f"metadata {name} must be {jnp.dtype(want).name}, got {x.dtype}")


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
    cl = _concrete(meta.comp_len) if meta.has_entries else None
    if cl is not None:
        if (cl < 0).any() or (cl > meta.comp_idx.shape[1]).any():
            raise ValueError(f"comp_len must lie in [0, {meta.comp_idx.shape[1]}], got {cl.tolist()}")
        ci = _concrete(meta.comp_idx)
        if n_entries is not None and ci is not None:
            used = np.arange(ci.shape[1])[None] < cl[:, None]
            if (ci[used] >= n_entries).any():
                raise ValueError(f"comp_idx names an entry >= the entries pool size {n_entries}")
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
    meta = RaggedMeta(cu_q_lens=jnp.arange(s + 1, dtype=jnp.int32) * width,
                      win_lo=jnp.where(valid, pos - window + 1, 1), win_hi=jnp.where(valid, pos, 0),
                      ring_end=lengths + n_valid, max_q_len=width)
    return meta, pos


def draft(lengths: Int[Array, " s"], *, block: int, window: int) -> RaggedMeta:
    """The drafter's block of ``block`` rows per request at positions lengths[s] .. + block - 1,
    written into the (transient part of the) context ring before attending. Every block row sees
    the ``window`` committed positions before the block and all rows of the block (non-causal)."""
    lengths = _i32(lengths)
    s = lengths.shape[0]
    cu = jnp.arange(s + 1, dtype=jnp.int32) * block
    per_tok = jnp.repeat(lengths, block, total_repeat_length=s * block)
    return RaggedMeta(cu_q_lens=cu, win_lo=per_tok - window, win_hi=per_tok + block - 1,
                      ring_end=lengths + block, max_q_len=block)


def with_prefix_entries(meta: RaggedMeta, positions: Int[Array, " t"], *, ratio: int,
                        num_slots: int) -> RaggedMeta:
    """Cm layers: token at position p sees every entry w < (p + 1) // ratio (in slots 0..num_slots-1
    of the entries pool). ``positions`` as returned by ``verify`` (-1 = padding token)."""
    positions = _i32(positions)
    count = jnp.where(positions >= 0, (positions + 1) // ratio, 0)
    u = jnp.arange(num_slots, dtype=jnp.int32)
    s = meta.num_requests
    comp_len = jnp.minimum(meta.ring_end // ratio, num_slots)  # the request's last token sees the most
    return dataclasses.replace(meta, comp_idx=jnp.broadcast_to(u[None], (s, num_slots)), comp_len=comp_len,
                               comp_mask=(u[None] < count[:, None]).astype(jnp.int8))


def with_topk_entries(meta: RaggedMeta, topk: Int[Array, "t k"],
                      positions: Int[Array, " t"] | None = None) -> RaggedMeta:
    """C4 layers: token t sees the entries ``topk[t]`` (-1 = empty). The lists of a request's tokens
    are merged into one sorted list without duplicates (so each entry is loaded once per request);
    ``comp_mask`` says which token picked which slot. U = max_q_len * k. With ``positions`` given,
    the picks of padding rows (position -1) are ignored."""
    topk = _i32(topk)
    if positions is not None:
        topk = jnp.where(_i32(positions)[:, None] >= 0, topk, -1)
    t, k = topk.shape
    s, q = meta.num_requests, meta.max_q_len
    cu = meta.cu_q_lens
    big = jnp.iinfo(jnp.int32).max
    tok = cu[:-1, None] + jnp.arange(q, dtype=jnp.int32)[None]  # [S, Q]
    tok_ok = tok < cu[1:, None]
    cand = jnp.where(tok_ok[..., None], topk[jnp.where(tok_ok, tok, 0)], -1).reshape(s, q * k)
    srt = jnp.sort(jnp.where(cand >= 0, cand, big), axis=1)
    first = (srt != big) & jnp.concatenate([jnp.ones((s, 1), bool), srt[:, 1:] != srt[:, :-1]], axis=1)
    union = jnp.sort(jnp.where(first, srt, big), axis=1)  # unique entries first, ascending
    comp_len = jnp.sum(first, axis=1, dtype=jnp.int32)
    comp_idx = jnp.where(union == big, -1, union)

    req = token_request(cu, t)
    valid = req < s
    rows = union[jnp.minimum(req, s - 1)]  # [T, U]
    slot = jax.vmap(lambda r, e: jnp.searchsorted(r, e))(rows, topk).astype(jnp.int32)  # [T, k]
    keep = valid[:, None] & (topk >= 0)
    slot = jnp.where(keep, slot, q * k)  # q * k: dropped
    mask = jnp.zeros((t, q * k), jnp.int8).at[jnp.arange(t)[:, None], slot].set(1, mode="drop")
    return dataclasses.replace(meta, comp_idx=comp_idx, comp_len=comp_len, comp_mask=mask)
