"""The MoE decode kernels: the router kernels and the pair kernels against their references, the
MoE layer's choice of them, and their gfx950 / NVIDIA lowering at DeepSeek-V4-Flash shapes.

Interpret mode fills every kernel output with NaN before the kernel runs
(``test_kernels_attention.test_interpret_mode_poisons_outputs``); every logit feeds the selection
and every element of h feeds y, so finite results mean every element was written.
Tolerances are the grouped kernel's (``test_kernels_grouped_matmul``): bf16 activations rtol 1e-2,
atol 1e-3 x max|reference| (its fused SwiGLU test); fp32 routing rtol 1e-6 (exact indices); the
fp32 MoE layer against ``Experts.dense`` is ``test_mechanisms.test_moe_grouped_equals_dense``
(rtol 1e-4, atol 1e-5), which runs a 5-token step through these kernels.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import config
from dspark_jax.model.common import Numerics
from dspark_jax.model.moe import PAIR_TILES_MAX, MoE, SharedExpert, grouped_experts
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import lowering, pair_experts, routing
from pallas_kernels.group_metadata import pair_tiles
from pallas_kernels.gemv import ONE_GROUP, ExpertRows, GemvConfig, Partials, gemv_many, total
from tests.helpers import pallas_calls
from tests.test_kernels_grouped_matmul import _random_weights

SD = jax.ShapeDtypeStruct


def _router_case(rng, n, e, d, xdt, wdt, learned):
    x = jnp.asarray(rng.standard_normal((n, d)), xdt)
    w = rng.standard_normal((e, d)) * 0.02
    if learned and e >= 256:
        # exact ties: experts 3 / 10 / 77 / 200 share one strong row, 50 / 120 / 250 a weaker one, so
        # that the 5th and 6th picks are 50 and 120 (lower indices first), not 250
        u = np.asarray(x, np.float64).sum(0) / d
        w[[3, 10, 77, 200]] = 3 * u
        w[[50, 120, 250]] = 2 * u
    bias = rng.standard_normal(e) * 0.1
    if learned and e >= 256:
        bias[[3, 10, 77, 200]], bias[[50, 120, 250]] = 0.05, 0.02
    return x, jnp.asarray(w, wdt), jnp.asarray(bias, jnp.float32)


@pytest.mark.parametrize("n,e,xdt,wdt,func,learned", [
    (2, 256, jnp.bfloat16, jnp.bfloat16, "sqrtsoftplus", True),  # Flash's router, with ties
    # hash routing; fp32 activations against bf16 weights (three bf16 parts); 24 experts padded to
    # 32 lanes (softmax over the real ones); two token tiles. (fp32 weights and learned routing in
    # an fp32 model: test_mechanisms.test_moe_grouped_equals_dense.)
    (20, 24, jnp.float32, jnp.bfloat16, "softmax", False),
])
def test_router_kernel_matches_reference(n, e, xdt, wdt, func, learned):
    rng = np.random.default_rng(e + n)
    k = 6 if e >= 256 else 3
    x, w, bias = _router_case(rng, n, e, 256, xdt, wdt, learned)
    idx = None if learned else jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
    opts = dict(top_k=k, func=func, norm=True, scale=1.5)
    got_w, got_i = routing.kernel(x, w, bias if learned else None, idx, **opts, interpret=True)
    want_w, want_i = routing.reference(x, w, bias if learned else None, idx, **opts)
    assert got_i.dtype == jnp.int32 and got_w.shape == (n, k)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    assert np.isfinite(np.asarray(got_w)).all() and np.abs(np.asarray(got_w)).min() > 0
    if learned and e >= 256:
        np.testing.assert_array_equal(np.asarray(got_i)[:, :6], [[3, 10, 77, 200, 50, 120]] * n)


@pytest.mark.parametrize("xdt,func,learned", [
    (jnp.bfloat16, "sqrtsoftplus", True),  # Flash's router at a batch-1 step, with ties
    (jnp.float32, "softmax", False),  # fp32 activations (three bf16 parts), hash routing
])
def test_select_on_gemv_partials_matches_reference(xdt, func, learned):
    """A batch-1 step's router: ``gemv``'s one-row product with its K split's partial sums kept, then
    ``routing.select`` adding them in the kernel: the reference's experts and weights."""
    rng = np.random.default_rng(7)
    e, k = (256, 6) if learned else (48, 3)
    x, w, bias = _router_case(rng, 1, e, 512, xdt, jnp.bfloat16, learned)
    idx = None if learned else jnp.asarray(rng.integers(0, e, (1, k)), jnp.int32)
    opts = dict(top_k=k, func=func, norm=True, scale=1.5)
    parts = gemv_many(x, (gm.Weights(w[None], None, "dense"),), ONE_GROUP, out_dtype=jnp.float32,
                      partials=(True,), config=GemvConfig(split_k=4, block_n=32))[0]
    assert parts.parts.shape[1:] == (1, e) and parts.parts.shape[0] > 1  # a K split: the kernel adds parts
    got_w, got_i = routing.select(parts, bias if learned else None, idx, **opts, interpret=True)
    want_w, want_i = routing.reference(x, w, bias if learned else None, idx, **opts)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    assert np.isfinite(np.asarray(got_w)).all() and np.abs(np.asarray(got_w)).min() > 0
    if learned:
        np.testing.assert_array_equal(np.asarray(got_i)[0], [3, 10, 77, 200, 50, 120])
    with pytest.raises(ValueError, match="partial sums"):
        routing.select(Partials(parts.parts.astype(jnp.bfloat16)), bias, None, **opts)
    with pytest.raises(ValueError, match="selection bias"):
        routing.select(parts, bias[:3] if learned else jnp.zeros(3), None, **opts)


