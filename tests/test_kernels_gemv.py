"""The one-row kernel (``pallas_kernels.gemv``: float32 multiply-adds) against the grouped
matmul's reference (the row padded to a 16-row tile), with quantised and bf16 rows, several
groups, K split or not, the fused SwiGLU; bf16 weights against ``matmul_f32`` (bf16 and fp32
rows), FP8 and bf16 weights in one launch; the automatic tiles; the lowering for gfx950 and
NVIDIA; the one-row linears' dispatch (``shared_input``, the router); and bad input.

Interpret mode fills outputs with NaN before the kernel runs
(``test_kernels_attention.test_interpret_mode_poisons_outputs``): a finite result means every
element was written, including every split's partial sums."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm
from pallas_kernels import lowering
from pallas_kernels.gemv import GemvConfig, gemv, gemv_many, gemv_swiglu
from tests.helpers import pallas_calls
from tests.test_kernels_grouped_matmul import _random_weights

SD = jax.ShapeDtypeStruct


def _padded(x, quantised: bool):
    """The rows padded to one 16-row tile each, as the grouped matmul takes them."""
    xp = jnp.zeros((x.shape[0] * 16, x.shape[1]), x.dtype).at[::16].set(x)
    return gm.QuantRows(xp) if quantised else xp


def _case(seed: int, fmt: str, groups: int, rows: int, n: int, k: int):
    rng = np.random.default_rng(seed)
    w = _random_weights(rng, (groups, n, k), fmt)
    x = jnp.asarray(rng.standard_normal((rows, k)) * np.exp(rng.uniform(-3, 3, (rows, 1))), jnp.bfloat16)
    group = jnp.asarray(rng.integers(0, groups, rows), jnp.int32)
    return rng, w, x, group


@pytest.mark.parametrize("fmt,groups,rows,n,k,cfg", [
    ("fp8", 1, 1, 256, 1024, GemvConfig(block_n=64, block_k=256, split_k=2)),  # a plain linear, K split
    ("fp8", 4, 4, 128, 512, GemvConfig(block_n=32, block_k=128, split_k=1)),  # wo_a's groups, unsplit
    ("fp8", 8, 3, 256, 512, GemvConfig(block_n=128, block_k=512)),  # one step; the automatic split
])
@pytest.mark.parametrize("quantised", [True, False])
def test_equals_the_grouped_matmul_reference(fmt, groups, rows, n, k, cfg, quantised):
    _, w, x, group = _case(n + k + rows, fmt, groups, rows, n, k)
    xin = gm.QuantRows(x) if quantised else x
    want = np.asarray(gm.reference(_padded(x, quantised), w, group, jnp.array([rows]), block_m=16,
                                   out_dtype=jnp.float32))[::16]
    got = np.asarray(gemv(xin, w, group, out_dtype=jnp.float32, config=cfg))
    assert got.shape == (rows, n) and np.isfinite(got).all()
    # every product exact in both; only the float32 sums' order differs
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert np.abs(want).max() > 0
    got16 = np.asarray(gemv(xin, w, group, config=cfg), np.float32)  # rounded to the rows' dtype
    np.testing.assert_allclose(got16, want, rtol=2**-8, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("split", [1, 4])
def test_swiglu_equals_the_reference(split):
    rng, w1, x, group = _case(split, "fp8", 1, 1, 256, 1024)
    w3 = _random_weights(rng, (1, 256, 1024), "fp8")
    got = gemv_swiglu(gm.QuantRows(x), w1, w3, group, limit=10.0, config=GemvConfig(block_n=32, split_k=split))
    want = gm.swiglu_reference(_padded(x, True), w1, w3, jnp.ones((16,)), group, jnp.array([1]), block_m=16,
                               limit=10.0)[::16]
    assert got.dtype == jnp.bfloat16 and np.isfinite(np.asarray(got, np.float32)).all()
    w = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), w, rtol=2**-7, atol=1e-5 * np.abs(w).max())


@pytest.mark.parametrize("cfg", [GemvConfig(), GemvConfig(block_n=32, split_k=1)])
def test_several_weights_in_one_launch(cfg):
    """``gemv_many``: the same rows times weights of different N (wq_a's and wkv's shapes scaled
    down; 48 columns: tiles of 16) in one launch, each output the reference's."""
    rng, w, x, group = _case(7, "fp8", 2, 2, 256, 512)
    ws = (w, _random_weights(rng, (2, 128, 512), "fp8"), _random_weights(rng, (2, 48, 512), "fp8"))
    outs = gemv_many(gm.QuantRows(x), ws, group, out_dtype=jnp.float32, config=cfg)
    assert [o.shape for o in outs] == [(2, 256), (2, 128), (2, 48)]
    for got, wi in zip(outs, ws):
        want = np.asarray(gm.reference(_padded(x, True), wi, group, jnp.array([2]), block_m=16,
                                       out_dtype=jnp.float32))[::16]
        assert np.isfinite(np.asarray(got)).all() and np.abs(want).max() > 0
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6 * np.abs(want).max())
    jaxpr = jax.make_jaxpr(lambda x: gemv_many(gm.QuantRows(x), ws, group, config=cfg))(x)
    names = [n for n, _ in pallas_calls(jaxpr.jaxpr)]
    assert len(names) == 1 and names[0].startswith("gemv_fp8_q_x3"), names


