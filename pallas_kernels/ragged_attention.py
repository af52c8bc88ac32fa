"""Ragged MQA latent attention with a sink: the Pallas kernel and its pure-JAX reference.

Queries ``q [T, H, D]`` of many requests are flattened into one token axis (metadata and key sets:
``attention_metadata``). Keys = values = one D-wide latent per row (MQA with K = V), read from
two pools that may each be bf16 / fp32 arrays or fp8 ``Fp8Rows`` (dequantised in the kernel):

- ``window`` ``[S, R, D]``: the per-request window ring (slot = position mod R), with the chunk's
  new rows already written;
- ``entries`` ``[S, N, D]`` (optional): compressed entries by window number.

For token t and head h: ``o = sum_k softmax_k(scale * q.k) k`` where the softmax denominator also
holds ``exp(sink[h])`` (a per-head fp32 logit that has no value). Logits and sums are fp32; the
probabilities are cast to the pool's dtype before the P.V product; the output has q's dtype and
is ready for the caller's inverse RoPE. A token with no key gets 0.

Kernel grid: (key splits, head blocks, token blocks, S + 1). A program takes ``block_t``
consecutive tokens of one request times ``block_h`` heads as the rows of its tiles, so every key
tile it loads serves all of them; programs of one request are adjacent in launch order and share
tiles through the cache. With ``kv_splits`` > 1 each program walks a share of the key tiles and
writes its partial softmax state, merged in XLA (``merge_splits``). The last grid row (s = S)
writes zeros (or empty states) for the padding tokens.

``kernel`` validates metadata values when they are concrete (a host sync); inside jit only the
shapes are checked.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend
from pallas_kernels.attention_metadata import RaggedMeta, check_shapes, check_values, ring_positions
from pallas_kernels.kv_fp8 import BLOCK, Fp8Rows, check_layout, dequantize

if TYPE_CHECKING:  # shape annotations only; jaxtyping is not needed at run time
    from jaxtyping import Array, Float

Pool = jax.Array | Fp8Rows


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


def reference(q: Float[Array, "t h d"], window: Pool, entries: Pool | None, sink: Float[Array, " h"],
              meta: RaggedMeta, *, scale: float | None = None) -> Float[Array, "t h d"]:
    """Pure-JAX (XLA) implementation: requests padded to ``max_q_len`` tokens, their key sets
    gathered once per request and masked per token."""
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
    if entries is not None:
        u = meta.comp_idx.shape[1]
        n = _pool_shape(entries)[1]
        idx = meta.comp_idx
        ok = (jnp.arange(u)[None] < meta.comp_len[:, None]) & (idx >= 0) & (idx < n)
        rows = jnp.where(ok, idx, 0)
        if isinstance(entries, Fp8Rows):
            picked = Fp8Rows(jnp.take_along_axis(entries.nope, rows[..., None], axis=1),
                             jnp.take_along_axis(entries.rope, rows[..., None], axis=1))
        else:
            picked = jnp.take_along_axis(entries, rows[..., None], axis=1)
        kc = jnp.where(ok[..., None], _values(picked), 0)
        parts.append((kc, tok_ok[..., None] & ok[:, None, :] & (meta.comp_mask[tok_c] != 0)))
    o = sink_attention(q[tok_c], parts, sink, scale)  # [S, Q, H, D]
    dest = jnp.where(tok_ok, tok, t)
    return jnp.zeros((t, h, d), q.dtype).at[dest].set(o, mode="drop")


# ------------------------------------------------------------------------------ Pallas kernel
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


def _flat(pool: Pool) -> tuple[Array, ...]:
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
            name="ragged_sink_attention",
        )(*args)
    if p > 1:
        acc, m, l = out
        out = merge_splits(acc.reshape(p, t * h, d), m.reshape(p, t * h), l.reshape(p, t * h), sink, q.dtype)
    return out.reshape(t, h, d)


def kernel(q: Float[Array, "t h d"], window: Pool, entries: Pool | None, sink: Float[Array, " h"],
           meta: RaggedMeta, *, scale: float | None = None, config: BlockConfig | None = None,
           interpret: bool | None = None) -> Float[Array, "t h d"]:
    """The Pallas kernel (same contract as ``reference``)."""
    check_inputs(q, window, entries, sink, meta)
    t, h, d = q.shape
    if not backend.is_power_of_2(d) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the kernel, got {d}")
    check_values(meta, ring=_pool_shape(window)[1],
                 n_entries=_pool_shape(entries)[1] if entries is not None else None)
    cfg = config or default_config(h, meta.max_q_len, meta.num_requests)
    cfg.check()
    scale = d**-0.5 if scale is None else float(scale)
    return _pallas(q, window, entries, sink, meta, cfg=cfg, scale=scale, interpret=backend.interpret_mode(interpret))


def ragged_attention(q: Float[Array, "t h d"], window: Pool, entries: Pool | None, sink: Float[Array, " h"],
                     meta: RaggedMeta, *, scale: float | None = None, impl: str | None = None,
                     **kernel_options) -> Float[Array, "t h d"]:
    """Ragged sink attention through the backend switch (``backend``): the Pallas kernel or the
    XLA reference. ``kernel_options`` (config, interpret) go to the kernel only."""
    if backend.resolve(impl) == "xla":
        return reference(q, window, entries, sink, meta, scale=scale)
    return kernel(q, window, entries, sink, meta, scale=scale, **kernel_options)
