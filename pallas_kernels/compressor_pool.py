"""The compressors' gated pooling at decode and verify: gather, softmax pool and ring update in one
kernel, beside its pure-JAX reference.

A Cm compressor (``dspark_jax.model.compressor``) turns every window of m tokens into one entry:
per channel, a softmax over the window's token slots of (gate score + ape[pos % m]) weights the
projected kv. C4 overlaps windows: slots 0..m-1 take the first half of the channels ("Ca") of
window w-1's tokens, slots m..2m-1 the second half ("Cb") of window w's: a span of 2m slots and
entries of width w = C / 2; other ratios have a span of m slots and w = C. The projected kv and
scores of recent tokens live in a ring of R rows per request (row = position % R); a chunk brings
t new rows at positions start .. start + t - 1, of which the first ``n_valid`` are real.

The chunk's rows may come as the float32 partial sums of the split projection that made them
(``gemv.Partials``, at one token from the attention's shared launch): the kernel adds them as it
loads each chunk row (t rows of its channels, not one per window slot); the reference first.

``pool(...)`` returns the pooled rows of the chunk's k_max = ceil(t / m) candidate windows
(window ``start // m + k``; the caller keeps those whose closing token is real) in float32 and
the ring with the chunk's real rows written. In plain XLA that is a concatenation and two gathers,
the softmax and the sum, and per ring array a scatter with the copies XLA adds around it: about
15 launches per compressor at decode. ``pool_kernel`` does it in one, grid (requests, channel
blocks); each program pools its channels for every candidate window, then writes the chunk's real
rows into its channels of the ring in place (``input_output_aliases``).

``pool_write(...)`` goes one step further: the closed windows' pooled rows are also finished and
written into the compressor's entries (norm, RoPE, the reference's rounding: ``kv_rows``), so a
compressor's step is one launch instead of two. ``pool_write_kernel`` runs one program per
request over whole rows (the norm takes all w channels; a long span, C128's 128 slots, in blocks
of slots: the max, the sum of exponentials, then the weighted sum); a window the chunk did not
close costs nothing (a decode step closes one in m), so most steps only write the ring.

Race-free in place: the windows read ring rows of positions start - span + 1 .. start - 1 and the
chunk writes rows of positions start .. start + t - 1; with t <= R - span no position written
shares a row (position % R) with one read, so the order of reads and writes across programs does
not matter. ``pool`` takes the reference beyond that (prefill chunks).

Numerics: float32 as the reference; the softmax is the reference's (max, exp, sum, divide), the
sum over slots in another order: results differ by float32 rounding only. Inference only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend, horizontal, kv_rows
from pallas_kernels.gemv import Partials, total

if TYPE_CHECKING:  # shape annotations only
    from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """Tiles of ``pool_kernel``: each program holds [span, block_c] values of kv and scores per
    window, block_c the largest power of two dividing w with span * block_c <= tile."""

    tile: int = 2048
    row_tile: int = 4096  # ``pool_write_kernel``'s blocks: slots x all w channels
    num_warps: int = 4
    num_stages: int = 1


def geometry(ratio: int, overlap: bool, channels: int) -> tuple[int, int]:
    """(span, w): token slots per window and the entries' width for ``channels`` projected columns."""
    if ratio < 1:
        raise ValueError(f"compression ratio must be positive, got {ratio}")
    if overlap and channels % 2:
        raise ValueError(f"an overlapping compressor needs an even number of channels, got {channels}")
    return (2 * ratio, channels // 2) if overlap else (ratio, channels)


def _rows_shape(x) -> tuple[int, ...]:
    """The shape of the chunk's rows (of their sum, for a split linear's ``Partials``)."""
    return tuple(x.parts.shape[1:]) if isinstance(x, Partials) else tuple(x.shape)


def _check(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, ratio, overlap) -> None:
    if ring_kv.ndim != 3 or ring_kv.shape != ring_score.shape:
        raise ValueError(f"ring kv / score must both be [b, R, C], got {ring_kv.shape} / {ring_score.shape}")
    b, ring, c = ring_kv.shape
    kv_shape, score_shape = _rows_shape(kv_new), _rows_shape(score_new)
    if len(kv_shape) != 3 or kv_shape != score_shape or kv_shape[0] != b or kv_shape[2] != c:
        raise ValueError(f"new kv / score must both be [{b}, t, {c}], got {kv_shape} / {score_shape}")
    if ape.shape != (ratio, c):
        raise ValueError(f"ape must be [{ratio}, {c}], got {ape.shape}")
    if start.shape != (b,) or n_valid.shape != (b,):
        raise ValueError(f"start and n_valid must be [{b}], got {start.shape} / {n_valid.shape}")
    span, _ = geometry(ratio, overlap, c)
    if ring < span:
        raise ValueError(f"the ring ({ring} rows) must hold a window's span ({span} slots)")


# ------------------------------------------------------------------------------ pure-JAX reference
def pool_reference(ring_kv: Float[Array, "b r c"], ring_score: Float[Array, "b r c"],
                   kv_new: Float[Array, "b t c"], score_new: Float[Array, "b t c"], ape: Float[Array, "m c"],
                   start: Int[Array, " b"], n_valid: Int[Array, " b"], *, ratio: int, overlap: bool
                   ) -> tuple[Float[Array, "b k w"], Float[Array, "b r c"], Float[Array, "b r c"]]:
    """(pooled rows of the candidate windows [b, ceil(t / m), w] float32, new ring kv, new ring score)."""
    from dspark_jax.cache import ring_write_slots, scatter_rows

    _check(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, ratio, overlap)
    kv_new, score_new = total(kv_new), total(score_new)  # (a split linear's partial sums added, float32)
    m = ratio
    b, t, _ = kv_new.shape
    ring = ring_kv.shape[1]
    span, w = geometry(ratio, overlap, ring_kv.shape[2])
    k_max = -(-t // m)
    win = start[:, None] // m + jnp.arange(k_max, dtype=jnp.int32)[None]  # [b, k]
    first = (win - 1) * m if overlap else win * m
    pos = first[..., None] + jnp.arange(span, dtype=jnp.int32)  # [b, k, span]

    # Each token comes from the chunk (pos >= start) or from the ring of recent tokens.
    src = jnp.where(pos >= start[:, None, None], ring + pos - start[:, None, None], jnp.mod(pos, ring))
    src = jnp.clip(src, 0, ring + t - 1).reshape(b, k_max * span, 1)
    kv = jnp.take_along_axis(jnp.concatenate([ring_kv, kv_new], 1), src, 1).reshape(b, k_max, span, -1)
    sc = jnp.take_along_axis(jnp.concatenate([ring_score, score_new], 1), src, 1).reshape(b, k_max, span, -1)
    sc = sc + ape[jnp.mod(pos, m)]
    sc = jnp.where((pos >= 0)[..., None], sc, -jnp.inf)
    if overlap:  # slots 0..m-1: Ca of window w-1; slots m..2m-1: Cb of window w
        kv = jnp.concatenate([kv[:, :, :m, :w], kv[:, :, m:, w:]], axis=2)
        sc = jnp.concatenate([sc[:, :, :m, :w], sc[:, :, m:, w:]], axis=2)
    c = jnp.sum(kv * jax.nn.softmax(sc, axis=2), axis=2)  # [b, k, w] fp32

    slots = ring_write_slots(start, n_valid, t, ring)
    return c, scatter_rows(ring_kv, slots, kv_new), scatter_rows(ring_score, slots, score_new)


# ------------------------------------------------------------------------------ Pallas kernel
def _iota(n: int) -> Array:
    return jnp.arange(n, dtype=jnp.int32)


def _pool_kernel(start_ref, n_valid_ref, ape_ref, kv_new_ref, score_new_ref, ring_kv_in, ring_score_in,
                 c_ref, ring_kv_ref, ring_score_ref, *, m: int, span: int, overlap: bool, w: int, bc: int,
                 parts: int):
    """``parts``: the chunk's rows come as that many partial sums of a split linear (refs
    [parts * b, t, C], part s of request r at s * b + r), added in order as they are loaded."""
    del ring_kv_in, ring_score_in  # aliased to ring_kv_ref / ring_score_ref
    t, ring = kv_new_ref.shape[1], ring_kv_ref.shape[1]
    b = kv_new_ref.shape[0] // parts
    req, blk = pl.program_id(0), pl.program_id(1)
    start, n_valid = start_ref[req], n_valid_ref[req]
    chan = blk * bc + _iota(bc)  # this program's output channels [bc]
    sp = backend.next_power_of_2(span)
    slot = _iota(sp)[:, None]  # [sp, 1]
    # ring / chunk column of each (slot, channel): C4's slots m.. read the second half (Cb)
    col = chan[None, :] + (jnp.where(slot >= m, w, 0) if overlap else 0 * slot)  # [sp, bc]

    def chunk_rows(ref, rows, cols, mask=None):  # the chunk's rows at cols, their parts added in order
        kw = {} if mask is None else dict(mask=mask, other=0.0)
        v = pltriton.load(ref.at[req, rows, cols], **kw)
        for s in range(1, parts):
            v = v + pltriton.load(ref.at[s * b + req, rows, cols], **kw)
        return v

    # every chunk row at this program's channels (each half for C4): t x [1, bc] loads, not [sp, bc]
    halves = (chan, chan + w) if overlap else (chan,)
    new_rows = [[[chunk_rows(ref, i, cols[None, :]) for cols in halves] for i in range(t)]
                for ref in (kv_new_ref, score_new_ref)]  # [kv / score][row][half]: [1, bc]

    def chunk_values(which: int, row_new):  # [sp, bc]: each slot's chunk row (row_new) at its half's columns
        out = None
        for i, row in enumerate(new_rows[which]):
            v = row[0] if not overlap else jnp.where(slot >= m, row[1], row[0])
            out = v + 0 * col if out is None else jnp.where(row_new == i, v, out)
        return out

    for k in range(-(-t // m)):  # candidate windows
        win = start // m + k
        pos = (win - 1) * m + slot if overlap else win * m + slot  # [sp, 1]
        real = (slot < span) & (pos >= 0)
        new = real & (pos >= start)
        old = real & (pos < start)
        row_new = jnp.clip(pos - start, 0, t - 1)
        row_old = jnp.where(old, pos, 0) % ring
        old_m = jnp.broadcast_to(old, col.shape)
        kv = jnp.where(new, chunk_values(0, row_new),
                       pltriton.load(ring_kv_ref.at[req, row_old, col], mask=old_m, other=0.0))
        sc = jnp.where(new, chunk_values(1, row_new),
                       pltriton.load(ring_score_ref.at[req, row_old, col], mask=old_m, other=0.0))
        sc = sc + pltriton.load(ape_ref.at[jnp.where(real, pos, 0) % m, col])
        sc = jnp.where(real, sc, -jnp.inf)
        e = jnp.exp(sc - jnp.max(sc, axis=0, keepdims=True))
        c = jnp.sum(kv * (e / jnp.sum(e, axis=0, keepdims=True)), axis=0)  # [bc]
        pltriton.store(c_ref.at[req, k, chan], c)

    # The chunk's real rows into this program's columns of the ring (t <= R - span: no row read above).
    # Masked rows point one past the ring: never accessed on a GPU, and in interpret mode a masked
    # store to a real row could overwrite it.
    i = _iota(backend.next_power_of_2(t))[:, None]
    real = (i < n_valid) & (i < t)
    ok = jnp.broadcast_to(real, (i.shape[0], bc))
    dest = jnp.where(real, (start + i) % ring, ring)
    src = jnp.where(i < t, i, 0)
    for cols in halves:
        for new_ref, ring_ref in ((kv_new_ref, ring_kv_ref), (score_new_ref, ring_score_ref)):
            pltriton.store(ring_ref.at[req, dest, cols[None, :]], chunk_rows(new_ref, src, cols[None, :], ok), mask=ok)


def _flat_parts(x) -> tuple[Array, int]:
    """(rows [S b, t, C] float32, S): a split linear's partial sums part-major, or the rows, S = 1."""
    if isinstance(x, Partials):
        return x.parts.reshape(-1, *x.parts.shape[2:]).astype(jnp.float32), x.parts.shape[0]
    return x.astype(jnp.float32), 1


@functools.partial(jax.jit, static_argnames=("ratio", "overlap", "config", "interpret"))
def _pool_pallas(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, *, ratio: int, overlap: bool,
                 config: PoolConfig, interpret: bool):
    (kv_new, parts), (score_new, score_parts) = _flat_parts(kv_new), _flat_parts(score_new)
    if parts != score_parts:
        kv_new, score_new = _flat_parts(total(kv_new))[0], _flat_parts(total(score_new))[0]
        parts = 1
    b, t, c = ring_kv.shape[0], kv_new.shape[1], kv_new.shape[2]
    span, w = geometry(ratio, overlap, c)
    bc = backend.largest_pow2_divisor(w, max(1, config.tile // backend.next_power_of_2(span)))
    kernel = functools.partial(_pool_kernel, m=ratio, span=span, overlap=overlap, w=w, bc=bc, parts=parts)
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=(b, w // bc),
            out_shape=(jax.ShapeDtypeStruct((b, -(-t // ratio), w), jnp.float32),
                       jax.ShapeDtypeStruct(ring_kv.shape, jnp.float32),
                       jax.ShapeDtypeStruct(ring_score.shape, jnp.float32)),
            input_output_aliases={5: 1, 6: 2},
            compiler_params=backend.compiler_params(config.num_warps, config.num_stages),
            interpret=interpret,
            name="compressor_pool",
        )(start.astype(jnp.int32), n_valid.astype(jnp.int32), ape.astype(jnp.float32), kv_new, score_new, ring_kv,
          ring_score)


def pool_kernel(ring_kv: Float[Array, "b r c"], ring_score: Float[Array, "b r c"],
                kv_new: Float[Array, "b t c"], score_new: Float[Array, "b t c"], ape: Float[Array, "m c"],
                start: Int[Array, " b"], n_valid: Int[Array, " b"], *, ratio: int, overlap: bool,
                config: PoolConfig = PoolConfig(), interpret: bool | None = None
                ) -> tuple[Float[Array, "b k w"], Float[Array, "b r c"], Float[Array, "b r c"]]:
    """The Pallas kernel (same contract as ``pool_reference``); the rings are float32 and updated
    in place (jit the caller with them donated to avoid a copy). Needs t <= R - span."""
    _check(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, ratio, overlap)
    span, _ = geometry(ratio, overlap, ring_kv.shape[2])
    if _rows_shape(kv_new)[1] > ring_kv.shape[1] - span:
        raise ValueError(f"the kernel takes chunks of at most R - span = {ring_kv.shape[1] - span} tokens, "
                         f"got {_rows_shape(kv_new)[1]}")
    if ring_kv.dtype != jnp.float32 or ring_score.dtype != jnp.float32:
        raise ValueError(f"the rings must be float32, got {ring_kv.dtype} / {ring_score.dtype}")
    return _pool_pallas(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, ratio=ratio, overlap=overlap,
                        config=config, interpret=backend.interpret_mode(interpret))


def pool(ring_kv: Float[Array, "b r c"], ring_score: Float[Array, "b r c"], kv_new: Float[Array, "b t c"],
         score_new: Float[Array, "b t c"], ape: Float[Array, "m c"], start: Int[Array, " b"],
         n_valid: Int[Array, " b"], *, ratio: int, overlap: bool, impl: str | None = None
         ) -> tuple[Float[Array, "b k w"], Float[Array, "b r c"], Float[Array, "b r c"]]:
    """The backend switch: the kernel for chunks of up to R - span tokens (decode and verify)
    when ``impl`` resolves to "pallas", else the reference."""
    span, _ = geometry(ratio, overlap, ring_kv.shape[-1])
    fits = _rows_shape(kv_new)[1] <= ring_kv.shape[1] - span and ring_kv.dtype == jnp.float32
    if backend.resolve(impl) == "pallas" and fits:
        return pool_kernel(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, ratio=ratio, overlap=overlap)
    return pool_reference(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, ratio=ratio, overlap=overlap)


# ------------------------------------------------------------------------------ pooling and the entries' write
# Whether ``pool_write`` takes ``pool_write_kernel`` (one launch) where it can, or the two launches
# (``pool_kernel``, its channels over programs, then ``kv_rows.write_window_rows``). Two: the one
# launch pools a closed window's whole rows in one program per request, and a layer's next kernels
# wait for it; on an H100 the 6-layer Flash slice's batch-1 step took 17 us less with two launches
# per compressor (34 us less with ``MoE.one_row`` "apart" too), docs/benchmarks.md (2026-12-05, last).
# A switch for benchmarks (``benchmarks/decode.py --compressor-launches``).
WRITE_IN_POOL = False


def pool_write_reference(ring_kv: Float[Array, "b r c"], ring_score: Float[Array, "b r c"],
                         kv_new: Float[Array, "b t c"], score_new: Float[Array, "b t c"], ape: Float[Array, "m c"],
                         start: Int[Array, " b"], n_valid: Int[Array, " b"], entries: Array,
                         weight: Float[Array, " w"], inv_freq, *, ratio: int, overlap: bool, eps: float,
                         quant: str | None, dtype) -> tuple[Array, Float[Array, "b r c"], Float[Array, "b r c"]]:
    """(entries, new ring kv, new ring score): ``pool_reference``'s pooled rows of the windows the
    chunk's real rows closed, finished (norm, RoPE, ``quant``) and written into ``entries`` at
    their window's row as ``kv_rows.write_window_rows`` (its reference)."""
    c, ring_kv, ring_score = pool_reference(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, ratio=ratio,
                                            overlap=overlap)
    entries = kv_rows.write_window_rows(entries, start, n_valid, ratio, c, weight, inv_freq, eps=eps, quant=quant,
                                        dtype=dtype, impl="xla")
    return entries, ring_kv, ring_score


def _pool_write_kernel(ids, start_ref, n_valid_ref, ape_ref, kv_new_ref, score_new_ref, weight_ref, freq_ref, *refs,
                       m: int, span: int, overlap: bool, w: int, sb: int, parts: int, eps: float, rope_dim: int,
                       quant: str | None, dt):
    """One request per program: every candidate window its real rows closed pooled over blocks
    of ``sb`` slots x all w channels (whole rows: the norm takes the row), finished by
    ``kv_rows.finished_row`` and written into its entry; then the chunk's real rows into the ring.
    A window not closed costs nothing (a decode step closes one in m)."""
    *h_ref, _, _, _, ring_kv_ref, ring_score_ref, entries_ref = refs  # (inputs aliased to the outputs)
    t, ring, n = kv_new_ref.shape[1], ring_kv_ref.shape[1], entries_ref.shape[1]
    b = kv_new_ref.shape[0] // parts
    (req,) = ids
    start, n_valid = start_ref[req], n_valid_ref[req]

    def chunk_rows(ref, rows, cols, mask):  # the chunk's rows at cols, their parts added in order
        v = pltriton.load(ref.at[req, rows, cols], mask=mask, other=0.0)
        for s in range(1, parts):
            v = v + pltriton.load(ref.at[s * b + req, rows, cols], mask=mask, other=0.0)
        return v

    def block(win, at, j):  # slots j * sb ..: kv and scores + ape (-inf: no slot) [sb, w] at channels ``at``
        slot = j * sb + _iota(sb)[:, None]
        pos = (win - 1) * m + slot if overlap else win * m + slot  # [sb, 1]
        real = (slot < span) & (pos >= 0)
        new, old = real & (pos >= start), real & (pos < start)
        col = at + (jnp.where(slot >= m, w, 0) if overlap else 0 * slot)  # C4's slots m..: the second half
        new_m, old_m = jnp.broadcast_to(new, col.shape), jnp.broadcast_to(old, col.shape)
        row_new, row_old = jnp.where(new, pos - start, 0), jnp.where(old, pos, 0) % ring
        kv = jnp.where(new, chunk_rows(kv_new_ref, row_new, col, new_m),
                       pltriton.load(ring_kv_ref.at[req, row_old, col], mask=old_m, other=0.0))
        sc = jnp.where(new, chunk_rows(score_new_ref, row_new, col, new_m),
                       pltriton.load(ring_score_ref.at[req, row_old, col], mask=old_m, other=0.0))
        sc = sc + pltriton.load(ape_ref.at[jnp.where(real, pos, 0) % m, col])
        return kv, jnp.where(real, sc, -jnp.inf)

    def pooled(win, at):  # [1, w]: the window's softmax pool at channels ``at`` [1, w], as ``_pool_kernel``
        blocks = -(-span // sb)
        if blocks == 1:
            kv, sc = block(win, at, 0)
            e = jnp.exp(sc - jnp.max(sc, axis=0, keepdims=True))
            return jnp.sum(kv * (e / jnp.sum(e, axis=0, keepdims=True)), axis=0, keepdims=True)
        # longer spans (C128): the max, the sum of exponentials, then the weighted sum, block by block
        first = jnp.full((1, w), -jnp.inf, jnp.float32)
        mx = jax.lax.fori_loop(0, blocks, lambda j, a: jnp.maximum(
            a, jnp.max(block(win, at, j)[1], axis=0, keepdims=True)), first)
        total_e = jax.lax.fori_loop(0, blocks, lambda j, a: a + jnp.sum(
            jnp.exp(block(win, at, j)[1] - mx), axis=0, keepdims=True), jnp.zeros((1, w), jnp.float32))

        def weighted(j, a):
            kv, sc = block(win, at, j)
            return a + jnp.sum(kv * (jnp.exp(sc - mx) / total_e), axis=0, keepdims=True)

        return jax.lax.fori_loop(0, blocks, weighted, jnp.zeros((1, w), jnp.float32))

    cols = _iota(w)[None, :]
    for k in range(-(-t // m)):  # candidate windows: written iff the chunk's real rows closed them
        win = start // m + k

        @pl.when((win < (start + n_valid) // m) & (win < n))
        def _(win=win):
            e = kv_rows.finished_row(functools.partial(pooled, win), weight_ref, freq_ref,
                                     h_ref[0] if h_ref else None, win * m, w=w, eps=eps, rope_dim=rope_dim,
                                     quant=quant, dt=dt)
            pltriton.store(entries_ref.at[req, win, cols], e.astype(entries_ref.dtype))

    # The chunk's real rows into the ring (t <= R - span: no row read above); masked rows point one
    # past the ring (never accessed), as in ``_pool_kernel``.
    i = _iota(backend.next_power_of_2(t))[:, None]
    real = (i < n_valid) & (i < t)
    ok = jnp.broadcast_to(real, (i.shape[0], w))
    dest = jnp.where(real, (start + i) % ring, ring)
    src = jnp.where(i < t, i, 0)
    for half in ((cols, cols + w) if overlap else (cols,)):
        for new_ref, ring_ref in ((kv_new_ref, ring_kv_ref), (score_new_ref, ring_score_ref)):
            pltriton.store(ring_ref.at[req, dest, half], chunk_rows(new_ref, src, half, ok), mask=ok)


def pool_write_part(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, entries, weight, inv_freq, *,
                    ratio: int, overlap: bool, eps: float, quant: str | None, dtype,
                    config: PoolConfig = PoolConfig()) -> horizontal.Part:
    """``pool_write_kernel`` as a launch's part (``horizontal``): outputs (ring kv, ring score,
    entries)."""
    (kv_new, parts), (score_new, score_parts) = _flat_parts(kv_new), _flat_parts(score_new)
    if parts != score_parts:
        kv_new, score_new = _flat_parts(total(kv_new))[0], _flat_parts(total(score_new))[0]
        parts = 1
    span, w = geometry(ratio, overlap, ring_kv.shape[2])
    fit = max(1, config.row_tile // w)
    sb = min(backend.next_power_of_2(span), 1 << (fit.bit_length() - 1))  # (powers of two)
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    body = functools.partial(_pool_write_kernel, m=ratio, span=span, overlap=overlap, w=w, sb=sb, parts=parts,
                             eps=eps, rope_dim=2 * inv_freq.shape[0], quant=quant, dt=jnp.dtype(dtype))
    inputs = (start.astype(jnp.int32), n_valid.astype(jnp.int32), ape.astype(jnp.float32), kv_new, score_new,
              weight.astype(jnp.float32), inv_freq, *kv_rows.hadamard_operands(quant, w), ring_kv, ring_score,
              entries)
    n = len(inputs)
    return horizontal.Part(body, (ring_kv.shape[0],), inputs,
                           (jax.ShapeDtypeStruct(ring_kv.shape, jnp.float32),
                            jax.ShapeDtypeStruct(ring_score.shape, jnp.float32),
                            jax.ShapeDtypeStruct(entries.shape, entries.dtype)),
                           {n - 3: 0, n - 2: 1, n - 1: 2},
                           "compressor_pool_write" if quant != "keys" else "compressor_pool_keys")


@functools.partial(jax.jit, static_argnames=("ratio", "overlap", "eps", "quant", "dtype", "config", "interpret"))
def _pool_write_pallas(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, entries, weight, inv_freq, *,
                       ratio: int, overlap: bool, eps: float, quant: str | None, dtype, config: PoolConfig,
                       interpret: bool):
    part = pool_write_part(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, entries, weight, inv_freq,
                           ratio=ratio, overlap=overlap, eps=eps, quant=quant, dtype=dtype, config=config)
    ((ring_kv, ring_score, entries),) = horizontal.launch([part], num_warps=config.num_warps,
                                                          num_stages=config.num_stages, interpret=interpret)
    return entries, ring_kv, ring_score


def _write_takes(ring_kv, kv_new, entries, ratio: int, overlap: bool, inv_freq, quant: str | None) -> bool:
    """Whether ``pool_write_kernel`` takes these: chunks of up to R - span rows, float32 rings and
    entries that ``kv_rows``' kernel writes (a plain float pool, w a power of two, ...)."""
    span, w = geometry(ratio, overlap, ring_kv.shape[-1])
    rows = _rows_shape(kv_new)
    windows = jax.ShapeDtypeStruct((rows[0], -(-rows[1] // ratio), w), jnp.float32)
    return (rows[1] <= ring_kv.shape[1] - span and ring_kv.dtype == jnp.float32
            and kv_rows.kernel_takes(entries, windows, 2 * np.asarray(inv_freq).shape[0], quant))


def pool_write_kernel(ring_kv: Float[Array, "b r c"], ring_score: Float[Array, "b r c"],
                      kv_new: Float[Array, "b t c"], score_new: Float[Array, "b t c"], ape: Float[Array, "m c"],
                      start: Int[Array, " b"], n_valid: Int[Array, " b"], entries: Array, weight: Float[Array, " w"],
                      inv_freq, *, ratio: int, overlap: bool, eps: float, quant: str | None, dtype,
                      config: PoolConfig = PoolConfig(), interpret: bool | None = None
                      ) -> tuple[Array, Float[Array, "b r c"], Float[Array, "b r c"]]:
    """The Pallas kernel (``pool_write_reference``'s contract): the pooling, the closed windows'
    entries and the ring update in one launch, grid (requests,); rings and entries updated in
    place (jit the caller with them donated to avoid a copy)."""
    _check(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, ratio, overlap)
    if not _write_takes(ring_kv, kv_new, entries, ratio, overlap, inv_freq, quant):
        raise ValueError(f"the pooling-and-write kernel takes chunks of at most R - span rows, float32 rings and "
                         f"entries kv_rows' kernel writes; got rows {_rows_shape(kv_new)}, rings {ring_kv.dtype} "
                         f"{ring_kv.shape}, entries {getattr(entries, 'dtype', type(entries).__name__)} "
                         f"{getattr(entries, 'shape', None)}, quant {quant!r}")
    _, w = geometry(ratio, overlap, ring_kv.shape[2])
    if weight.shape != (w,):
        raise ValueError(f"the norm weight must be [{w}], got {weight.shape}")
    return _pool_write_pallas(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, entries, weight,
                              jnp.asarray(inv_freq, jnp.float32), ratio=ratio, overlap=overlap, eps=float(eps),
                              quant=quant, dtype=jnp.dtype(dtype), config=config,
                              interpret=backend.interpret_mode(interpret))


def takes_pool_write(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, entries, weight, inv_freq, *,
                     ratio: int, overlap: bool, eps: float, quant: str | None, dtype, impl: str | None = None) -> bool:
    """Whether ``pool_write`` (same arguments) takes ``pool_write_kernel``: ``impl`` resolves to
    "pallas", ``WRITE_IN_POOL`` is on and the kernel takes the inputs."""
    del ring_score, score_new, ape, start, n_valid, weight, eps, dtype  # (``pool_write``'s signature)
    return (backend.resolve(impl) == "pallas" and WRITE_IN_POOL
            and _write_takes(ring_kv, kv_new, entries, ratio, overlap, inv_freq, quant))


def pool_write(ring_kv: Float[Array, "b r c"], ring_score: Float[Array, "b r c"], kv_new: Float[Array, "b t c"],
               score_new: Float[Array, "b t c"], ape: Float[Array, "m c"], start: Int[Array, " b"],
               n_valid: Int[Array, " b"], entries: Array, weight: Float[Array, " w"], inv_freq, *, ratio: int,
               overlap: bool, eps: float, quant: str | None, dtype, impl: str | None = None
               ) -> tuple[Array, Float[Array, "b r c"], Float[Array, "b r c"]]:
    """The backend switch: ``pool_write_kernel`` where ``impl`` resolves to "pallas", it takes the
    inputs and ``WRITE_IN_POOL`` is on; else ``pool``, then ``kv_rows.write_window_rows`` (each its
    own kernel or reference)."""
    if takes_pool_write(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, entries, weight, inv_freq,
                        ratio=ratio, overlap=overlap, eps=eps, quant=quant, dtype=dtype, impl=impl):
        return pool_write_kernel(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, entries, weight,
                                 inv_freq, ratio=ratio, overlap=overlap, eps=eps, quant=quant, dtype=dtype)
    c, ring_kv, ring_score = pool(ring_kv, ring_score, kv_new, score_new, ape, start, n_valid, ratio=ratio,
                                  overlap=overlap, impl=impl)
    entries = kv_rows.write_window_rows(entries, start, n_valid, ratio, c, weight, inv_freq, eps=eps, quant=quant,
                                        dtype=dtype, impl=impl)
    return entries, ring_kv, ring_score


kernel = pool_kernel
reference = pool_reference