@pytest.mark.parametrize("hash_routing", [False, True])
def test_moe_one_row_paths_launch_their_kernels_and_agree(hash_routing):
    """A one-token MoE step on the Pallas path under each ``MoE.one_row``: "xla" (the router's
    ``gemv``, the selection in XLA, the shared expert's ``gemv_swiglu``), "select" (the selection
    from ``gemv``'s partial sums in one launch), "shared" (the router and the shared expert's
    w1 / w3 in one ``gemv_many`` launch) and "apart" (the router's ``gemv`` alone, the shared
    expert's w1 / w3 in one launch of their own) and "tile" (the router's ``gemv`` alone, the shared
    expert as one more pair of the routed experts' two launches): their launches, the same experts,
    and outputs within the bf16 tolerance of the "xla" path (only the float32 sums' order differs)."""
    cfg = dataclasses.replace(config.tiny(), hidden_size=256, n_routed_experts=64, num_experts_per_tok=6,
                              moe_intermediate_size=128)
    num = Numerics(quant_sim=True, weight_format="fp8", kernels="pallas")
    moe = MoE(cfg, hash_routing, num, rngs=nnx.Rngs(3))
    if not hash_routing:
        moe.gate.bias[...] = jnp.asarray(np.random.default_rng(4).standard_normal(64) * 0.1, jnp.float32)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 1, 256)), jnp.bfloat16)
    ids = jnp.asarray([[7]], jnp.int32)
    assert moe.one_row == "apart"  # the default
    got = {}
    for path in ("xla", "select", "shared", "apart", "tile"):
        moe.one_row = path
        graphdef, state = nnx.split(moe)
        jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, ids))(state, x)
        kernels = [o[len("pallas:"):] for o in _pallas_calls(jaxpr.jaxpr) if o.startswith("pallas:")]
        routing_w, experts, _ = moe._route(x.reshape(1, -1), ids.reshape(-1))
        y = moe(x, ids)  # "shared" leaves the sum to mHC's next launch
        assert isinstance(y, ExpertRows) == (path in ("shared", "apart", "tile"))
        assert y.shape == x.shape and y.dtype == x.dtype
        got[path] = (kernels, np.asarray(routing_w), np.asarray(experts), np.asarray(total(y), np.float32))
    kernels = {path: got[path][0] for path in got}
    assert kernels["xla"][0].startswith("gemv_bf16") and "router_select" not in kernels["xla"], kernels
    assert kernels["select"][:2] == [kernels["xla"][0], "router_select"], kernels
    assert kernels["select"][2:] == kernels["xla"][1:], kernels  # the rest as before
    swiglu = [k for k in kernels["xla"] if k.startswith("gemv_fp8_q_swiglu")]
    assert len(swiglu) == 1, kernels
    assert kernels["shared"][0].startswith("gemv_bf16_fp8_q_x3") and kernels["shared"][1] == "router_select", kernels
    assert swiglu[0] not in kernels["shared"] and len(kernels["shared"]) == len(kernels["xla"]), kernels
    assert kernels["apart"][0] == kernels["select"][0], kernels  # the router's product alone
    assert kernels["apart"][1].startswith("gemv_fp8_q_x2") and kernels["apart"][2] == "router_select", kernels
    assert kernels["apart"][3:] == kernels["shared"][2:], kernels  # the shared w2 and the routed experts as "shared"
    # "tile": the router's product, the selection, then only the routed experts' launches, each
    # taking the shared expert's FP8 weights too (no gemv of the shared expert)
    assert kernels["tile"][:2] == kernels["apart"][:1] + ["router_select"], kernels
    assert not any(k.startswith("gemv") for k in kernels["tile"][2:]), kernels
    grouped = [k for k in kernels["tile"] if k.startswith("grouped_matmul")]
    assert len(grouped) == 2 and all(k.endswith("_and_fp8") for k in grouped), kernels
    assert len(kernels["tile"]) == len(kernels["apart"]) - 2, kernels
    assert moe.shared_tile(x.reshape(1, -1)) is not None
    y = moe(x, ids)
    assert y.extra is None and y.k == 7 and y.rows.shape[0] == 7 * y.stride
    want_w, want_i, want_y = got["xla"][1:]
    scale = np.abs(want_y).max()
    assert scale > 0 and np.isfinite(want_y).all()
    for path in ("select", "shared", "apart", "tile"):
        _, w, i, y = got[path]
        np.testing.assert_array_equal(i, want_i)
        np.testing.assert_allclose(w, want_w, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(y, want_y, rtol=1e-2, atol=1e-3 * scale)
    # "experts": the selection inside the routed SwiGLU's programs (no router_select), bit for bit "shared"
    moe.one_row = "experts"
    graphdef, state = nnx.split(moe)
    kernels = [o[len("pallas:"):] for o in _pallas_calls(jax.make_jaxpr(
        lambda s, x: nnx.merge(graphdef, s)(x, ids))(state, x).jaxpr) if o.startswith("pallas:")]
    routed = [k for k in kernels if k.endswith("_routed")]
    assert "router_select" not in kernels and len(routed) == 1 and "swiglu" in routed[0], kernels
    assert len(kernels) == len(got["shared"][0]) - 1, kernels
    assert isinstance(moe._route(x.reshape(1, -1), ids.reshape(-1))[0], gm.Route)
    y = moe(x, ids)
    assert isinstance(y, ExpertRows)
    np.testing.assert_array_equal(np.asarray(total(y), np.float32), got["shared"][3])
    moe.one_row = "fused"
    with pytest.raises(ValueError, match="MoE.one_row must be one of"):
        moe(x, ids)


def _weights(rng, fmt, e, d, i):
    return tuple(_random_weights(rng, s, fmt) for s in ((e, i, d), (e, d, i), (e, i, d)))


@pytest.mark.parametrize("fmt,shared_fmt,quant_sim", [("dense", None, False), ("fp4", "fp8", True)])
def test_pair_kernels_match_reference(fmt, shared_fmt, quant_sim):
    """bf16 activations; FP4 experts with an FP8 (128 x 128 blocks) shared expert as the checkpoints
    store them; the dense case without a shared expert also equals the grouped path. (fp8_k128
    experts and fp32 activations: ``test_mechanisms.test_moe_grouped_equals_dense``.)"""
    rng = np.random.default_rng(1)
    e, d, i, n, k = 8, 256, 128, 2, 3
    w1, w2, w3 = _weights(rng, fmt, e, d, i)
    shared = None if shared_fmt is None else _weights(rng, shared_fmt, 1, d, i)
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    idx = jnp.asarray([[5, 1, 5], [0, 7, 2]], jnp.int32)  # expert 5 twice
    w = jnp.asarray(rng.random((n, k)) + 0.1, jnp.float32)
    opts = dict(limit=1.0, quant_sim=quant_sim, shared=shared)
    got = np.asarray(pair_experts.kernel(x, w, idx, w1, w2, w3, **opts, interpret=True))
    want = np.asarray(pair_experts.reference(x, w, idx, w1, w2, w3, **opts))
    assert np.isfinite(got).all()
    scale = np.abs(want).max()
    assert scale > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3 * scale)
    if shared is None:
        grouped = grouped_experts(x, w, idx, w1, w2, w3, limit=1.0, quant_sim=quant_sim, impl="xla")
        np.testing.assert_allclose(want, np.asarray(grouped), rtol=1e-2, atol=1e-3 * scale)
        # the clamp is active (limit 1.0 against products of several units)
        g = np.asarray(w1.values, np.float32)[np.asarray(idx)] @ np.asarray(x, np.float32)[:, None, :, None]
        assert np.abs(g).max() > 1.0
    else:  # the shared expert's contribution is in (not trivially small)
        alone = np.asarray(pair_experts.reference(x, w, idx, w1, w2, w3, limit=1.0, quant_sim=quant_sim))
        assert np.abs(want - alone).max() > 0.05 * scale


