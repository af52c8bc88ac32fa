"""Each mechanism against straightforward reference math."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import config
from dspark_jax.cache import init_cache
from dspark_jax.model.attention import sink_attention
from dspark_jax.model.common import Chunk, Numerics
from dspark_jax.model.compressor import Compressor
from dspark_jax.model.hyper import hc_post, hc_pre, sinkhorn
from dspark_jax.model.indexer import visible_entries
from dspark_jax.model.moe import Gate
from dspark_jax.model.norms_rope import apply_rope, layer_inv_freq, rope_inv_freq
from dspark_jax.model.quant import fp8_sim, hadamard, hadamard_matrix, kv_sim, pow2_scale_ceil

F32 = Numerics(dtype=jnp.float32, param_dtype=jnp.float32)


def test_sinkhorn_is_doubly_stochastic():
    logits = jax.random.normal(jax.random.key(0), (64, 4, 4)) * 3
    c = np.asarray(sinkhorn(logits, 20, 1e-6))
    np.testing.assert_allclose(c.sum(-2), 1.0, atol=1e-5)  # ends on a column normalisation
    np.testing.assert_allclose(c.sum(-1), 1.0, atol=0.05)  # rows only approximately after 20 iterations
    assert (c > 0).all()
    # straightforward loop
    ref = np.exp(np.asarray(logits) - np.asarray(logits).max(-1, keepdims=True))
    ref = ref / ref.sum(-1, keepdims=True) + 1e-6
    ref = ref / (ref.sum(-2, keepdims=True) + 1e-6)
    for _ in range(19):
        ref = ref / (ref.sum(-1, keepdims=True) + 1e-6)
        ref = ref / (ref.sum(-2, keepdims=True) + 1e-6)
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-6)
    for unroll in (True, False):  # both forms of the iterations compute the same thing
        np.testing.assert_allclose(np.asarray(sinkhorn(logits, 20, 1e-6, unroll=unroll)), ref, rtol=1e-5, atol=1e-6)


def test_numerics_sinkhorn_choice(monkeypatch):
    from dspark_jax.model.common import Numerics
    from pallas_kernels import backend

    assert Numerics(sinkhorn="loop").sinkhorn_impl() == "loop"
    assert Numerics(sinkhorn="unrolled").sinkhorn_impl() == "unrolled"
    assert Numerics(sinkhorn="kernel").sinkhorn_impl() == "kernel"
    assert Numerics(sinkhorn="fused").sinkhorn_impl() == "fused" and Numerics(sinkhorn="fused").mhc_fused()
    assert Numerics().sinkhorn_impl() == "loop" and not Numerics().mhc_fused()  # "auto" on the CPU
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    assert Numerics().sinkhorn_impl() == "fused" and Numerics().mhc_fused()  # "auto" on a GPU
    with pytest.raises(ValueError, match="sinkhorn must be"):
        Numerics(sinkhorn="scan")


def test_hc_pre_post_reference():
    rng = np.random.default_rng(0)
    n, d = 4, 16
    x = rng.standard_normal((2, 3, n, d)).astype(np.float32)
    fn = rng.standard_normal(((2 + n) * n, n * d)).astype(np.float32) * 0.1
    base = rng.standard_normal((2 + n) * n).astype(np.float32)
    scale = np.array([0.7, 1.3, 0.9], np.float32)
    y, post, comb = hc_pre(jnp.asarray(x), fn, base, scale, iters=20, hc_eps=1e-6, norm_eps=1e-6)
    flat = x.reshape(2, 3, -1)
    mix = flat @ fn.T / np.sqrt((flat**2).mean(-1, keepdims=True) + 1e-6)
    pre = 1 / (1 + np.exp(-(mix[..., :n] * scale[0] + base[:n]))) + 1e-6
    np.testing.assert_allclose(np.asarray(y), (pre[..., None] * x).sum(-2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(post), 2 / (1 + np.exp(-(mix[..., n:2 * n] * scale[1] + base[n:2 * n]))),
                               rtol=1e-5)
    f = rng.standard_normal((2, 3, d)).astype(np.float32)
    out = np.asarray(hc_post(jnp.asarray(f), jnp.asarray(x), post, comb))
    c = np.asarray(comb)
    for j in range(n):  # X'_j = post_j f + sum_i C[i, j] X_i
        expect = np.asarray(post)[..., j, None] * f + sum(c[..., i, j, None] * x[..., i, :] for i in range(n))
        np.testing.assert_allclose(out[..., j, :], expect, rtol=1e-5, atol=1e-5)


def test_yarn_frequencies():
    flash = config.flash()
    base = rope_inv_freq(64, 160000.0, None)
    yarn = layer_inv_freq(flash, 4)
    assert layer_inv_freq(flash, 128) is yarn or np.array_equal(layer_inv_freq(flash, 128), yarn)
    # with base 160000 and original length 65536: low = 15, high = 25 (architecture reference)
    np.testing.assert_array_equal(yarn[:16], base[:16])  # ramp 0: unchanged
    np.testing.assert_allclose(yarn[25:], base[25:] / 16, rtol=1e-6)  # ramp 1: interpolated by the factor
    mid = yarn[16:25] / base[16:25]
    assert np.all((mid < 1) & (mid > 1 / 16)) and np.all(np.diff(mid) < 0)
    # window-only layers: base 10000, no YaRN
    np.testing.assert_allclose(layer_inv_freq(flash, 0), 1 / 10000 ** (np.arange(0, 64, 2) / 64), rtol=1e-6)


def test_rope_interleaved_pairs_inverse_and_relative():
    rng = np.random.default_rng(1)
    inv = rope_inv_freq(64, 10000.0, None)
    x = jnp.asarray(rng.standard_normal((1, 5, 2, 128)).astype(np.float32))
    pos = jnp.arange(5)[None] * 7
    y = apply_rope(x, pos, inv)
    np.testing.assert_array_equal(np.asarray(y[..., :64]), np.asarray(x[..., :64]))  # nope dims untouched
    ang = np.asarray(pos)[0, 2] * inv[3]  # pair (2*3, 2*3+1) of the rope part, at row 2
    a, b = np.asarray(x)[0, 2, 0, 64 + 6], np.asarray(x)[0, 2, 0, 64 + 7]
    np.testing.assert_allclose(np.asarray(y)[0, 2, 0, 64 + 6:64 + 8],
                               [a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(apply_rope(y, pos, inv, inverse=True)), np.asarray(x), atol=1e-5)
    q, k = x[:, :1], x[:, 1:2]  # q . k after RoPE depends only on the position difference
    d1 = jnp.sum(apply_rope(q, jnp.array([[10]]), inv) * apply_rope(k, jnp.array([[3]]), inv))
    d2 = jnp.sum(apply_rope(q, jnp.array([[107]]), inv) * apply_rope(k, jnp.array([[100]]), inv))
    np.testing.assert_allclose(float(d1), float(d2), rtol=1e-4)


def test_sink_only_enters_the_denominator():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 3, 2, 8)).astype(np.float32))
    kv = jnp.asarray(rng.standard_normal((1, 6, 8)).astype(np.float32))
    mask = jnp.asarray(rng.random((1, 3, 6)) < 0.7).at[:, :, 0].set(True)
    sink = jnp.array([0.5, -1.0], jnp.float32)
    out = np.asarray(sink_attention(q, [(kv, mask)], sink, 0.3))
    no_sink = np.asarray(sink_attention(q, [(kv, mask)], jnp.full((2,), -jnp.inf), 0.3))
    s = np.einsum("bthd,bkd->bthk", np.asarray(q), np.asarray(kv)) * 0.3
    s = np.where(np.asarray(mask)[:, :, None], s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    plain = np.einsum("bthk,bkd->bthd", e / e.sum(-1, keepdims=True), np.asarray(kv))
    np.testing.assert_allclose(no_sink, plain, rtol=1e-5, atol=1e-6)
    z = np.exp(s).sum(-1)  # sink: o = plain * Z / (Z + e^sink)
    np.testing.assert_allclose(out, plain * (z / (z + np.exp(np.asarray(sink))[None, None]))[..., None],
                               rtol=1e-5, atol=1e-6)
    # per-query key parts (C4 picks) combine with shared ones exactly like one concatenated set
    per_q = jnp.broadcast_to(kv[:, None, 3:], (1, 3, 3, 8))
    split = sink_attention(q, [(kv[:, :3], mask[..., :3]), (per_q, mask[..., 3:])], sink, 0.3)
    np.testing.assert_allclose(np.asarray(split), out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ratio", [4, 16])
def test_compressor_entries_and_chunking(ratio):
    """Entries equal the gated-pool formula computed directly; chunk boundaries do not matter."""
    cfg = config.tiny().replace(compress_ratios=(0, ratio, 0, 0, 0, 0))
    width = cfg.head_dim
    comp = Compressor(cfg, ratio, width, F32, rotate=False, rngs=nnx.Rngs(0))
    comp.ape[...] = jax.random.normal(jax.random.key(1), comp.ape.shape)
    rng = np.random.default_rng(3)
    t = 3 * ratio + 3
    x = rng.standard_normal((1, t, cfg.hidden_size)).astype(np.float32)

    # direct formula
    kv = x[0] @ np.asarray(comp.wkv.weight[...]).T
    sc = x[0] @ np.asarray(comp.wgate.weight[...]).T + np.asarray(comp.ape[...])[np.arange(t) % ratio]
    expect = []
    for w in range(t // ratio):
        cur = slice(w * ratio, (w + 1) * ratio)
        if ratio == 4:
            prev = slice((w - 1) * ratio, w * ratio)
            k_ = np.concatenate([kv[prev, :width] if w else np.zeros((0, width)), kv[cur, width:]])
            s_ = np.concatenate([sc[prev, :width] if w else np.zeros((0, width)), sc[cur, width:]])
        else:
            k_, s_ = kv[cur], sc[cur]
        p = np.exp(s_ - s_.max(0)) / np.exp(s_ - s_.max(0)).sum(0)
        c = (p * k_).sum(0)
        c = c / np.sqrt((c**2).mean() + cfg.rms_norm_eps) * np.asarray(comp.norm.weight[...])
        expect.append(c)
    expect = apply_rope(jnp.asarray(np.stack(expect))[None], jnp.arange(len(expect))[None] * ratio,
                        layer_inv_freq(cfg, ratio), heads=False)[0]

    @jax.jit
    def step(x, start, state):  # one program per chunk width (op by op, every operation compiles on its own)
        sz = x.shape[1]
        return comp(x, Chunk(jnp.zeros((1, sz), jnp.int32), start, jnp.array([sz])), state)

    def run(sizes):
        state = init_cache(cfg, 1, t + 16, jnp.float32, fill=1e4).layers[1].compressor
        start = 0
        for sz in sizes:
            entries, state = step(jnp.asarray(x[:, start:start + sz]), jnp.array([start]), state)
            start += sz
        return np.asarray(entries[0, :t // ratio])

    np.testing.assert_allclose(run([t]), np.asarray(expect), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run([1] * t), np.asarray(expect), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run([ratio - 1, 5, 2 * ratio + 3 - 5]), np.asarray(expect), rtol=1e-4, atol=1e-4)


def test_compressed_entry_visibility_rule():
    pos = jnp.arange(12)[None]
    # entry w becomes visible to the token that closes it: w < (i + 1) // m
    assert list(np.asarray(visible_entries(pos, 4))[0]) == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_future_tokens_do_not_change_past_logits(tiny_f32):
    """Causality end to end, including the indexer's top-k and the compressors."""
    m = tiny_f32
    rng = np.random.default_rng(4)
    a = rng.integers(0, m.config.vocab_size, 40).astype(np.int32)
    b = a.copy()
    b[25:] = rng.integers(0, m.config.vocab_size, 15)
    la, lb = np.asarray(m.logits(np.stack([a, b])))
    np.testing.assert_allclose(la[:25], lb[:25], rtol=0, atol=1e-5)
    assert np.abs(la[25:] - lb[25:]).max() > 1e-2


