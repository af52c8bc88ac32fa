"""The fused mHC kernels (hc_pre, hc_post, hc_head; hc_post + hc_pre; each collapse with and
without the sub-block's RMSNorm) against their references, their lowering for gfx950 and NVIDIA
GPUs, and their place in the model.

Interpret mode fills every output of a ``pallas_call`` with NaN before the kernel runs
(``test_kernels_attention.test_interpret_mode_poisons_outputs``), so finite outputs mean every
element was written.

Tolerance: the kernels and the references add in different orders (the mixes' K-long dot products
in S splits, the streams in a tree), and the gates carry those differences through the sigmoid and
the Sinkhorn iterations. Float32 outputs agree within 2e-6 of each output's largest magnitude
(about 16 float32 ulps; the largest deviation seen is 9e-7, on post); bfloat16 outputs (y, X')
within 2^-8 of it (one bfloat16 rounding step).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import dspark_jax
from dspark_jax import config, sharding
from dspark_jax.api import forward_step
from dspark_jax.cache import init_cache
from dspark_jax.model.block import hc_head_of
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4
from dspark_jax.model.dspark import draft_block, init_draft_cache
from dspark_jax.model.hyper import hc_head, hc_post, hc_post_pre_norm, hc_pre, hc_pre_norm
from pallas_kernels.gemv import ExpertRows, Partials, total
from pallas_kernels import hc_fused, lowering
from tests.helpers import equations, matmul_precisions, pallas_calls

N, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6
F32_TOL, BF16_TOL = 2e-6, 2.0**-8  # of the largest magnitude of each output
SD = jax.ShapeDtypeStruct


def _unit(rng, lead, d, dtype):
    """Streams x, sub-block output f, and pre- and head-unit parameters (non-zero bases, scales
    away from 1: a misplaced one shows)."""
    x = jnp.asarray(rng.standard_normal((*lead, N, d)), dtype)
    f = jnp.asarray(rng.standard_normal((*lead, d)), dtype)
    m = (2 + N) * N
    pre = (jnp.asarray(rng.standard_normal((m, N * d)) * 0.05, jnp.float32),
           jnp.asarray(rng.standard_normal(m), jnp.float32), jnp.asarray([0.7, 1.3, 0.9], jnp.float32))
    head = (jnp.asarray(rng.standard_normal((N, N * d)) * 0.05, jnp.float32),
            jnp.asarray(rng.standard_normal(N), jnp.float32), jnp.asarray([1.2], jnp.float32))
    return x, f, pre, head


def _close(got, want, dtype, name):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, name
    assert np.isfinite(got).all(), f"{name}: unwritten or non-finite elements"
    assert np.abs(want).max() > 0.1, f"{name}: a trivially small reference"
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("lead,d,dtype", [
    # 74 tokens: 5 token tiles of 16, the last one partial; d = 512 in 8 splits; 4 d chunks of 128
    ((2, 37), 512, jnp.float32),
    # 3 tokens in one tile of 4 (multiply-add mixes); d = 32 in 1 split; one d chunk of 32; bf16 streams
    ((1, 3), 32, jnp.bfloat16),
])
def test_fused_unit_matches_reference(lead, d, dtype):
    """hc_pre / hc_post (/ hc_head) through the model's entry points (``sinkhorn_impl="fused"``,
    ``fused=True``: the kernels in interpret mode here) against the plain-JAX references, with
    the references' output dtypes."""
    x, f, (fn, base, scale), head = _unit(np.random.default_rng(0), lead, d, dtype)
    t = hc_fused._tiles(int(np.prod(lead)), N, d, (2 + N) * N, hc_fused.HcConfig())
    assert (t.splits, d // t.bd) == ((8, 4) if d == 512 else (1, 1))  # the tiling the cases describe
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    got = hc_pre(x, fn, base, scale, sinkhorn_impl="fused", **kw)
    want = hc_pre(x, fn, base, scale, sinkhorn_impl="loop", **kw)
    for g, w, name in zip(got, want, ("y", "post", "comb")):
        assert g.dtype == w.dtype, name
        _close(g, w, dtype if name == "y" else jnp.float32, name)
    np.testing.assert_allclose(np.asarray(got[2]).sum(-2), 1.0, atol=1e-5)  # ends on a column normalisation

    post, comb = want[1:]
    out = hc_post(f, x, post, comb, fused=True)
    assert out.dtype == dtype
    _close(out, hc_post(f, x, post, comb), dtype, "hc_post")

    if dtype == jnp.float32:  # (hc_head's collapse kernel is hc_pre's without post and comb)
        y = hc_head(x, *head, hc_eps=HC_EPS, norm_eps=NORM_EPS, fused=True)
        _close(y, hc_head(x, *head, hc_eps=HC_EPS, norm_eps=NORM_EPS), dtype, "hc_head")


@pytest.mark.parametrize("lead,d,dtype", [
    # 74 tokens: 5 mixes tiles of 16 (the last partial), 74 x 2 collapse programs; 8 d splits
    ((2, 37), 512, jnp.float32),
    # one token; d = 96 not a power of two (the collapse's 128 columns masked); bf16 streams
    ((1, 1), 96, jnp.bfloat16),
])
def test_fused_transitions_match_reference(lead, d, dtype):
    """The model's fused steps between sub-blocks (``hyper.hc_pre_norm`` / ``hc_post_pre_norm`` /
    ``hc_head`` with a norm weight, ``sinkhorn_impl="fused"``: interpret mode here) against the same
    entry points in plain JAX (hc_post, hc_pre with the Sinkhorn loop, ``rms_norm``)."""
    rng = np.random.default_rng(3)
    x, f, (fn, base, scale), head = _unit(rng, lead, d, dtype)
    w = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32)  # a misplaced column shows
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, out_eps=1e-5)
    want = hc_pre_norm(x, fn, base, scale, w, sinkhorn_impl="loop", **kw)
    got = hc_pre_norm(x, fn, base, scale, w, sinkhorn_impl="fused", **kw)
    for g, v, name in zip(got, want, ("normed y", "post", "comb")):
        assert g.dtype == v.dtype, name
        _close(g, v, dtype if name == "normed y" else jnp.float32, name)
    _, post, comb = want
    want = hc_post_pre_norm(f, x, post, comb, fn, base, scale, w, sinkhorn_impl="loop", **kw)
    got = hc_post_pre_norm(f, x, post, comb, fn, base, scale, w, sinkhorn_impl="fused", **kw)
    for g, v, name in zip(got, want, ("X'", "normed y", "post", "comb")):
        assert g.dtype == v.dtype, name
        _close(g, v, dtype if name in ("X'", "normed y") else jnp.float32, name)
    np.testing.assert_allclose(np.asarray(got[3]).sum(-2), 1.0, atol=1e-5)
    hkw = dict(hc_eps=HC_EPS, norm_eps=NORM_EPS, norm_weight=w, out_eps=1e-5)
    _close(hc_head(x, *head, fused=True, **hkw), hc_head(x, *head, **hkw), dtype, "hc_head + norm")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expansion_adds_partial_sums(dtype):
    """f given as a linear's K-split partial sums (``gemv.Partials``, wo_b at one token): the fused
    step adds them in order and rounds the sum to the streams' dtype (the linear's output), then
    runs as with that f, bit for bit; against the plain-JAX step (``gemv.total``) to summation
    order."""
    rng = np.random.default_rng(11)
    x, _, (fn, base, scale), _ = _unit(rng, (1, 1), 256, dtype)
    parts = jnp.asarray(rng.standard_normal((8, 1, 1, 256)), jnp.float32)
    w = jnp.asarray(1.0 + 0.3 * rng.standard_normal(256), jnp.float32)
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, out_eps=1e-5)
    _, post, comb = hc_pre_norm(x, fn, base, scale, w, sinkhorn_impl="loop", **kw)
    got = hc_post_pre_norm(Partials(parts), x, post, comb, fn, base, scale, w, sinkhorn_impl="fused", **kw)
    summed = np.asarray(parts[0])
    for s in range(1, 8):  # in order, in float32
        summed = summed + np.asarray(parts[s])
    exact = hc_post_pre_norm(jnp.asarray(summed).astype(dtype), x, post, comb, fn, base, scale, w,
                             sinkhorn_impl="fused", **kw)
    want = hc_post_pre_norm(Partials(parts), x, post, comb, fn, base, scale, w, sinkhorn_impl="loop", **kw)
    for g, e, v, name in zip(got, exact, want, ("X'", "normed y", "post", "comb")):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32), err_msg=name)
        _close(g, v, dtype if name in ("X'", "normed y") else jnp.float32, name)
    with pytest.raises(ValueError, match="partial sums"):
        hc_fused.post_pre_kernel(Partials(parts[:, :, :, :128]), x, post, comb, fn, base, scale, iters=ITERS,
                                 hc_eps=HC_EPS, norm_eps=NORM_EPS)


