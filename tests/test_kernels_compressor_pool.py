"""The compressors' pooling kernel (gather, softmax pool and in-place ring update in one launch)
and the pooling-and-write kernel (with the closed windows' entries finished and written too)
against their pure-JAX references and the two launches, their lowering for gfx950 and NVIDIA, and
their bad-input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import tiny
from dspark_jax.model.norms_rope import layer_inv_freq
from pallas_kernels import compressor_pool, kv_rows, lowering

SD = jax.ShapeDtypeStruct


def _case(rng, b: int, ratio: int, overlap: bool, channels: int, t: int, start, n_valid):
    span = 2 * ratio if overlap else ratio
    ring = span + 16  # as ``ModelConfig.compressor_ring_size``
    f32 = jnp.float32
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), f32)  # noqa: E731
    return (normal(b, ring, channels), 2 * normal(b, ring, channels), normal(b, t, channels),
            2 * normal(b, t, channels), normal(ratio, channels), jnp.asarray(start, jnp.int32),
            jnp.asarray(n_valid, jnp.int32))


def _real_windows(start, n_valid, ratio: int, k: int) -> np.ndarray:
    """[b, k]: candidate windows whose closing token is a real row of the chunk (the ones kept)."""
    win = np.asarray(start)[:, None] // ratio + np.arange(k)[None]
    return win < (np.asarray(start) + np.asarray(n_valid))[:, None] // ratio


@pytest.mark.parametrize("ratio,overlap,channels,t,start,n_valid", [
    (4, True, 64, 1, [0, 3, 7, 101], [1, 1, 0, 1]),  # C4 decode: first window (slots before 0), idle row
    (4, True, 64, 6, [0, 2, 29, 50], [6, 3, 6, 0]),  # C4 verify: two windows close, a short and an empty request
    (4, True, 96, 16, [5, 64, 8, 250], [16, 16, 11, 1]),  # C4, the longest chunk the kernel takes; w = 48
    (128, False, 32, 6, [0, 125, 250, 1021], [6, 6, 2, 6]),  # C128: a window closes at 127 / 255 / 1023
    (8, False, 48, 16, [3, 8, 60, 1000], [16, 9, 16, 4]),  # C8: two windows close, ring wraps many times
])
def test_kernel_matches_reference(ratio, overlap, channels, t, start, n_valid):
    """Pooled rows of every window closed in the chunk agree to float32 rounding; the rings after
    the write are equal bit for bit (rows not written keep their values, padding rows are dropped)."""
    args = _case(np.random.default_rng(ratio + t), len(start), ratio, overlap, channels, t, start, n_valid)
    kw = dict(ratio=ratio, overlap=overlap)
    c_ref, kv_ref, sc_ref = compressor_pool.pool_reference(*args, **kw)
    c, kv, sc = compressor_pool.pool_kernel(*args, **kw)
    assert c.shape == c_ref.shape == (len(start), -(-t // ratio), channels // 2 if overlap else channels)
    real = _real_windows(start, n_valid, ratio, c.shape[1])
    assert real.any()
    np.testing.assert_allclose(np.asarray(c)[real], np.asarray(c_ref)[real], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(kv), np.asarray(kv_ref))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(sc_ref))
    assert not np.array_equal(np.asarray(kv), np.asarray(args[0]))  # some rows were written


@pytest.mark.parametrize("ratio,overlap,t,start,n_valid", [
    (4, True, 1, [0, 3, 7, 101], [1, 1, 0, 1]),  # C4 decode
    (4, True, 6, [0, 2, 29, 50], [6, 3, 6, 0]),  # C4 verify
    (128, False, 1, [0, 127, 250, 1023], [1, 1, 1, 1]),  # C128 decode: windows close at 127 / 1023
])
def test_rows_as_partial_sums(ratio, overlap, t, start, n_valid):
    """The chunk's rows as a split projection's partial sums (``gemv.Partials``, 8 parts): the
    kernel adds them in order as it loads each row: the pooled rows and the rings are those of the
    rows summed in that order first, bit for bit, and the reference's to float32 rounding."""
    from pallas_kernels.gemv import Partials

    rng = np.random.default_rng(ratio + t)
    args = list(_case(rng, len(start), ratio, overlap, 64, t, start, n_valid))
    kv_parts = jnp.asarray(rng.standard_normal((8, *args[2].shape)), jnp.float32)
    sc_parts = jnp.asarray(rng.standard_normal((8, *args[3].shape)) * 2, jnp.float32)
    summed = [np.asarray(p[0]) for p in (kv_parts, sc_parts)]
    for s in range(1, 8):
        summed = [acc + np.asarray(p[s]) for acc, p in zip(summed, (kv_parts, sc_parts))]
    kw = dict(ratio=ratio, overlap=overlap)
    rest = (args[4], args[5], args[6])
    got = compressor_pool.pool_kernel(args[0], args[1], Partials(kv_parts), Partials(sc_parts), *rest, **kw)
    same = compressor_pool.pool_kernel(args[0], args[1], jnp.asarray(summed[0]), jnp.asarray(summed[1]), *rest, **kw)
    want = compressor_pool.pool_reference(args[0], args[1], Partials(kv_parts), Partials(sc_parts), *rest, **kw)
    real = _real_windows(start, n_valid, ratio, got[0].shape[1])
    assert real.any()
    np.testing.assert_array_equal(np.asarray(got[0])[real], np.asarray(same[0])[real])
    for g, sm, w in zip(got[1:], same[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(sm))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[0])[real], np.asarray(want[0])[real], rtol=1e-5, atol=1e-5)