@pytest.mark.parametrize("row_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("split", [1, 4])
def test_bf16_weights_equal_matmul_f32(row_dtype, split):
    """bf16 weights (the compressors' and the router's) against ``matmul_f32``'s exact products:
    bf16 rows as they are, fp32 rows (full 24-bit significands) as three bf16 parts."""
    from dspark_jax.model.common import matmul_f32

    rng = np.random.default_rng(split)
    w = jnp.asarray(rng.standard_normal((2, 96, 512)) * 0.05, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 512)) * np.exp(rng.uniform(-3, 3, (2, 1))), row_dtype)
    group = jnp.array([1, 0], jnp.int32)
    got = np.asarray(gemv(x, gm.Weights(w, None, "dense"), group, out_dtype=jnp.float32,
                          config=GemvConfig(block_n=32, split_k=split)))
    want = np.stack([np.asarray(matmul_f32(x[r], w[int(group[r])])) for r in range(2)])
    assert np.isfinite(got).all() and np.abs(want).max() > 0
    # the fp32 rows' low parts matter: a product of their bf16 rounding alone is far off
    coarse = np.stack([np.asarray(matmul_f32(x[r].astype(jnp.bfloat16), w[int(group[r])])) for r in range(2)])
    tol = 2e-6 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert row_dtype == jnp.bfloat16 or np.abs(coarse - want).max() > 100 * tol


def test_fp8_and_bf16_weights_in_one_launch():
    """An attention layer's linears of x in one launch: wq_a and wkv (FP8, the row quantised) and
    a compressor's wkv and wgate (bf16, the row as it is), each output its own reference's."""
    from dspark_jax.model.common import matmul_f32

    rng, w, x, group = _case(11, "fp8", 1, 1, 256, 512)
    fp8 = (w, _random_weights(rng, (1, 128, 512), "fp8"))
    dense = tuple(jnp.asarray(rng.standard_normal((1, n, 512)) * 0.05, jnp.bfloat16) for n in (64, 64))
    ws = fp8 + tuple(gm.Weights(d, None, "dense") for d in dense)
    outs = gemv_many(x, ws, group, quantise=(True, True, False, False), out_dtype=jnp.float32)
    assert [o.shape for o in outs] == [(1, 256), (1, 128), (1, 64), (1, 64)]
    wants = [np.asarray(gm.reference(_padded(x, True), wi, group, jnp.array([1]), block_m=16,
                                     out_dtype=jnp.float32))[::16] for wi in fp8]
    wants += [np.asarray(matmul_f32(x, d[0])) for d in dense]
    for got, want in zip(outs, wants):
        assert np.isfinite(np.asarray(got)).all() and np.abs(want).max() > 0
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6 * np.abs(want).max())
    jaxpr = jax.make_jaxpr(lambda x: gemv_many(x, ws, group, quantise=(True, True, False, False)))(x)
    names = [n for n, _ in pallas_calls(jaxpr.jaxpr)]
    assert len(names) == 1 and names[0].startswith("gemv_fp8_bf16_q_x4"), names