def test_indexer_topk_is_causal(tiny_f32):
    m = tiny_f32
    layer = m.module.layers[1]  # C4 + indexer
    assert m.config.compress_ratios[1] == 4
    t = 30
    cache = init_cache(m.config, 1, 48, jnp.float32).layers[1]
    x = jax.random.normal(jax.random.key(5), (1, t, m.config.hidden_size))
    qr = layer.attn.q_norm(layer.attn.wq_a(x))
    chunk = Chunk(jnp.zeros((1, t), jnp.int32), jnp.array([0]), jnp.array([t]))
    top, _ = layer.attn.indexer(x, qr, chunk, cache.indexer)
    top = np.asarray(top)[0]
    limit = (np.arange(t) + 1) // 4
    k = m.config.index_topk
    for i in range(t):
        picks = top[i][top[i] >= 0]
        assert np.all(picks < limit[i]) and len(set(picks)) == len(picks)
        assert len(picks) == min(k, limit[i])  # every visible entry is used until k are available


def test_hash_and_learned_routing():
    cfg = config.tiny()
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((5, cfg.hidden_size)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, 5))
    hashed = Gate(cfg, True, F32, rngs=nnx.Rngs(0))
    w, idx = hashed(x, ids)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(hashed.tid2eid[...])[np.asarray(ids)])
    s = np.sqrt(np.log1p(np.exp(np.asarray(x) @ np.asarray(hashed.weight[...]).T)))
    sel = np.take_along_axis(s, np.asarray(idx), -1)
    np.testing.assert_allclose(np.asarray(w), sel / sel.sum(-1, keepdims=True) * cfg.routed_scaling_factor, rtol=1e-5)

    learned = Gate(cfg, False, F32, rngs=nnx.Rngs(0))
    learned.bias[...] = jnp.zeros(cfg.n_routed_experts).at[7].set(100.0)  # bias forces expert 7 to be chosen
    w, idx = learned(x, ids)
    assert np.all(np.asarray(idx) == 7, axis=-1).sum() == 0 and np.all((np.asarray(idx) == 7).any(-1))
    s = np.sqrt(np.log1p(np.exp(np.asarray(x) @ np.asarray(learned.weight[...]).T)))
    sel = np.take_along_axis(s, np.asarray(idx), -1)  # weights come from the unbiased scores
    np.testing.assert_allclose(np.asarray(w), sel / sel.sum(-1, keepdims=True) * cfg.routed_scaling_factor, rtol=1e-5)