def test_rows_of_padding_and_other_requests_stay():
    """Poisoned rings: a request with no real rows keeps its ring bit for bit; a request writes
    exactly the rows (start + i) % R for its real rows i and nothing else."""
    t, ratio = 6, 4
    args = list(_case(np.random.default_rng(7), 2, ratio, True, 32, t, [40, 13], [0, 2]))
    args[0] = args[0].at[:].set(jnp.nan)
    args[1] = args[1].at[:].set(jnp.nan)
    _, kv, sc = compressor_pool.pool_kernel(*args, ratio=ratio, overlap=True)
    kv, sc = np.asarray(kv), np.asarray(sc)
    assert np.isnan(kv[0]).all() and np.isnan(sc[0]).all()
    ring = kv.shape[1]
    written = [(13 + i) % ring for i in range(2)]
    np.testing.assert_array_equal(kv[1, written], np.asarray(args[2])[1, :2])
    np.testing.assert_array_equal(sc[1, written], np.asarray(args[3])[1, :2])
    others = np.setdiff1d(np.arange(ring), written)
    assert np.isnan(kv[1, others]).all() and np.isnan(sc[1, others]).all()


def test_dispatcher_takes_the_reference_for_long_chunks():
    """Chunks longer than R - span (prefill) go through the reference even with impl="pallas"."""
    ratio, t = 4, 40
    args = _case(np.random.default_rng(3), 2, ratio, True, 32, t, [0, 17], [40, 33])
    hlo = jax.jit(lambda *a: compressor_pool.pool(*a, ratio=ratio, overlap=True, impl="pallas")).lower(*args).as_text()
    assert "compressor_pool" not in hlo
    out = compressor_pool.pool(*args, ratio=ratio, overlap=True, impl="pallas")
    ref = compressor_pool.pool_reference(*args, ratio=ratio, overlap=True)
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"at most R - span = 16 tokens, got 40"):
        compressor_pool.pool_kernel(*args, ratio=ratio, overlap=True)


@pytest.mark.parametrize("arch,platform,ratio,overlap,channels,b,t", [
    ("gfx950", "rocm", 4, True, 1024, 1, 1),  # Flash's C4 attention compressor, a decode step
    ("gfx950", "rocm", 4, True, 256, 8, 6),  # Flash's C4 indexer compressor, a verify chunk
    ("NVIDIA H200", "cuda", 128, False, 512, 32, 16),  # Flash's C128 compressor, batch 32
])
def test_lowers_for_gpus(arch, platform, ratio, overlap, channels, b, t):
    """One Triton call through JAX's Triton lowering for an abstract gfx950 (ROCm) and H200 (CUDA)
    device (no GPU needed)."""
    span = 2 * ratio if overlap else ratio
    f32, i32 = jnp.float32, jnp.int32
    args = (SD((b, span + 16, channels), f32), SD((b, span + 16, channels), f32), SD((b, t, channels), f32),
            SD((b, t, channels), f32), SD((ratio, channels), f32), SD((b,), i32), SD((b,), i32))
    fn = lambda *a: compressor_pool.pool_kernel(*a, ratio=ratio, overlap=overlap, interpret=False)  # noqa: E731
    assert lowering.count_triton_calls(lowering.lower(fn, *args, arch=arch, platform=platform)) == 1