def test_config_fits_the_shapes():
    cfg = GemvConfig(block_n=256, block_k=1024, split_k=2).fit(1, (4096,), 8192)
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == (128, 1024, 2)  # one 128-column scale block per program
    assert GemvConfig(block_k=1024).fit(1, (4096,), 384).block_k == 128
    assert GemvConfig(split_k=16).fit(1, (32768,), 1024).split_k == 4  # at most K / block_k
    # automatic: Flash's wq_b unsplit (512 column tiles), wo_b split in 8, wq_a split in 8 on
    # 16-column tiles (512 programs), wkv (512 outputs) as far as the tiles go, wo_a's 8 groups
    auto = lambda rows, n, k: GemvConfig().fit(rows, (n,), k)  # noqa: E731
    assert (auto(1, 32768, 1024).split_k, auto(1, 32768, 1024).block_n) == (1, 64)
    assert (auto(1, 4096, 8192).split_k, auto(1, 4096, 8192).block_n) == (8, 64)
    assert (auto(1, 1024, 4096).split_k, auto(1, 1024, 4096).block_n) == (8, 16)
    assert (auto(1, 512, 4096).split_k, auto(1, 512, 4096).block_n) == (8, 16)
    assert (auto(8, 1024, 4096).split_k, auto(8, 1024, 4096).block_n) == (4, 64)


