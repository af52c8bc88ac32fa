"""The ragged attention kernel as it was before the per-token rewrite (repository commit 4e3a624),
kept only so that ``benchmarks/kernels.py`` measures "before" and "after" in one GPU run.

It reads the metadata of that time: compressed entries as one list per request (``comp_idx``,
``comp_len``) with a per-token membership mask (``comp_mask``); ``union_meta`` builds it from the
current ``RaggedMeta``. Not part of the library; delete once the comparison is recorded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend
from pallas_kernels.attention_metadata import RaggedMeta, token_request
from pallas_kernels.kv_fp8 import BLOCK, Fp8Rows

Array = jax.Array


def _pool_shape(pool):
    return pool.shape if isinstance(pool, Fp8Rows) else tuple(pool.shape)


def _pool_dtype(pool):
    return jnp.dtype(jnp.bfloat16) if isinstance(pool, Fp8Rows) else pool.dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class UnionMeta:
    """The metadata layout of the old kernel."""

    cu_q_lens: Array
    win_lo: Array
    win_hi: Array
    ring_end: Array
    comp_idx: Array | None = None  # [S, U] entry numbers, -1 = empty
    comp_len: Array | None = None  # [S] used slots of comp_idx
    comp_mask: Array | None = None  # [T, U] int8, 1 where slot u is a key of token t
    max_q_len: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def num_requests(self) -> int:
        return self.ring_end.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.win_lo.shape[0]


def union_meta(meta: RaggedMeta, num_slots: int | None = None) -> UnionMeta:
    """The old layout of ``meta``: prefix entries as slots 0..num_slots-1 of every request, top-k
    lists merged per request (sorted, without duplicates) with a membership mask."""
    base = UnionMeta(meta.cu_q_lens, meta.win_lo, meta.win_hi, meta.ring_end, max_q_len=meta.max_q_len)
    if meta.entries_kind == "prefix":
        s, t = meta.num_requests, meta.num_tokens
        u = jnp.arange(num_slots, dtype=jnp.int32)
        req = jnp.minimum(token_request(meta.cu_q_lens, t), s - 1)
        comp_len = jnp.zeros((s,), jnp.int32).at[req].max(meta.comp_count)
        return dataclasses.replace(base, comp_idx=jnp.broadcast_to(u[None], (s, num_slots)), comp_len=comp_len,
                                   comp_mask=(u[None] < meta.comp_count[:, None]).astype(jnp.int8))
    if meta.entries_kind == "topk":
        return _with_topk_union(base, meta.comp_topk)
    return base


def _with_topk_union(meta: UnionMeta, topk: Array) -> UnionMeta:
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


# ------------------------------------------------------------------------------ the old kernel
@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes (powers of two; block_t * block_h >= 16 rows, block_k >= 16 keys) and the number
    of key splits: with ``kv_splits`` > 1 every (request, token block, head block) is spread over
    that many programs, each taking a share of the key tiles, and the partial softmax states are
    merged in XLA afterwards (more parallelism for small batches and decode)."""

    block_t: int
    block_h: int
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2
    kv_splits: int = 1

    def check(self) -> None:
        if self.kv_splits < 1:
            raise ValueError(f"kv_splits must be >= 1, got {self.kv_splits}")
        for name in ("block_t", "block_h", "block_k"):
            if not backend.is_power_of_2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        if self.block_t * self.block_h < 16 or self.block_k < 16:
            raise ValueError(f"tiles need >= 16 rows and >= 16 keys, got block_t * block_h = "
                             f"{self.block_t * self.block_h}, block_k = {self.block_k}")