def _pallas_calls(jaxpr) -> list[str]:
    """Names of the pallas_calls of a jaxpr (nested ones included), and the primitives outside them."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append("pallas:" + str(eqn.params["name"]))
            continue
        found.append(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _pallas_calls(sub)
    return found


def _ops(moe, tokens: int) -> list[str]:
    """The ops of a MoE layer's step of ``tokens`` tokens, traced on its abstract state."""
    graphdef, state = nnx.split(moe)
    x = SD((1, tokens, moe.gate.cfg.hidden_size), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda s, x, ids: nnx.merge(graphdef, s)(x, ids))(state, x, SD((1, tokens), jnp.int32))
    return _pallas_calls(jaxpr.jaxpr)


@pytest.mark.parametrize("hashed", [False, True])
def test_moe_decode_step_runs_as_four_kernels(hashed):
    """On the Pallas path a decode step (pairs <= PAIR_TILES_MAX) runs the router kernels and the
    pair kernels with the shared expert inside: no matmul, top-k or sort outside the kernels. More
    pairs, ``decode_max_pairs`` 0 or the XLA path keep the grouped path (a mesh too: ``decode_path``)."""
    cfg = config.tiny().replace(n_routed_experts=24, num_experts_per_tok=3)
    num = Numerics(quant_sim=True, weight_format="fp8", kernels="pallas")
    moe = nnx.eval_shape(lambda: MoE(cfg, hashed, num, rngs=nnx.Rngs(0)))
    assert moe.decode_max_pairs == 0 and "pallas:router_logits" not in _ops(moe, 5)  # opt-in
    moe.decode_max_pairs = PAIR_TILES_MAX
    ops = _ops(moe, 5)
    kernels = [o for o in ops if o.startswith("pallas:")]
    assert kernels == ["pallas:router_logits", "pallas:router_select", "pallas:pair_experts_up",
                       "pallas:pair_experts_down"], kernels
    assert not {"dot_general", "top_k", "sort", "scatter-add", "scatter_add"} & set(ops), ops
    assert ("gather" in ops) == hashed  # the hash table lookup
    grouped = "pallas:grouped_matmul_fp8_k128"  # quantised rows: the _a8 / _a8q kernels
    big = _ops(moe, 6)  # 18 pairs
    assert "pallas:router_logits" not in big and any(o.startswith(grouped) for o in big), big
    moe.decode_max_pairs = 0
    off = _ops(moe, 5)
    assert any(o.startswith(grouped) for o in off) and "pallas:pair_experts_up" not in off
    moe.decode_max_pairs = 18
    assert _ops(moe, 6) == ops  # the bound is the layer's
    moe.experts.num = dataclasses.replace(num, kernels="xla")  # the routed experts' switch
    xla = _ops(moe, 5)
    assert "pallas:router_logits" not in xla and "pallas:pair_experts_up" not in xla and "dot_general" in xla


