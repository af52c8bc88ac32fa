"""Two one-row linears in one launch (``pallas_kernels.gemv_chain``: wo_a then wo_b) against the two
``gemv`` launches they replace (bit for bit: the same products and sums) and against the grouped
matmul's reference; tiles whose second-linear programs read one row of the first or several, a
first linear with and without a K split; the lowering for gfx950 and NVIDIA at Flash's shapes; bad
input.

Interpret mode fills outputs with NaN before the kernel runs: a finite result means every partial
sum was written, and a second-linear program that read the first's rows before they were written
would read NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gemv_chain, lowering
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.gemv import GemvConfig
from tests.test_kernels_grouped_matmul import _random_weights

SD = jax.ShapeDtypeStruct


def _case(seed: int, rows=4, n1=256, k1=512, n2=128):
    rng = np.random.default_rng(seed)
    w1 = _random_weights(rng, (rows, n1, k1), "fp8")
    w2 = _random_weights(rng, (1, n2, rows * n1), "fp8")
    x = jnp.asarray(rng.standard_normal((rows, k1)) * np.exp(rng.uniform(-2, 2, (rows, 1))), jnp.bfloat16)
    return x, w1, w2


@pytest.mark.parametrize("config1,config2", [
    (None, None),  # the library's tiles: the second's programs each within one row of the first
    (GemvConfig(block_n=32, split_k=2), GemvConfig(block_n=64, split_k=2)),  # each over two rows
    (GemvConfig(block_n=64, split_k=1), GemvConfig(block_n=32, split_k=8)),  # the first unsplit
])
@pytest.mark.parametrize("quantise2", [True, False])
def test_equals_two_launches(config1, config2, quantise2):
    x, w1, w2 = _case(1)
    kw = dict(mid_dtype=jnp.bfloat16, quantise2=quantise2, config1=config1, config2=config2)
    got = gemv_chain.gemv_chain(x, w1, w2, **kw)
    want = gemv_chain.reference(x, w1, w2, **kw)
    parts = np.asarray(got.parts)
    assert parts.shape == want.parts.shape and np.isfinite(parts).all()
    assert np.abs(parts).max() > 0
    np.testing.assert_array_equal(parts, np.asarray(want.parts))


def test_equals_the_grouped_matmul_reference():
    """Against the grouped matmul's reference for both linears (the first's output rounded to
    bf16, then quantised as the reference's FP8 GEMM input): float32 summation order only."""
    x, w1, w2 = _case(2)
    got = np.asarray(gemv_chain.gemv_chain(x, w1, w2, mid_dtype=jnp.bfloat16).total())
    mid = gm.batched_matmul(x[:, None, :], w1, act_quant=False, out_dtype=jnp.bfloat16, impl="xla")[:, 0]
    want = gm.batched_matmul(mid.reshape(1, 1, -1), w2, act_quant=True, out_dtype=jnp.float32, impl="xla")[0]
    scale = np.abs(np.asarray(want)).max()
    assert scale > 0
    # a bf16 rounding of the middle may differ by one step where the float32 sums' order moved it
    np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=2e-2 * scale)
    assert np.mean(np.abs(got - np.asarray(want)) <= 1e-5 * scale) > 0.9


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_output_projection_lowers_for_gpus(arch, platform):
    x = SD((8, 4096), jnp.bfloat16)
    wo_a = gm.Weights(SD((8, 1024, 4096), jnp.float8_e4m3fn), SD((8, 8, 32), jnp.uint8), "fp8")
    wo_b = gm.Weights(SD((1, 4096, 8192), jnp.float8_e4m3fn), SD((1, 32, 64), jnp.uint8), "fp8")
    text = lowering.lower(lambda x, a, b: gemv_chain.gemv_chain(x, a, b, mid_dtype=jnp.bfloat16,
                                                                interpret=False).parts,
                          x, wo_a, wo_b, arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "gemv_chain_fp8_q_split4_8" in text


def test_bad_input_is_named():
    x, w1, w2 = _case(3)
    with pytest.raises(ValueError, match="first weight"):
        gemv_chain.gemv_chain(x[:3], w1, w2, mid_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="second weight"):
        gemv_chain.gemv_chain(x, w1, _random_weights(np.random.default_rng(0), (1, 128, 512), "fp8"),
                              mid_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="FP8"):
        dense = gm.Weights(jnp.zeros(w1.shape, jnp.bfloat16), None, "dense")
        gemv_chain.gemv_chain(x, dense, w2, mid_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        gemv_chain.gemv_chain(x[None], w1, w2, mid_dtype=jnp.bfloat16)
