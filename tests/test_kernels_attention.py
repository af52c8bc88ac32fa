"""Ragged sink attention: kernel (interpret mode) vs reference, and reference vs the model's key sets.

Interpret mode fills every output of a ``pallas_call`` with NaN before the kernel runs (checked by
``test_interpret_mode_poisons_outputs``), so a finite result means every element was written.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from dspark_jax.cache import ring_positions, ring_write_slots, scatter_rows
from dspark_jax.model import attention as model_attention
from dspark_jax.model.indexer import visible_entries
from pallas_kernels import attention_metadata as am
from pallas_kernels import attention_configs, backend, kv_fp8
from pallas_kernels import ragged_attention as ra

H, D, W = 4, 128, 8  # tiny-model head count, head dim and window
R = W + 16  # ring slots
TOL = dict(f32=dict(rtol=2e-5, atol=2e-5), bf16=dict(rtol=2e-2, atol=2e-2))


def _rand(rng, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _poison_unwritten_ring(ring, ring_end):
    """NaN in every ring slot that holds no position yet (the kernel must never read them)."""
    pos = ra.ring_positions(jnp.asarray(ring_end, jnp.int32), ring.shape[1])
    return jnp.where((pos >= 0)[..., None], ring, jnp.nan)


def _compare(out, ref, dtype, padding_from):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "unwritten or non-finite output elements"
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    assert (out[padding_from:] == 0).all()
    assert np.abs(out[:padding_from]).max() > 0.05  # not a trivially zero result


def test_interpret_mode_poisons_outputs():
    def writes_half(o_ref):
        o_ref[pl.ds(0, 8)] = jnp.ones((8,), jnp.float32)

    out = pl.pallas_call(writes_half, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=True)()
    assert np.isnan(np.asarray(out)[8:]).all()


@pytest.mark.parametrize("splits,d,dtype", [(3, 128, jnp.float32), (16, 512, jnp.bfloat16), (5, 96, jnp.bfloat16)])
def test_merge_kernel_matches_merge_splits(splits, d, dtype):
    """The split merge as one launch against its XLA reference: splits without keys (lse = -inf,
    zero partials), a row with no keys in any split (only the sink), non-power-of-two splits and
    widths; every element written (interpret mode poisons the output)."""
    rng = np.random.default_rng(splits)
    n, h = 3 * H, H
    o = _rand(rng, (splits, n, d), dtype)
    lse = _rand(rng, (splits, n), scale=3.0)
    empty = rng.random((splits, n)) < 0.3
    empty[:, 5] = True
    lse = jnp.where(empty, -jnp.inf, lse)
    o = jnp.where(empty[..., None], 0, o).astype(dtype)
    sink = _rand(rng, (h,))
    out = ra.merge_kernel(o, lse, sink, dtype)
    ref = ra.merge_splits(o, lse, sink, dtype)
    assert out.shape == (n, d) and out.dtype == dtype
    _compare(out, ref, "f32" if dtype == jnp.float32 else "bf16", n)


# (q_lens, committed lengths): lengths 1 and γ+1 = 6, a request without tokens, a fresh request,
# ring wrap-around (> R)
VERIFY = ([1, 6, 3, 0, 6, 2], [0, 5, 31, 12, 100, 9])
S = len(VERIFY[0])


@pytest.mark.parametrize("dtype,layout,splits", [("f32", "plain", 1), ("bf16", "fp8", 4)])
def test_window_only(dtype, layout, splits):
    rng = np.random.default_rng(0)
    q_lens, lengths = VERIFY
    t = sum(q_lens) + 3  # three padding tokens
    meta, _ = am.verify(q_lens, lengths, window=W, num_tokens=t, max_q_len=6)
    qd = jnp.float32 if dtype == "f32" else jnp.bfloat16
    q = _rand(rng, (t, H, D), qd)
    ring = _poison_unwritten_ring(_rand(rng, (S, R, D), qd), np.add(q_lens, lengths))
    if layout == "fp8":
        ring = kv_fp8.quantize(ring)
    sink = _rand(rng, (H,))
    out = ra.kernel(q, ring, None, sink, meta, config=ra.BlockConfig(block_t=4, block_h=4, kv_splits=splits))
    _compare(out, ra.reference(q, ring, None, sink, meta), dtype, sum(q_lens))


@pytest.mark.parametrize("dtype,w_layout,c_layout,config", [
    ("f32", "plain", "plain", None),
    ("bf16", "fp8", "fp8", ra.BlockConfig(block_h=16, block_k=16, kv_splits=3, block_d=64)),
    ("bf16", "plain", "fp8", ra.BlockConfig(block_h=16, block_k=32, num_warps=4, fp8_fold=True)),
])
def test_topk_entries_with_empty_slots(dtype, w_layout, c_layout, config):
    rng = np.random.default_rng(1)
    q_lens, lengths = VERIFY
    t, n, k = sum(q_lens) + 2, 40, 5
    meta, pos = am.verify(q_lens, lengths, window=W, num_tokens=t, max_q_len=6)
    vis = np.maximum((np.asarray(pos) + 1) // 4, 0)
    topk = np.full((t, k), -1, np.int32)
    for i in range(t):  # causal picks, some slots empty (fewer visible entries than k, or -1 holes)
        m = min(k, vis[i])
        topk[i, :m] = rng.choice(vis[i], m, replace=False) if m else []
        topk[i, rng.random(k) < 0.2] = -1
    topk[-1] = np.arange(k)  # a padding token's picks must be ignored
    meta = am.with_topk_entries(meta, jnp.asarray(topk))
    qd = jnp.float32 if dtype == "f32" else jnp.bfloat16
    q = _rand(rng, (t, H, D), qd)
    ring = _poison_unwritten_ring(_rand(rng, (S, R, D), qd), np.add(q_lens, lengths))
    entries = _rand(rng, (S, n, D), qd)
    picked = np.zeros((S, n), bool)  # entries no token picked hold NaN: they must not be read
    req = np.searchsorted(np.cumsum(q_lens), np.arange(sum(q_lens)), side="right")
    for i, r in enumerate(req):
        picked[r, topk[i][topk[i] >= 0]] = True
    entries = jnp.where(jnp.asarray(picked)[..., None], entries, jnp.nan)
    ring = kv_fp8.quantize(ring) if w_layout == "fp8" else ring
    entries = kv_fp8.quantize(entries) if c_layout == "fp8" else entries
    sink = _rand(rng, (H,))
    out = ra.kernel(q, ring, entries, sink, meta, config=config)
    _compare(out, ra.reference(q, ring, entries, sink, meta), dtype, sum(q_lens))


@pytest.mark.parametrize("config", [None, ra.BlockConfig(block_t=1, block_h=16, block_k=16, block_d=64),
                                    ra.BlockConfig(block_t=2, block_h=8, block_k=64, num_warps=8, kv_splits=3)])
def test_prefix_entries_block_configs(config):
    rng = np.random.default_rng(2)
    q_lens, lengths = VERIFY
    t, n, ratio = sum(q_lens), 16, 8
    meta, pos = am.verify(q_lens, lengths, window=W, num_tokens=t, max_q_len=6)
    meta = am.with_prefix_entries(meta, pos, ratio=ratio, num_slots=n)
    q = _rand(rng, (t, H, D))
    ring = _poison_unwritten_ring(_rand(rng, (S, R, D)), np.add(q_lens, lengths))
    entries = _rand(rng, (S, n, D))
    # entries nobody may see yet hold NaN: they must not be read
    visible = np.arange(n)[None] < (np.add(q_lens, lengths) // ratio)[:, None]
    entries = jnp.where(jnp.asarray(visible)[..., None], entries, jnp.nan)
    sink = _rand(rng, (H,))
    out = ra.kernel(q, ring, entries, sink, meta, config=config)
    _compare(out, ra.reference(q, ring, entries, sink, meta), "f32", t)


def test_draft_block_and_dispatch():
    rng = np.random.default_rng(3)
    lengths, g = np.array([0, 3, 50]), 5
    meta = am.draft(jnp.asarray(lengths), block=g, window=W)
    q = _rand(rng, (3 * g, H, D), jnp.bfloat16)
    ring = _poison_unwritten_ring(_rand(rng, (3, R, D), jnp.bfloat16), lengths + g)
    sink = _rand(rng, (H,))
    # the switch is read at trace time: trace a fresh function under each setting
    with backend.use("xla"):
        ref = ra.ragged_attention(q, ring, None, sink, meta)
        assert "pallas_call" not in str(jax.make_jaxpr(lambda *a: ra.ragged_attention(*a))(q, ring, None, sink, meta))
    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: ra.ragged_attention(*a))(q, ring, None, sink, meta))
    out = ra.ragged_attention(q, ring, None, sink, meta)
    _compare(out, ref, "bf16", 3 * g)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(ra.reference(q, ring, None, sink, meta)))


# ------------------------------------------------------------------ reference vs the model's key sets
def _model_chunk(rng, b, t, n_valid, lengths):
    q = _rand(rng, (b, t, H, D))
    window = _rand(rng, (b, R, D))
    kv = _rand(rng, (b, t, D))
    return q, window, kv


def _model_window_part(window, kv, lengths, n_valid, t):
    """Keys and mask exactly as ``Attention.__call__`` builds them (ring before the chunk + chunk)."""
    pos = lengths[:, None] + jnp.arange(t)[None]
    rpos = ring_positions(lengths, R)
    keys = jnp.concatenate([window, kv], axis=1)
    key_pos = jnp.concatenate([rpos, pos], axis=1)
    key_ok = jnp.concatenate([rpos >= 0, jnp.arange(t)[None] < n_valid[:, None]], axis=1)
    return (keys, model_attention.window_mask(key_pos, key_ok, pos, W)), pos


def _flatten(x, n_valid):
    return jnp.concatenate([x[i, :int(n)] for i, n in enumerate(n_valid)], axis=0)


@pytest.mark.parametrize("kind,dense", [("window", False), ("prefix", False), ("topk", False), ("topk", True)])
def test_reference_matches_model_key_sets(kind, dense):
    rng = np.random.default_rng(4)
    b, t, n, ratio, k = 4, 6, 12, 4, 3
    lengths = jnp.asarray([0, 7, 30, 45], jnp.int32)
    n_valid = jnp.asarray([1, 6, 4, 6], jnp.int32)
    q, window, kv = _model_chunk(rng, b, t, n_valid, lengths)
    sink = _rand(rng, (H,))
    part, pos = _model_window_part(window, kv, lengths, n_valid, t)
    parts = [part]
    entries = _rand(rng, (b, n, D))
    if dense:  # the model's [b, t] layout with padding rows, flattened
        meta, tok_pos = am.verify_dense(n_valid, lengths, width=t, window=W)
        flat = lambda x: x.reshape(b * t, *x.shape[2:])  # noqa: E731
    else:
        meta, tok_pos = am.verify(n_valid, lengths, window=W, num_tokens=int(n_valid.sum()), max_q_len=t)
        flat = lambda x: _flatten(x, n_valid)  # noqa: E731
    if kind == "prefix":
        parts.append((entries, jnp.arange(n)[None, None] < visible_entries(pos, ratio)[..., None]))
        meta = am.with_prefix_entries(meta, tok_pos, ratio=ratio, num_slots=n)
    elif kind == "topk":
        vis = np.asarray(visible_entries(pos, ratio))
        top = np.full((b, t, k), -1, np.int32)
        for i in range(b):
            for j in range(t):
                m = min(k, vis[i, j])
                top[i, j, :m] = rng.choice(vis[i, j], m, replace=False) if m else []
        top = jnp.asarray(top)
        picked = entries[jnp.arange(b)[:, None, None], jnp.maximum(top, 0)]
        parts.append((picked, top >= 0))
        meta = am.with_topk_entries(meta, flat(top), tok_pos)
    expect = flat(model_attention.sink_attention(q, parts, sink, D**-0.5))

    ring = scatter_rows(window, ring_write_slots(lengths, n_valid, t, R), kv)  # the chunk's rows first
    got = ra.reference(flat(q), ring, None if kind == "window" else entries, sink, meta)
    real = np.asarray(tok_pos) >= 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expect)[real], rtol=1e-5, atol=1e-5)
    assert (np.asarray(got)[~real] == 0).all()
    if dense:  # and the kernel on the dense layout
        out = ra.kernel(flat(q), ring, entries, sink, meta)
        assert np.isfinite(np.asarray(out)).all()
        np.testing.assert_allclose(np.asarray(out), np.asarray(got), rtol=2e-5, atol=2e-5)


def test_reference_matches_drafter_key_sets():
    rng = np.random.default_rng(5)
    b, g = 3, 5
    lengths = jnp.asarray([0, 4, 77], jnp.int32)
    q, ring, block_kv = _rand(rng, (b, g, H, D)), _rand(rng, (b, R, D)), _rand(rng, (b, g, D))
    sink = _rand(rng, (H,))
    rpos = ring_positions(lengths, R)  # as DSparkStage.draft_layer: committed context + the block
    visible = (rpos >= 0) & (rpos >= lengths[:, None] - W)
    parts = [(ring, jnp.broadcast_to(visible[:, None, :], (b, g, R))), (block_kv, jnp.ones((b, g, g), bool))]
    expect = model_attention.sink_attention(q, parts, sink, D**-0.5)
    full = jnp.full((b,), g, jnp.int32)
    ring_with_block = scatter_rows(ring, ring_write_slots(lengths, full, g, R), block_kv)
    got = ra.reference(q.reshape(b * g, H, D), ring_with_block, None, sink, am.draft(lengths, block=g, window=W))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expect).reshape(b * g, H, D), rtol=1e-5, atol=1e-5)


def test_entry_metadata_builders():
    """Top-k lists are kept per token (padding tokens and rows at position -1 get none); prefix
    counts follow the reference rule w < (p + 1) // ratio, clamped to the pool."""
    rng = np.random.default_rng(7)
    q_lens, k = [3, 1, 4], 4
    t = sum(q_lens) + 1
    meta, pos = am.verify(q_lens, [10, 0, 20], window=W, num_tokens=t, max_q_len=4)
    topk = rng.integers(-1, 9, (t, k)).astype(np.int32)
    m = am.with_topk_entries(meta, jnp.asarray(topk))
    assert m.entries_kind == "topk" and m.comp_count is None
    want = topk.copy()
    want[-1] = -1  # padding token
    np.testing.assert_array_equal(np.asarray(m.comp_topk), want)
    dense_pos = np.asarray(pos).copy()
    dense_pos[1] = -1  # a padding row of the dense layout
    m = am.with_topk_entries(meta, jnp.asarray(topk), jnp.asarray(dense_pos))
    assert (np.asarray(m.comp_topk)[1] == -1).all() and (np.asarray(m.comp_topk)[0] == topk[0]).all()

    m = am.with_prefix_entries(meta, pos, ratio=4, num_slots=5)
    assert m.entries_kind == "prefix" and m.comp_topk is None
    p = np.asarray(pos)
    np.testing.assert_array_equal(np.asarray(m.comp_count), np.where(p >= 0, np.minimum((p + 1) // 4, 5), 0))


def test_bad_input_is_rejected():
    meta, _ = am.verify([2, 3], [4, 5], window=W, num_tokens=5, max_q_len=3)
    q, ring, sink = jnp.zeros((5, H, D)), jnp.zeros((2, R, D)), jnp.zeros((H,))
    with pytest.raises(ValueError, match="q has 6 tokens"):
        ra.kernel(jnp.zeros((6, H, D)), ring, None, sink, meta)
    with pytest.raises(ValueError, match="window pool"):
        ra.kernel(q, jnp.zeros((3, R, D)), None, sink, meta)
    with pytest.raises(ValueError, match="sink"):
        ra.reference(q, ring, None, jnp.zeros((H + 1,)), meta)
    with pytest.raises(ValueError, match="entries pool exactly"):
        ra.kernel(q, ring, jnp.zeros((2, 4, D)), sink, meta)
    short, _ = am.verify([2, 3], [4, 5], window=W, num_tokens=5, max_q_len=2)
    with pytest.raises(ValueError, match="max_q_len"):
        ra.kernel(q, ring, None, sink, short)
    wide, _ = am.verify([2, 3], [4, 5], window=R, num_tokens=5, max_q_len=3)
    with pytest.raises(ValueError, match="outside the ring"):
        ra.kernel(q, ring, None, sink, wide)
    with pytest.raises(ValueError, match="power of two"):
        ra.kernel(q, ring, None, sink, meta, config=ra.BlockConfig(block_t=3, block_h=8))
    with pytest.raises(ValueError, match="win_hi must have shape"):
        ra.kernel(q, ring, None, sink, am.RaggedMeta(meta.cu_q_lens, meta.win_lo, meta.win_hi[:4], meta.ring_end,
                                                    max_q_len=3))
    prefix = am.with_prefix_entries(meta, jnp.arange(5), ratio=4, num_slots=4)
    with pytest.raises(ValueError, match="comp_count must be int32"):
        ra.kernel(q, ring, jnp.zeros((2, 4, D)), sink,
                  dataclasses.replace(prefix, comp_count=prefix.comp_count.astype(jnp.int8)))
    with pytest.raises(ValueError, match="comp_count must lie in"):  # 10 visible entries, a pool of 4
        ra.kernel(q, ring, jnp.zeros((2, 4, D)), sink, am.with_prefix_entries(meta, jnp.arange(5) + 40, ratio=4,
                                                                            num_slots=16))
    topk = am.with_topk_entries(meta, jnp.asarray([[0, 3]] * 5, jnp.int32))
    with pytest.raises(ValueError, match="comp_topk names an entry"):
        ra.kernel(q, ring, jnp.zeros((2, 3, D)), sink, topk)
    with pytest.raises(ValueError, match="not both"):
        ra.reference(q, ring, jnp.zeros((2, 4, D)), sink, dataclasses.replace(topk, comp_count=prefix.comp_count))
    with pytest.raises(ValueError, match="block_t = 1"):
        ra.kernel(q, ring, jnp.zeros((2, 4, D)), sink, topk, config=ra.BlockConfig(block_t=2, block_h=8))


@pytest.mark.parametrize("config", [ra.BlockConfig(4, 4), ra.BlockConfig(1, 16, fp8_fold=True, kv_splits=2)])
def test_fp8_keys_are_dequantised_exactly(config):
    """With a one-position window and no sink mass the output is the key row itself: it must equal
    the reference KV fake-quantisation of the stored row bit for bit, whether the kernel
    dequantises the key tiles or folds the scales into its dots (and merges key splits)."""
    from dspark_jax.model.quant import kv_sim

    rng = np.random.default_rng(8)
    s, r = 3, 24
    rows = jnp.asarray(rng.standard_normal((s, r, D)) * np.exp(rng.uniform(-10, 10, (s, r, 1))), jnp.bfloat16)
    lengths = np.array([3, 30, 57])
    meta, pos = am.verify([2, 1, 3], lengths, window=1, num_tokens=6, max_q_len=3)
    q = _rand(rng, (6, H, D), jnp.bfloat16)
    sink = jnp.full((H,), -1e30, jnp.float32)  # exp(sink - m) == 0
    out = ra.kernel(q, kv_fp8.quantize(rows), None, sink, meta, config=config)
    req = np.array([0, 0, 1, 2, 2, 2])
    expect = kv_sim(rows, 64)[req, np.asarray(pos) % r]  # [6, D]
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                  np.broadcast_to(np.asarray(expect)[:, None, :], (6, H, D)).view(np.uint16))


TABLE_CONFIGS = attention_configs.table_configs()


@pytest.mark.parametrize("index", range(len(TABLE_CONFIGS)))
def test_every_tuned_config_in_interpret_mode(index):
    """Each distinct configuration of the tuned table (tiles, splits, column blocks) against the
    reference at head_dim 512 with few heads (the rows past them masked): C128-like prefix entries
    and C4-like top-k lists in turn, with one fp8 and one bf16 pool so that both key loaders run."""
    config = TABLE_CONFIGS[index]
    rng = np.random.default_rng(20 + index)
    d, n, k = 512, 12, 6
    q_lens, lengths = [6, 3], [40, 17]
    t = sum(q_lens) + 1  # one padding token
    meta, pos = am.verify(q_lens, lengths, window=W, num_tokens=t, max_q_len=6)
    topk_layer = index % 2 == 1
    if topk_layer:
        vis = np.minimum((np.asarray(pos) + 1) // 4, n)
        topk = np.full((t, k), -1, np.int32)
        for i, v in enumerate(vis):
            topk[i, :min(k, v)] = rng.permutation(max(v, 0))[:k]
        meta = am.with_topk_entries(meta, jnp.asarray(topk))
    else:
        meta = am.with_prefix_entries(meta, pos, ratio=4, num_slots=n)
    q = _rand(rng, (t, H, d), jnp.bfloat16)
    ring = _poison_unwritten_ring(_rand(rng, (2, R, d), jnp.bfloat16), np.add(q_lens, lengths))
    entries = _rand(rng, (2, n, d), jnp.bfloat16)
    ring, entries = (kv_fp8.quantize(ring), entries) if topk_layer else (ring, kv_fp8.quantize(entries))
    sink = _rand(rng, (H,))
    out = ra.kernel(q, ring, entries, sink, meta, config=config)
    _compare(out, ra.reference(q, ring, entries, sink, meta), "bf16", sum(q_lens))


def test_config_selection_by_shape(tmp_path):
    """The engine's configuration comes from the table by platform, layer kind, pool layout, heads
    and batch; other batches keep about the tuned number of programs (bounded by the key tiles);
    shapes without an entry get the default; a malformed table is refused."""
    entries = attention_configs.table_entries()
    for e in entries:
        got = attention_configs.select(e["heads"], e["q_len"], e["batch"], e["kind"], e["pool"] == "fp8",
                                       platform=e["platform"])
        assert got == e["config"], e
    big = next(e for e in entries if e["platform"] == "cuda" and e["kind"] == "prefix" and e["pool"] == "bf16"
               and e["batch"] == 64)["config"]
    assert big.kv_splits == 1
    at8 = attention_configs.select(64, 6, 8, "prefix", False, platform="cuda", n_keys=144 + 256)
    # 8 x 6 programs -> 8 splits would keep 384 programs, but never more splits than key tiles
    assert at8.block_h == big.block_h and at8.kv_splits == min(8, -(-(144 + 256) // at8.block_k))
    few_keys = attention_configs.select(64, 6, 8, "prefix", False, platform="cuda", n_keys=2 * big.block_k)
    assert few_keys.kv_splits == 2  # never more splits than key tiles
    rocm = attention_configs.select(64, 6, 64, "topk", True, platform="rocm")
    assert rocm.num_warps * 64 == 256 and rocm.block_t == 1  # 4 wavefronts of 64 lanes
    tiny = attention_configs.select(4, 6, 2, "topk", False, n_keys=30)
    assert tiny == attention_configs.default_config(4, 6, 2, kind="topk", n_keys=30) and tiny.block_t == 1

    # the kernel picks the same configuration when none is given (what the model's calls do)
    q = jnp.zeros((12, 64, 128), jnp.bfloat16)
    meta, pos = am.verify([6, 6], [40, 50], window=W, num_tokens=12, max_q_len=6)
    meta = am.with_prefix_entries(meta, pos, ratio=4, num_slots=16)
    assert ra.select_config(q, jnp.zeros((2, R, 128)), jnp.zeros((2, 16, 128)), meta) == attention_configs.select(
        64, 6, 2, "prefix", False, platform="cuda", n_keys=R + 16)

    bad = tmp_path / "table.json"
    bad.write_text('{"entries": [{"platform": "cuda", "kind": "topk", "pool": "bf16", "heads": 64, "q_len": 6, '
                   '"batch": 64, "config": {"block_t": 2, "block_h": 32}}]}')
    with pytest.raises(ValueError, match="block_t = 1"):
        attention_configs.table_entries(str(bad))
    bad.write_text('{"entries": [{"platform": "cuda", "kind": "prefix", "pool": "bf16", "heads": 64, "q_len": 6, '
                   '"batch": 64, "config": {"block_k": 24}}]}')
    with pytest.raises(ValueError, match="power of two"):
        attention_configs.table_entries(str(bad))


@pytest.mark.parametrize("splits", [1, 4])
def test_output_rotated_back_in_the_merge(splits):
    """``out_rope``: the output rotated back by the split merge (one launch, ``_rope`` in its
    name) or, unsplit, by XLA; each the reference's output through ``apply_rope(inverse=True)``
    (bf16: one rounding step at most, the merge's sums in another order)."""
    from dspark_jax.model.norms_rope import apply_rope, rope_inv_freq
    from tests.helpers import pallas_calls

    rng = np.random.default_rng(splits)
    t, h, d, ring = 3, 4, 128, 32
    q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((1, ring, d)), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    meta, pos = am.verify(jnp.array([t]), jnp.array([40]), window=16, num_tokens=t, max_q_len=t)
    inv_freq = rope_inv_freq(64, 10000.0, None)
    cfg = ra.BlockConfig(block_t=4, block_h=4, block_k=16, kv_splits=splits, block_d=128)
    got = ra.kernel(q, keys, None, sink, meta, config=cfg, out_rope=(pos, inv_freq))
    plain = ra.kernel(q, keys, None, sink, meta, config=cfg)
    want = apply_rope(ra.reference(q, keys, None, sink, meta), pos, inv_freq, inverse=True)
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(g).all() and not np.array_equal(g, np.asarray(plain, np.float32))
    np.testing.assert_allclose(g, w, rtol=2**-7, atol=2**-7 * np.abs(w).max())
    np.testing.assert_array_equal(g[..., :d - 64], np.asarray(plain, np.float32)[..., :d - 64])  # nope dims kept
    names = [n for n, _ in pallas_calls(jax.make_jaxpr(
        lambda q: ra.kernel(q, keys, None, sink, meta, config=cfg, out_rope=(pos, inv_freq)))(q).jaxpr)]
    assert ("attention_merge_splits_rope" in names) == (splits > 1), names
    via = ra.ragged_attention(q, keys, None, sink, meta, impl="xla", out_rope=(pos, inv_freq))
    np.testing.assert_array_equal(np.asarray(via, np.float32), w)


@pytest.mark.parametrize("kind,layout,cfg", [
    ("window", "plain", ra.BlockConfig(block_t=4, block_h=4, block_k=16, kv_splits=1, block_d=128)),
    ("window", "fp8", ra.BlockConfig(block_t=1, block_h=16, block_k=16, kv_splits=3, fp8_fold=True)),
    ("prefix", "plain", ra.BlockConfig(block_t=8, block_h=2, block_k=16, kv_splits=2, block_d=64)),
    ("topk", "fp8", ra.BlockConfig(block_t=1, block_h=16, block_k=16, kv_splits=1, block_d=64)),
])
def test_queries_normed_and_rotated_by_the_kernel(kind, layout, cfg):
    """``q_rope``: the kernel applies the queries' head norm and RoPE as it loads them; the result
    equals the kernel on ``rope.q_norm_rope``'s queries up to one bf16 rounding step of a query
    (the norm's sum over the kernel's column blocks in another order), and the XLA path applies
    the reference first (exactly). Positions differ per token; the unnormed queries' scale is far
    from 1, so a skipped norm would show."""
    from dspark_jax.model.norms_rope import rope_inv_freq
    from pallas_kernels import rope
    from tests.helpers import pallas_calls

    rng = np.random.default_rng(7)
    q_lens, lengths = VERIFY
    t, n, eps = sum(q_lens) + 1, 16, 1e-6
    meta, pos = am.verify(q_lens, lengths, window=W, num_tokens=t, max_q_len=6)
    entries = None
    if kind == "prefix":
        meta = am.with_prefix_entries(meta, pos, ratio=4, num_slots=n)
        entries = _rand(rng, (S, n, D), jnp.bfloat16)
    elif kind == "topk":
        vis = np.maximum((np.asarray(pos) + 1) // 4, 1)
        meta = am.with_topk_entries(meta, jnp.asarray(np.stack([np.arange(3) % v for v in vis]), jnp.int32))
        entries = _rand(rng, (S, n, D), jnp.bfloat16)
    q = _rand(rng, (t, H, D), jnp.bfloat16, scale=7.0)
    ring = _rand(rng, (S, R, D), jnp.bfloat16)
    if layout == "fp8":
        ring = kv_fp8.quantize(ring)
        entries = None if entries is None else kv_fp8.quantize(entries)
    sink = _rand(rng, (H,))
    inv_freq = rope_inv_freq(64, 10000.0, None)
    q_rope = (pos, inv_freq, eps)
    got = ra.kernel(q, ring, entries, sink, meta, config=cfg, q_rope=q_rope)
    qn = rope.q_norm_rope_reference(q, pos, inv_freq, eps)
    want = ra.kernel(qn, ring, entries, sink, meta, config=cfg)
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(g).all() and np.abs(w[:sum(q_lens)]).max() > 0.05
    np.testing.assert_allclose(g, w, rtol=2**-7, atol=2**-7 * np.abs(w).max())
    plain = np.asarray(ra.kernel(q, ring, entries, sink, meta, config=cfg), np.float32)
    assert np.abs(plain - w).max() > 10 * np.abs(g - w).max()  # the norm and rotation did happen
    via = ra.ragged_attention(q, ring, entries, sink, meta, impl="xla", q_rope=q_rope)
    np.testing.assert_array_equal(np.asarray(via, np.float32),
                                  np.asarray(ra.reference(qn, ring, entries, sink, meta), np.float32))
    names = [nm for nm, _ in pallas_calls(jax.make_jaxpr(
        lambda q: ra.kernel(q, ring, entries, sink, meta, config=cfg, q_rope=q_rope))(q).jaxpr)]
    assert "q_norm_rope" not in names and "ragged_sink_attention" in names
    with pytest.raises(ValueError, match="q_rope needs positions"):
        ra.kernel(q, ring, entries, sink, meta, config=cfg, q_rope=(pos[:-1], inv_freq, eps))