@pytest.mark.parametrize("rows", [1, 6])
def test_shared_expert_runs_w1_and_w3_as_one_fused_kernel(rows):
    """FP8 shared expert on the Pallas path: w1 and w3 in one SwiGLU kernel, bit-identical to the
    two GEMMs it replaces (same K split, the same roundings; one row: ``gemv``, more: the grouped
    matmul); the XLA path keeps them apart."""
    cfg = config.tiny().replace(hidden_size=1024, moe_intermediate_size=256)  # w1 / w3: K split in 2
    num = Numerics(quant_sim=True, weight_format="fp8", kernels="pallas")
    shared = SharedExpert(cfg, num, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(rows), (rows, 1024), jnp.bfloat16)
    assert shared.fused(x)
    fused = shared(x)
    two = shared.w2(gm.swiglu(shared.w1(x), shared.w3(x), shared.limit).astype(x.dtype))
    assert np.isfinite(np.asarray(fused, np.float32)).all() and np.abs(np.asarray(fused, np.float32)).max() > 0
    np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(two, np.float32))
    graphdef, state = nnx.split(shared)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    kernels = [o for o in _pallas_calls(jaxpr.jaxpr) if o.startswith("pallas:")]
    # rows quantised inside the kernels: nothing else launches (one row: the multiply-add kernels)
    want = (["pallas:gemv_fp8_q_swiglu_split4", "pallas:gemv_fp8_q"] if rows == 1
            else ["pallas:grouped_matmul_fp8_a8q_swiglu_split2", "pallas:grouped_matmul_fp8_a8q"])
    assert kernels == want, kernels
    for mod in (shared.w1, shared.w2, shared.w3):
        mod.num = dataclasses.replace(num, kernels="xla")
    assert not shared.fused(x)
    np.testing.assert_allclose(np.asarray(shared(x), np.float32), np.asarray(fused, np.float32), rtol=2e-2,
                               atol=2e-2 * np.abs(np.asarray(fused, np.float32)).max())


