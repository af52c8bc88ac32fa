"""Ragged MQA latent attention with a sink: the Pallas kernel and its pure-JAX reference.

Queries ``q [T, H, D]`` of many requests are flattened into one token axis (metadata and key sets:
``attention_metadata``). Keys = values = one D-wide latent per row (MQA with K = V), read from
two pools that may each be bf16 / fp32 arrays or fp8 ``Fp8Rows``:

- ``window`` ``[S, R, D]``: the per-request window ring (slot = position mod R), with the chunk's
  new rows already written;
- ``entries`` ``[S, N, D]`` (optional): compressed entries by window number.

For token t and head h: ``o = sum_k softmax_k(scale * q.k) k`` where the softmax denominator also
holds ``exp(sink[h])`` (a per-head fp32 logit that has no value). Logits and sums are fp32; the
probabilities are cast to the pool's dtype before the P.V product; the output has q's dtype and
is ready for the caller's inverse RoPE. A token with no key gets 0.

Kernel grid: (key splits, row blocks, S + 1). A program holds ``block_t`` tokens x ``block_h``
heads of one request as the rows of its tiles (DeepSeek-V4-Flash: the 64 heads of one token), so
each key row it loads serves all of them, and it walks only the keys its tokens see:

- ring rows as one contiguous range of positions, [min win_lo, max win_hi] of its tokens
  (slot = position mod R), ``block_k`` rows per tile;
- prefix entries (Cm layers) as the range 0 .. max comp_count of its tokens;
- top-k entries (C4 layers; ``block_t = 1``) as its token's own list.

The programs of one request are adjacent in launch order, so rows that several of them read come
from the cache. The online softmax runs in fp32 on log2-scaled logits (``exp2``). An fp8 key tile
(e4m3 codes + one power-of-two scale per 64 dims) is either dequantised once per tile and
program (codes times their block's scale: one multiply per element), or, with
``BlockConfig.fp8_fold``, never dequantised: q.k is a sum over 64-column blocks of
``scale_b(key) * (q_b . code_b)`` and P.V scales the probability columns per block,
``o_b += (p * scale_b(key)) @ code_b``. Powers of two commute with rounding, so both give the
products of the dequantised keys (see ``docs/kernels.md``).

With ``kv_splits`` > 1 (small batches, decode) the key tiles of a program (its ring tiles, then
its entry tiles) are shared among that many programs, each writing its partial output normalised
in q's dtype plus its log-sum-exp; ``merge_kernel`` combines them (one launch; ``merge_splits`` is
its reference). The last
grid row (s = S) writes zeros (or empty partials) for the padding tokens after the last request.

``kernel`` validates metadata values when they are concrete (a host sync); inside jit only the
shapes are checked. Without an explicit ``config`` it takes the tuned one for the call's shape
(``attention_configs.select``).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import attention_configs, backend
from pallas_kernels.attention_configs import BlockConfig, default_config  # noqa: F401 (re-exported)
from pallas_kernels.attention_metadata import RaggedMeta, check_shapes, check_values, ring_positions  # noqa: F401
from pallas_kernels.kv_fp8 import BLOCK, Fp8Rows, check_layout, dequantize
from pallas_kernels.rope import partner_columns, q_norm_rope_reference, rotate_pairs

if TYPE_CHECKING:  # shape annotations only; jaxtyping is not needed at run time
    from jaxtyping import Array, Float

Pool = jax.Array | Fp8Rows
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# ------------------------------------------------------------------------------ shared helpers
def _pool_shape(pool: Pool) -> tuple[int, ...]:
    return pool.shape if isinstance(pool, Fp8Rows) else tuple(pool.shape)


def _pool_dtype(pool: Pool):
    return jnp.dtype(jnp.bfloat16) if isinstance(pool, Fp8Rows) else pool.dtype


def _values(pool: Pool) -> Array:
    return dequantize(pool) if isinstance(pool, Fp8Rows) else pool


def check_inputs(q: Array, window: Pool, entries: Pool | None, sink: Array, meta: RaggedMeta) -> None:
    check_shapes(meta)
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    t, h, d = q.shape
    if t != meta.num_tokens:
        raise ValueError(f"q has {t} tokens but the metadata describes {meta.num_tokens}")
    if q.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"q must be bfloat16 or float32, got {q.dtype}")
    if sink.shape != (h,):
        raise ValueError(f"sink must be [{h}], got {sink.shape}")
    s = meta.num_requests
    for name, pool in (("window", window), ("entries", entries)):
        if pool is None:
            continue
        shape = _pool_shape(pool)
        if len(shape) != 3 or shape[0] != s or shape[2] != d:
            raise ValueError(f"{name} pool must be [{s}, rows, {d}], got {shape}")
        if isinstance(pool, Fp8Rows):
            check_layout(pool.head_dim, pool.rope_dim)
        elif pool.dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"{name} pool must be bfloat16, float32 or Fp8Rows, got {pool.dtype}")
    if (entries is None) != (not meta.has_entries):
        raise ValueError("pass an entries pool exactly when the metadata has compressed entries")


# ------------------------------------------------------------------------------ pure-JAX reference
def sink_attention(q: Float[Array, "b t h d"], parts: Sequence[tuple[Array, Array]], sink: Float[Array, " h"],
                   scale: float) -> Float[Array, "b t h d"]:
    """Softmax attention over the union of key parts with a sink logit in the denominator only.

    A part is (kv [b, k, d] shared by the queries of a request, or [b, t, k, d] per query;
    mask [b, t, k]). Logits and sums in fp32; probabilities are cast to the kv dtype before the
    P.V product (bf16 in the DeepSeek-V4 reference), accumulation in fp32. A query without keys
    gets 0. This is the math every attention path of the project reduces to.
    """
    logits = []
    for kv, mask in parts:
        eq = "bthd,bkd->bthk" if kv.ndim == 3 else "bthd,btkd->bthk"
        s = jnp.einsum(eq, q, kv.astype(q.dtype), preferred_element_type=jnp.float32) * scale
        logits.append(jnp.where(mask[:, :, None, :], s, -jnp.inf))
    s = jnp.concatenate(logits, axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink.astype(jnp.float32)[None, None, :, None] - m)
    out, k0 = 0.0, 0
    for kv, _ in parts:
        k1 = k0 + kv.shape[-2]
        eq = "bthk,bkd->bthd" if kv.ndim == 3 else "bthk,btkd->bthd"
        out = out + jnp.einsum(eq, p[..., k0:k1].astype(kv.dtype), kv, preferred_element_type=jnp.float32)
        k0 = k1
    return (out / denom).astype(q.dtype)


def _gather_rows(pool: Pool, rows: Array) -> Pool:
    """pool [S, N, d] rows ``rows [S, n]`` -> [S, n, d] (Fp8Rows stay fp8)."""
    take = lambda x: jnp.take_along_axis(x, rows[..., None], axis=1)  # noqa: E731
    return Fp8Rows(take(pool.nope), take(pool.rope)) if isinstance(pool, Fp8Rows) else take(pool)


def reference(q: Float[Array, "t h d"], window: Pool, entries: Pool | None, sink: Float[Array, " h"],
              meta: RaggedMeta, *, scale: float | None = None) -> Float[Array, "t h d"]:
    """Pure-JAX (XLA) implementation: requests padded to ``max_q_len`` tokens; ring and prefix
    entries shared by the tokens of a request and masked per token, top-k entries gathered per
    token."""
    check_inputs(q, window, entries, sink, meta)
    t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qn = meta.max_q_len
    cu = meta.cu_q_lens
    tok = cu[:-1, None] + jnp.arange(qn, dtype=jnp.int32)[None]  # [S, Q]
    tok_ok = tok < cu[1:, None]
    tok_c = jnp.where(tok_ok, tok, 0)
    lo, hi = meta.win_lo[tok_c][..., None], meta.win_hi[tok_c][..., None]

    kw = _values(window)
    pos = ring_positions(meta.ring_end, kw.shape[1])[:, None, :]  # [S, 1, R]
    kw = jnp.where((pos[:, 0] >= 0)[..., None], kw, 0)  # never-written slots may hold garbage
    parts = [(kw, tok_ok[..., None] & (pos >= 0) & (pos >= lo) & (pos <= hi))]
    if meta.entries_kind == "prefix":
        n = _pool_shape(entries)[1]
        count = jnp.where(tok_ok, meta.comp_count[tok_c], 0)  # [S, Q]
        u = jnp.arange(n, dtype=jnp.int32)
        readable = u[None] < jnp.max(count, axis=1)[:, None]  # rows no token sees may hold garbage
        kc = jnp.where(readable[..., None], _values(entries), 0)
        parts.append((kc, u[None, None] < count[..., None]))
    elif meta.entries_kind == "topk":
        s_, n = meta.num_requests, _pool_shape(entries)[1]
        idx = meta.comp_topk[tok_c]  # [S, Q, K]
        ok = tok_ok[..., None] & (idx >= 0) & (idx < n)
        picked = _gather_rows(entries, jnp.where(ok, idx, 0).reshape(s_, -1))
        kc = jnp.where(ok[..., None], _values(picked).reshape(*idx.shape, d), 0)  # [S, Q, K, d]
        parts.append((kc, ok))
    o = sink_attention(q[tok_c], parts, sink, scale)  # [S, Q, H, D]
    dest = jnp.where(tok_ok, tok, t)
    return jnp.zeros((t, h, d), q.dtype).at[dest].set(o, mode="drop")


# ------------------------------------------------------------------------------ Pallas kernel
def _iota(n: int) -> Array:
    return jnp.arange(n, dtype=jnp.int32)


def _load_cols(ref, rows: Array, ok: Array, start: int, width: int, other) -> Array:
    """``ref[rows, start:start + width]`` as [len(rows), width]; ``other`` where not ``ok``. Refs
    are indexed with broadcast integer arrays only (both the Triton lowering and interpret mode
    take them)."""
    return pltriton.load(ref.at[rows[:, None], start + _iota(width)[None, :]], mask=ok[:, None], other=other)


def _e4m3(codes: Array) -> Array:
    return lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)


def _key_blocks(refs, rows: Array, ok: Array, spans, fp8: bool, fold: bool) -> list[tuple[Array, Array | None]]:
    """One key tile (rows ``rows [bk]`` of a flat pool, zero where not ``ok``) as column blocks
    matching ``spans``: a list of (keys [bk, width], per-key scale [bk] fp32 or None).

    bf16 / fp32 pools: the stored values. fp8 pools: the keys dequantised in bf16 (exactly: e4m3
    codes times a power of two), each 64-dim block's exponent byte read once per key row, not
    once per element; or, with ``fold`` (64-wide spans), the e4m3 codes of each nope block as
    bf16 (exact) with that block's scale, and the rope block as stored.
    """
    if not fp8:
        (pool_ref,) = refs
        return [(_load_cols(pool_ref, rows, ok, start, width, 0.0), None) for start, width in spans]
    nope_ref, rope_ref = refs
    d = nope_ref.shape[1]
    nope = d - rope_ref.shape[1]
    rope = _load_cols(rope_ref, rows, ok, 0, rope_ref.shape[1], 0.0)
    bk = rows.shape[0]
    blocks = []
    for start, width in spans:
        groups = width // BLOCK
        has_rope = start + width > nope  # the last span ends with the rope block
        if fold and not has_rope:
            codes = _load_cols(nope_ref, rows, ok, start, width, 0)
            e = pltriton.load(nope_ref.at[rows, nope + start // BLOCK], mask=ok, other=0)
            scale = lax.bitcast_convert_type(e.astype(jnp.int32) << 23, jnp.float32)  # 2 ** (e - 127)
            blocks.append((_e4m3(codes).astype(jnp.bfloat16), scale))
            continue
        if fold:
            blocks.append((rope, None))
            continue
        # codes of the span's nope blocks (in the rope block's place: exponent / padding bytes, unused)
        codes = _load_cols(nope_ref, rows, ok, start, width, 0).reshape(bk, groups, BLOCK)
        e = _load_cols(nope_ref, rows, ok, nope + start // BLOCK, groups, 0)  # exponent byte of each block
        scale = lax.bitcast_convert_type(e.astype(jnp.int16) << 7, jnp.bfloat16)  # 2 ** (e - 127) in bf16
        vals = _e4m3(codes).astype(jnp.bfloat16) * scale[:, :, None]
        if has_rope:
            group = lax.broadcasted_iota(jnp.int32, (1, groups, 1), 1)
            vals = jnp.where(group < groups - 1, vals, rope[:, None, :])
        blocks.append((vals.reshape(bk, width), None))
    return blocks


def _online_update(state, q_blocks: list[Array], keys: list[tuple[Array, Array | None]], visible: Array,
                   logit_scale: float):
    """One key tile of the online softmax in the log2 domain; state = (running max, running sum,
    accumulator blocks)."""
    m, l, acc = state
    s = None
    for q_b, (k_b, scale_b) in zip(q_blocks, keys):
        s_b = lax.dot_general(q_b, k_b.astype(q_b.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if scale_b is not None:
            s_b = s_b * scale_b[None, :]
        s = s_b if s is None else s + s_b
    s = jnp.where(visible, s * logit_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    corr = jnp.exp2(m - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l = l * corr + jnp.sum(p, axis=1)
    new_acc = []
    for a, (k_b, scale_b) in zip(acc, keys):
        p_b = p if scale_b is None else p * scale_b[None, :]
        new_acc.append(a * corr[:, None] + lax.dot_general(p_b.astype(k_b.dtype), k_b, (((1,), (0,)), ((), ())),
                                                           preferred_element_type=jnp.float32))
    return m_new, l, tuple(new_acc)


def _normed_rotated(q_blocks: list[Array], spans, pos: Array, freq_ref, d: int, eps: float,
                    partner_load) -> list[Array]:
    """The queries' per-head RMS norm (no weight) and RoPE of their last 2 len(inv_freq) columns, as
    ``rope.q_norm_rope`` computes them, on a program's q rows held as column blocks (``spans``).
    ``pos``: each row's position [rows, 1] (or a scalar); ``freq_ref``: inv_freq; ``partner_load(start,
    width)``: the rows' values at the pair partners of columns start .. start + width."""
    dt = q_blocks[0].dtype
    sq = sum(jnp.sum(jnp.square(b.astype(jnp.float32)), axis=1) for b in q_blocks)
    r = lax.rsqrt(sq / d + eps).astype(dt).astype(jnp.float32)[:, None]
    rope_dim = 2 * freq_ref.shape[0]
    out = []
    for (start, width), b in zip(spans, q_blocks):
        y = (b.astype(jnp.float32) * r).astype(dt)
        if start + width > d - rope_dim:  # a block holding rotated columns
            cols = start + _iota(width)[None, :]
            partner = (partner_load(start, width).astype(jnp.float32) * r).astype(dt)
            y = rotate_pairs(y, partner, cols, d, rope_dim, pos, freq_ref, inverse=False)
        out.append(y)
    return out


