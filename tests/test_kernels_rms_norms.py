"""RMSNorms of split partial sums in one launch (``pallas_kernels.rms_norms``: an attention
layer's q_norm and kv_norm at a batch-1 step) against the reference (the parts added, rounded to
the output dtype, ``norms_rope.rms_norm``), its lowering for gfx950 and NVIDIA, and bad input.
Interpret mode fills outputs with NaN first: finite results were written."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowering
from pallas_kernels.gemv import Partials
from pallas_kernels.rms_norms import rms_norms, rms_norms_kernel, rms_norms_reference

SD = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("parts,rows", [(8, 1), (1, 2)])
def test_equals_the_reference(dtype, parts, rows):
    rng = np.random.default_rng(parts + rows)
    xs = (Partials(jnp.asarray(rng.standard_normal((parts, rows, 256)) * 3, jnp.float32)),
          Partials(jnp.asarray(rng.standard_normal((parts, rows, 128)) * 0.01, jnp.float32)))
    ws = (jnp.asarray(rng.uniform(0.5, 1.5, 256), jnp.float32), jnp.asarray(rng.uniform(0.5, 1.5, 128), jnp.float32))
    got = rms_norms_kernel(xs, ws, 1e-6, dtype)
    want = rms_norms_reference(xs, ws, 1e-6, dtype)
    for g, w, x in zip(got, want, xs):
        assert g.dtype == dtype and g.shape == x.parts.shape[1:]
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all() and np.abs(w).max() > 0.5  # normalised: values of order one
        if dtype == jnp.bfloat16:  # one rounding step at most (the mean's sum in another order)
            np.testing.assert_allclose(g, w, rtol=2**-7, atol=0)
        else:
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6)
    via = rms_norms(xs, ws, 1e-6, dtype, impl="xla")
    np.testing.assert_array_equal(np.asarray(via[0], np.float32), np.asarray(want[0], np.float32))


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_norms_lower_for_gpus(arch, platform):
    """Flash's q_norm (1024) and kv_norm (512) over 8 parts in one Triton call."""
    f32 = jnp.float32
    fn = lambda a, b, wa, wb: rms_norms_kernel((Partials(a), Partials(b)), (wa, wb), 1e-6, jnp.bfloat16,  # noqa
                                               interpret=False)
    text = lowering.lower(fn, SD((8, 1, 1024), f32), SD((8, 1, 512), f32), SD((1024,), f32), SD((512,), f32),
                          arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "rms_norms_x2" in text


def test_bad_input_is_named():
    x = Partials(jnp.ones((2, 1, 128), jnp.float32))
    w = jnp.ones((128,), jnp.float32)
    with pytest.raises(ValueError, match="one weight per input"):
        rms_norms_kernel((x, x), (w,), 1e-6, jnp.float32)
    with pytest.raises(ValueError, match=r"parts \[S, R, N\] of one R and weights \[N\]"):
        rms_norms_kernel((x,), (jnp.ones((64,), jnp.float32),), 1e-6, jnp.float32)
    with pytest.raises(ValueError, match="power-of-two widths"):
        rms_norms_kernel((Partials(jnp.ones((2, 1, 96), jnp.float32)),), (jnp.ones((96,), jnp.float32),), 1e-6,
                         jnp.float32)