def test_bad_inputs_are_named():
    rng = np.random.default_rng(2)
    x = jnp.ones((2, 256), jnp.bfloat16)
    w, bias = jnp.ones((16, 256), jnp.bfloat16), jnp.zeros((16,), jnp.float32)
    opts = dict(top_k=2, func="sqrtsoftplus", norm=True, scale=1.0)
    with pytest.raises(ValueError, match="either the selection bias"):
        routing.kernel(x, w, bias, jnp.zeros((2, 2), jnp.int32), **opts)
    with pytest.raises(ValueError, match="score function"):
        routing.kernel(x, w, bias, None, **dict(opts, func="relu"))
    with pytest.raises(ValueError, match="top_k"):
        routing.kernel(x, w, bias, None, **dict(opts, top_k=17))
    w1, w2, w3 = _weights(rng, "dense", 4, 256, 64)
    args = (x, jnp.ones((2, 2)), jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="quant_sim needs D and I multiples of 128"):
        pair_experts.kernel(*args, w1, w2, w3, limit=1.0, quant_sim=True)
    with pytest.raises(ValueError, match="routed weights must be"):
        pair_experts.kernel(*args, w1, w1, w3, limit=1.0, quant_sim=False)
    with pytest.raises(ValueError, match="shared expert must be one group"):
        pair_experts.kernel(*args, w1, w2, w3, limit=1.0, quant_sim=False, shared=(w1, w2, w3))