@pytest.mark.parametrize("dtype,tokens,extra_parts", [(jnp.bfloat16, 1, 4), (jnp.float32, 2, 0),
                                                      (jnp.bfloat16, 2, None)])
def test_expansion_adds_expert_rows(dtype, tokens, extra_parts):
    """f given as a MoE's terms (``gemv.ExpertRows``, a one-token step: each token's k routed rows
    in w2's pair tiles of 16 rows, and the shared expert's w2 as partial sums, as an array, or as
    none: its row the last of the k): the fused step adds the rows in order, then the extra (its
    parts summed and rounded to the streams' dtype), rounds the sum, and runs as with that f, bit
    for bit; against the plain-JAX step (``gemv.total``) to summation order."""
    rng = np.random.default_rng(12)
    k, stride, d = 6, 16, 256
    x, _, (fn, base, scale), _ = _unit(rng, (1, tokens), d, dtype)
    rows = rng.standard_normal((tokens * k * stride, d))
    rows[np.arange(rows.shape[0]) % stride != 0] = np.nan  # the tiles' padding rows are never read
    rows = jnp.asarray(rows, dtype)
    extra = (Partials(jnp.asarray(rng.standard_normal((extra_parts, 1, tokens, d)), jnp.float32)) if extra_parts
             else None if extra_parts is None else jnp.asarray(rng.standard_normal((1, tokens, d)), dtype))
    f = ExpertRows(rows, extra, k=k, stride=stride, shape=(1, tokens, d))
    w = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32)
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, out_eps=1e-5)
    _, post, comb = hc_pre_norm(x, fn, base, scale, w, sinkhorn_impl="loop", **kw)
    got = hc_post_pre_norm(f, x, post, comb, fn, base, scale, w, sinkhorn_impl="fused", **kw)
    r = np.asarray(rows, np.float32)[::stride].reshape(tokens, k, d)
    summed = r[:, 0]
    for j in range(1, k):  # in order, in float32
        summed = summed + r[:, j]
    if extra_parts:
        e = np.asarray(extra.parts[0])
        for s in range(1, extra_parts):
            e = e + np.asarray(extra.parts[s])
        e = np.asarray(jnp.asarray(e).astype(dtype), np.float32)
    elif extra is None:
        e = np.zeros_like(summed)
    else:
        e = np.asarray(extra, np.float32)
    exact_f = jnp.asarray(summed + e.reshape(tokens, d)).astype(dtype).reshape(1, tokens, d)
    np.testing.assert_array_equal(np.asarray(total(f), np.float32), np.asarray(exact_f, np.float32))
    exact = hc_post_pre_norm(exact_f, x, post, comb, fn, base, scale, w, sinkhorn_impl="fused", **kw)
    want = hc_post_pre_norm(f, x, post, comb, fn, base, scale, w, sinkhorn_impl="loop", **kw)
    for g, ex, v, name in zip(got, exact, want, ("X'", "normed y", "post", "comb")):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(ex, np.float32), err_msg=name)
        _close(g, v, dtype if name in ("X'", "normed y") else jnp.float32, name)
    np.testing.assert_array_equal(np.asarray(hc_post(f, x, post, comb, fused=True), np.float32),
                                  np.asarray(hc_post(exact_f, x, post, comb, fused=True), np.float32))
    with pytest.raises(ValueError, match="expert rows must be"):
        hc_fused.post_pre_kernel(ExpertRows(rows[:-stride], extra, k=k, stride=stride, shape=(1, tokens, d)), x, post,
                                 comb, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mixes_dots_keep_float32_products(dtype):
    """The kernels' only dots (the mixes, one per stream): float32 streams ask for precision
    HIGHEST, which the Triton lowering turns into an IEEE float32 dot (its default for float32
    operands, like HIGH, is TF32), whatever the caller's default matmul precision; bf16 streams
    multiply by fn split into three bf16 parts (exact products, float32 sums). A call of few
    tokens (``fma_tokens``) has no dot: its products are float32 multiplications."""
    x, f, (fn, base, scale), head = _unit(np.random.default_rng(1), (1, 2), 32, dtype)

    def jaxpr_of(config):
        with jax.default_matmul_precision("tensorfloat32"):
            return jax.make_jaxpr(lambda x: (
                hc_fused.pre_kernel(x, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, config=config),
                hc_fused.head_kernel(x, *head, hc_eps=HC_EPS, norm_eps=NORM_EPS, config=config)))(x)

    fma = jaxpr_of(hc_fused.HcConfig())
    assert [name for name, _ in pallas_calls(fma.jaxpr)] == ["hc_mixes", "hc_pre", "hc_mixes", "hc_head"]
    assert not [e for e in equations(fma.jaxpr) if e.primitive.name == "dot_general"]
    products = [e for e in equations(fma.jaxpr) if e.primitive.name == "mul" and len(e.outvars[0].aval.shape) == 3]
    assert len(products) == 2 * N and all(e.outvars[0].aval.dtype == jnp.float32 for e in products)
    jaxpr = jaxpr_of(hc_fused.HcConfig(fma_tokens=0))
    assert [name for name, _ in pallas_calls(jaxpr.jaxpr)] == ["hc_mixes", "hc_pre", "hc_mixes", "hc_head"]
    if dtype == jnp.float32:
        assert matmul_precisions(jaxpr.jaxpr) == [(lax.Precision.HIGHEST, lax.Precision.HIGHEST)] * (2 * N)
    else:
        dots = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
        assert len(dots) == 2 * N * 3
        assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
        assert all(e.params["preferred_element_type"] == jnp.float32 for e in dots)


@pytest.mark.parametrize("tokens,dtype", [(6, jnp.bfloat16), (1, jnp.float32)])
def test_mixes_as_multiply_adds_match_dots_and_reference(tokens, dtype):
    """The mixes of a few tokens as float32 multiply-adds (``HcConfig.fma_tokens``) and as dots
    give hc_pre and hc_post + hc_pre (with the norm) within the references' tolerance; d = 512 in
    several splits of several steps each, so every partial sum is used."""
    rng = np.random.default_rng(6)
    d = 512
    x, f, (fn, base, scale), _ = _unit(rng, (1, tokens), d, dtype)
    w = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32)
    fma, dots = hc_fused.HcConfig(fma_split_k=256, fma_block=1024), hc_fused.HcConfig(fma_tokens=0)
    t = hc_fused._tiles(tokens, N, d, (2 + N) * N, fma)
    assert t.fma and t.splits > 1 and t.steps > 1 and not hc_fused._tiles(tokens, N, d, (2 + N) * N, dots).fma
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    want = hc_pre(x, fn, base, scale, sinkhorn_impl="loop", **kw)
    _, post, comb = want
    want_pp = hc_post_pre_norm(f, x, post, comb, fn, base, scale, w, sinkhorn_impl="loop", out_eps=1e-5, **kw)
    for config in (fma, dots):
        got = hc_fused.pre_kernel(x, fn, base, scale, config=config, **kw)
        for g, v, name in zip(got, want, ("y", "post", "comb")):
            _close(g, v, dtype if name == "y" else jnp.float32, f"{name} {config}")
        got = hc_fused.post_pre_kernel(f, x, post, comb, fn, base, scale, norm_weight=w, out_eps=1e-5, config=config,
                                       **kw)
        for g, v, name in zip(got, want_pp, ("X'", "normed y", "post", "comb")):
            _close(g, v, dtype if name in ("X'", "normed y") else jnp.float32, f"{name} {config}")