def test_bad_input_is_named():
    args = list(_case(np.random.default_rng(1), 2, 4, True, 32, 1, [0, 1], [1, 1]))
    kw = dict(ratio=4, overlap=True)
    with pytest.raises(ValueError, match=r"ape must be \[4, 32\]"):
        compressor_pool.pool_kernel(*args[:4], args[4][:3], *args[5:], **kw)
    with pytest.raises(ValueError, match=r"new kv / score must both be \[2, t, 32\]"):
        compressor_pool.pool_kernel(args[0], args[1], args[2][..., :16], *args[3:], **kw)
    with pytest.raises(ValueError, match=r"start and n_valid must be \[2\]"):
        compressor_pool.pool_kernel(*args[:5], args[5][:1], args[6], **kw)
    with pytest.raises(ValueError, match="even number of channels"):
        compressor_pool.geometry(4, True, 31)
    with pytest.raises(ValueError, match="rings must be float32"):
        compressor_pool.pool_kernel(args[0].astype(jnp.bfloat16), args[1].astype(jnp.bfloat16), *args[2:], **kw)


# ------------------------------------------------------------------------------ pooling and the entries' write
INV_FREQ = layer_inv_freq(tiny(), 4)  # 32 pairs: 64 rope dims


def _write_case(rng, b: int, ratio: int, overlap: bool, w: int, t: int, start, n_valid, dtype):
    """``_case``'s rings and rows for entries of width w, NaN-poisoned entries (no window's row is
    NaN) [b, n, w] and a norm weight [w]."""
    args = _case(rng, b, ratio, overlap, 2 * w if overlap else w, t, start, n_valid)
    n = 2048 // ratio
    entries = jnp.full((b, n, w), jnp.nan, dtype)
    return (*args, entries, jnp.asarray(rng.uniform(0.5, 1.5, w), jnp.float32))


