"""A decode step's routed experts in one launch (``pallas_kernels.grouped_chain``: the SwiGLU, its
quantisation and w2) against the grouped matmul's launches (bit for bit) and the grouped matmul's
reference; K split or not, unused tiles; the lowering for gfx950 and NVIDIA at Flash's shapes;
bad input.

Interpret mode fills outputs with NaN before the kernel runs: a finite result means every row was
written, and a w2 program that read its tile's SwiGLU sums before they were written would read
NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_chain, lowering
from pallas_kernels import grouped_matmul as gm
from tests.test_kernels_grouped_matmul import _random_weights

SD = jax.ShapeDtypeStruct
BM = 16


def _case(seed: int, k1: int, fmt: str = "fp8_k128", groups=8, n1=256, n2=256, tiles=6):
    """``tiles`` pairs in their own 16-row tiles (a token's row first, the rest padding, weight 0)."""
    rng = np.random.default_rng(seed)
    w1, w3 = (_random_weights(rng, (groups, n1, k1), fmt) for _ in range(2))
    w2 = _random_weights(rng, (groups, n2, n1), fmt)
    x = jnp.asarray(rng.standard_normal((tiles * BM, k1)) * np.exp(rng.uniform(-2, 2, (tiles * BM, 1))), jnp.bfloat16)
    rw = np.zeros((tiles * BM,), np.float32)
    rw[::BM] = rng.uniform(0.1, 1.0, tiles)
    tile_group = jnp.asarray(rng.integers(0, groups, tiles), jnp.int32)
    return gm.ActQuant.of(x), w1, w3, w2, jnp.asarray(rw), tile_group


@pytest.mark.parametrize("k1,used", [(2048, 6), (2048, 4), (512, 6)])  # K split in 4, 4 with unused tiles, unsplit
def test_equals_the_grouped_matmul_launches(k1, used):
    x, w1, w3, w2, rw, tg = _case(1, k1)
    num_tiles = jnp.asarray([used], jnp.int32)
    cfg1, _ = grouped_chain.configs(w1, w2, tg.shape[0], BM)
    assert (cfg1.split_k > 1) == (k1 == 2048)
    kw = dict(block_m=BM, limit=7.0)
    got = grouped_chain.swiglu_down(x, w1, w3, w2, rw, tg, num_tiles, **kw)
    want = grouped_chain.reference(x, w1, w3, w2, rw, tg, num_tiles, **kw)
    g = np.asarray(got, np.float32)
    assert got.dtype == jnp.bfloat16 and np.isfinite(g).all() and np.abs(g[::BM][:used]).min() > 0
    np.testing.assert_array_equal(g, np.asarray(want, np.float32))
    assert not g[used * BM:].any()


def test_equals_the_grouped_matmul_reference():
    """Against ``swiglu_reference`` then ``reference`` (XLA): float32 summation order only."""
    x, w1, w3, w2, rw, tg = _case(2, 1024, fmt="fp8")
    num_tiles = jnp.asarray([6], jnp.int32)
    got = np.asarray(grouped_chain.swiglu_down(x, w1, w3, w2, rw, tg, num_tiles, block_m=BM, limit=7.0), np.float32)
    h = gm.swiglu_reference(x, w1, w3, rw, tg, num_tiles, block_m=BM, limit=7.0)
    want = np.asarray(gm.reference(gm.ActQuant.of(h), w2, tg, num_tiles, block_m=BM), np.float32)
    scale = np.abs(want).max()
    assert scale > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * scale)  # a rounding of h may move by one step
    assert np.mean(np.abs(got - want) <= 1e-2 * np.abs(want) + 1e-6 * scale) > 0.9


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_experts_lower_for_gpus(arch, platform):
    w1 = gm.Weights(SD((256, 2048, 4096), jnp.float8_e4m3fn), SD((256, 2048, 32), jnp.uint8), "fp8_k128")
    w2 = gm.Weights(SD((256, 4096, 2048), jnp.float8_e4m3fn), SD((256, 4096, 16), jnp.uint8), "fp8_k128")

    def fn(codes, amax, w1, w3, w2, rw, tg, nt):
        return grouped_chain.swiglu_down(gm.ActQuant(codes, amax, jnp.bfloat16), w1, w3, w2, rw, tg, nt, block_m=BM,
                                         limit=10.0, interpret=False)

    text = lowering.lower(fn, SD((96, 4096), jnp.float8_e4m3fn), SD((96, 32), jnp.float32), w1, w1, w2,
                          SD((96,), jnp.float32), SD((6,), jnp.int32), SD((1,), jnp.int32), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "grouped_chain_fp8_k128_a8_swiglu_down_split2_1" in text


def test_bad_input_is_named():
    x, w1, w3, w2, rw, tg = _case(3, 512)
    nt = jnp.asarray([6], jnp.int32)
    with pytest.raises(ValueError, match="w2"):
        grouped_chain.swiglu_down(x, w1, w3, w1, rw, tg, nt, block_m=BM, limit=7.0)
    with pytest.raises(ValueError, match="fp8 codes"):
        grouped_chain.swiglu_down(x.values(), w1, w3, w2, rw, tg, nt, block_m=BM, limit=7.0)
    assert not grouped_chain.takes(x, w1, w2, 32)