def test_bf16_split_dot_equals_a_float32_dot():
    """``_mixes_dot`` on bf16 values: three bf16 products sum to the float32 dot (within float32
    summation order), far closer than a single bf16 dot of fn."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.bfloat16).astype(jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 128)) * 0.05, jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = np.asarray(hc_fused._mixes_dot(x, w, exact_bf16=True))
    one = np.asarray(jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32))
    assert np.abs(got - want).max() < 2e-6 * np.abs(want).max() < np.abs(one - want).max()


def _lower_unit(tokens: int, d: int, dtype, arch: str, platform: str) -> str:
    def unit(x, f, fn, base, scale, hfn, hbase, hscale, w):
        kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, interpret=False)
        hkw = dict(hc_eps=HC_EPS, norm_eps=NORM_EPS, interpret=False)
        normed = dict(norm_weight=w, out_eps=1e-5)
        y, post, comb = hc_fused.pre_kernel(x, fn, base, scale, **kw)
        return (y, hc_fused.post_kernel(f, x, post, comb, interpret=False),
                hc_fused.head_kernel(x, hfn, hbase, hscale, **hkw),
                hc_fused.post_pre_kernel(f, x, post, comb, fn, base, scale, **kw, **normed),
                hc_fused.head_kernel(x, hfn, hbase, hscale, **hkw, **normed))

    m, f32 = (2 + N) * N, jnp.float32
    args = (SD((tokens, N, d), dtype), SD((tokens, d), dtype), SD((m, N * d), f32), SD((m,), f32), SD((3,), f32),
            SD((N, N * d), f32), SD((N,), f32), SD((1,), f32), SD((d,), f32))
    return lowering.lower(unit, *args, arch=arch, platform=platform)


@pytest.mark.parametrize("arch,platform,tokens,d,dtype", [
    ("gfx950", "rocm", 6, 4096, jnp.bfloat16),  # Flash, a verify chunk
    ("gfx950", "rocm", 2 * 2048 + 5, 4096, jnp.bfloat16),  # Flash, a prefill chunk (a partial last tile)
    ("NVIDIA H200", "cuda", 1, 4096, jnp.bfloat16),  # Flash, a decode step
    ("NVIDIA H200", "cuda", 12, 256, jnp.float32),  # the shipped model's width, float32
])
def test_lowers_for_gpus(arch, platform, tokens, d, dtype):
    """hc_pre (2 kernels), hc_post (1), hc_head (2), hc_post + hc_pre + norm (2) and hc_head + norm
    (2): nine Triton calls, through JAX's Triton lowering for an abstract gfx950 (ROCm) and H200
    (CUDA) device (no GPU needed)."""
    assert lowering.count_triton_calls(_lower_unit(tokens, d, dtype, arch, platform)) == 9


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_expansion_of_expert_rows_lowers_for_gpus(arch, platform):
    """hc_post + hc_pre + norm of a Flash decode step's MoE terms (``gemv.ExpertRows``: 6 routed rows
    in 16-row pair tiles, the shared expert's w2 as 8 partial sums): two Triton calls for an
    abstract gfx950 (ROCm) and H200 (CUDA) device."""
    d, m, f32 = 4096, (2 + N) * N, jnp.float32

    def unit(x, rows, parts, post, comb, fn, base, scale, w):
        f = ExpertRows(rows, Partials(parts), k=6, stride=16, shape=(1, d))
        return hc_fused.post_pre_kernel(f, x, post, comb, fn, base, scale, iters=ITERS, hc_eps=HC_EPS,
                                        norm_eps=NORM_EPS, norm_weight=w, out_eps=1e-5, interpret=False)

    args = (SD((1, N, d), jnp.bfloat16), SD((96, d), jnp.bfloat16), SD((8, 1, d), f32), SD((1, N), f32),
            SD((1, N, N), f32), SD((m, N * d), f32), SD((m,), f32), SD((3,), f32), SD((d,), f32))
    assert lowering.count_triton_calls(lowering.lower(unit, *args, arch=arch, platform=platform)) == 2


def test_bad_input_is_named():
    x, f, (fn, base, scale), head = _unit(np.random.default_rng(2), (1, 2), 32, jnp.float32)
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    with pytest.raises(ValueError, match=r"fn must be \[24, 128\]"):
        hc_fused.pre_kernel(x, fn[:, :64], base, scale, **kw)
    with pytest.raises(ValueError, match=r"scale \[1\]"):
        hc_fused.head_kernel(x, head[0], head[1], scale, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    with pytest.raises(ValueError, match="power-of-two number of streams"):
        hc_fused.pre_kernel(x[..., :3, :], fn[:15, :96], base[:15], scale, **kw)
    with pytest.raises(ValueError, match="multiple of 16"):
        hc_fused.pre_kernel(x[..., :24], fn[:, :96], base, scale, **kw)
    with pytest.raises(ValueError, match=r"post \(1, 2, 4\)"):
        hc_fused.post_kernel(f, x, jnp.ones((1, 2, 3)), jnp.ones((1, 2, 4, 4)))
    with pytest.raises(ValueError, match="block_d must be a power of two"):
        hc_fused.HcConfig(block_d=96)
    with pytest.raises(ValueError, match="fma_tokens must be in"):
        hc_fused.HcConfig(fma_tokens=-1)


def _kernels(blocks: int, head_norm: bool, folded: bool = False) -> dict:
    """The fused mHC kernels of ``blocks`` blocks and one head (with its norm or without);
    ``folded``: each block's last hc_post in the next block's first launch (``Block.unexpanded``)
    but for the last block's."""
    posts = 1 if folded else blocks
    return {"hc_mixes": posts + 1, "hc_post_mixes": 2 * blocks - posts, "hc_pre_norm": 2 * blocks,
            "hc_post": posts, "hc_head_norm" if head_norm else "hc_head": 1}