def test_fake_quantisation():
    rng = np.random.default_rng(7)
    x = jnp.asarray((rng.standard_normal((3, 256)) * np.exp(rng.uniform(-6, 6, (3, 1)))).astype(np.float32))
    y = np.asarray(fp8_sim(x, 128))
    blocks = np.asarray(x).reshape(3, 2, 128)
    scale = np.asarray(pow2_scale_ceil(jnp.asarray(np.maximum(np.abs(blocks).max(-1), 1e-4) / 448)))
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))  # powers of two
    assert np.all(np.abs(blocks).max(-1) / scale <= 448)
    codes = y.reshape(3, 2, 128) / scale[..., None]
    np.testing.assert_array_equal(codes.astype(jnp.float8_e4m3fn).astype(np.float32), codes)  # on the e4m3 grid
    assert np.abs(y - np.asarray(x)).max() / np.abs(np.asarray(x)).max() < 0.07
    assert float(pow2_scale_ceil(jnp.float32(0.75))) == 1.0 and float(pow2_scale_ceil(jnp.float32(2.0))) == 2.0
    kv = jnp.asarray(rng.standard_normal((2, 128)).astype(np.float32))
    q = np.asarray(kv_sim(kv, 64))
    np.testing.assert_array_equal(q[:, 64:], np.asarray(kv)[:, 64:])  # rope dims stay exact
    np.testing.assert_array_equal(q[:, :64], np.asarray(fp8_sim(kv[:, :64], 64)))
    h = hadamard_matrix(128)
    np.testing.assert_allclose(h @ h.T, np.eye(128), atol=1e-5)
    np.testing.assert_allclose(np.asarray(hadamard(kv)), np.asarray(kv) @ h.T, atol=1e-5)