def test_one_row_linears_take_gemv():
    """``batched_matmul`` / ``batched_swiglu`` at one row per group against FP8 weights: the
    multiply-add kernels, nothing padded; more rows, other formats or the XLA backend: as before."""
    rng = np.random.default_rng(5)
    w = _random_weights(rng, (2, 128, 256), "fp8")
    x = jnp.asarray(rng.standard_normal((2, 1, 256)), jnp.bfloat16)
    calls = lambda f, *a: [n for n, _ in pallas_calls(jax.make_jaxpr(f)(*a).jaxpr)]  # noqa: E731
    assert calls(lambda x: gm.batched_matmul(x, w, impl="pallas"), x) == ["gemv_fp8"]
    assert calls(lambda x: gm.batched_matmul(x[:1], w.group(0), act_quant=True, impl="pallas"), x) == ["gemv_fp8_q"]
    assert calls(lambda x: gm.batched_swiglu(x[0], w.group(0), w.group(1), limit=1.0, act_quant=True,
                                             impl="pallas"), x) == ["gemv_fp8_q_swiglu"]
    x2 = jnp.concatenate([x, x], axis=1)
    assert calls(lambda x: gm.batched_matmul(x, w, impl="pallas"), x2) == ["grouped_matmul_fp8"]
    assert calls(lambda x: gm.batched_matmul(x, w, impl="pallas", one_row_gemv=False), x) == ["grouped_matmul_fp8"]
    assert calls(lambda x: gm.batched_matmul(x, w, impl="xla"), x) == []
    got = np.asarray(gm.batched_matmul(x, w, out_dtype=jnp.float32, impl="pallas"))
    want = np.asarray(gm.batched_matmul(x, w, out_dtype=jnp.float32, impl="pallas", one_row_gemv=False))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    # bf16 weights: taken without act_quant, the grouped matmul's results (SwiGLU: one bf16 rounding)
    d = gm.Weights(jnp.asarray(rng.standard_normal((2, 128, 256)) * 0.05, jnp.bfloat16), None, "dense")
    assert calls(lambda x: gm.batched_matmul(x, d, impl="pallas"), x) == ["gemv_bf16"]
    assert calls(lambda x: gm.batched_matmul(x, d, act_quant=True, impl="pallas"), x)[0].startswith("grouped_matmul")
    assert calls(lambda x: gm.batched_swiglu(x[0], d.group(0), d.group(1), limit=1.0, impl="pallas"),
                 x) == ["gemv_bf16_swiglu"]

    def dense_pair(one_row: bool):
        return (np.asarray(gm.batched_matmul(x, d, out_dtype=jnp.float32, impl="pallas", one_row_gemv=one_row)),
                np.asarray(gm.batched_swiglu(x[0], d.group(0), d.group(1), limit=1.0, impl="pallas",
                                             one_row_gemv=one_row), np.float32))

    for g, w_ in zip(dense_pair(True), dense_pair(False)):
        assert np.isfinite(g).all() and np.abs(w_).max() > 0
        np.testing.assert_allclose(g, w_, rtol=2**-7, atol=2e-6 * np.abs(w_).max())


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_linears_lower_for_gpus(arch, platform):
    x = SD((1, 1024), jnp.bfloat16)
    wq_b = gm.Weights(SD((1, 32768, 1024), jnp.float8_e4m3fn), SD((1, 256, 8), jnp.uint8), "fp8")
    text = lowering.lower(lambda x, w: gemv(gm.QuantRows(x), w, jnp.zeros((1,), jnp.int32), interpret=False), x, wq_b,
                          arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "gemv_fp8_q" in text
    x = SD((1, 4096), jnp.bfloat16)
    w = gm.Weights(SD((1, 2048, 4096), jnp.float8_e4m3fn), SD((1, 16, 32), jnp.uint8), "fp8")
    text = lowering.lower(lambda x, w: gemv_swiglu(gm.QuantRows(x), w, w, jnp.zeros((1,), jnp.int32), limit=10.0,
                                                   interpret=False), x, w, arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "gemv_fp8_q_swiglu_split" in text
    wkv = gm.Weights(SD((1, 512, 4096), jnp.float8_e4m3fn), SD((1, 4, 32), jnp.uint8), "fp8")
    wq_a = gm.Weights(SD((1, 1024, 4096), jnp.float8_e4m3fn), SD((1, 8, 32), jnp.uint8), "fp8")
    text = lowering.lower(lambda x, a, b: gemv_many(gm.QuantRows(x), (a, b), jnp.zeros((1,), jnp.int32),
                                                    interpret=False), x, wq_a, wkv, arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "gemv_fp8_q_x2_split" in text
    cmp = gm.Weights(SD((1, 1024, 4096), jnp.bfloat16), None, "dense")  # a C4 compressor's wkv / wgate
    text = lowering.lower(lambda x, a, b, c: gemv_many(x, (a, b, c, c), jnp.zeros((1,), jnp.int32),
                                                       quantise=(True, True, False, False), interpret=False),
                          x, wq_a, wkv, cmp, arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "gemv_fp8_bf16_q_x4_split" in text
    # a batch-1 MoE's router (bf16, 256 experts) with its shared expert's w1 / w3, all as partial sums
    router = gm.Weights(SD((1, 256, 4096), jnp.bfloat16), None, "dense")
    text = lowering.lower(lambda x, r, a: [p.parts for p in gemv_many(
        x, (r, a, a), jnp.zeros((1,), jnp.int32), quantise=(False, True, True), partials=(True,) * 3,
        out_dtype=jnp.float32, interpret=False)], x, router, w, arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "gemv_bf16_fp8_q_x3" in text
    # wo_b on wo_a's 4 partial sums, its own as partial sums
    from pallas_kernels.gemv import Partials

    wo_b = gm.Weights(SD((1, 4096, 8192), jnp.float8_e4m3fn), SD((1, 32, 64), jnp.uint8), "fp8")
    text = lowering.lower(lambda p, w: gemv_many(Partials(p), (w,), jnp.zeros((1,), jnp.int32), quantise=(True,),
                                                 partials=(True,), rows_dtype=jnp.bfloat16, interpret=False)[0].parts,
                          SD((4, 1, 8192), jnp.float32), wo_b, arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "gemv_fp8_q_split" in text
    # the shared expert's w2 on the SwiGLU of w1's and w3's 8 partial sums, its own as partial sums
    from pallas_kernels.gemv import SwiGLUPartials

    w2 = gm.Weights(SD((1, 4096, 2048), jnp.float8_e4m3fn), SD((1, 32, 16), jnp.uint8), "fp8")
    text = lowering.lower(lambda g, u, w: gemv_many(SwiGLUPartials(Partials(g), Partials(u), 10.0), (w,),
                                                    jnp.zeros((1,), jnp.int32), quantise=(True,), partials=(True,),
                                                    rows_dtype=jnp.bfloat16, interpret=False)[0].parts,
                          SD((8, 1, 2048), jnp.float32), SD((8, 1, 2048), jnp.float32), w2, arch=arch,
                          platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "gemv_fp8_q_split" in text


def test_bad_input_is_named():
    _, w, x, group = _case(0, "fp8", 2, 2, 128, 256)
    with pytest.raises(ValueError, match=r"gemv needs rows \[R, 256\]"):
        gemv(x[:, :128], w, group)
    with pytest.raises(ValueError, match="one entry per row"):
        gemv(x, w, group[:1])
    dense32 = gm.Weights(jnp.ones((2, 128, 256), jnp.float32), None, "dense")
    with pytest.raises(ValueError, match="gemv takes dense weights in bf16"):
        gemv(x, dense32, group)
    with pytest.raises(ValueError, match="with unquantised rows"):
        gemv(gm.QuantRows(x), dataclasses.replace(dense32, values=dense32.values.astype(jnp.bfloat16)), group)
    with pytest.raises(ValueError, match="one quantise flag per weight"):
        gemv_many(x, (w, w), group, quantise=(True,))
    with pytest.raises(ValueError, match="QuantRows quantise the rows for every weight"):
        gemv_many(gm.QuantRows(x), (w,), group, quantise=(True,))
    with pytest.raises(ValueError, match="gemv takes weights of format"):
        gemv(x, dataclasses.replace(w, fmt="fp8_k128"), group)
    with pytest.raises(ValueError, match="must share their groups and K"):
        gemv_many(x, (w, w.group(0)), group)
    with pytest.raises(ValueError, match="rows must be bf16 / fp32"):
        gemv(x.astype(jnp.float16), w, group)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        GemvConfig(block_k=384)
    with pytest.raises(ValueError, match="block_k must be at least 128"):
        GemvConfig(block_k=64)



def test_linears_of_one_input_share_a_launch():
    """``model.common.shared_input`` (an attention layer's wq_a and wkv): at one row on the
    Pallas path one ``gemv_many`` launch with each linear's own result; at two rows, or with
    unquantised weights, each linear's own call."""
    from flax import nnx

    from dspark_jax.model.common import Linear, Numerics, shared_input

    num = Numerics(quant_sim=True, weight_format="fp8", kernels="pallas")
    lins = (Linear(256, 128, num, rngs=nnx.Rngs(0)), Linear(256, 64, num, rngs=nnx.Rngs(1)))
    x = jax.random.normal(jax.random.key(0), (1, 1, 256), jnp.bfloat16) * 3
    names = lambda x: [n for n, _ in pallas_calls(jax.make_jaxpr(lambda x: shared_input(lins, x))(x).jaxpr)]  # noqa
    assert len(names(x)) == 1 and names(x)[0].startswith("gemv_fp8_q_x2")
    for got, lin in zip(shared_input(lins, x), lins):
        want = np.asarray(lin(x), np.float32)
        assert got.shape == want.shape and got.dtype == jnp.bfloat16 and np.abs(want).max() > 0
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-8, atol=1e-6 * np.abs(want).max())
    x2 = jnp.concatenate([x, x], axis=1)
    assert len(names(x2)) == 2 and all(n.startswith("grouped_matmul_fp8") for n in names(x2))
    dense = Numerics(quant_sim=True, weight_format="dense", kernels="pallas")
    lins = (Linear(256, 128, dense, rngs=nnx.Rngs(0)), Linear(256, 64, dense, rngs=nnx.Rngs(1)))
    assert names(x) == []


def test_fp8_and_bf16_linears_share_a_launch():
    """A compressed layer's linears of x (``Attention``: wq_a, wkv, the compressor's wkv and wgate
    in fp32, an indexer's weights_proj in bf16): one launch at one row, each result in its
    linear's dtype and equal to its own call; on a mesh (the caller's) one call each."""
    from flax import nnx

    from dspark_jax.model.common import Linear, Numerics, shared_input

    num = Numerics(quant_sim=True, weight_format="fp8", kernels="pallas")
    lins = (Linear(256, 128, num, rngs=nnx.Rngs(0)), Linear(256, 64, num, rngs=nnx.Rngs(1)),
            Linear(256, 96, num, rngs=nnx.Rngs(2), fp8_act=False, compute_dtype=jnp.float32),
            Linear(256, 96, num, rngs=nnx.Rngs(3), fp8_act=False, compute_dtype=jnp.float32),
            Linear(256, 16, num, rngs=nnx.Rngs(4), fp8_act=False))
    x = jax.random.normal(jax.random.key(1), (1, 1, 256), jnp.bfloat16) * 3
    names = [n for n, _ in pallas_calls(jax.make_jaxpr(lambda x: shared_input(lins, x))(x).jaxpr)]
    assert len(names) == 1 and names[0].startswith("gemv_fp8_bf16_q_x5"), names
    for got, lin in zip(shared_input(lins, x), lins):
        ref = lin(x)
        want = np.asarray(ref, np.float32)
        assert got.shape == ref.shape and got.dtype == ref.dtype and np.abs(want).max() > 0
        rtol = 2**-8 if ref.dtype == jnp.bfloat16 else 0
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=rtol, atol=2e-6 * np.abs(want).max())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    calls = [n for n, _ in pallas_calls(jax.make_jaxpr(lambda x: shared_input(lins, x, mesh))(x).jaxpr)]
    assert not any(n.startswith("gemv_fp8_bf16") for n in calls), calls


def test_one_row_router_logits_take_gemv():
    """``matmul_f32`` on the Pallas path: one row times a bf16 weight through ``gemv`` (the
    router of a batch-1 step), the XLA result; two rows or the XLA path: no kernel."""
    from dspark_jax.model.common import matmul_f32

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((256, 512)) * 0.05, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16)
    def calls(x, impl):
        return [n for n, _ in pallas_calls(jax.make_jaxpr(lambda x: matmul_f32(x, w, impl))(x).jaxpr)]

    assert len(calls(x, "pallas")) == 1 and calls(x, "pallas")[0].startswith("gemv_bf16")
    assert calls(jnp.concatenate([x, x]), "pallas") == [] and calls(x, "xla") == []
    want = np.asarray(matmul_f32(x, w))
    np.testing.assert_allclose(np.asarray(matmul_f32(x, w, "pallas")), want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_partial_sums_on_request():
    """``gemv_many(partials=...)``: the flagged weights' products as ``Partials`` (float32 parts of
    the K split, adding up to the product), the others summed as usual; one part when K is not
    split."""
    from pallas_kernels.gemv import Partials, total

    rng, w, x, group = _case(13, "fp8", 1, 1, 128, 1024)
    dense = gm.Weights(jnp.asarray(rng.standard_normal((1, 64, 1024)) * 0.05, jnp.bfloat16), None, "dense")
    for split in (4, 1):
        cfg = GemvConfig(block_n=32, split_k=split)
        a, b = gemv_many(x, (w, dense), group, quantise=(True, False), partials=(False, True), config=cfg,
                         out_dtype=jnp.float32)
        ra, rb = gemv_many(x, (w, dense), group, quantise=(True, False), config=cfg, out_dtype=jnp.float32)
        assert isinstance(b, Partials) and b.parts.shape == (split, 1, 64) and b.parts.dtype == jnp.float32
        assert not isinstance(a, Partials)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(ra))
        np.testing.assert_allclose(np.asarray(total(b)), np.asarray(rb), rtol=0, atol=1e-6 * np.abs(rb).max())
        assert split == 1 or np.abs(np.asarray(b.parts[0]) - np.asarray(rb)).max() > 1e-3 * np.abs(rb).max()
    with pytest.raises(ValueError, match="one partials flag per weight"):
        gemv_many(x, (w, dense), group, quantise=(True, False), partials=(True,))


def test_one_dtype_per_output():
    """``gemv_many(out_dtype=(...))``: each output in its own dtype, bit for bit the float32
    result rounded after the launch (K split or not; with a partial-sums output beside them)."""
    from pallas_kernels.gemv import Partials

    rng, w, x, group = _case(17, "fp8", 1, 1, 128, 1024)
    w2 = _random_weights(rng, (1, 64, 1024), "fp8")
    for split in (1, 4):
        cfg = GemvConfig(block_n=32, split_k=split)
        wide = gemv_many(x, (w, w2, w), group, quantise=(True, True, False), config=cfg, out_dtype=jnp.float32)
        got = gemv_many(x, (w, w2, w), group, quantise=(True, True, False), config=cfg,
                        out_dtype=(jnp.bfloat16, jnp.float32, jnp.float16))
        assert [g.dtype for g in got] == [jnp.bfloat16, jnp.float32, jnp.float16]
        for g, f in zip(got, wide):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(f.astype(g.dtype)))
        q_b, index_q = gemv_many(x, (w, w2), group, quantise=(True, True), config=cfg, partials=(False, True),
                                 out_dtype=(jnp.bfloat16, jnp.float32))
        assert q_b.dtype == jnp.bfloat16 and isinstance(index_q, Partials)
        np.testing.assert_array_equal(np.asarray(q_b), np.asarray(wide[0].astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="one out_dtype per weight"):
        gemv_many(x, (w, w2), group, out_dtype=(jnp.bfloat16,))


@pytest.mark.parametrize("quantise", [True, False])
def test_rows_as_partial_sums(quantise):
    """Rows given as their producer's partial sums (``Partials`` [S, R, K], e.g. wo_a's for wo_b):
    every program adds its inputs' parts in order and rounds them to ``rows_dtype``, then
    (quantise) quantises them: the products of those rows, bit for bit, from partial sums in and
    out alike; and through ``Linear`` the product of the rounded sum."""
    from dspark_jax.model.common import Linear, Numerics
    from flax import nnx
    from pallas_kernels.gemv import Partials

    rng, w, _, _ = _case(17, "fp8", 1, 1, 256, 512)
    parts = jnp.asarray(rng.standard_normal((4, 1, 512)) * 2, jnp.float32)
    summed = np.asarray(parts[0])
    for s in range(1, 4):
        summed = summed + np.asarray(parts[s])
    rows = jnp.asarray(summed).astype(jnp.bfloat16)
    cfg = GemvConfig(block_n=32, split_k=2)
    kw = dict(quantise=(quantise,), config=cfg, out_dtype=jnp.float32)
    (got,) = gemv_many(Partials(parts), (w,), jnp.zeros((1,), jnp.int32), rows_dtype=jnp.bfloat16, **kw)
    (want,) = gemv_many(rows, (w,), jnp.zeros((1,), jnp.int32), **kw)
    assert np.abs(np.asarray(want)).max() > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    (got_parts,) = gemv_many(Partials(parts), (w,), jnp.zeros((1,), jnp.int32), rows_dtype=jnp.bfloat16,
                             partials=(True,), **kw)
    np.testing.assert_allclose(np.asarray(got_parts.total()), np.asarray(want), rtol=0,
                               atol=1e-6 * np.abs(np.asarray(want)).max())
    with pytest.raises(ValueError, match="rows_dtype"):
        gemv_many(Partials(parts), (w,), jnp.zeros((1,), jnp.int32), **kw)

    num = Numerics(dtype=jnp.bfloat16, quant_sim=quantise, weight_format="fp8", kernels="pallas")
    lin = Linear(512, 256, num, rngs=nnx.Rngs(0))
    x = Partials(parts.reshape(4, 1, 1, 512))
    got = lin(x)
    want = lin(jnp.asarray(summed).reshape(1, 1, 512).astype(jnp.bfloat16))
    assert got.shape == (1, 1, 256) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=0)
    calls = [n for n, _ in pallas_calls(jax.make_jaxpr(lambda p: lin(Partials(p)))(x.parts).jaxpr)]
    assert len(calls) == 1 and calls[0].startswith("gemv_fp8"), calls


@pytest.mark.parametrize("quantise,limit", [(True, 10.0), (False, 0.0)])
def test_rows_as_the_swiglu_of_partial_sums(quantise, limit):
    """Rows given as the SwiGLU of two products' partial sums (``SwiGLUPartials``: a shared
    expert's w1 and w3 for w2): every program adds both products' parts in order, rounds them to
    ``rows_dtype``, applies the SwiGLU (clamped at ``limit``; 0: none) and rounds that: the
    products of those rows bit for bit; through ``SharedExpert.down`` one launch, the reference's
    w2 of the SwiGLU of the rounded sums."""
    from dspark_jax.config import tiny
    from dspark_jax.model.common import Numerics
    from dspark_jax.model.moe import SharedExpert
    from flax import nnx
    from pallas_kernels.gemv import Partials, SwiGLUPartials, total

    rng, w, _, _ = _case(23, "fp8", 1, 1, 256, 512)
    gate, up = (jnp.asarray(rng.standard_normal((4, 1, 512)) * 6, jnp.float32) for _ in range(2))
    summed = []
    for p in (gate, up):
        acc = np.asarray(p[0])
        for s_ in range(1, 4):
            acc = acc + np.asarray(p[s_])
        summed.append(jnp.asarray(acc).astype(jnp.bfloat16))
    rows = gm.swiglu(summed[0], summed[1], limit).astype(jnp.bfloat16)
    assert limit == 0 or float(jnp.max(jnp.abs(summed[1].astype(jnp.float32)))) > limit  # the clamp bites
    kw = dict(quantise=(quantise,), config=GemvConfig(block_n=32, split_k=2), out_dtype=jnp.float32)
    x = SwiGLUPartials(Partials(gate), Partials(up), limit)
    (got,) = gemv_many(x, (w,), jnp.zeros((1,), jnp.int32), rows_dtype=jnp.bfloat16, **kw)
    (want,) = gemv_many(rows, (w,), jnp.zeros((1,), jnp.int32), **kw)
    assert np.abs(np.asarray(want)).max() > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="gate and up parts of one shape"):
        gemv_many(SwiGLUPartials(Partials(gate), Partials(up[:2]), limit), (w,), jnp.zeros((1,), jnp.int32),
                  rows_dtype=jnp.bfloat16, **kw)

    cfg = tiny().replace(hidden_size=256, moe_intermediate_size=512, swiglu_limit=limit)
    num = Numerics(dtype=jnp.bfloat16, quant_sim=quantise, weight_format="fp8", kernels="pallas")
    se = SharedExpert(cfg, num, rngs=nnx.Rngs(0))
    g, u = Partials(gate), Partials(up)
    got = total(se.down(g, u), jnp.bfloat16)
    want = se.w2(gm.swiglu(g.total(jnp.bfloat16), u.total(jnp.bfloat16), limit).astype(jnp.bfloat16)[None])
    np.testing.assert_allclose(np.asarray(got, np.float32).ravel(), np.asarray(want, np.float32).ravel(),
                               rtol=2**-7, atol=1e-6)
    calls = [n for n, _ in pallas_calls(jax.make_jaxpr(lambda a, b: se.down(Partials(a), Partials(b)))(gate, up).jaxpr)]
    assert len(calls) == 1 and calls[0].startswith("gemv_fp8"), calls


def test_grouped_linear_partial_sums():
    """``Linear.grouped(partials=True)`` at one token (wo_a's 8 groups, here 4): the groups' K-split
    partial sums, adding up to ``grouped``'s product; more than one token: the product itself."""
    from dspark_jax.model.common import Linear, Numerics
    from flax import nnx
    from pallas_kernels.gemv import Partials

    num = Numerics(dtype=jnp.bfloat16, quant_sim=True, weight_format="fp8", kernels="pallas")
    lin = Linear(512, 4 * 128, num, rngs=nnx.Rngs(1), fp8_act=False, fp8_weight=True)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 1, 4, 512)), jnp.bfloat16)
    got = lin.grouped(x, partials=True)
    want = np.asarray(lin.grouped(x), np.float32)
    assert isinstance(got, Partials) and got.parts.shape[1:] == (1, 1, 4, 128) and np.abs(want).max() > 0
    np.testing.assert_allclose(np.asarray(got.total(jnp.bfloat16), np.float32), want, rtol=2**-7, atol=0)
    two = jnp.concatenate([x, x], axis=1)
    assert not isinstance(lin.grouped(two, partials=True), Partials)