def test_model_runs_every_mhc_unit_fused():
    """With ``Numerics.sinkhorn="fused"`` every mHC unit of the target and of the drafter goes
    through the kernels: per layer and drafter stage hc_pre + attn_norm (mixes + collapse), the
    attention's hc_post + hc_pre + ffn_norm (expansion and mixes + collapse) and the MoE's hc_post
    (a target layer's in the next layer's first launch, with its hc_pre + attn_norm);
    hc_head (mixes + collapse) once for the target (with its norm), once for the drafter (without:
    the confidence head reads the hidden before the norm). (The programs are traced on the
    abstract model, not run.)"""
    cfg = config.tiny()
    num = Numerics(dtype=jnp.float32, param_dtype=jnp.float32, sinkhorn="fused")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0))))
    ids = jnp.ones((1, 4), jnp.int32)
    cache = init_cache(cfg, 1, 32, jnp.float32)
    fwd = forward_step.trace(graphdef, state, ids, jnp.full((1,), 4, jnp.int32), cache).jaxpr.jaxpr
    layers, stages = cfg.num_hidden_layers, cfg.dspark.num_stages
    assert collections.Counter(name for name, _ in pallas_calls(fwd)) == _kernels(layers, head_norm=True, folded=True)

    def draft(state, anchor, lengths):
        return draft_block(nnx.merge(graphdef, state), init_draft_cache(cfg, 1, jnp.float32), anchor, lengths,
                           lambda lg, k: jnp.argmax(lg, -1)).logits

    jaxpr = jax.make_jaxpr(draft)(state, jnp.ones((1,), jnp.int32), jnp.full((1,), 8, jnp.int32))
    assert collections.Counter(name for name, _ in pallas_calls(jaxpr.jaxpr)) == _kernels(stages, head_norm=False)


