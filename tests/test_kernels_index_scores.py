"""The lightning indexer's scores in one launch (``pallas_kernels.index_scores``: q.K, relu, the
heads' weights from weights_proj's output or its partial sums, the weighted sum, the visibility
mask) against the pure-JAX reference, its lowering for gfx950 and NVIDIA, and bad input.
Interpret mode fills outputs with NaN first: finite or -inf results were written."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import index_scores, lowering
from pallas_kernels.gemv import Partials
from tests.helpers import pallas_calls

SD = jax.ShapeDtypeStruct
SCALE = 128**-0.5 * 16**-0.5


def _case(rng, b, t, h, d, n, dtype):
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    keys = jnp.asarray(rng.standard_normal((b, n, d)), dtype)
    parts = jnp.asarray(rng.standard_normal((4, b, t, h)) * 3, jnp.float32)
    return q, keys, parts


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("partials", [False, True])
def test_kernel_matches_reference(dtype, partials):
    """Two requests of three queries over 100 entries (two entry blocks, the last partial); limits
    from none visible to all: the visible scores agree to float32 summation order, the others are
    -inf in both."""
    rng = np.random.default_rng(1 + partials)
    q, keys, parts = _case(rng, 2, 3, 16, 128, 100, dtype)
    w_raw = Partials(parts) if partials else jnp.sum(parts, axis=0).astype(dtype)
    limit = jnp.asarray([[0, 37, 100], [64, 65, 1]], jnp.int32)
    got = np.asarray(index_scores.scores_kernel(q, keys, w_raw, limit, scale=SCALE, dtype=dtype))
    want = np.asarray(index_scores.scores_reference(q, keys, w_raw, limit, scale=SCALE, dtype=dtype))
    assert got.shape == (2, 3, 100) and got.dtype == np.float32
    visible = np.arange(100)[None, None] < np.asarray(limit)[..., None]
    assert (got[~visible] == -np.inf).all() and (want[~visible] == -np.inf).all()
    assert np.isfinite(got[visible]).all() and np.abs(want[visible]).max() > 1
    np.testing.assert_allclose(got[visible], want[visible], rtol=1e-5, atol=1e-5 * np.abs(want[visible]).max())
    via = index_scores.scores(q, keys, w_raw, limit, scale=SCALE, dtype=dtype, impl="xla")
    np.testing.assert_array_equal(np.asarray(via), want)
    # the switch: the kernel up to KERNEL_MAX_ROWS query rows (6 here), XLA's beyond
    names = lambda q: [n for n, _ in pallas_calls(jax.make_jaxpr(lambda q: index_scores.scores(  # noqa: E731
        q, keys, w_raw, limit, scale=SCALE, dtype=dtype, impl="pallas"))(q).jaxpr)]
    assert names(q) == ["index_scores"]
    big = jnp.tile(q, (1, 3, 1, 1))
    limit = jnp.tile(limit, (1, 3))
    w_raw = Partials(jnp.tile(parts, (1, 1, 3, 1))) if partials else jnp.tile(w_raw, (1, 3, 1))
    assert 2 * 9 > index_scores.KERNEL_MAX_ROWS and names(big) == []


def test_head_weights_round_as_the_model():
    """The heads' weights: weights_proj's output rounded to the activations' dtype, times the scale
    in that dtype (``head_weights``), which the kernel reproduces bit for bit: a weight changed by
    one bf16 step moves the scores."""
    rng = np.random.default_rng(3)
    q, keys, parts = _case(rng, 1, 1, 16, 128, 64, jnp.bfloat16)
    limit = jnp.asarray([[64]], jnp.int32)
    w = index_scores.head_weights(Partials(parts), SCALE, jnp.bfloat16)
    w16 = np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(w), w16)  # values of the dtype
    got = index_scores.scores_kernel(q, keys, Partials(parts), limit, scale=SCALE, dtype=jnp.bfloat16)
    dots = np.einsum("hd,nd->hn", np.asarray(q[0, 0], np.float64), np.asarray(keys[0], np.float64))
    exact = np.einsum("hn,h->n", np.maximum(dots, 0), np.asarray(w[0, 0], np.float64))
    np.testing.assert_allclose(np.asarray(got)[0, 0], exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_scores_lower_for_gpus(arch, platform):
    """A Flash C4 layer at one token and a 2k-token context (64 heads of 128, 672 entries, the
    weights from 8 partial sums): one Triton call."""
    fn = lambda q, k, w, lim: index_scores.scores_kernel(q, k, Partials(w), lim, scale=SCALE,  # noqa: E731
                                                         dtype=jnp.bfloat16, interpret=False)
    text = lowering.lower(fn, SD((1, 1, 64, 128), jnp.bfloat16), SD((1, 672, 128), jnp.bfloat16),
                          SD((8, 1, 1, 64), jnp.float32), SD((1, 1), jnp.int32), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "index_scores" in text


@pytest.mark.parametrize("quant,parts", [("keys", 4), ("keys", 1), (None, 1)])
def test_queries_finished_in_the_kernel(quant, parts):
    """Unfinished queries (``kv_rows.QueryRows``: wq_b's partial sums, their positions, the
    rounding) finished inside the scores' kernel: one launch (``index_scores_queries``), the same
    scores bit for bit as ``query_rows``' kernel then the scores' kernel, and the reference's (the
    queries of ``queries_reference``) but where the queries' rotation rounded a value across an
    e2m1 step; in XLA the queries finished first."""
    from dspark_jax.config import tiny
    from dspark_jax.model.norms_rope import layer_inv_freq
    from pallas_kernels import kv_rows

    rng = np.random.default_rng(7 + parts)
    _, keys, w_parts = _case(rng, 2, 3, 16, 128, 100, jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((parts, 2, 3, 16, 128)), jnp.float32)
    raw = kv_rows.QueryRows(Partials(c) if parts > 1 else c[0], jnp.asarray(rng.integers(0, 9000, (2, 3)), jnp.int32),
                            layer_inv_freq(tiny(), 4), quant=quant, dtype=jnp.bfloat16)
    limit = jnp.asarray([[0, 37, 100], [64, 65, 1]], jnp.int32)
    kw = dict(scale=SCALE, dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda r: index_scores.scores(r, keys, Partials(w_parts), limit, impl="pallas", **kw))(raw)
    assert [n for n, _ in pallas_calls(jaxpr.jaxpr)] == ["index_scores_queries"]
    got = np.asarray(index_scores.scores_kernel(raw, keys, Partials(w_parts), limit, **kw))
    q = kv_rows.query_rows(raw.c, raw.positions, raw.inv_freq, quant=quant, dtype=jnp.bfloat16, impl="pallas")
    two = np.asarray(index_scores.scores_kernel(q, keys, Partials(w_parts), limit, **kw))
    np.testing.assert_array_equal(got, two)
    visible = np.arange(100)[None, None] < np.asarray(limit)[..., None]
    assert (got[~visible] == -np.inf).all() and np.isfinite(got[visible]).all()
    q_ref = kv_rows.queries_reference(raw.c, raw.positions, raw.inv_freq, quant=quant, dtype=jnp.bfloat16)
    assert np.mean(np.asarray(q, np.float32) == np.asarray(q_ref, np.float32)) > 0.97
    want = np.asarray(index_scores.scores_reference(q_ref, keys, Partials(w_parts), limit, **kw))
    np.testing.assert_array_equal(np.asarray(index_scores.scores(raw, keys, Partials(w_parts), limit, impl="xla",
                                                                 **kw)), want)
    # beyond QUERIES_MAX_PROGRAMS programs the queries are finished in their own launch first
    many = jnp.zeros((2, 64 * index_scores.QUERIES_MAX_PROGRAMS // 6 + 64, 128), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda r: index_scores.scores(r, many, Partials(w_parts), limit, impl="pallas", **kw))(raw)
    assert [n for n, _ in pallas_calls(jaxpr.jaxpr)] == ["query_rows", "index_scores"]
    rows_equal = np.all(np.asarray(q, np.float32) == np.asarray(q_ref, np.float32), axis=(2, 3))  # [b, t]
    assert rows_equal.any() or quant is None
    np.testing.assert_allclose(got[visible & rows_equal[..., None]], want[visible & rows_equal[..., None]],
                               rtol=1e-5, atol=1e-5 * np.abs(want[visible]).max())


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_scores_of_unfinished_queries_lower_for_gpus(arch, platform):
    """A Flash C4 layer at one token: the indexer's 64 queries of 128 dims from wq_b's output,
    finished in the scores' kernel (RoPE, the Hadamard rotation, e2m1) over 672 entries: one
    Triton call."""
    from dspark_jax.config import tiny
    from dspark_jax.model.norms_rope import layer_inv_freq
    from pallas_kernels import kv_rows

    def fn(c, pos, k, w, lim):
        raw = kv_rows.QueryRows(c, pos, layer_inv_freq(tiny(), 4), quant="keys", dtype=jnp.bfloat16)
        return index_scores.scores_kernel(raw, k, Partials(w), lim, scale=SCALE, dtype=jnp.bfloat16,
                                          interpret=False)

    text = lowering.lower(fn, SD((1, 1, 64, 128), jnp.float32), SD((1, 1), jnp.int32), SD((1, 672, 128), jnp.bfloat16),
                          SD((8, 1, 1, 64), jnp.float32), SD((1, 1), jnp.int32), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "index_scores_queries" in text


def test_bad_input_is_named():
    rng = np.random.default_rng(0)
    q, keys, parts = _case(rng, 1, 2, 16, 128, 32, jnp.bfloat16)
    limit = jnp.zeros((1, 2), jnp.int32)
    kw = dict(scale=SCALE, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="h and d powers of two >= 16"):
        index_scores.scores_kernel(q[:, :, :8], keys, Partials(parts[..., :8]), limit, **kw)
    with pytest.raises(ValueError, match="head weights must be"):
        index_scores.scores_kernel(q, keys, Partials(parts[:, :, :1]), limit, **kw)
    with pytest.raises(ValueError, match="limit"):
        index_scores.scores_kernel(q, keys, Partials(parts), limit[:, :1], **kw)
