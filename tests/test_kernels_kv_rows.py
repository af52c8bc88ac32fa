"""New KV rows in one launch (``pallas_kernels.kv_rows``: RMSNorm, RoPE, the reference's rounding
(fp8 KV, or the indexer keys' Hadamard + e2m1) and the in-place write; rows as an array or a
linear's partial sums) against the pure-JAX reference, its lowering for gfx950 and NVIDIA, and bad
input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.cache import Fp8Keys
from dspark_jax.config import tiny
from dspark_jax.model.norms_rope import layer_inv_freq
from pallas_kernels import kv_rows, lowering
from tests.helpers import pallas_calls

SD = jax.ShapeDtypeStruct
INV_FREQ = layer_inv_freq(tiny(), 4)  # 32 pairs: 64 rope dims


def _case(rng, b: int, k: int, n: int, w: int, dtype):
    c = jnp.asarray(rng.standard_normal((b, k, w)) * rng.uniform(0.1, 30, (b, k, 1)), jnp.float32)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, w), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((b, n, w)) * 100, dtype)  # poisoned rows: values no entry has
    positions = jnp.asarray(rng.integers(0, 5000, (b, k)) * 4, jnp.int32)
    return c, weight, pool, positions


@pytest.mark.parametrize("w", [128, 512])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kv_quant", [False, True])
def test_kernel_matches_reference(w, dtype, kv_quant):
    """Entries written where their window closed (one dropped slot per request), every other pool
    row bit for bit as it was; the entries agree with the reference to a rounding step of the dtype
    (the norm's sum and cos / sin: ~all elements equal), or of fp8 where that step crossed an fp8
    boundary."""
    rng = np.random.default_rng(w + kv_quant)
    b, k, n = 2, 3, 12
    c, weight, pool, positions = _case(rng, b, k, n, w, dtype)
    slots = jnp.asarray([[4, n, 0], [11, 7, n + 5]], jnp.int32)  # >= n: windows not closed
    kw = dict(eps=1e-6, quant=("kv" if kv_quant else None), dtype=dtype)
    want = kv_rows.rows_reference(pool, slots, positions, c, weight, INV_FREQ, **kw)
    got = kv_rows.rows_kernel(pool, slots, positions, c, weight, INV_FREQ, **kw)
    assert got.shape == pool.shape and got.dtype == pool.dtype
    got, want, before = (np.asarray(a, np.float32) for a in (got, want, pool))
    written = np.zeros((b, n), bool)
    written[0, [4, 0]] = written[1, [11, 7]] = True
    np.testing.assert_array_equal(got[~written], before[~written])
    assert not np.isclose(got[written], before[written]).all()
    g, r = got[written], want[written]
    assert np.isfinite(g).all() and np.abs(r).max() > 0.5
    step = 2**-3 if kv_quant else (2**-7 if dtype == jnp.bfloat16 else 1e-5)
    np.testing.assert_allclose(g, r, rtol=step, atol=1e-6)
    if dtype == jnp.bfloat16:  # (float32: XLA's and the kernel's cos / sin differ in the last bits on a GPU)
        assert np.mean(g == r) > 0.98
    if kv_quant:  # the nope dims on the fp8 grid of their 64-dim block: kv_sim leaves them as they are
        from dspark_jax.model.quant import kv_sim
        np.testing.assert_array_equal(np.asarray(kv_sim(jnp.asarray(g, dtype), 64), np.float32), g)


def test_keys_match_reference():
    """The indexer's keys (128 dims): the Hadamard rotation and e2m1 per 32 dims after the norm and
    RoPE. The rotation's float32 sum runs in another order than XLA's dot: a key element may land
    one e2m1 step away where its value sat on a rounding boundary; all others equal."""
    from dspark_jax.model.quant import FP4_MAX, fp4_sim

    rng = np.random.default_rng(5)
    b, k, n, w = 2, 4, 9, 128
    c, weight, pool, positions = _case(rng, b, k, n, w, jnp.bfloat16)
    slots = jnp.asarray([[0, 1, 2, n], [3, 4, 5, 6]], jnp.int32)
    kw = dict(eps=1e-6, quant="keys", dtype=jnp.bfloat16)
    want = np.asarray(kv_rows.rows_reference(pool, slots, positions, c, weight, INV_FREQ, **kw), np.float32)
    got = kv_rows.rows_kernel(pool, slots, positions, c, weight, INV_FREQ, **kw)
    got = np.asarray(got, np.float32)
    written = np.asarray(slots) < n
    rows = np.asarray(slots)[written]
    g = got[np.nonzero(written)[0], rows]
    r = want[np.nonzero(written)[0], rows]
    np.testing.assert_array_equal(np.delete(got[1], rows[3:], axis=0), np.delete(np.asarray(pool[1], np.float32),
                                                                                 rows[3:], axis=0))
    # on the e2m1 grid of each 32-dim block (fp4_sim leaves them as they are), and the reference's
    np.testing.assert_array_equal(np.asarray(fp4_sim(jnp.asarray(g, jnp.bfloat16), 32), np.float32), g)
    # at most one e2m1 step: the widest is 2 x the block's scale, which is at most 2 x amax / 6
    step = np.repeat(np.abs(r).reshape(-1, 4, 32).max(-1) * 4 / FP4_MAX, 32, axis=-1).reshape(r.shape)
    assert np.mean(g == r) > 0.97 and np.abs(g).max() > 0
    assert (np.abs(g - r) <= step + 1e-6).all()


def test_rows_from_partial_sums():
    """A one-token window row from wkv's K-split partial sums (``gemv.Partials``): the kernel adds
    them in order and rounds to the dtype, as the reference's ``gemv.total``; the same row as from
    their sum added first."""
    from pallas_kernels.gemv import Partials

    rng = np.random.default_rng(9)
    parts = jnp.asarray(rng.standard_normal((8, 1, 1, 512)), jnp.float32)
    _, weight, pool, _ = _case(rng, 1, 1, 16, 512, jnp.bfloat16)
    slots, positions = jnp.asarray([[5]], jnp.int32), jnp.asarray([[1234]], jnp.int32)
    summed = np.asarray(parts[0])
    for s in range(1, 8):
        summed = summed + np.asarray(parts[s])
    kw = dict(eps=1e-6, quant="kv", dtype=jnp.bfloat16)
    got = kv_rows.rows_kernel(pool, slots, positions, Partials(parts), weight, INV_FREQ, **kw)
    same = kv_rows.rows_kernel(pool, slots, positions, jnp.asarray(summed), weight, INV_FREQ, **kw)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(same, np.float32))
    want = kv_rows.rows_reference(pool, slots, positions, Partials(parts), weight, INV_FREQ, **kw)
    g, r = np.asarray(got, np.float32)[0, 5], np.asarray(want, np.float32)[0, 5]
    np.testing.assert_allclose(g, r, rtol=2**-3, atol=1e-6)
    assert np.mean(g == r) > 0.98


@pytest.mark.parametrize("ratio,quant,start,n_valid", [
    (4, "kv", [0, 5, 29, 50], [6, 3, 6, 0]),  # C4 verify: 0-2 windows close per request, an empty request
    (4, "keys", [3, 7, 8, 101], [1, 1, 1, 0]),  # C4 decode: a window closes at 3 and 7, not at 8; idle row
    (128, "kv", [0, 125, 1021, 250], [6, 6, 6, 0]),  # C128: windows close at 127 and 1023; an empty request
])
def test_window_rows_match_reference(ratio, quant, start, n_valid):
    """A compressor's candidate windows (``write_window_rows``): the kernel works out each window's
    slot and position from start and n_valid; the same pool rows written as the reference's, every
    other row as it was."""
    rng = np.random.default_rng(ratio + len(quant))
    w = 128
    t = 1 if quant == "keys" else 6
    k = -(-t // ratio)
    n = 2048 // ratio
    c, weight, pool, _ = _case(rng, 4, k, n, w, jnp.bfloat16)
    start, n_valid = jnp.asarray(start, jnp.int32), jnp.asarray(n_valid, jnp.int32)
    kw = dict(eps=1e-6, quant=quant, dtype=jnp.bfloat16)
    got = np.asarray(kv_rows.write_window_rows(pool, start, n_valid, ratio, c, weight, INV_FREQ, impl="pallas", **kw),
                     np.float32)
    want = np.asarray(kv_rows.write_window_rows(pool, start, n_valid, ratio, c, weight, INV_FREQ, impl="xla", **kw),
                      np.float32)
    slots, _ = kv_rows.window_slots(start, n_valid, k, ratio, n)
    written = np.zeros((4, n), bool)
    for b, row in zip(*np.nonzero(np.asarray(slots) < n)):
        written[b, np.asarray(slots)[b, row]] = True
    assert written.any() and not written[3].any()
    before = np.asarray(pool, np.float32)
    np.testing.assert_array_equal(got[~written], before[~written])
    g, r = got[written], want[written]
    assert not np.isclose(g, before[written]).all()
    np.testing.assert_allclose(g, r, rtol=2**-3 if quant == "kv" else 1, atol=1e-6)
    assert np.mean(g == r) > 0.97


@pytest.mark.parametrize("quant", [None, "keys"])
def test_query_rows_match_reference(quant):
    """The indexer's queries (``query_rows``: wq_b's partial sums added, every head rotated at its
    token's position, with "keys" the Hadamard rotation and e2m1): the reference's rows, all but a
    few elements bit for bit (the rotation's sums in another order), the rest one step away."""
    from pallas_kernels.gemv import Partials

    rng = np.random.default_rng(21)
    parts = jnp.asarray(rng.standard_normal((4, 2, 3, 16, 128)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 9000, (2, 3)), jnp.int32)
    kw = dict(quant=quant, dtype=jnp.bfloat16)
    got = kv_rows.query_rows(Partials(parts), positions, INV_FREQ, impl="pallas", **kw)
    want = kv_rows.queries_reference(Partials(parts), positions, INV_FREQ, **kw)
    assert got.shape == (2, 3, 16, 128) and got.dtype == jnp.bfloat16
    g, r = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(g).all() and np.abs(r).max() > 1
    assert np.mean(g == r) > (0.97 if quant else 0.99)
    if quant:  # at most one e2m1 step of the 32-dim block (2 x its scale <= 4 x amax / 6)
        step = np.repeat(np.abs(r).reshape(-1, 4, 32).max(-1) * 4 / 6, 32, axis=-1).reshape(r.shape)
        assert (np.abs(g - r) <= step + 1e-6).all()
    else:
        np.testing.assert_allclose(g, r, rtol=2**-7, atol=1e-6)
    same = kv_rows.query_rows(jnp.sum(parts, axis=0).astype(jnp.bfloat16), positions, INV_FREQ, impl="xla", **kw)
    np.testing.assert_array_equal(np.asarray(same, np.float32), r)
    # more tokens than the kernel takes: XLA's (the reference)
    many = jnp.tile(parts, (1, 1, 3, 1, 1))  # 2 x 9 tokens
    calls = [n for n, _ in pallas_calls(jax.make_jaxpr(lambda p: kv_rows.query_rows(
        Partials(p), jnp.tile(positions, (1, 3)), INV_FREQ, impl="pallas", **kw))(many).jaxpr)]
    assert calls == [] and 2 * 9 > kv_rows.QUERY_KERNEL_MAX_TOKENS >= 2 * 3
    with pytest.raises(ValueError, match="query rows take quant"):
        kv_rows.queries_reference(Partials(parts), positions, INV_FREQ, quant="kv", dtype=jnp.bfloat16)


def test_switch_takes_the_reference_for_fp8_pools():
    """``write_entries`` on the Pallas path with an fp8 pool (not a plain array) writes through the
    reference (``cache.write_kv``): the same result as the reference."""
    rng = np.random.default_rng(3)
    c, weight, _, positions = _case(rng, 1, 1, 4, 128, jnp.bfloat16)
    pool = Fp8Keys(codes=jnp.zeros((1, 4, 128), jnp.uint8), scales=jnp.zeros((1, 4, 4), jnp.uint8))
    slots = jnp.asarray([[2]], jnp.int32)
    kw = dict(eps=1e-6, quant="kv", dtype=jnp.bfloat16)
    got = kv_rows.write_rows(pool, slots, positions, c, weight, INV_FREQ, impl="pallas", **kw)
    want = kv_rows.rows_reference(pool, slots, positions, c, weight, INV_FREQ, **kw)
    assert isinstance(got, Fp8Keys)
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
    assert np.asarray(got.codes)[0, 2].any()


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
@pytest.mark.parametrize("quant,w,parts", [("kv", 512, 0), ("kv", 512, 8), ("keys", 128, 0)])
def test_flash_rows_lower_for_gpus(arch, platform, quant, w, parts):
    """Flash's KV rows (512 dims, 64 rope dims, fp8 nope blocks; from a pooled row or from wkv's 8
    partial sums) and indexer keys (128 dims: Hadamard + e2m1) into a 2k-context pool, one Triton
    call each."""
    from pallas_kernels.gemv import Partials

    freq = layer_inv_freq(tiny(), 128)

    def fn(pool, slots, positions, c, weight):
        c = Partials(c) if parts else c
        return kv_rows.rows_kernel(pool, slots, positions, c, weight, freq, eps=1e-6, quant=quant, dtype=jnp.bfloat16,
                                   interpret=False)

    rows = SD((parts, 1, 1, w) if parts else (1, 1, w), jnp.float32)
    text = lowering.lower(fn, SD((1, 512, w), jnp.bfloat16), SD((1, 1), jnp.int32), SD((1, 1), jnp.int32), rows,
                          SD((w,), jnp.float32), arch=arch, platform=platform)
    name = "key_rows" if quant == "keys" else "kv_rows"
    assert lowering.count_triton_calls(text) == 1 and name in text
    if quant == "keys":  # and the indexer's 64 query heads of one token from wq_b's 4 partial sums
        fn = lambda c, pos: kv_rows._queries_pallas(Partials(c), pos, jnp.asarray(freq), quant="keys",  # noqa: E731
                                                    dtype=jnp.bfloat16, interpret=False)
        text = lowering.lower(fn, SD((4, 1, 1, 64, 128), jnp.float32), SD((1, 1), jnp.int32), arch=arch,
                              platform=platform)
        assert lowering.count_triton_calls(text) == 1 and "query_rows" in text


@pytest.mark.parametrize("rounded", [False, True])
def test_rows_and_norm_in_one_launch(rounded):
    """``write_rows_and_norm`` (a one-token step's window row and q_norm, both from split partial
    sums): one launch whose pool, normed rows and quantised values equal the two launches'
    (``rows_kernel``, ``rms_norms_kernel``) bit for bit, outputs poisoned first; rows of other
    requests kept; in XLA the references."""
    from pallas_kernels import rms_norms
    from pallas_kernels.gemv import Partials
    from tests.helpers import pallas_calls

    rng = np.random.default_rng(11 + rounded)
    b, n_q = 3, 256
    c = Partials(jnp.asarray(rng.standard_normal((8, b, 1, 128)), jnp.float32))
    q_a = Partials(jnp.asarray(rng.standard_normal((4, b, n_q)) * 3, jnp.float32))
    _, weight, pool, _ = _case(rng, b, 1, 16, 128, jnp.bfloat16)
    q_weight = jnp.asarray(rng.uniform(0.5, 1.5, n_q), jnp.float32)
    slots, positions = jnp.asarray([[5], [16], [0]], jnp.int32), jnp.asarray([[1234], [7], [99]], jnp.int32)
    kw = dict(eps=1e-6, quant="kv", dtype=jnp.bfloat16)
    norm = dict(norm_x=q_a, norm_weight=q_weight, norm_eps=1e-5, rounded=rounded)

    def one(impl):
        return kv_rows.write_rows_and_norm(pool, slots, positions, c, weight, INV_FREQ, impl=impl, **kw, **norm)

    jaxpr = jax.make_jaxpr(lambda: one("pallas"))()
    assert [n for n, _ in pallas_calls(jaxpr.jaxpr)] == ["kv_rows_norm"]
    got = one("pallas")
    two = (kv_rows.rows_kernel(pool, slots, positions, c, weight, INV_FREQ, **kw),
           *rms_norms.rms_norms_kernel((q_a,), (q_weight,), 1e-5, jnp.bfloat16, rounded=(rounded,)))
    want = one("xla")
    assert len(got) == len(two) == len(want) == 2 + rounded
    for g, o in zip(got, two):
        assert g.shape == o.shape and g.dtype == o.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(o, np.float32))
    before, g = np.asarray(pool, np.float32), np.asarray(got[0], np.float32)
    np.testing.assert_array_equal(g[1], before[1])  # slot 16: outside the pool, not written
    assert not np.isclose(g[0, 5], before[0, 5]).all() and not np.isclose(g[2, 0], before[2, 0]).all()
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2**-3, atol=1e-6)
    assert np.mean(np.asarray(got[1], np.float32) == np.asarray(want[1], np.float32)) > 0.98


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_rows_and_norm_lower_for_gpus(arch, platform):
    """Flash's window row (512 dims from wkv's 8 partial sums) with q_norm (1024 dims from wq_a's 8,
    quantised too): one Triton call."""
    from pallas_kernels.gemv import Partials

    freq = layer_inv_freq(tiny(), 128)

    def fn(pool, slots, positions, c, weight, q_a, q_weight):
        return kv_rows._pallas(pool, slots, positions, Partials(c), weight, jnp.asarray(freq), Partials(q_a), q_weight,
                               eps=1e-6, quant="kv", ratio=0, dtype=jnp.dtype(jnp.bfloat16), norm_eps=1e-6,
                               norm_rounded=True, interpret=False)

    text = lowering.lower(fn, SD((1, 512, 512), jnp.bfloat16), SD((1, 1), jnp.int32), SD((1, 1), jnp.int32),
                          SD((8, 1, 1, 512), jnp.float32), SD((512,), jnp.float32), SD((8, 1, 1024), jnp.float32),
                          SD((1024,), jnp.float32), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "kv_rows_norm" in text


def test_bad_input_is_named():
    rng = np.random.default_rng(0)
    c, weight, pool, positions = _case(rng, 1, 1, 4, 128, jnp.bfloat16)
    slots = jnp.zeros((1, 1), jnp.int32)
    kw = dict(eps=1e-6, quant="kv", dtype=jnp.bfloat16)
    keys = Fp8Keys(codes=jnp.zeros((1, 4, 128), jnp.uint8), scales=jnp.zeros((1, 4, 4), jnp.uint8))
    with pytest.raises(ValueError, match="plain float pool"):
        kv_rows.rows_kernel(keys, slots, positions, c, weight, INV_FREQ, **kw)
    with pytest.raises(ValueError, match="plain float pool"):
        kv_rows.rows_kernel(pool[..., :96], slots, positions, c[..., :96], weight[:96], INV_FREQ, **kw)
    with pytest.raises(ValueError, match="slots and positions must be"):
        kv_rows.rows_kernel(pool, slots[:, :0], positions, c, weight, INV_FREQ, **kw)
    with pytest.raises(ValueError, match="weight"):
        kv_rows.rows_kernel(pool, slots, positions, c, weight[:64], INV_FREQ, **kw)
    with pytest.raises(ValueError, match="quant must be one of"):
        kv_rows.rows_kernel(pool, slots, positions, c, weight, INV_FREQ, eps=1e-6, quant="fp4", dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="at most 128"):
        kv_rows.rows_kernel(jnp.zeros((1, 4, 256), jnp.bfloat16), slots, positions, jnp.zeros((1, 1, 256)),
                            jnp.ones((256,)), INV_FREQ, eps=1e-6, quant="keys", dtype=jnp.bfloat16)
