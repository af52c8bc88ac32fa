"""The model's decode / verify path through the kernels and fp8 KV pools."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax
from dspark_jax.api import forward_step
from dspark_jax.cache import Fp8Keys, commit, init_cache, read_kv
from dspark_jax.model import attention, moe
from dspark_jax.model.quant import kv_sim
from pallas_kernels import compressor_pool
from tests.helpers import pallas_calls, perturb

# The tiny target's mechanisms in 3 layers instead of 6 (window-only, C4 + indexer, C128; hash
# then learned routing): each forward compiles in about half the time.
SMALL = dspark_jax.config.tiny(dspark=False).replace(num_hidden_layers=3, compress_ratios=(0, 4, 128))


def _model(dtype, quant_sim, kernels="xla", seed=5, cfg=None):
    m = dspark_jax.init(cfg or dspark_jax.config.tiny(), seed, dtype=dtype, quant_sim=quant_sim)
    m = perturb(m, seed)
    num = dataclasses.replace(m.numerics, kernels=kernels)
    for _, mod in nnx.iter_modules(m.module):  # numerics are static attributes of the modules
        if hasattr(mod, "num"):
            mod.num = num
    return dspark_jax.Model(m.module)


def _decode(m, ids, layout, prefill=40, steps=(6, 1, 6)):
    cache = init_cache(m.config, ids.shape[0], 96, m.numerics.dtype, kv_layout=layout)
    n = jnp.full((ids.shape[0],), prefill, jnp.int32)
    _, _, cache = forward_step(m.graphdef, m.state, jnp.asarray(ids[:, :prefill]), n, cache)
    cache, pos, out = commit(cache, n), prefill, []
    for t in steps:
        n = jnp.full((ids.shape[0],), t, jnp.int32)
        lg, _, cache = forward_step(m.graphdef, m.state, jnp.asarray(ids[:, pos:pos + t]), n, cache)
        cache, pos = commit(cache, n), pos + t
        out.append(np.asarray(lg, np.float32))
    return np.concatenate(out, axis=1), cache


def test_fp8_pools_reproduce_the_reference_kv_fake_quantisation():
    """With quant_sim, cached KV values and indexer keys are already on the fp8 / fp4 grids: fp8
    pools give the same logits, every stored row dequantises to exactly kv_sim of itself and
    every stored indexer key to the key the bf16 pools hold."""
    m = _model(jnp.bfloat16, True, cfg=SMALL)
    ids = np.random.default_rng(0).integers(2, 500, (2, 60)).astype(np.int32)
    a, cache_bf16 = _decode(m, ids, "bf16")
    b, cache_fp8 = _decode(m, ids, "fp8")
    np.testing.assert_array_equal(a, b)
    for lb, lf in zip(cache_bf16.layers, cache_fp8.layers):
        deq = read_kv(lf.window, jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(deq, np.float32), np.asarray(lb.window, np.float32))
        np.testing.assert_array_equal(np.asarray(kv_sim(deq, 64), np.float32), np.asarray(deq, np.float32))
        if lf.compressor is not None:
            np.testing.assert_array_equal(np.asarray(read_kv(lf.compressor.entries, jnp.bfloat16), np.float32),
                                          np.asarray(lb.compressor.entries, np.float32))
        if lf.indexer is not None:  # fp8 keys hold the reference's fp4-rounded keys exactly
            assert isinstance(lf.indexer.entries, Fp8Keys)
            np.testing.assert_array_equal(np.asarray(read_kv(lf.indexer.entries, jnp.bfloat16), np.float32),
                                          np.asarray(lb.indexer.entries, np.float32))
    assert cache_fp8.layers[0].window.nope.dtype == jnp.uint8  # really stored as fp8 rows


def test_pallas_kernels_inside_the_model_match_the_xla_path():
    """Verify chunks through the Pallas kernels (interpret mode here) vs their references, with bf16
    and fp8 pools (fp32 compute: bf16 activations with fp8 / fp4 fake-quantisation would turn
    last-bit differences of summation order into rounding flips)."""
    ids = np.random.default_rng(1).integers(2, 500, (2, 60)).astype(np.int32)
    # fp8 pools dequantise to bf16 keys, so probabilities are rounded to bf16 before P.V: per key
    # tile in the kernel's online softmax, once in the reference.
    xla, pallas = _model(jnp.float32, False, "xla", cfg=SMALL), _model(jnp.float32, False, "pallas", cfg=SMALL)
    for layout, tol in (("bf16", 1e-5), ("fp8", 1e-2)):
        ref, _ = _decode(xla, ids, layout, steps=(6,))
        ker, _ = _decode(pallas, ids, layout, steps=(6,))
        np.testing.assert_allclose(ker, ref, rtol=0, atol=tol * np.abs(ref).max())


def test_packed_verify_through_the_kernels_matches_per_request():
    """Ragged verify: the verify tokens of three requests (6, none and 3) front-packed on 16 rows
    through the Pallas kernels (interpret mode; attention through cu_q_lens) give the per-request
    XLA path's logits on those tokens and the same caches (a C4 + indexer layer and a C8 layer,
    both with the sliding window; windows of both close inside the verify block)."""
    from dspark_jax.model.common import Packing

    cfg = dspark_jax.config.tiny(dspark=False).replace(num_hidden_layers=2, compress_ratios=(4, 8),
                                                        num_hash_layers=1)
    ids = jnp.asarray(np.random.default_rng(2).integers(2, 500, (3, 32)), jnp.int32)
    start, lens = jnp.asarray([26, 20, 23], jnp.int32), jnp.asarray([6, 0, 3], jnp.int32)
    block = jnp.stack([ids[i, int(s):int(s) + 6] for i, s in enumerate(start)])
    packing = Packing.from_lens(lens, width=6, tokens=16)
    out = {}
    for kernels in ("xla", "pallas"):  # the same weights
        m = _model(jnp.float32, False, kernels, cfg=cfg)
        if kernels == "xla":
            _, _, cache = forward_step(m.graphdef, m.state, ids[:, :26], start, init_cache(cfg, 3, 48, jnp.float32))
            cache = commit(cache, start)

        @jax.jit
        def verify(state, cache):
            model = nnx.merge(m.graphdef, state)
            if kernels == "xla":  # per request
                return model.forward(block, lens, cache)[::2]
            logits, _, cache = model.forward(packing.pack(block), lens, cache, packing=packing)
            return packing.unpack(logits), cache

        out[kernels] = verify(m.state, cache)
    (ref, ref_cache), (ker, ker_cache) = out["xla"], out["pallas"]
    verified = (np.arange(6)[None] < np.asarray(lens)[:, None])[..., None]
    np.testing.assert_allclose(np.where(verified, ker, 0), np.where(verified, ref, 0), rtol=0,
                               atol=1e-5 * np.abs(ref).max())
    assert not np.asarray(ker)[~verified[..., 0]].any()  # rows not verified
    for a, b in zip(jax.tree_util.tree_leaves(ker_cache), jax.tree_util.tree_leaves(ref_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


def test_draft_block_attention_through_the_kernel_matches_the_dense_math():
    """The drafter's block rows attend to the last ``window`` committed context rows plus the whole
    block. Inference takes the ragged dispatcher (Pallas kernel in interpret mode, or its reference);
    training takes the dense math with an explicit visibility mask: all three agree, including a
    request whose ring has wrapped, and whole draft blocks agree between kernel and reference."""
    from dspark_jax.cache import ring_positions
    from dspark_jax.model.dspark import DraftCache, draft_block

    rng = np.random.default_rng(3)
    cfg = dspark_jax.config.tiny()
    b, g, r, w = 3, cfg.dspark.block_size, cfg.window_ring_size, cfg.sliding_window
    lengths = jnp.asarray([0, 9, 3 * r + 5], jnp.int32)
    rings = tuple(jnp.asarray(rng.standard_normal((b, r, cfg.head_dim)), jnp.float32)
                  for _ in range(cfg.dspark.num_stages))
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, g)), jnp.int32)
    pos = lengths[:, None] + jnp.arange(g, dtype=jnp.int32)[None]
    rpos = ring_positions(lengths, r)
    visible = (rpos >= 0) & (rpos >= lengths[:, None] - w)
    assert bool(visible[2].sum() == w) and not bool(visible[0].any())  # a full window, and none

    drafts = {}
    for kernels in ("xla", "pallas"):
        m = _model(jnp.float32, False, kernels)

        @jax.jit
        def run(state):  # one program (op by op, every operation would compile on its own)
            module = nnx.merge(m.graphdef, state)
            stage, x = module.mtp[0], module.embed_streams(ids)
            dense = stage.draft_layer(x, ids, pos, rings[0], visible)
            ragged = stage.draft_layer(x, ids, pos, rings[0], lengths=lengths)
            out = draft_block(module, DraftCache(rings=rings), ids[:, 0], lengths, lambda lg, k: jnp.argmax(lg, -1))
            return dense, ragged, out.tokens, out.logits

        dense, ragged, *drafts[kernels] = run(m.state)
        np.testing.assert_allclose(np.asarray(ragged), np.asarray(dense), rtol=2e-5, atol=2e-5)
    (tokens, logits), (ref_tokens, ref_logits) = drafts["pallas"], drafts["xla"]
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-4, atol=1e-4)


def _under_switch(monkeypatch, name: str, values, seed: int, module=attention, cfg=None) -> list:
    """(logits, cache, one-token step's Pallas launches) of a small Pallas-path model's decode
    steps with ``module.<name>`` (default: ``attention``) set to each value in turn (switches read
    at trace time)."""
    m = dspark_jax.init(cfg or SMALL.replace(n_routed_experts=16, index_n_heads=16), 3, dtype=jnp.float32,
                        param_dtype=jnp.bfloat16, weight_format="official", quant_sim=True)
    for _, mod in nnx.iter_modules(m.module):
        if hasattr(mod, "num"):
            mod.num = dataclasses.replace(mod.num, kernels="pallas")
    m = dspark_jax.Model(m.module)
    ids = np.random.default_rng(seed).integers(2, 500, (1, 48)).astype(np.int32)
    one, runs = jnp.ones((1,), jnp.int32), []
    for value in values:
        monkeypatch.setattr(module, name, value)
        jax.clear_caches()
        logits, cache = _decode(m, ids, "bf16", steps=(1, 1, 1, 1))
        jaxpr = jax.make_jaxpr(lambda s, x: forward_step(m.graphdef, s, x, one, cache))(m.state, ids[:, :1])
        runs.append((logits, cache, [n for n, _ in pallas_calls(jaxpr.jaxpr)]))
    jax.clear_caches()
    return runs


def _assert_same_steps(got, want) -> None:
    """Logits and caches equal bit for bit."""
    np.testing.assert_array_equal(got[0], want[0])
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("mode", ["apart", "separate"])
def test_new_rows_launch_modes_agree(monkeypatch, mode):
    """``attention.NEW_ROWS``: a one-token step's new rows with q_norm in a launch of its own
    ("apart", the default: ``rms_norms`` beside the window's row and the compressors' pooling) or
    one launch per kernel give the logits and caches of the one launch ("one") bit for bit (the
    same row code). With the compressors' steps in one launch each (``WRITE_IN_POOL`` on: only then
    does a compressed layer merge its new rows)."""
    monkeypatch.setattr(compressor_pool, "WRITE_IN_POOL", True)
    want, got = _under_switch(monkeypatch, "NEW_ROWS", ("one", mode), seed=6)
    _assert_same_steps(got, want)
    names = got[2]
    assert ("rms_norms_x1" in names) == (mode == "apart") and ("new_rows_x3" in names) == (mode == "apart"), names


def test_wq_b_launched_apart_agrees(monkeypatch):
    """``attention.WQ_B_TOGETHER`` off: a C4 layer's wq_b and its indexer's wq_b in a launch each
    give the logits and caches of the shared launch bit for bit (the same products and sums),
    with one launch more per C4 layer."""
    merged, apart = _under_switch(monkeypatch, "WQ_B_TOGETHER", (True, False), seed=7)
    _assert_same_steps(apart, merged)
    assert len(apart[2]) == len(merged[2]) + 1 and SMALL.compress_ratios.count(4) == 1, (merged[2], apart[2])


def test_x_linears_launched_apart_agree(monkeypatch):
    """``attention.X_LINEARS_TOGETHER`` off: a compressed layer's wq_a + wkv in one launch and its
    compressors' linears (bf16; a C4 layer's indexer's too) in another: the same exact products,
    their K split's float32 sums perhaps split otherwise (at Flash sizes), so logits within float32
    rounding; one launch more per compressed layer, none in the window-only layer."""
    together, apart = _under_switch(monkeypatch, "X_LINEARS_TOGETHER", (True, False), seed=8)
    scale = np.abs(np.asarray(together[0])).max()
    assert scale > 0 and np.isfinite(np.asarray(apart[0])).all()
    np.testing.assert_allclose(np.asarray(apart[0]), np.asarray(together[0]), rtol=0, atol=1e-5 * scale)
    names = apart[2]
    assert SMALL.compress_ratios == (0, 4, 128) and len(names) == len(together[2]) + 2, (together[2], names)
    assert [n for n in together[2] if n.startswith("gemv_fp8_bf16_q_x")] == ["gemv_fp8_bf16_q_x7", "gemv_fp8_bf16_q_x4"]
    assert not [n for n in names if n.startswith("gemv_fp8_bf16")], names
    assert [n for n in names if n.startswith("gemv_bf16_x")] == ["gemv_bf16_x5", "gemv_bf16_x2"], names
    assert names.count("gemv_fp8_q_x2") == together[2].count("gemv_fp8_q_x2") + 2, names


def test_indexer_linears_launched_apart_agree(monkeypatch):
    """``attention.INDEXER_LINEARS_APART``: a C4 layer's indexer linears of x (weights_proj and its
    compressor's wkv and wgate) in a launch of their own instead of with the attention compressor's:
    the same exact bf16 products, their K split's float32 sums perhaps split otherwise (at Flash
    sizes), so logits within float32 rounding; one launch more in the C4 layer only."""
    with_compressor, apart = _under_switch(monkeypatch, "INDEXER_LINEARS_APART", (False, True), seed=9)
    scale = np.abs(np.asarray(with_compressor[0])).max()
    assert scale > 0 and np.isfinite(np.asarray(apart[0])).all()
    np.testing.assert_allclose(np.asarray(apart[0]), np.asarray(with_compressor[0]), rtol=0, atol=1e-5 * scale)
    names = apart[2]
    assert SMALL.compress_ratios == (0, 4, 128) and len(names) == len(with_compressor[2]) + 1, names
    assert [n for n in with_compressor[2] if n.startswith("gemv_bf16_x")] == ["gemv_bf16_x5", "gemv_bf16_x2"]
    assert [n for n in names if n.startswith("gemv_bf16_x")] == ["gemv_bf16_x2", "gemv_bf16_x3", "gemv_bf16_x2"], names


def test_shared_expert_split_agrees(monkeypatch):
    """``moe.SHARED_SPLIT``: the shared expert's one-row launches (w1 + w3, then w2 adding their
    SwiGLU) with the K split given instead of the automatic one: the same exact products, their
    float32 sums split otherwise, so logits within float32 rounding; the same launches, named by
    their split (hidden 512, intermediate 256: 2 loop steps of w1 + w3, automatically split in 2)."""
    cfg = SMALL.replace(n_routed_experts=16, index_n_heads=16, hidden_size=512, moe_intermediate_size=256)
    auto, unsplit = _under_switch(monkeypatch, "SHARED_SPLIT", (0, 1), seed=10, module=moe, cfg=cfg)
    scale = np.abs(np.asarray(auto[0])).max()
    assert scale > 0 and np.isfinite(np.asarray(unsplit[0])).all()
    np.testing.assert_allclose(np.asarray(unsplit[0]), np.asarray(auto[0]), rtol=0, atol=1e-5 * scale)
    # every layer's w1 + w3 launch unsplit, nothing else changed (w2's 256 inputs take one step either way)
    assert len(unsplit[2]) == len(auto[2]), (auto[2], unsplit[2])
    changed = [(a, b) for a, b in zip(auto[2], unsplit[2]) if a != b]
    assert changed == [("gemv_fp8_q_x2_split2", "gemv_fp8_q_x2")] * len(cfg.compress_ratios), (auto[2], unsplit[2])


@pytest.mark.parametrize("quant_sim", [False, True])
def test_one_token_steps_share_the_linears_launches(quant_sim):
    """Linears at one token through ``gemv`` (interpret mode here): per layer the attention's wq_a +
    wkv in one launch (``model.common.shared_input``) and a compressed layer's compressor wkv +
    wgate in bf16 (a C4 layer's indexer weights_proj and compressor too) in another
    (``attention.X_LINEARS_TOGETHER`` off),
    the router's logits in one (16 experts and indexer heads here: multiples of 16 columns), the
    shared expert's w1 + w3 in one, the q norm of the split sums with the window's new KV row in
    one (a compressed layer's; the window-only layer's beside it), each compressor's pooling and its
    entries' write in one each, the queries' norm + RoPE inside the attention, a C4 layer's wq_b with its
    indexer's wq_b in one, the indexer's queries finished in its scores' launch; the logits those of
    the XLA path (fp32 activations, bf16 and FP8 weights: exact products both ways but for fp32
    rows times FP8 weights, rounded alike). With ``quant_sim`` the q norm's launch also gives
    its quantised values, which wq_b and the indexer's wq_b multiply as they are (no ``_q``)."""
    cfg = SMALL.replace(n_routed_experts=16, index_n_heads=16)

    def model(kernels):
        m = dspark_jax.init(cfg, 3, dtype=jnp.float32, param_dtype=jnp.bfloat16, weight_format="official",
                            quant_sim=quant_sim)
        num = dataclasses.replace(m.numerics, kernels=kernels)
        for _, mod in nnx.iter_modules(m.module):
            if hasattr(mod, "num"):
                mod.num = num
        return dspark_jax.Model(m.module)

    xla, pallas = model("xla"), model("pallas")
    ids = np.random.default_rng(4).integers(2, 500, (1, 44)).astype(np.int32)
    ref, cache = _decode(xla, ids, "bf16", steps=(1, 1))
    got, _ = _decode(pallas, ids, "bf16", steps=(1, 1))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    one = jnp.ones((1,), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda s, x: forward_step(pallas.graphdef, s, x, one, cache))(pallas.state, ids[:, :1])
    names = [n for n, _ in pallas_calls(jaxpr.jaxpr)]
    count = lambda prefix: len([n for n in names if n.startswith(prefix)])  # noqa: E731
    assert SMALL.compress_ratios == (0, 4, 128)
    q = "_q" if quant_sim else ""
    assert not [n for n in names if n.startswith("gemv_fp8_bf16")], names  # no launch of both formats
    # the compressors' bf16 linears: the C4 layer's compressor wkv + wgate, indexer weights_proj, wkv, wgate
    # (5), the C128 layer's compressor wkv + wgate (2)
    assert (count("gemv_bf16_x5"), count("gemv_bf16_x2")) == (1, 1), names
    layers = len(SMALL.compress_ratios)
    # every layer's wq_a + wkv, the C4 layer's wq_b with its indexer's wq_b (on qr, rounded already),
    # every layer's shared expert's w1 + w3 (``MoE.one_row`` "apart"; quantised rows with quant_sim)
    pairs = (2 * layers, 1) if quant_sim else (1 + 2 * layers, 1 + 2 * layers)
    assert (count(f"gemv_fp8{q}_x2"), count("gemv_fp8_x2")) == pairs, names
    # the routers' products alone, the selection after them (``MoE.one_row`` "apart")
    routers = (count("gemv_bf16_fp8"), len([n for n in names if re.fullmatch(r"gemv_bf16(_split\d+)?", n)]),
               count("router_select"))
    assert routers == (0, layers, layers), names
    assert count("gemv_fp8_q_swiglu") == 0, names
    # the window-only layer's new row (kv_norm + RoPE + kv_sim + the write) with q_norm of the partial sums in a
    # launch beside it; a compressed layer's new row with q_norm in one launch and each compressor's step in
    # two (``compressor_pool.WRITE_IN_POOL`` off: the pooling, then the entries' write: the indexer's keys
    # with their Hadamard + e2m1 rounding under quant_sim, else plain rows); no merged launch of new rows
    rows = (names.count("kv_rows_norm"), count("rms_norms_x1"), count("new_rows"), count("compressor_pool"))
    assert rows == (2, 1, 0, 3) and SMALL.compress_ratios == (0, 4, 128), " ".join(names)
    writes = [names[i + 1] for i, n in enumerate(names) if n == "compressor_pool"]
    assert writes == ["kv_rows", "key_rows" if quant_sim else "kv_rows", "kv_rows"], " ".join(names)
    # the queries' head norm + RoPE inside the attention kernel (``q_rope``): no launch of their own
    assert count("q_norm_rope") == 0 and count("ragged_sink_attention") == layers, names
    # the indexer's: its queries finished inside the scores' kernel (no query_rows launch), the top-k
    assert (count("query_rows"), count("index_scores_queries"), count("top_k_rank")) == (0, 1, 1), names
    if not quant_sim:
        assert not any(n.startswith("gemv_fp8_bf16_q") for n in names)  # no row quantised
    else:  # rows quantised by the q norm's launch: every wq_b (the C4 layer's with its indexer's wq_b, above);
        # the rows of wo_b and the shared expert's w2 quantised in their launches (wo_a: XLA's here)
        plain = [n for n in names if re.fullmatch(r"gemv_fp8(_split\d+)?", n)]
        assert len(plain) == layers - 1, " ".join(names)
        assert count("gemv_fp8_q") - count("gemv_fp8_q_") == 2 * layers, " ".join(names)
