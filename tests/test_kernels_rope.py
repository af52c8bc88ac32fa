"""The queries' head norm + RoPE in one launch (``pallas_kernels.rope.q_norm_rope``) against the
reference (``Attention.project_q``'s norm, ``norms_rope.apply_rope``), its lowering for gfx950 and
NVIDIA, and bad input. Interpret mode fills outputs with NaN first: finite results were written."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.model.norms_rope import rope_inv_freq
from pallas_kernels import lowering
from pallas_kernels.rope import q_norm_rope, q_norm_rope_kernel, q_norm_rope_reference

SD = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t,h,bh", [(1, 8, 8), (3, 16, 4)])
def test_equals_the_reference(dtype, t, h, bh):
    rng = np.random.default_rng(t * h)
    q = jnp.asarray(rng.standard_normal((t, h, 128)) * np.exp(rng.uniform(-2, 2, (t, h, 1))), dtype)
    pos = jnp.asarray(rng.integers(0, 5000, t), jnp.int32)
    inv_freq = rope_inv_freq(64, 10000.0, None)
    got = q_norm_rope_kernel(q, pos, inv_freq, 1e-6, block_h=bh)
    want = q_norm_rope_reference(q, pos, inv_freq, 1e-6)
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.dtype == dtype and np.isfinite(g).all() and np.abs(w).max() > 1
    if dtype == jnp.bfloat16:  # one rounding step at most
        np.testing.assert_allclose(g, w, rtol=2**-7, atol=2**-8)
    else:
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    unrotated = q_norm_rope_reference(q, jnp.zeros_like(pos), inv_freq, 1e-6)  # the rope dims did turn
    assert np.abs(np.asarray(unrotated, np.float32)[..., 64:] - w[..., 64:]).max() > 0.1
    np.testing.assert_array_equal(np.asarray(q_norm_rope(q, pos, inv_freq, 1e-6, impl="xla"), np.float32), w)


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_queries_lower_for_gpus(arch, platform):
    """Flash's 64 heads of 512 (RoPE on the last 64 dims), one token, one Triton call."""
    inv_freq = rope_inv_freq(64, 10000.0, None)
    fn = lambda q, p: q_norm_rope_kernel(q, p, inv_freq, 1e-6, interpret=False)  # noqa: E731
    text = lowering.lower(fn, SD((1, 64, 512), jnp.bfloat16), SD((1,), jnp.int32), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "q_norm_rope" in text


def test_bad_input_is_named():
    q = jnp.ones((2, 8, 128), jnp.bfloat16)
    inv_freq = rope_inv_freq(64, 10000.0, None)
    with pytest.raises(ValueError, match=r"positions \[2\] and inv_freq"):
        q_norm_rope_kernel(q, jnp.zeros((3,), jnp.int32), inv_freq, 1e-6)
    with pytest.raises(ValueError, match="power-of-two head_dim and heads a multiple of 8"):
        q_norm_rope_kernel(jnp.ones((2, 12, 128), jnp.bfloat16), jnp.zeros((2,), jnp.int32), inv_freq, 1e-6)