def _attention_kernel(*refs, cfg: BlockConfig, heads: int, ring: int, n_entries: int, kind: str | None,
                      n_head_blocks: int, n_tok_blocks: int, num_tokens: int, spans: tuple, w_fp8: bool,
                      c_fp8: bool, scale: float, q_eps: float | None):
    refs = list(refs)
    split = cfg.kv_splits > 1
    if split:  # normalised partial output + log-sum-exp of each key split
        o_ref, lse_ref = refs[-2:]
        refs = refs[:-2]
    else:
        o_ref = refs.pop()
    if q_eps is not None:  # the queries' norm + RoPE here: their positions and inv_freq
        pos_ref, freq_ref = refs[-2:]
        refs = refs[:-2]
    cu_ref, lo_ref, hi_ref, end_ref, q_ref, sink_ref = refs[:6]
    rest = refs[6:]
    n_w = 2 if w_fp8 else 1
    w_refs, rest = tuple(rest[:n_w]), rest[n_w:]
    if kind is not None:
        ent_ref, c_refs = rest[0], tuple(rest[1:])

    bt, bh, bk, n_split = cfg.block_t, cfg.block_h, cfg.block_k, cfg.kv_splits
    fold = cfg.fp8_fold
    n_req = end_ref.shape[0]
    n_rows = num_tokens * heads  # rows of q / the output: token * heads + head
    ks, rb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    j, hb = rb // n_head_blocks, rb % n_head_blocks
    i = _iota(bt * bh)
    head = hb * bh + i % bh
    head_ok = head < heads
    head_c = jnp.where(head_ok, head, 0)
    empty = (jnp.full((bt * bh,), -jnp.inf, jnp.float32), jnp.zeros((bt * bh,), jnp.float32),
             tuple(jnp.zeros((bt * bh, width), jnp.float32) for _, width in spans))

    def store(row, ok, state):
        """Final output, or this split's partial state. Masked rows index one past the end: never
        accessed on a GPU, and in interpret mode a masked store to a shared in-range row could
        race with a real one."""
        m, l, acc = state
        m_use = jnp.where(m == -jnp.inf, 0.0, m)
        if split:
            dest = jnp.where(ok, ks * n_rows + row, n_split * n_rows)
            inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
            lse = jnp.where(l > 0, m_use * LN2 + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
            pltriton.store(lse_ref.at[dest], lse, mask=ok)
        else:
            dest = jnp.where(ok, row, n_rows)
            sink = pltriton.load(sink_ref.at[head_c], mask=head_ok, other=0.0)
            inv = 1.0 / (l + jnp.exp2(sink * LOG2E - m_use))
        for (start, width), a in zip(spans, acc):
            pltriton.store(o_ref.at[dest[:, None], start + _iota(width)[None, :]],
                           (a * inv[:, None]).astype(o_ref.dtype), mask=ok[:, None])

    @pl.when(s < n_req)
    def _attend():
        q0, q1 = cu_ref[s], cu_ref[s + 1]

        @pl.when(j * bt < q1 - q0)
        def _():
            tok = q0 + j * bt + i // bh
            row_ok = (tok < q1) & head_ok
            tok_c = jnp.where(row_ok, tok, 0)
            row = tok * heads + head
            row_c = jnp.where(row_ok, row, 0)
            q_blocks = [_load_cols(q_ref, row_c, row_ok, start, width, 0.0) for start, width in spans]
            if q_eps is not None:
                pos = pos_ref[q0 + j] if bt == 1 else pltriton.load(pos_ref.at[tok_c], mask=row_ok, other=0)[:, None]
                d = sum(width for _, width in spans)

                def partner_load(start, width):
                    cols = partner_columns(start + _iota(width))
                    return pltriton.load(q_ref.at[row_c[:, None], cols[None, :]], mask=row_ok[:, None], other=0.0)

                q_blocks = _normed_rotated(q_blocks, spans, pos, freq_ref, d, q_eps, partner_load)

            def per_token(ref, other, reduce):
                """A per-token value for every row (a scalar when the program holds one token,
                broadcast over its rows for free, else a [rows, 1] column) and its reduction
                over the program's rows."""
                if bt == 1:
                    v = ref[q0 + j]
                    return v, v
                v = pltriton.load(ref.at[tok_c], mask=row_ok, other=other)
                return v[:, None], reduce(v)

            lo, lo_min = per_token(lo_ref, 2**30, jnp.min)  # masked rows see nothing
            hi, hi_max = per_token(hi_ref, -1, jnp.max)
            end = end_ref[s]
            # the positions any row of this program sees, all inside the ring: [end - R, end)
            p_lo = jnp.maximum(lo_min, jnp.maximum(end - ring, 0))
            p_hi = jnp.minimum(hi_max, end - 1)
            n_ring = pl.cdiv(jnp.maximum(p_hi - p_lo + 1, 0), bk)

            def ring_tile(kt, state):
                pos = p_lo + kt * bk + _iota(bk)
                ok = pos <= p_hi
                keys = _key_blocks(w_refs, s * ring + jnp.where(ok, lax.rem(pos, ring), 0), ok, spans, w_fp8, fold)
                visible = ok[None, :] & (pos[None, :] >= lo) & (pos[None, :] <= hi)
                return _online_update(state, q_blocks, keys, visible, scale * LOG2E)

            if kind == "prefix":
                count, count_max = per_token(ent_ref, 0, jnp.max)
                n_keys = jnp.minimum(count_max, n_entries)
                n_ent = pl.cdiv(n_keys, bk)

                def entry_tile(kt, state):
                    u = kt * bk + _iota(bk)
                    ok = u < n_keys
                    keys = _key_blocks(c_refs, s * n_entries + jnp.where(ok, u, 0), ok, spans, c_fp8, fold)
                    return _online_update(state, q_blocks, keys, ok[None, :] & (u[None, :] < count), scale * LOG2E)
            elif kind == "topk":  # block_t = 1: the program's one token and its own list
                k_len = ent_ref.shape[0] // num_tokens
                n_ent = pl.cdiv(k_len, bk)

                def entry_tile(kt, state):
                    u = kt * bk + _iota(bk)
                    u_ok = u < k_len
                    idx = pltriton.load(ent_ref.at[(q0 + j) * k_len + jnp.where(u_ok, u, 0)], mask=u_ok, other=-1)
                    ok = u_ok & (idx >= 0) & (idx < n_entries)
                    keys = _key_blocks(c_refs, s * n_entries + jnp.where(ok, idx, 0), ok, spans, c_fp8, fold)
                    return _online_update(state, q_blocks, keys, ok[None, :], scale * LOG2E)
            else:
                n_ent = 0

            # this split's share of the program's tiles: ring tiles first, then entry tiles
            n_tiles = n_ring + n_ent
            per = pl.cdiv(n_tiles, n_split)
            t0 = jnp.minimum(ks * per, n_tiles)
            t1 = jnp.minimum(t0 + per, n_tiles)
            state = lax.fori_loop(jnp.minimum(t0, n_ring), jnp.minimum(t1, n_ring), ring_tile, empty)
            if kind is not None:
                state = lax.fori_loop(jnp.maximum(t0 - n_ring, 0), jnp.maximum(t1 - n_ring, 0), entry_tile, state)
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


def _flat(pool: Pool) -> tuple[Array, ...]:
    if isinstance(pool, Fp8Rows):
        return (pool.nope.reshape(-1, pool.head_dim), pool.rope.reshape(-1, pool.rope_dim))
    return (pool.reshape(-1, pool.shape[-1]),)


def merge_splits(o: Float[Array, "p n d"], lse: Float[Array, "p n"], sink: Float[Array, " h"], out_dtype):
    """Merge per-split normalised outputs ``o`` and log-sum-exps ``lse`` (row n = token * H +
    head; a split without keys has lse = -inf) with the sink in the denominator."""
    m = jnp.max(lse, axis=0)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse - m)  # [P, n]
    sink_rows = jnp.tile(sink.astype(jnp.float32), lse.shape[1] // sink.shape[0])
    den = jnp.sum(w, axis=0) + jnp.exp(sink_rows - m)
    return (jnp.einsum("pn,pnd->nd", w, o.astype(jnp.float32)) / den[:, None]).astype(out_dtype)


def _merge_kernel(o_ref, lse_ref, sink_ref, *refs, splits: int, heads: int, rope_dim: int):
    """One output row per program: its ``splits`` partial rows weighted in one [P, d] tile; with
    ``rope_dim`` the row's last ``rope_dim`` columns rotated back (``rope.rotate_pairs``)."""
    out_ref = refs[-1]
    n, d = out_ref.shape
    row = pl.program_id(0)
    s = _iota(backend.next_power_of_2(splits))
    s_ok = s < splits
    src = jnp.where(s_ok, s * n + row, 0)
    lse = pltriton.load(lse_ref.at[src], mask=s_ok, other=-jnp.inf)
    m = jnp.max(lse)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.where(s_ok, jnp.exp(lse - m), 0.0)
    den = jnp.sum(w) + jnp.exp(sink_ref[row % heads] - m)
    cols = _iota(backend.next_power_of_2(d))
    c_ok = cols < d

    def merged(c, ok):  # the row's merged values at columns c [dp], rounded to the output dtype
        o = pltriton.load(o_ref.at[src[:, None], c[None, :]], mask=s_ok[:, None] & ok[None, :], other=0.0)
        return (jnp.sum(w[:, None] * o.astype(jnp.float32), axis=0) / den).astype(out_ref.dtype)

    out = merged(cols, c_ok)
    if rope_dim:  # the last rope_dim columns rotated back, each column's pair partner merged as well
        pos_ref, freq_ref = refs[:2]
        partner = merged(partner_columns(cols), c_ok & (cols >= d - rope_dim))
        out = rotate_pairs(out, partner, cols, d, rope_dim, pos_ref[row // heads], freq_ref, inverse=True)
    pltriton.store(out_ref.at[row, cols], out, mask=c_ok)


def merge_kernel(o: Float[Array, "p n d"], lse: Float[Array, "p n"], sink: Float[Array, " h"], out_dtype, *,
                 out_rope: tuple[Array, Array] | None = None, num_warps: int = 4,
                 interpret: bool | None = None) -> Float[Array, "n d"]:
    """``merge_splits`` as one Pallas launch, grid (rows,): a row's P partials in one tile. At a Flash C4
    decode step (16 splits of 64 heads x 512, 1 MiB) it takes 2 us where XLA's fusion of the
    reference (with the output's inverse rope, which XLA fused into it) took 10.3
    (docs/benchmarks.md). Differs from it by the order of float32 sums. ``out_rope``: (positions
    [n / h], inv_freq [r]): the merged rows rotated back as ``norms_rope.apply_rope(...,
    inverse=True)`` does (the last 2r columns; the token of row i is i // h), in this launch."""
    p, n, d = o.shape
    if lse.shape != (p, n) or n % sink.shape[0]:
        raise ValueError(f"lse must be [{p}, {n}] and the rows a multiple of the heads, got {lse.shape} / {sink.shape}")
    rope_args = ()
    if out_rope is not None:
        positions, inv_freq = out_rope
        if positions.shape != (n // sink.shape[0],) or inv_freq.ndim != 1 or 2 * inv_freq.shape[0] > d:
            raise ValueError(f"out_rope needs positions [{n // sink.shape[0]}] and inv_freq [r] with 2r <= {d}, got "
                             f"{positions.shape} / {inv_freq.shape}")
        rope_args = (jnp.asarray(positions, jnp.int32), jnp.asarray(inv_freq, jnp.float32))
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            functools.partial(_merge_kernel, splits=p, heads=sink.shape[0],
                              rope_dim=2 * rope_args[1].shape[0] if rope_args else 0),
            grid=(n,),
            out_shape=jax.ShapeDtypeStruct((n, d), out_dtype),
            compiler_params=backend.compiler_params(num_warps, 1),
            interpret=backend.interpret_mode(interpret),
            name="attention_merge_splits" + ("_rope" if rope_args else ""),
        )(o.reshape(p * n, d), lse.reshape(p * n).astype(jnp.float32), sink.astype(jnp.float32), *rope_args)


def spans_for(cfg: BlockConfig, d: int, fp8: bool) -> tuple[tuple[int, int], ...]:
    """Column blocks of q, keys and accumulator: ``block_d`` wide (64 when fp8 scales are folded)."""
    width = BLOCK if (cfg.fp8_fold and fp8) else min(cfg.block_d, d)
    return tuple((start, width) for start in range(0, d, width))


@functools.partial(jax.jit, static_argnames=("cfg", "scale", "q_eps", "interpret"))
def _pallas(q, window, entries, sink, meta: RaggedMeta, out_rope, q_rope, *, cfg: BlockConfig, scale: float,
            q_eps: float | None, interpret: bool):
    t, h, d = q.shape
    s = meta.num_requests
    ring = _pool_shape(window)[1]
    kind = meta.entries_kind
    w_fp8, c_fp8 = isinstance(window, Fp8Rows), isinstance(entries, Fp8Rows)
    n_head_blocks = pl.cdiv(h, cfg.block_h)
    n_tok_blocks = pl.cdiv(meta.max_q_len, cfg.block_t)
    args = [meta.cu_q_lens, meta.win_lo, meta.win_hi, meta.ring_end, q.reshape(t * h, d),
            sink.astype(jnp.float32), *_flat(window)]
    if kind is not None:
        args += [meta.comp_count if kind == "prefix" else meta.comp_topk.reshape(-1), *_flat(entries)]
    if q_eps is not None:
        args += list(q_rope)
    kernel = functools.partial(
        _attention_kernel, cfg=cfg, heads=h, ring=ring, n_entries=_pool_shape(entries)[1] if kind else 0,
        kind=kind, n_head_blocks=n_head_blocks, n_tok_blocks=n_tok_blocks, num_tokens=t,
        spans=spans_for(cfg, d, w_fp8 or c_fp8), w_fp8=w_fp8, c_fp8=c_fp8, scale=scale, q_eps=q_eps)
    p = cfg.kv_splits
    if p > 1:
        out_shape = (jax.ShapeDtypeStruct((p * t * h, d), q.dtype), jax.ShapeDtypeStruct((p * t * h,), jnp.float32))
    else:
        out_shape = jax.ShapeDtypeStruct((t * h, d), q.dtype)
    with backend.quiet_triton_deprecation():
        out = pl.pallas_call(
            kernel,
            grid=(p, n_tok_blocks * n_head_blocks, s + 1),
            out_shape=out_shape,
            compiler_params=backend.compiler_params(cfg.num_warps, cfg.num_stages),
            interpret=interpret,
            name="ragged_sink_attention",
        )(*args)
    if p > 1:  # the output's inverse rope in the merge's launch
        o, lse = out
        out = merge_kernel(o.reshape(p, t * h, d), lse.reshape(p, t * h), sink, q.dtype, out_rope=out_rope,
                           interpret=interpret)
        return out.reshape(t, h, d)
    return _rotated_back(out.reshape(t, h, d), out_rope)


def _rotated_back(o: Float[Array, "t h d"], out_rope) -> Float[Array, "t h d"]:
    """``o`` with ``out_rope`` = (positions, inv_freq) applied as ``norms_rope.apply_rope(...,
    inverse=True)`` (XLA), or as it is (None)."""
    if out_rope is None:
        return o
    from dspark_jax.model.norms_rope import apply_rope

    positions, inv_freq = out_rope
    return apply_rope(o, positions, inv_freq, inverse=True)


def select_config(q: Array, window: Pool, entries: Pool | None, meta: RaggedMeta) -> BlockConfig:
    """The tuned configuration for this call's shape (``attention_configs.select``)."""
    fp8 = isinstance(window, Fp8Rows) or isinstance(entries, Fp8Rows)
    n_keys = _pool_shape(window)[1]  # ring rows, plus entry slots
    if meta.entries_kind == "prefix":
        n_keys += _pool_shape(entries)[1]
    elif meta.entries_kind == "topk":
        n_keys += meta.comp_topk.shape[1]
    return attention_configs.select(q.shape[1], meta.max_q_len, meta.num_requests, meta.entries_kind or "window",
                                    fp8, platform=backend.gpu_platform(), n_keys=n_keys)


def kernel(q: Float[Array, "t h d"], window: Pool, entries: Pool | None, sink: Float[Array, " h"],
           meta: RaggedMeta, *, scale: float | None = None, config: BlockConfig | None = None,
           out_rope: tuple[Array, Array] | None = None, q_rope: tuple[Array, Array, float] | None = None,
           interpret: bool | None = None) -> Float[Array, "t h d"]:
    """The Pallas kernel (same contract as ``reference``; ``out_rope`` and ``q_rope`` as in
    ``ragged_attention``)."""
    check_inputs(q, window, entries, sink, meta)
    t, h, d = q.shape
    if not backend.is_power_of_2(d) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the kernel, got {d}")
    check_values(meta, ring=_pool_shape(window)[1],
                 n_entries=_pool_shape(entries)[1] if entries is not None else None)
    cfg = config or select_config(q, window, entries, meta)
    cfg.check()
    if meta.entries_kind == "topk" and cfg.block_t != 1:
        raise ValueError(f"top-k entries are a key list per token: the kernel needs block_t = 1, got {cfg.block_t}")
    scale = d**-0.5 if scale is None else float(scale)
    if out_rope is not None:
        out_rope = (jnp.asarray(out_rope[0], jnp.int32), jnp.asarray(out_rope[1], jnp.float32))
    q_eps = None
    if q_rope is not None:
        positions, inv_freq, q_eps = _check_q_rope(q, q_rope)
        q_rope = (positions, inv_freq)
    return _pallas(q, window, entries, sink, meta, out_rope, q_rope, cfg=cfg, scale=scale, q_eps=q_eps,
                   interpret=backend.interpret_mode(interpret))


def _check_q_rope(q: Array, q_rope) -> tuple[Array, Array, float]:
    """(positions [t] int32, inv_freq [r] float32, eps) of a ``q_rope`` argument, checked."""
    positions, inv_freq, eps = q_rope
    positions, inv_freq = jnp.asarray(positions, jnp.int32), jnp.asarray(inv_freq, jnp.float32)
    t, _, d = q.shape
    if positions.shape != (t,) or inv_freq.ndim != 1 or not 0 < 2 * inv_freq.shape[0] <= d:
        raise ValueError(f"q_rope needs positions [{t}] and inv_freq [r] with 0 < 2r <= {d}, got "
                         f"{positions.shape} and {inv_freq.shape}")
    return positions, inv_freq, float(eps)


def ragged_attention(q: Float[Array, "t h d"], window: Pool, entries: Pool | None, sink: Float[Array, " h"],
                     meta: RaggedMeta, *, scale: float | None = None, impl: str | None = None,
                     out_rope: tuple[Array, Array] | None = None, q_rope: tuple[Array, Array, float] | None = None,
                     **kernel_options) -> Float[Array, "t h d"]:
    """Ragged sink attention through the backend switch (``backend``): the Pallas kernel or the
    XLA reference. ``kernel_options`` (config, interpret) go to the kernel only. ``out_rope``:
    (positions [t], inv_freq [r]): the output rotated back (inverse RoPE of each token's last 2r
    dims at its position, as ``norms_rope.apply_rope(..., inverse=True)``), by the kernel's split
    merge when it has one (a decode step's launch the fewer), else by XLA. ``q_rope``: (positions
    [t], inv_freq [r], eps): q is wq_b's output, and the queries' per-head RMS norm and RoPE
    (``rope.q_norm_rope``) are applied first, by the kernel as it loads its rows (a launch the
    fewer), else by XLA."""
    if backend.resolve(impl) == "xla":
        if q_rope is not None:
            positions, inv_freq, eps = _check_q_rope(q, q_rope)
            q = q_norm_rope_reference(q, positions, inv_freq, eps)
        return _rotated_back(reference(q, window, entries, sink, meta, scale=scale), out_rope)
    return kernel(q, window, entries, sink, meta, scale=scale, out_rope=out_rope, q_rope=q_rope, **kernel_options)
