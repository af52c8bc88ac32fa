"""The indexer's top-k kernel (each element's rank counted, written to its slot) against
``jax.lax.top_k``, the dispatcher's limit, its lowering for gfx950 and NVIDIA, and bad input.

Interpret mode fills outputs with a poison value before the kernel runs (int32: its minimum;
``test_kernels_attention.test_interpret_mode_poisons_outputs``); a slot left unwritten could
not equal ``lax.top_k``'s index there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowering, top_k
from tests.helpers import pallas_calls

SD = jax.ShapeDtypeStruct


def _scores(rng, shape) -> jnp.ndarray:
    """Scores with ties (repeated values, +0 and -0), masked entries (-inf) and distinct values."""
    s = rng.standard_normal(shape).astype(np.float32)
    s[..., ::7] = 0.0
    s[..., 3::11] = -0.0
    s[..., 5::13] = -np.inf
    s[..., 1:40:3] = 1.5
    return jnp.asarray(s)


@pytest.mark.parametrize("shape,k,config", [
    ((3, 100), 17, top_k.TopKConfig(block_i=16, block_j=32)),  # n not a multiple of either block
    ((2, 512), 512, top_k.TopKConfig()),  # k = n: the whole order (a 2k-token context's C4 entries)
    ((1, 6, 600), 512, top_k.TopKConfig(block_i=64, block_j=128)),  # a verify chunk's queries
    ((2, 1, 37), 1, top_k.TopKConfig()),  # the maximum only, one block
])
def test_kernel_equals_lax_top_k(shape, k, config):
    s = _scores(np.random.default_rng(k), shape)
    got = top_k.kernel(s, k, config=config)
    assert got.shape == (*shape[:-1], k) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.lax.top_k(s, k)[1]))


def test_limit_marks_invisible_picks():
    """With a per-row ``limit`` (the indexer's visible entries, the others scored -inf) picks at or
    above it come back as -1, the others as ``lax.top_k``'s; kernel and reference alike."""
    rng = np.random.default_rng(4)
    s = np.asarray(_scores(rng, (2, 3, 100)))
    limit = np.asarray([[0, 17, 100], [40, 99, 5]], np.int32)
    s = np.where(np.arange(100)[None, None] < limit[..., None], s, -np.inf).astype(np.float32)
    want = np.asarray(jax.lax.top_k(jnp.asarray(s), 32)[1])
    want = np.where(want < limit[..., None], want, -1)
    assert (want == -1).any() and (want >= 0).any()
    for got in (top_k.kernel(jnp.asarray(s), 32, jnp.asarray(limit), config=top_k.TopKConfig(block_i=16, block_j=32)),
                top_k.top_k(jnp.asarray(s), 32, jnp.asarray(limit), impl="xla")):
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="limit must have the scores' leading shape"):
        top_k.kernel(jnp.asarray(s), 32, jnp.asarray(limit[0]))


def test_total_order_of_signed_zeros_and_nan():
    """+0 ranks above -0 and NaN above everything, as ``lax.top_k`` orders them."""
    s = jnp.asarray([[0.0, -0.0, 1.0, -0.0, 0.0, -jnp.inf, -jnp.inf, 2.0, jnp.nan, -3.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(top_k.kernel(s, 10)), np.asarray(jax.lax.top_k(s, 10)[1]))


def test_dispatcher_keeps_large_calls_on_xla(monkeypatch):
    s = _scores(np.random.default_rng(2), (4, 64))
    run = lambda: [name for name, _ in pallas_calls(jax.make_jaxpr(  # noqa: E731
        lambda x: top_k.top_k(x, 8, impl="pallas"))(s).jaxpr)]
    assert run() == ["top_k_rank"]
    monkeypatch.setattr(top_k, "MAX_SCORES", 4 * 64 - 1)
    assert run() == []
    np.testing.assert_array_equal(np.asarray(top_k.top_k(s, 8, impl="pallas")), np.asarray(jax.lax.top_k(s, 8)[1]))


@pytest.mark.parametrize("arch,platform,rows,n", [
    ("gfx950", "rocm", 1, 512),  # a decode step at a 2k-token context
    ("gfx950", "rocm", 6, 2048),  # a verify chunk at 8k
    ("NVIDIA H200", "cuda", 32, 600),  # batch 32, n not a power of two
])
def test_lowers_for_gpus(arch, platform, rows, n):
    fn = lambda s: top_k.kernel(s, 512, interpret=False)  # noqa: E731
    assert lowering.count_triton_calls(lowering.lower(fn, SD((rows, n), jnp.float32), arch=arch,
                                                      platform=platform)) == 1
    fn = lambda s, lim: top_k.kernel(s, 512, lim, interpret=False)  # noqa: E731 (with the rows' limits)
    assert lowering.count_triton_calls(lowering.lower(fn, SD((rows, n), jnp.float32), SD((rows,), jnp.int32),
                                                      arch=arch, platform=platform)) == 1


def test_bad_input_is_named():
    s = _scores(np.random.default_rng(1), (2, 16))
    with pytest.raises(ValueError, match=r"k must lie in \[1, n = 16\], got 17"):
        top_k.kernel(s, 17)
    with pytest.raises(ValueError, match="scores must be float32"):
        top_k.kernel(s.astype(jnp.bfloat16), 4)
    with pytest.raises(ValueError, match="block_j must be a power of two"):
        top_k.TopKConfig(block_j=96)