FLASH = dict(e=256, d=4096, i=2048, k=6)


def _flash_weights(fmt: str, groups: int, n: int, k: int) -> gm.Weights:
    if fmt == "fp4":
        return gm.Weights(SD((groups, n, k // 2), jnp.uint8), SD((groups, n, k // 32), jnp.uint8), "fp4")
    if fmt == "fp8":
        return gm.Weights(SD((groups, n, k), jnp.float8_e4m3fn), SD((groups, n // 128, k // 128), jnp.uint8), "fp8")
    if fmt == "fp8_k128":
        return gm.Weights(SD((groups, n, k), jnp.float8_e4m3fn), SD((groups, n, k // 128), jnp.uint8), "fp8_k128")
    return gm.Weights(SD((groups, n, k), jnp.bfloat16), None, "dense")


def _flash_layer(fmt: str, shared_fmt: str, groups: int):
    e, d, i = (groups, FLASH["d"], FLASH["i"])
    return tuple(_flash_weights(f, g, a, b) for f, g, (a, b) in ((fmt, e, (i, d)), (fmt, e, (d, i)), (fmt, e, (i, d)),
                                                                 (shared_fmt, 1, (i, d)), (shared_fmt, 1, (d, i)),
                                                                 (shared_fmt, 1, (i, d))))


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
@pytest.mark.parametrize("fmt,shared_fmt,tokens", [("fp4", "fp8", 1), ("fp8_k128", "fp8", 2), ("dense", "dense", 2)])
def test_flash_decode_step_lowers(arch, platform, fmt, shared_fmt, tokens):
    """A Flash MoE decode step (router, routed and shared experts) as the model runs it: 4 kernels."""
    n, k = tokens, FLASH["k"]
    ws = _flash_layer(fmt, shared_fmt, FLASH["e"])

    def step(x, gate, bias, w1, w2, w3, s1, s2, s3):
        w, idx = routing.kernel(x, gate, bias, None, top_k=k, func="sqrtsoftplus", norm=True, scale=1.5,
                                interpret=False)
        return pair_experts.kernel(x, w, idx, w1, w2, w3, limit=10.0, quant_sim=fmt != "dense", shared=(s1, s2, s3),
                                   out_dtype=jnp.bfloat16, interpret=False)

    text = lowering.lower(step, SD((n, FLASH["d"]), jnp.bfloat16), SD((FLASH["e"], FLASH["d"]), jnp.bfloat16),
                          SD((FLASH["e"],), jnp.float32), *ws, arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 4


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_shared_expert_as_a_tile_lowers(arch, platform):
    """A batch-1 step's experts under ``MoE.one_row`` "tile" at Flash shapes: FP8 routed experts
    (``fp8_k128``) and the FP8 shared expert as a seventh pair, in the SwiGLU (split, its halves
    activated and quantised by ``swiglu_quantise``) and w2: three Triton calls."""
    k = FLASH["k"]

    def experts(x, w, idx, w1, w2, w3, s1, s2, s3):
        rows, _ = grouped_experts(x, w, idx, w1, w2, w3, limit=10.0, quant_sim=True, impl="pallas", as_rows=True,
                                  shared=(s1, s2, s3))
        return rows

    text = lowering.lower(experts, SD((1, FLASH["d"]), jnp.bfloat16), SD((1, k), jnp.float32), SD((1, k), jnp.int32),
                          *_flash_layer("fp8_k128", "fp8", FLASH["e"]), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 3
    assert "swiglu_quantise" in text and text.count("_and_fp8") >= 2


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_one_row_router_lowers(arch, platform):
    """The batch-1 step's router at Flash shapes: gemv's partial sums, then the selection."""
    def router(x, gate, bias):
        parts = gemv_many(x, (gm.Weights(gate[None], None, "dense"),), ONE_GROUP, out_dtype=jnp.float32,
                          partials=(True,), interpret=False)[0]
        return routing.select(parts, bias, None, top_k=FLASH["k"], func="sqrtsoftplus", norm=True, scale=1.5,
                              interpret=False)

    text = lowering.lower(router, SD((1, FLASH["d"]), jnp.bfloat16), SD((FLASH["e"], FLASH["d"]), jnp.bfloat16),
                          SD((FLASH["e"],), jnp.float32), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 2 and "router_select" in text


def test_fp32_router_and_experts_lower():
    """fp32 activations (an fp32 model): the three-part router dots and IEEE fp32 dots, hash routing."""
    n, k, e, d, i = 2, 6, 256, 4096, 2048

    def step(x, gate, idx, w1, w2, w3):
        w, idx = routing.kernel(x, gate, None, idx, top_k=k, func="sqrtsoftplus", norm=True, scale=1.5,
                                interpret=False)
        return pair_experts.kernel(x, w, idx, w1, w2, w3, limit=10.0, quant_sim=False, interpret=False)

    experts = (gm.Weights(SD(s, jnp.float32), None, "dense") for s in ((e, i, d), (e, d, i), (e, i, d)))
    with jax.default_matmul_precision("highest"):
        text = lowering.lower(step, SD((n, d), jnp.float32), SD((e, d), jnp.bfloat16), SD((n, k), jnp.int32), *experts)
    assert lowering.count_triton_calls(text) == 4


def test_one_token_swiglu_unsplit_takes_one_launch_fewer(monkeypatch):
    """``grouped_matmul.ONE_TOKEN_SWIGLU_BLOCK_N``: a decode step's routed SwiGLU (``fp8_k128``, one
    16-row tile per pair, K split by default) unsplit in narrow column tiles, w2's programs
    quantising its rows (``QuantRows``): no ``swiglu_quantise`` launch, w2 as the ``_a8q`` kernel,
    and the layer's output bit for bit that of the unsplit SwiGLU quantised by ``ActQuant.of``; both
    paths within the reference's tolerance of the XLA path."""
    rng = np.random.default_rng(5)
    e, d, i = 8, 1024, 256
    w1, w2, w3 = _weights(rng, "fp8_k128", e, d, i)
    x = jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16)
    idx = jnp.asarray([[5, 1, 6, 0, 3, 2]], jnp.int32)
    w = jnp.asarray(rng.random((1, 6)) + 0.1, jnp.float32)
    run = lambda: jax.jit(lambda x, w: grouped_experts(x, w, idx, w1, w2, w3, limit=1.0, quant_sim=True,  # noqa: E731
                                                        impl="pallas", as_rows=False))(x, w)
    launches = lambda: [o for o in _pallas_calls(jax.make_jaxpr(  # noqa: E731
        lambda x, w: grouped_experts(x, w, idx, w1, w2, w3, limit=1.0, quant_sim=True, impl="pallas"))(x, w).jaxpr)
        if o.startswith("pallas:")]
    assert launches() == ["pallas:grouped_matmul_fp8_k128_a8_swiglu_split2", "pallas:swiglu_quantise",
                          "pallas:grouped_matmul_fp8_k128_a8"]
    split = np.asarray(run())
    monkeypatch.setattr(gm, "ONE_TOKEN_SWIGLU_BLOCK_N", 32)
    assert launches() == ["pallas:grouped_matmul_fp8_k128_a8_swiglu", "pallas:grouped_matmul_fp8_k128_a8q"]
    got = np.asarray(run())
    # the same products unsplit, quantised by XLA (ActQuant) instead of by w2's programs
    tiles = pair_tiles(idx, 16)
    pair = tiles.pair_of_row
    rows = gm.quantised_rows(jnp.where(pair[:, None] >= 0, x[jnp.maximum(pair, 0) // 6], 0), 16)
    rw = jnp.where(pair >= 0, w.reshape(-1)[jnp.maximum(pair, 0)], 0.0)
    meta = (tiles.tile_group, tiles.num_tiles)
    cfg = gm.GemmConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)
    h = gm.swiglu_kernel(rows, w1, w3, rw, *meta, block_m=16, limit=1.0, config=cfg, interpret=True)
    y = gm.kernel(gm.ActQuant.of(h), w2, *meta, block_m=16, interpret=True)
    want = np.asarray(jnp.sum(y[tiles.row_of_pair].reshape(1, 6, -1).astype(jnp.float32), axis=1))
    np.testing.assert_array_equal(got, want)
    ref = np.asarray(grouped_experts(x, w, idx, w1, w2, w3, limit=1.0, quant_sim=True, impl="xla"))
    scale = np.abs(ref).max()
    assert np.isfinite(got).all() and scale > 0.1
    for out in (got, split):
        np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("learned", [True, False])
@pytest.mark.parametrize("unsplit", [0, 32])
def test_routing_decided_in_the_swiglu_programs(monkeypatch, learned, unsplit):
    """``grouped_matmul.Route``: a decode step's selection decided by each routed SwiGLU program for
    its own pair (``routing.select_rows``) gives bit for bit the experts' output of the selection's
    own launch (``routing.select``), with the K split's ``swiglu_quantise`` taking the row weights
    the programs decided, and unsplit (``ONE_TOKEN_SWIGLU_BLOCK_N``); the XLA path refuses it."""
    monkeypatch.setattr(gm, "ONE_TOKEN_SWIGLU_BLOCK_N", unsplit)
    rng = np.random.default_rng(11)
    e, d, i, k = 64, 1024, 256, 6
    w1, w2, w3 = _weights(rng, "fp8_k128", e, d, i)
    x = jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16)
    logits = Partials(jnp.asarray(rng.standard_normal((4, 1, e)), jnp.float32))
    bias = jnp.asarray(rng.standard_normal(e) * 0.1, jnp.float32)
    given = jnp.asarray([[9, 2, 63, 2, 40, 17]], jnp.int32)  # (hash routing may pick an expert twice)
    opts = dict(top_k=k, func="sqrtsoftplus", norm=True, scale=1.5)
    sel_w, sel_i = routing.select(logits, bias if learned else None, None if learned else given, **opts,
                                  interpret=True)
    route = gm.Route(logits.parts.reshape(4, e), bias if learned else given, n=1, k=k, func="sqrtsoftplus",
                     norm=True, scale=1.5)
    run = lambda w, idx: grouped_experts(x, w, idx, w1, w2, w3, limit=1.0, quant_sim=True,  # noqa: E731
                                         impl="pallas", as_rows=True)
    want, bm = run(sel_w, sel_i)
    got, bm2 = run(route, None)
    assert bm == bm2 == 16 and np.abs(np.asarray(want, np.float32)).max() > 0.1
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    names = [o for o in _pallas_calls(jax.make_jaxpr(lambda: run(route, None)[0])().jaxpr) if o.startswith("pallas:")]
    assert names[0].endswith("_routed") and ("pallas:swiglu_quantise" in names) == (unsplit == 0), names
    with pytest.raises(ValueError, match="Route"):
        grouped_experts(x, route, None, w1, w2, w3, limit=1.0, quant_sim=True, impl="xla")