@pytest.mark.parametrize("ratio,overlap,w,t,start,n_valid,quant", [
    (4, True, 128, 1, [3, 7, 0, 101], [1, 0, 1, 1], "kv"),  # C4 decode: window 0 closes; an idle row; no window closes
    (4, True, 128, 6, [0, 2, 29, 50], [6, 3, 6, 0], "kv"),  # C4 verify: two windows close, a short and an empty request
    (4, True, 128, 1, [3, 7, 11, 1023], [1, 1, 0, 1], "keys"),  # C4 decode, the indexer's keys (Hadamard + e2m1)
    (128, False, 128, 6, [0, 125, 250, 1021], [6, 6, 2, 6], "kv"),  # C128: closes at 127, 1023 (4 slot blocks)
    (128, False, 512, 1, [127, 0, 1023, 255], [1, 1, 1, 0], "kv"),  # C128 decode at Flash's width (16 slot blocks)
    (4, True, 64, 6, [1, 6, 60, 9], [6, 6, 4, 5], None),  # no rounding (quant None), entries of 64 dims
])
@pytest.mark.parametrize("parts", [0, 8])
def test_pool_write_matches_two_launches_and_reference(ratio, overlap, w, t, start, n_valid, quant, parts):
    """One launch (``pool_write_kernel``) against the two (``pool_kernel``, then
    ``kv_rows.write_window_rows``' kernel): the rings and every entry bit for bit; entries of
    windows not closed stay poisoned, the closed ones finite. Against the reference: the rings bit
    for bit (rows as partial sums: to float32 rounding), the entries within a rounding step of
    bf16, or of fp8 / e2m1 where that step crossed a boundary."""
    from pallas_kernels.gemv import Partials

    rng = np.random.default_rng(ratio + t + w + parts)
    args = list(_write_case(rng, len(start), ratio, overlap, w, t, start, n_valid, jnp.bfloat16))
    if parts:  # the chunk's rows as a split projection's partial sums
        args[2], args[3] = (Partials(jnp.asarray(rng.standard_normal((parts, *a.shape)) * s, jnp.float32))
                            for a, s in ((args[2], 1), (args[3], 2)))
    kw = dict(ratio=ratio, overlap=overlap, eps=1e-6, quant=quant, dtype=jnp.bfloat16)
    got = compressor_pool.pool_write_kernel(*args, INV_FREQ, **kw)
    c, ring_kv, ring_score = compressor_pool.pool_kernel(*args[:7], ratio=ratio, overlap=overlap)
    two = (kv_rows.write_window_rows(args[7], args[5], args[6], ratio, c, args[8], INV_FREQ, eps=1e-6, quant=quant,
                                     dtype=jnp.bfloat16, impl="pallas"), ring_kv, ring_score)
    want = compressor_pool.pool_write_reference(*args, INV_FREQ, **kw)
    for g, o in zip(got, two):
        assert g.dtype == o.dtype and g.shape == o.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(o, np.float32))
    for g, r in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-5 if parts else 0)
    written = np.zeros(got[0].shape[:2], bool)
    k = -(-t // ratio)
    for b, row in zip(*np.nonzero(_real_windows(start, n_valid, ratio, k))):
        written[b, start[b] // ratio + row] = True
    assert written.any() and not written.all(axis=1).any()
    e, r = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
    assert np.isnan(e[~written]).all() and np.isfinite(e[written]).all()
    np.testing.assert_allclose(e[written], r[written], rtol={"kv": 2**-3, "keys": 1}.get(quant, 2**-7), atol=1e-6)
    assert np.mean(e[written] == r[written]) > 0.97


def test_pool_write_switch(monkeypatch):
    """``pool_write`` takes the two launches on the Pallas path (``WRITE_IN_POOL`` off, the default),
    the one launch with it on (both alike), the references for XLA, and for chunks longer than R -
    span (prefill) the pooling's reference and the rows' kernel."""
    from tests.helpers import pallas_calls

    rng = np.random.default_rng(5)
    args = _write_case(rng, 2, 4, True, 128, 6, [0, 13], [6, 5], jnp.bfloat16)
    kw = dict(ratio=4, overlap=True, eps=1e-6, quant="kv", dtype=jnp.bfloat16)

    def launches(impl):
        jaxpr = jax.make_jaxpr(lambda *a: compressor_pool.pool_write(*a, INV_FREQ, impl=impl, **kw))(*args)
        return [n for n, _ in pallas_calls(jaxpr.jaxpr)]

    assert not compressor_pool.WRITE_IN_POOL  # the default
    assert launches("pallas") == ["compressor_pool", "kv_rows"] and launches("xla") == []
    two = compressor_pool.pool_write(*args, INV_FREQ, impl="pallas", **kw)
    monkeypatch.setattr(compressor_pool, "WRITE_IN_POOL", True)
    assert launches("pallas") == ["compressor_pool_write"]
    one = compressor_pool.pool_write(*args, INV_FREQ, impl="pallas", **kw)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    long = _write_case(rng, 2, 4, True, 128, 40, [0, 17], [40, 33], jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda *a: compressor_pool.pool_write(*a, INV_FREQ, impl="pallas", **kw))(*long)
    assert [n for n, _ in pallas_calls(jaxpr.jaxpr)] == ["kv_rows"]  # (the pooling's reference, the rows' kernel)


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
@pytest.mark.parametrize("ratio,overlap,w,quant,b,t,parts", [
    (4, True, 512, "kv", 1, 1, 8),  # Flash's C4 attention compressor at a decode step (wkv / wgate: 8 partial sums)
    (4, True, 128, "keys", 8, 6, 0),  # Flash's C4 indexer compressor, a verify chunk
    (128, False, 512, "kv", 32, 6, 0),  # Flash's C128 compressor, batch 32
])
def test_pool_write_lowers_for_gpus(arch, platform, ratio, overlap, w, quant, b, t, parts):
    """One Triton call through JAX's Triton lowering for an abstract gfx950 (ROCm) and H200 (CUDA)
    device (no GPU needed), at Flash's widths into a 2k-context pool."""
    from pallas_kernels.gemv import Partials

    span, c = (2 * ratio, 2 * w) if overlap else (ratio, w)
    f32, i32 = jnp.float32, jnp.int32
    freq = layer_inv_freq(tiny(), ratio)
    rows = SD((parts, b, t, c) if parts else (b, t, c), f32)

    def fn(ring_kv, ring_score, kv, score, *rest):
        kv, score = (Partials(kv), Partials(score)) if parts else (kv, score)
        return compressor_pool.pool_write_kernel(ring_kv, ring_score, kv, score, *rest, freq, ratio=ratio,
                                                 overlap=overlap, eps=1e-6, quant=quant, dtype=jnp.bfloat16,
                                                 interpret=False)

    text = lowering.lower(fn, SD((b, span + 16, c), f32), SD((b, span + 16, c), f32), rows, rows, SD((ratio, c), f32),
                          SD((b,), i32), SD((b,), i32), SD((b, 2048 // ratio, w), jnp.bfloat16), SD((w,), f32),
                          arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1


def test_pool_write_bad_input_is_named():
    args = list(_write_case(np.random.default_rng(2), 2, 4, True, 128, 1, [0, 1], [1, 1], jnp.bfloat16))
    kw = dict(ratio=4, overlap=True, eps=1e-6, quant="kv", dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"the norm weight must be \[128\], got \(64,\)"):
        compressor_pool.pool_write_kernel(*args[:8], args[8][:64], INV_FREQ, **kw)
    with pytest.raises(ValueError, match=r"entries kv_rows' kernel writes; got .* entries float32 \(2, 512, 96\)"):
        compressor_pool.pool_write_kernel(*args[:7], jnp.zeros((2, 512, 96), jnp.float32), args[8], INV_FREQ, **kw)
    with pytest.raises(ValueError, match=r"ape must be \[4, 256\]"):
        compressor_pool.pool_write_kernel(*args[:4], args[4][:3], *args[5:], INV_FREQ, **kw)