def test_fused_mhc_runs_per_device_on_a_mesh():
    """On a mesh (``sharding.attach_mesh``) the fused kernels of a block's units and of the head
    run inside a ``shard_map``, each device on its own requests (a ``pallas_call`` has no
    partitioning rule)."""
    cfg = config.tiny()
    num = Numerics(dtype=jnp.float32, param_dtype=jnp.float32, sinkhorn="fused")
    model = nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0)))  # the rules name whole-model paths
    x = jnp.ones((8, 2, cfg.hc_mult, cfg.hidden_size), jnp.float32)
    for mesh, inside in ((None, False), (sharding.make_mesh(model=1, data=8), True)):
        if mesh is not None:
            sharding.attach_mesh(model, mesh)
        graphdef, state = nnx.split(model.mtp[-1])  # the last stage: a block's units + a head

        def unit(state, x):
            s = nnx.merge(graphdef, state)
            y, post, comb = s.attn_in(x)
            return hc_head_of(s, s.post(y, x, post, comb))

        calls = pallas_calls(jax.make_jaxpr(unit)(state, x).jaxpr)
        assert [name for name, _ in calls] == ["hc_mixes", "hc_pre_norm", "hc_post", "hc_mixes", "hc_head"]
        assert all(i == inside for _, i in calls), calls


