"""The mHC weights kernel (gates + Sinkhorn) against its reference, and its gfx950 lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.model.hyper import hc_pre
from pallas_kernels import hc_weights, lowering

N, ITERS, EPS = 4, 20, 1e-6


def _z(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3)


@pytest.mark.parametrize("lead,block_t", [((2, 37), 16), ((5,), 128), ((1, 1), 16)])
def test_kernel_matches_reference(lead, block_t):
    z = _z((*lead, (2 + N) * N))
    got = hc_weights.weights_kernel(z, n=N, iters=ITERS, eps=EPS, block_t=block_t, interpret=True)
    want = hc_weights.weights_reference(z, n=N, iters=ITERS, eps=EPS)
    for g, w, name in zip(got, want, ("pre", "post", "comb")):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-7, err_msg=name)
    comb = np.asarray(got[2])
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)  # ends on a column normalisation


def test_kernel_writes_every_row_of_its_tile():
    """Padding rows and tokens come back as computed values, never as stale memory: the kernel
    writes the whole [M, BT] tile (rows past (2 + n) * n are zero)."""
    z = _z((24, (2 + N) * N), seed=1)
    m = hc_weights.padded_rows(N)
    z_t = jnp.pad(z.T, ((0, m - z.shape[1]), (0, 8)))
    out = np.asarray(hc_weights._weights_pallas(z_t, n=N, iters=ITERS, eps=EPS, block_t=16, interpret=True))
    assert np.isfinite(out).all()
    assert (out[(2 + N) * N:] == 0).all()
    pre = np.asarray(hc_weights.weights_reference(z, n=N, iters=ITERS, eps=EPS)[0])
    np.testing.assert_allclose(out[:N, :24].T, pre, rtol=2e-6)


def test_hc_pre_kernel_equals_loop():
    rng = np.random.default_rng(2)
    d = 32
    x = jnp.asarray(rng.standard_normal((2, 3, N, d)).astype(np.float32))
    fn = jnp.asarray(rng.standard_normal(((2 + N) * N, N * d)).astype(np.float32) * 0.1)
    base = jnp.asarray(rng.standard_normal((2 + N) * N).astype(np.float32))
    scale = jnp.asarray([0.7, 1.3, 0.9], jnp.float32)
    outs = {impl: hc_pre(x, fn, base, scale, iters=ITERS, hc_eps=EPS, norm_eps=1e-6, sinkhorn_impl=impl)
            for impl in ("loop", "kernel")}
    for a, b in zip(outs["loop"], outs["kernel"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match="sinkhorn_impl"):
        hc_pre(x, fn, base, scale, iters=ITERS, hc_eps=EPS, norm_eps=1e-6, sinkhorn_impl="scan")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"\(2 \+ n\) \* n = 24"):
        hc_weights.weights_kernel(jnp.zeros((3, 20)), n=N, iters=ITERS, eps=EPS)


@pytest.mark.parametrize("tokens", [6, 8192])
def test_lowers_for_gfx950(tokens):
    sd = jax.ShapeDtypeStruct((tokens, (2 + N) * N), jnp.float32)
    text = lowering.lower(lambda z: hc_weights.weights_kernel(z, n=N, iters=ITERS, eps=EPS, interpret=False), sd)
    assert lowering.count_triton_calls(text) == 1