@pytest.mark.parametrize("quant_sim,weight_format", [(False, "dense"), (True, "dense"), (True, "official"),
                                                     (True, "fp8")])
def test_moe_grouped_equals_dense(quant_sim, weight_format):
    """The grouped MoE path (each selected expert read once: kernel and loop reference) equals
    every-expert compute, with bf16 / fp32 weights and with FP4 experts + FP8 shared expert."""
    from dspark_jax.model.moe import PAIR_TILES_MAX, MoE

    cfg = config.tiny().replace(n_routed_experts=24, num_experts_per_tok=3)  # top-3 of 24: many empty experts
    num = Numerics(dtype=jnp.float32, param_dtype=jnp.float32, quant_sim=quant_sim, weight_format=weight_format)
    moe = MoE(cfg, False, num, rngs=nnx.Rngs(0))
    assert moe.impl == "grouped"
    moe.gate.bias[...] = jax.random.normal(jax.random.key(1), moe.gate.bias.shape)
    x = jax.random.normal(jax.random.key(2), (2, 7, cfg.hidden_size))
    ids = jnp.zeros((2, 7), jnp.int32)
    moe.impl = "dense"
    dense = moe(x, ids)
    moe.impl = "grouped"
    grouped = moe(x, ids)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), rtol=1e-4, atol=1e-5)
    moe.experts.num = moe.shared_experts.w1.num = dataclasses.replace(num, kernels="pallas")  # interpret mode
    np.testing.assert_allclose(np.asarray(moe(x, ids)), np.asarray(dense), rtol=1e-4, atol=1e-5)
    # 5 tokens x top-3 <= PAIR_TILES_MAX: one tile per pair (kernel), the decode kernels (opt-in),
    # then the loop reference
    for kernels, pairs in (("pallas", 0), ("pallas", PAIR_TILES_MAX), (num.kernels, 0)):
        moe.experts.num = moe.shared_experts.w1.num = dataclasses.replace(num, kernels=kernels)
        moe.decode_max_pairs = pairs
        np.testing.assert_allclose(np.asarray(moe(x[:1, :5], ids[:1, :5])), np.asarray(dense[:1, :5]),
                                   rtol=1e-4, atol=1e-5)
    # and the dense path equals a per-token loop over the selected experts
    xf = np.asarray(x).reshape(-1, cfg.hidden_size)
    w, idx = moe.gate(x.reshape(-1, cfg.hidden_size), ids.reshape(-1))
    if not quant_sim:
        w1, w2, w3 = (np.asarray(moe.experts.w1[...]), np.asarray(moe.experts.w2[...]), np.asarray(moe.experts.w3[...]))
        expect = np.array(moe.shared_experts(x.reshape(-1, cfg.hidden_size)))
        for n in range(xf.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[n, j])
                g, u = w1[e] @ xf[n], np.clip(w3[e] @ xf[n], -10, 10)
                g = np.minimum(g, 10)
                expect[n] += w2[e] @ (g / (1 + np.exp(-g)) * u * float(w[n, j]))
        np.testing.assert_allclose(np.asarray(dense).reshape(-1, cfg.hidden_size), expect, rtol=1e-4, atol=1e-5)