@pytest.fixture(scope="module")
def fused_tiny():
    """The shipped model's dims in float32 with random weights, the same model with every mHC step
    in the fused kernels (``with_numerics(sinkhorn="fused")``, interpret mode), two prompts, and
    the fused model's logits of them."""
    plain = dspark_jax.init(config.tiny(), 7, dtype=jnp.float32, param_dtype=jnp.float32)
    fused = dspark_jax.with_numerics(plain, sinkhorn="fused")
    ids = np.random.default_rng(4).integers(0, plain.config.vocab_size, (2, 12))
    return plain, fused, ids, np.asarray(fused.logits(ids))


def test_fused_model_matches_the_plain_one(fused_tiny):
    """The logits of the fused model against plain JAX (the Sinkhorn loop), within float32
    summation-order error."""
    plain, fused, ids, got = fused_tiny
    assert fused.numerics.sinkhorn == "fused" and plain.numerics.sinkhorn == "auto"
    assert all(b.num.sinkhorn == "fused" for b in fused.module.layers)
    want = np.asarray(plain.logits(ids))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="weight_format"):
        dspark_jax.with_numerics(plain, weight_format="fp8")


def test_fused_model_on_a_mesh_matches_one_device(fused_tiny):
    """The fused mHC steps inside ``shard_map`` on a (data 2, model 4) mesh of virtual CPU devices,
    each device on its own request: the logits of two prompts as on one device."""
    _, one, ids, want = fused_tiny
    mesh = sharding.make_mesh(model=4, data=2)
    sharded = sharding.shard_model(one, mesh)
    assert all(b.mesh is mesh for b in sharded.module.layers)  # the fused kernels then run per device
    got = np.asarray(sharded.logits(ids))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