def auto_splits(cfg: BlockConfig, num_heads: int, max_q_len: int, num_requests: int, *,
                target_programs: int = 128) -> BlockConfig:
    """``cfg`` with key splits when its grid has fewer than ``target_programs`` programs."""
    programs = num_requests * -(-max_q_len // cfg.block_t) * -(-num_heads // cfg.block_h)
    splits = 1 if programs >= target_programs else min(8, backend.next_power_of_2(-(-target_programs // programs)))
    return dataclasses.replace(cfg, kv_splits=splits)


def default_config(num_heads: int, max_q_len: int, num_requests: int = 64, *, rows: int = 32) -> BlockConfig:
    """Tiles of ``rows`` (token, head) rows, split keys for small grids (``auto_splits``)."""
    block_h = min(backend.next_power_of_2(num_heads), rows)
    block_t = max(1, min(backend.next_power_of_2(max_q_len), rows // block_h))
    block_t = max(block_t, 16 // block_h)
    return auto_splits(BlockConfig(block_t=block_t, block_h=block_h), num_heads, max_q_len, num_requests)


def _iota(n: int) -> Array:
    return jnp.arange(n, dtype=jnp.int32)


def _load_keys(refs, rows: Array, ok: Array, d: int, fp8: bool, out_dtype) -> Array:
    """Key rows [bk, d] of a pool (flat refs), zero where not ``ok``; fp8 rows are dequantised.

    Everything stays 2-D: each nope column gathers the exponent byte of its 64-dim block and the
    last ``rope_dim`` columns come from the rope pool (no in-register reshapes).
    """
    r = rows[:, None]
    cols = _iota(d)[None, :]
    if not fp8:
        (pool_ref,) = refs
        return pltriton.load(pool_ref.at[r, cols], mask=ok[:, None], other=0.0)
    nope_ref, rope_ref = refs
    nope = d - rope_ref.shape[1]
    is_nope = cols < nope
    codes = pltriton.load(nope_ref.at[r, cols], mask=ok[:, None], other=0)
    exps = pltriton.load(nope_ref.at[r, nope + cols // BLOCK], mask=ok[:, None] & is_nope, other=0)
    rope = pltriton.load(rope_ref.at[r, cols - nope], mask=ok[:, None] & ~is_nope, other=0.0)
    # all in bf16, exactly: e4m3 codes and powers of two (2 ** (e - 127), built from the exponent
    # bits) are bf16 values, and their products are too (the scales keep them in the normal range)
    scale = lax.bitcast_convert_type(exps.astype(jnp.int16) << 7, jnp.bfloat16)
    vals = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.bfloat16) * scale
    return jnp.where(is_nope, vals, rope).astype(out_dtype)


def _online_update(state, q, kv, visible, scale: float):
    """One key tile of the online softmax; state = (running max, running sum, accumulator)."""
    m, l, acc = state
    s = lax.dot_general(q, kv.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = jnp.where(visible, s * scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    corr = jnp.exp(m - m_use)
    p = jnp.exp(s - m_use[:, None])
    l = l * corr + jnp.sum(p, axis=1)
    acc = acc * corr[:, None] + lax.dot_general(p.astype(kv.dtype), kv, (((1,), (0,)), ((), ())),
                                                preferred_element_type=jnp.float32)
    return m_new, l, acc


def _attention_kernel(*refs, cfg: BlockConfig, heads: int, ring: int, n_entries: int, n_slots: int,
                      n_tok_blocks: int, num_tokens: int, w_fp8: bool, c_fp8: bool, has_entries: bool,
                      scale: float, pv_dtype_w, pv_dtype_c):
    refs = list(refs)
    split = cfg.kv_splits > 1
    if split:  # partial softmax states of each key split
        acc_ref, m_ref, l_ref = refs[-3:]
        refs = refs[:-3]
    else:
        o_ref = refs.pop()
    cu_ref, lo_ref, hi_ref, end_ref, q_ref, sink_ref = refs[:6]
    rest = refs[6:]
    w_refs = tuple(rest[:2] if w_fp8 else rest[:1])
    rest = rest[len(w_refs):]
    if has_entries:
        idx_ref, len_ref, mask_ref = rest[:3]
        c_refs = tuple(rest[3:5] if c_fp8 else rest[3:4])

    bt, bh, bk, n_split = cfg.block_t, cfg.block_h, cfg.block_k, cfg.kv_splits
    d = q_ref.shape[1]
    n_req = end_ref.shape[0]
    n_rows = num_tokens * heads  # rows of q / the output: token * heads + head
    ks, hb, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    i = _iota(bt * bh)
    head = hb * bh + i % bh
    head_ok = head < heads
    head_c = jnp.where(head_ok, head, 0)
    cols = _iota(d)[None, :]

    def store(row, ok, state):
        """Final output, or this split's partial state. Masked rows index one past the end: never
        accessed on a GPU, and in interpret mode a masked store to a shared in-range row could
        race with a real one."""
        m, l, acc = state
        if split:
            dest = jnp.where(ok, ks * n_rows + row, n_split * n_rows)
            pltriton.store(acc_ref.at[dest[:, None], cols], acc, mask=ok[:, None])
            pltriton.store(m_ref.at[dest], m, mask=ok)
            pltriton.store(l_ref.at[dest], l, mask=ok)
        else:
            sink = pltriton.load(sink_ref.at[head_c], mask=head_ok, other=0.0)
            m = jnp.where(m == -jnp.inf, 0.0, m)
            out = acc / (l + jnp.exp(sink - m))[:, None]
            dest = jnp.where(ok, row, n_rows)[:, None]
            pltriton.store(o_ref.at[dest, cols], out.astype(o_ref.dtype), mask=ok[:, None])

    def share(n_tiles):
        """This split's range of ``n_tiles`` key tiles."""
        per = pl.cdiv(n_tiles, n_split)
        return jnp.minimum(ks * per, n_tiles), jnp.minimum((ks + 1) * per, n_tiles)

    empty = (jnp.full((bt * bh,), -jnp.inf, jnp.float32), jnp.zeros((bt * bh,), jnp.float32),
             jnp.zeros((bt * bh, d), jnp.float32))

    @pl.when(s < n_req)
    def _attend():
        q0, q1 = cu_ref[s], cu_ref[s + 1]

        @pl.when(j * bt < q1 - q0)
        def _():
            tok = q0 + j * bt + i // bh
            row_ok = (tok < q1) & head_ok
            tok_c = jnp.where(row_ok, tok, 0)
            row = tok * heads + head
            q = pltriton.load(q_ref.at[jnp.where(row_ok, row, 0)[:, None], cols], mask=row_ok[:, None], other=0.0)
            lo = pltriton.load(lo_ref.at[tok_c], mask=row_ok, other=1)  # masked rows: empty window
            hi = pltriton.load(hi_ref.at[tok_c], mask=row_ok, other=0)
            end = end_ref[s]

            def ring_tile(kt, state):
                slot = kt * bk + _iota(bk)
                pos = end - 1 - lax.rem(end - 1 - slot + ring, ring)
                ok = (slot < ring) & (pos >= 0)
                kv = _load_keys(w_refs, s * ring + slot, ok, d, w_fp8, pv_dtype_w)
                vis = ok[None, :] & (pos[None, :] >= lo[:, None]) & (pos[None, :] <= hi[:, None])
                return _online_update(state, q, kv, vis, scale)

            state = lax.fori_loop(*share(pl.cdiv(ring, bk)), ring_tile, empty)

            if has_entries:
                n_used = len_ref[s]

                def entry_tile(kt, state):
                    u = kt * bk + _iota(bk)
                    u_ok = u < n_used
                    idx = pltriton.load(idx_ref.at[s * n_slots + u], mask=u_ok, other=-1)
                    ok = u_ok & (idx >= 0) & (idx < n_entries)
                    kv = _load_keys(c_refs, s * n_entries + jnp.where(ok, idx, 0), ok, d, c_fp8, pv_dtype_c)
                    picked = pltriton.load(mask_ref.at[tok_c[:, None] * n_slots + u[None, :]],
                                           mask=row_ok[:, None] & u_ok[None, :], other=0)
                    return _online_update(state, q, kv, ok[None, :] & (picked != 0), scale)

                state = lax.fori_loop(*share(pl.cdiv(n_used, bk)), entry_tile, state)
            store(row, row_ok, state)

    @pl.when(s == n_req)
    def _padding_tokens():  # tokens after the last request: zero output (empty states)
        first = cu_ref[n_req] + j * bt
        step = n_tok_blocks * bt

        def body(it, carry):
            tok = first + it * step + i // bh
            store(tok * heads + head, (tok < num_tokens) & head_ok, empty)
            return carry

        lax.fori_loop(0, pl.cdiv(jnp.maximum(num_tokens - first, 0), step), body, 0)


def _flat(pool) -> tuple[Array, ...]:
    if isinstance(pool, Fp8Rows):
        return (pool.nope.reshape(-1, pool.head_dim), pool.rope.reshape(-1, pool.rope_dim))
    return (pool.reshape(-1, pool.shape[-1]),)


def merge_splits(acc, m, l, sink, out_dtype):
    """Merge per-split softmax states ``acc [P, n, d], m [P, n], l [P, n]`` (row n = token * H + head)."""
    m_max = jnp.max(m, axis=0)
    m_use = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_use)  # splits without keys (m = -inf) weigh 0
    sink_rows = jnp.tile(sink.astype(jnp.float32), m.shape[1] // sink.shape[0])
    den = jnp.sum(w * l, axis=0) + jnp.exp(sink_rows - m_use)
    return (jnp.einsum("pn,pnd->nd", w, acc) / den[:, None]).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "scale", "interpret"))
def _pallas(q, window, entries, sink, meta: RaggedMeta, *, cfg: BlockConfig, scale: float, interpret: bool):
    t, h, d = q.shape
    s = meta.num_requests
    ring = _pool_shape(window)[1]
    has_entries = entries is not None
    n_entries = _pool_shape(entries)[1] if has_entries else 0
    n_slots = meta.comp_idx.shape[1] if has_entries else 0
    n_tok_blocks = pl.cdiv(meta.max_q_len, cfg.block_t)
    args = [meta.cu_q_lens, meta.win_lo, meta.win_hi, meta.ring_end, q.reshape(t * h, d),
            sink.astype(jnp.float32), *_flat(window)]
    if has_entries:
        args += [meta.comp_idx.reshape(-1), meta.comp_len, meta.comp_mask.reshape(-1), *_flat(entries)]
    kernel = functools.partial(
        _attention_kernel, cfg=cfg, heads=h, ring=ring, n_entries=n_entries, n_slots=n_slots,
        n_tok_blocks=n_tok_blocks, num_tokens=t, w_fp8=isinstance(window, Fp8Rows),
        c_fp8=isinstance(entries, Fp8Rows), has_entries=has_entries, scale=scale,
        pv_dtype_w=_pool_dtype(window), pv_dtype_c=_pool_dtype(entries) if has_entries else None)
    p = cfg.kv_splits
    if p > 1:
        out_shape = (jax.ShapeDtypeStruct((p * t * h, d), jnp.float32), jax.ShapeDtypeStruct((p * t * h,), jnp.float32),
                     jax.ShapeDtypeStruct((p * t * h,), jnp.float32))
    else:
        out_shape = jax.ShapeDtypeStruct((t * h, d), q.dtype)
    with backend.quiet_triton_deprecation():
        out = pl.pallas_call(
            kernel,
            grid=(p, pl.cdiv(h, cfg.block_h), n_tok_blocks, s + 1),
            out_shape=out_shape,
            compiler_params=backend.compiler_params(cfg.num_warps, cfg.num_stages),
            interpret=interpret,
            name="ragged_sink_attention_before",
        )(*args)
    if p > 1:
        acc, m, l = out
        out = merge_splits(acc.reshape(p, t * h, d), m.reshape(p, t * h), l.reshape(p, t * h), sink, q.dtype)
    return out.reshape(t, h, d)


def kernel(q, window, entries, sink, meta: UnionMeta, *, config: BlockConfig | None = None,
           scale: float | None = None, interpret: bool | None = None):
    """The old kernel, with its old default configuration unless ``config`` is given."""
    t, h, d = q.shape
    cfg = config or default_config(h, meta.max_q_len, meta.num_requests)
    scale = d**-0.5 if scale is None else float(scale)
    return _pallas(q, window, entries, sink, meta, cfg=cfg, scale=scale, interpret=backend.interpret_mode(interpret))