def test_matmul_f32_with_bf16_weights_is_as_exact_as_upcasting():
    """fp32 activations times bf16 weights without an fp32 copy of the weights: the three-part split
    keeps every product exact, so the result is as close to the float64 product as the fp32 GEMM of
    the upcast weights (and bit-identical to it up to summation order)."""
    from dspark_jax.model.common import matmul_f32

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 3, 256)) * np.exp(rng.uniform(-8, 8, (5, 3, 1)))).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((300, 256)), jnp.bfloat16)
    exact = np.einsum("...i,oi->...o", x.astype(np.float64), np.asarray(w, np.float64))
    with jax.default_matmul_precision("highest"):
        split = np.asarray(matmul_f32(jnp.asarray(x), w))
        upcast = np.asarray(jnp.einsum("...i,oi->...o", jnp.asarray(x), w.astype(jnp.float32)))
    scale = np.abs(exact).max(axis=-1, keepdims=True)
    err_split, err_upcast = np.abs(split - exact) / scale, np.abs(upcast - exact) / scale
    assert err_split.max() < 1e-6 and err_split.max() <= 2 * err_upcast.max() + 1e-7
    # a two-part split would not be exact: the test can tell
    hi = jnp.asarray(x).astype(jnp.bfloat16)
    two = np.asarray(jnp.einsum("...i,oi->...o", jnp.stack([hi, (jnp.asarray(x) - hi).astype(jnp.bfloat16)]), w,
                                preferred_element_type=jnp.float32).sum(0))
    assert (np.abs(two - exact) / scale).max() > 10 * err_split.max()


def test_index_scores_bf16_dot_equals_float32_scores():
    """bf16 queries and keys are scored by a bf16 dot accumulating in float32 (no float32 copy of
    the keys); the products are exact, so the scores equal float32 scoring up to summation order."""
    from dspark_jax.model.indexer import index_scores

    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 128)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((2, 50, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
    got = np.asarray(index_scores(q, keys, w))
    s = np.einsum("bthd,bnd->bthn", np.asarray(q, np.float64), np.asarray(keys, np.float64))
    want = np.einsum("bthn,bth->btn", np.maximum(s, 0), np.asarray(w, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    dots = [e for e in jax.make_jaxpr(index_scores)(q, keys, w).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots[0].invars[1].aval.dtype == jnp.bfloat16  # the keys enter the dot as stored
    f32 = index_scores(q.astype(jnp.float32), keys.astype(jnp.float32), w)  # float32 models: float32 dot
    np.testing.assert_allclose(np.asarray(f32), want, rtol=1e-5, atol=1e-4)
