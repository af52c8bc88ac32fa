"""RMSNorms of split partial sums in one launch (``pallas_kernels.rms_norms``: an attention
layer's q_norm and kv_norm at a batch-1 step) against the reference (the parts added, rounded to
the output dtype, ``norms_rope.rms_norm``), its lowering for gfx950 and NVIDIA, and bad input.
Interpret mode fills outputs with NaN first: finite results were written."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.model.quant import fp8_sim
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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rounded_outputs_are_the_quantised_norms(dtype):
    """A flagged input's extra output is the reference's FP8 GEMM input (``fp8_sim``, block 128)
    of its normalised row, bit for bit; unflagged inputs get none. Blocks of very different
    magnitudes: each block's own scale."""
    rng = np.random.default_rng(7)
    scale = np.repeat(2.0 ** rng.integers(-6, 6, 8), 128)[None, None]  # per 128-column block
    xs = (Partials(jnp.asarray(rng.standard_normal((8, 2, 1024)) * scale, jnp.float32)),
          Partials(jnp.asarray(rng.standard_normal((8, 2, 512)), jnp.float32)))
    ws = (jnp.asarray(rng.uniform(0.5, 1.5, 1024), jnp.float32), jnp.asarray(rng.uniform(0.5, 1.5, 512), jnp.float32))
    got = rms_norms_kernel(xs, ws, 1e-6, dtype, rounded=(True, False))
    want = rms_norms_reference(xs, ws, 1e-6, dtype, rounded=(True, False))
    assert len(got) == len(want) == 3 and got[2].dtype == dtype and got[2].shape == (2, 1024)
    np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(fp8_sim(got[0], 128), np.float32))
    g, w = np.asarray(got[2], np.float32), np.asarray(want[2], np.float32)
    assert np.isfinite(g).all() and np.abs(g - np.asarray(got[0], np.float32)).max() > 0  # values changed
    # the norms agree to a rounding step, and so the quantised values to one e4m3 step (2**-3 relative)
    np.testing.assert_allclose(g, w, rtol=2**-3, atol=0)
    assert np.mean(g == w) > 0.95
    via = rms_norms(xs, ws, 1e-6, dtype, rounded=(True, False), impl="xla")
    np.testing.assert_array_equal(np.asarray(via[2], np.float32), w)


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
@pytest.mark.parametrize("rounded", [(), (True, False)])
def test_flash_norms_lower_for_gpus(arch, platform, rounded):
    """Flash's q_norm (1024) and kv_norm (512) over 8 parts in one Triton call (with q_norm's
    quantised values as a third output)."""
    f32 = jnp.float32
    fn = lambda a, b, wa, wb: rms_norms_kernel((Partials(a), Partials(b)), (wa, wb), 1e-6, jnp.bfloat16,  # noqa
                                               rounded=rounded, interpret=False)
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
    with pytest.raises(ValueError, match="one rounded flag per input"):
        rms_norms_kernel((x,), (w,), 1e-6, jnp.float32, rounded=(True, False))
    small = Partials(jnp.ones((2, 1, 64), jnp.float32))
    with pytest.raises(ValueError, match="quantises widths that are multiples of 128"):
        rms_norms_kernel((small,), (jnp.ones((64,), jnp.float32),), 1e-6, jnp.float32, rounded=(True,))
