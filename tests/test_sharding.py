"""Sharding rules and sharded loading on 8 virtual CPU devices."""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dspark_jax
from dspark_jax import config, sharding
from dspark_jax.cache import init_cache
from dspark_jax.checkpoint import hf
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4
from dspark_jax.model.dspark import init_draft_cache
from tests.checkpoint_helpers import flat_params, random_model
from tests.helpers import pallas_calls


def _abstract(cfg, weight_format="dense"):
    return nnx.eval_shape(lambda: DeepSeekV4(cfg, Numerics(weight_format=weight_format), rngs=nnx.Rngs(0)))


def _specs(cfg, mesh, weight_format="dense"):
    return {p: s.spec for p, s in sharding.param_shardings(_abstract(cfg, weight_format), cfg, mesh).items()}


def test_rules_for_real_dimensions():
    assert len(jax.devices()) == 8
    cfg = config.flash_slice(4)  # real Flash widths: window-only, C4 + indexer and C128 layers + DSpark
    specs = _specs(cfg, sharding.make_mesh(), "official")  # FP8 linears and FP4 experts with their scales
    model = "model"
    expect = {
        "embed.weight": P(model), "head.weight": P(model),
        "layers.2.attn.wq_b.weight": P(model), "layers.2.attn.wq_b.scale": P(model),
        "layers.2.attn.attn_sink": P(model),
        "layers.2.attn.wo_a.weight": P(model), "layers.2.attn.wo_a.scale": P(model),
        "layers.2.attn.wo_b.weight": P(None, model), "layers.2.attn.wo_b.scale": P(None, model),
        "layers.2.attn.indexer.wq_b.weight": P(model), "layers.2.attn.indexer.wq_b.scale": P(model),
        "layers.2.attn.indexer.weights_proj.weight": P(model),
        "layers.3.ffn.experts.w1": P(model), "layers.3.ffn.experts.w1_scale": P(model),
        "layers.3.ffn.experts.w2": P(model), "layers.3.ffn.experts.w2_scale": P(model),
        "layers.3.ffn.shared_experts.w3.weight": P(model), "layers.3.ffn.shared_experts.w3.scale": P(model),
        "layers.3.ffn.shared_experts.w2.weight": P(None, model), "layers.3.ffn.shared_experts.w2.scale": P(None, model),
        "mtp.2.markov_head.markov_w2.weight": P(model), "mtp.2.ffn.experts.w3_scale": P(model),
        # small or shared tensors stay replicated
        "layers.2.attn.wq_a.weight": P(), "layers.2.attn.wq_a.scale": P(), "layers.2.attn.wkv.weight": P(),
        "layers.2.attn.kv_norm.weight": P(),
        "layers.2.attn.compressor.wkv.weight": P(), "layers.2.attn.compressor.ape": P(),
        "layers.3.ffn.gate.weight": P(), "layers.3.ffn.gate.bias": P(), "layers.0.ffn.gate.tid2eid": P(),
        "layers.0.hc_attn_fn": P(), "hc_head_fn": P(), "mtp.0.main_proj.weight": P(), "mtp.0.main_proj.scale": P(),
        "mtp.2.confidence_head.proj.weight": P(),
    }
    for path, spec in expect.items():
        assert specs[path] == spec, (path, specs[path], spec)
    # 6 devices divide none of 64 heads, 8 groups, 256 experts, 2048 ffn rows or 129280 vocab rows
    six = _specs(cfg, sharding.make_mesh(model=6, devices=jax.devices()[:6]))
    assert all(s == P() for s in six.values())
    # (data, model) meshes: experts over every device, the rest over model; size-1 axes left out
    two_four = _specs(cfg, sharding.make_mesh(model=4, data=2), "official")
    assert two_four["layers.2.attn.wq_b.weight"] == P(model) and two_four["layers.2.attn.wo_b.weight"] == P(None, model)
    assert two_four["layers.3.ffn.experts.w1"] == P(("data", model)) == two_four["layers.3.ffn.experts.w1_scale"]
    eight_one = _specs(cfg, sharding.make_mesh(model=1, data=8), "official")
    assert eight_one["layers.3.ffn.experts.w2"] == P("data") and eight_one["layers.2.attn.wq_b.weight"] == P()


def test_unknown_paths_raise():
    cfg = config.tiny()
    mesh = sharding.make_mesh()
    with pytest.raises(sharding.UnknownPathError, match=r"layers\.0\.attn\.new_proj\.weight"):
        sharding.partition_spec("layers.0.attn.new_proj.weight", (8, 8), cfg, mesh)
    with pytest.raises(sharding.UnknownPathError, match=r"cache\.layers\.0\.extra"):
        sharding.state_shardings({"cache": {"layers": [{"extra": jnp.zeros((2, 3))}]}}, mesh)
    state = nnx.state(_abstract(cfg, "official"))
    flat = nnx.to_flat_state(state)
    orphan = [(k, v) for k, v in flat if ".".join(map(str, k)) != "layers.1.attn.wq_b.weight"]
    with pytest.raises(sharding.UnknownPathError, match=r"scale 'layers\.1\.attn\.wq_b\.scale' has no weight"):
        sharding.param_shardings(nnx.from_flat_state(orphan), cfg, mesh)


def test_scales_split_only_in_whole_blocks():
    """A weight dim is split only where every shard holds whole 128-row scale blocks."""
    cfg = config.tiny()  # 4 heads of 128 rows: wq_b [512, 128] with scales [4, 1]
    four = sharding.make_mesh(model=4, devices=jax.devices()[:4])
    path = "layers.0.attn.wq_b.weight"
    assert sharding.partition_spec(path, (512, 128), cfg, four, scale_shape=(4, 1)) == P("model")
    # 64-row heads: one scale block spans two heads, so 4 shards of one head each cannot hold whole blocks
    assert sharding.partition_spec(path, (256, 128), cfg, four, scale_shape=(2, 1)) == P()
    assert sharding.partition_spec(path, (256, 128), cfg, four) == P("model")  # unquantised: whole heads suffice


@pytest.mark.parametrize("data, model", [(1, 8), (2, 4), (8, 1)])
def test_flash_scale_shards_describe_their_weight_shards(data, model):
    """On every device of each mesh, each FP8 / FP4 scale shard covers exactly the blocks of its weight shard."""
    cfg = config.flash_slice(4)
    mesh = sharding.make_mesh(model=model, data=data)
    abstract = _abstract(cfg, "official")
    shardings = sharding.param_shardings(abstract, cfg, mesh)
    shapes = {".".join(map(str, k)): tuple(v.shape) for k, v in nnx.to_flat_state(nnx.state(abstract))}
    n_scales = n_split = 0
    for path, sh in shardings.items():
        weight = sharding.weight_of(path)
        if weight is None:
            continue
        n_scales += 1
        w_shape, s_shape = shapes[weight], shapes[path]
        w_idx, s_idx = shardings[weight].devices_indices_map(w_shape), sh.devices_indices_map(s_shape)
        for device in mesh.devices.flat:
            for dim, (w_n, s_n, ws, ss) in enumerate(zip(w_shape, s_shape, w_idx[device], s_idx[device])):
                w_rows, s_rows = range(w_n)[ws], range(s_n)[ss]
                if len(w_rows) == w_n:
                    assert len(s_rows) == s_n, (path, dim)  # an unsplit weight dim has an unsplit scale dim
                    continue
                n_split += 1
                block = -(-w_n // s_n)
                assert s_rows.start * block == w_rows.start and min(s_rows.stop * block, w_n) == w_rows.stop, \
                    (path, dim, device, w_rows, s_rows)
    assert n_scales > 50 and n_split > 0


_GB = 1e9
H200, MI355X = 141 * _GB, 288 * _GB


def test_flash_every_leaf_has_a_rule_and_fits_one_gpu_per_device():
    """DeepSeek-V4-Flash with its checkpoint's FP4 experts and FP8 linears, plus caches of 64
    requests x 65,536 tokens (fp8 KV pools, drafter rings): every leaf has a rule, no replicated
    array is large, and what one device holds fits one H200 and one MI355X on 8 devices."""
    cfg = config.flash()
    abstract = _abstract(cfg, "official")
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(abstract))}
    n_req, ctx = 64, 65536
    caches = jax.eval_shape(lambda: {"cache": init_cache(cfg, n_req, ctx, jnp.bfloat16, kv_layout="fp8"),
                                     "draft": init_draft_cache(cfg, n_req)})
    nbytes = lambda x: math.prod(x.shape) * jnp.dtype(x.dtype).itemsize  # noqa: E731
    total_w = sum(nbytes(v) for v in flat.values())
    experts = sum(nbytes(v) for p, v in flat.items() if ".ffn.experts." in p)
    total_c = sum(nbytes(x) for x in jax.tree_util.tree_leaves(caches))
    print(f"\nFlash: weights {total_w / _GB:.1f} GB (routed experts {experts / _GB:.1f}), caches of {n_req} x {ctx} "
          f"tokens {total_c / _GB:.1f} GB")
    for data, model in [(1, 8), (2, 4), (8, 1)]:
        mesh = sharding.make_mesh(model=model, data=data)
        shardings = sharding.param_shardings(abstract, cfg, mesh)  # raises on a path without a rule
        assert shardings.keys() == flat.keys()
        cache_shardings = sharding.state_shardings(caches, mesh)  # raises on a leaf without a rule
        for x, sh in zip(jax.tree_util.tree_leaves(caches), jax.tree_util.tree_leaves(cache_shardings)):
            assert sh.spec == (P("data") if data > 1 else P()), sh.spec  # by request over data, replicated over model
        if model == 8:  # nothing large is replicated over the model axis
            big = [p for p, v in flat.items() if shardings[p].spec == P() and nbytes(v) > 64 * 2**20]
            assert not big, big
        w = sharding.shard_bytes(abstract, shardings)
        w_experts = sum(math.prod(shardings[p].shard_shape(tuple(v.shape))) * jnp.dtype(v.dtype).itemsize
                        for p, v in flat.items() if ".ffn.experts." in p)
        c = sharding.shard_bytes(caches, cache_shardings)
        print(f"mesh (data={data}, model={model}): {(w + c) / _GB:.1f} GB per device = weights {w / _GB:.1f} "
              f"(routed experts {w_experts / _GB:.1f}) + caches {c / _GB:.1f}")
        assert w_experts * 8 == experts  # routed experts (and their scales) over all 8 devices
        assert w - w_experts <= (total_w - experts) * (0.3 if model == 8 else 1)  # heads, vocab, ffn over model
        assert c == total_c // data
        assert w + c < H200 < MI355X


def test_mesh_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(model=16)
    with pytest.raises(ValueError, match="divisor"):
        sharding.make_mesh(data=3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("shard") / "tiny")
    hf.save_official(random_model(config.tiny(), seed=5), path, encoding="official")
    return path


@pytest.mark.parametrize("model_axis, data_axis", [(8, 1), (4, 2)])
def test_sharded_load_equals_unsharded(tiny_dir, model_axis, data_axis):
    mesh = sharding.make_mesh(model=model_axis, data=data_axis)
    # plain fp32 math: with quant_sim, fp8 rounding would amplify the last-bit differences of
    # sharded reductions (the sharded forward is checked, not the quantisation)
    plain = dspark_jax.load(tiny_dir, dtype=jnp.float32, quant_sim=False, progress=False)
    sharded = dspark_jax.load(tiny_dir, dtype=jnp.float32, quant_sim=False, progress=False, mesh=mesh)
    want = sharding.param_shardings(sharded.module, sharded.config, mesh)
    a, b = flat_params(plain), flat_params(sharded)
    for k, var in nnx.to_flat_state(nnx.state(sharded.module)):
        path = ".".join(map(str, k))
        assert var[...].sharding == want[path], path
        np.testing.assert_array_equal(b[path], a[path], err_msg=path)
    heads = "model" if 4 % model_axis == 0 else None  # tiny has 4 heads: sharded on 4 devices, not on 8
    assert want["layers.1.attn.wq_b.weight"].spec == (P(heads) if heads else P())
    experts = P("model") if data_axis == 1 else P(("data", "model"))  # over every device
    assert want["layers.1.ffn.experts.w1"].spec == experts and want["embed.weight"].spec == P("model")
    if model_axis == 8:  # one forward is enough to show that XLA runs the sharded model (compile time)
        ids = np.random.default_rng(0).integers(0, plain.config.vocab_size, (2, 140))  # > one C128 window
        ref = np.asarray(plain.logits(ids))
        got = sharded.logits(ids)
        assert len(got.sharding.device_set) == 8
        np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_shard_model_moves_a_loaded_model(tiny_dir):
    mesh = sharding.make_mesh()
    plain = dspark_jax.load(tiny_dir, dtype=jnp.float32, progress=False)
    moved = sharding.shard_model(plain, mesh)
    spec = {".".join(map(str, k)): v[...].sharding.spec for k, v in nnx.to_flat_state(nnx.state(moved.module))}
    assert spec["head.weight"] == P("model") and spec["layers.0.ffn.experts.w3"] == P("model")
    a, b = flat_params(plain), flat_params(moved)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def small_model():
    """The expert-parallel check config (32 experts: ragged MoE; Pallas kernels in interpret mode)."""
    from benchmarks import sharded

    return sharded.small_model()


@pytest.fixture(scope="module")
def small_ep(small_model):
    """``small_model``, its check inputs (8 requests of ragged lengths) and its unsharded results
    (``sharded.run_check``)."""
    from benchmarks import sharded

    ids, n_prompt = sharded.check_inputs(small_model.config.vocab_size)
    return small_model, ids, n_prompt, sharded.run_check(small_model, ids, n_prompt)


def test_kernels_run_per_device(small_model):
    """On a mesh every Pallas kernel of a prefill + verify + draft step (ragged attention over the
    window, the C4 entries and the drafter's ring, fp8 KV writes, grouped matmuls of the routed
    experts) sits inside a ``shard_map``, i.e. runs on its device's shard; on one device none does."""
    from benchmarks import sharded

    ids, n_prompt = sharded.check_inputs(small_model.config.vocab_size)

    def kernels(model):
        cache = init_cache(model.config, ids.shape[0], sharded.MAX_LEN, jnp.float32, kv_layout="fp8")
        draft = init_draft_cache(model.config, ids.shape[0], jnp.float32)
        jaxpr = jax.make_jaxpr(sharded._prefill_and_verify, static_argnums=0)(
            model.graphdef, model.state, ids, n_prompt, cache, draft)
        return [inside for _, inside in pallas_calls(jaxpr.jaxpr)]

    plain = kernels(small_model)
    assert len(plain) >= 8 and not any(plain)  # 2 ragged attentions, 2 x 2 fp8 writes, 3 x 2 grouped matmuls
    assert all(kernels(sharding.shard_model(small_model, sharding.make_mesh(model=4, data=2))))


# Every mesh shares one model and its unsharded reference. (1, 8) splits heads, vocab and experts
# over model; (2, 4) requests over data, heads / vocab over model, experts over both; (8, 1)
# requests and experts over data.
@pytest.mark.slow
@pytest.mark.parametrize("data, model", [(1, 8), (2, 4), (8, 1)])
def test_sharded_equals_unsharded_with_ragged_moe_and_kernels(small_ep, data, model):
    from benchmarks import sharded

    plain, ids, n_prompt, want = small_ep
    assert plain.module.layers[0].ffn.impl == "grouped" and plain.numerics.kernels == "pallas"
    m = sharding.shard_model(plain, sharding.make_mesh(model=model, data=data))
    experts = P("model") if data == 1 else P("data") if model == 1 else P(("data", "model"))
    assert m.state["layers"][0]["ffn"]["experts"]["w1"][...].sharding.spec == experts
    assert all(layer.ffn.experts.mesh is not None for layer in (*m.module.layers, *m.module.mtp))  # shard_map path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sharded.run_check(m, ids, n_prompt)
    # fp32 math; sharded reductions differ from unsharded ones in the last bits only
    for name in ("prefill", "verify", "draft"):
        a, b = getattr(got, name), getattr(want, name)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(), err_msg=name)
    assert got.tokens == want.tokens and all(len(t) == 6 for t in want.tokens)
    if data == 2:  # ragged verify rounds (packed tokens, per-device attention by cu_q_lens): the same tokens
        assert sharded.run_check(m, ids, n_prompt, ragged=True).tokens == want.tokens

    # the state stays on its layout round after round, and the donated buffers are reused
    mesh = sharding.model_mesh(m)
    for x, sh in zip(jax.tree_util.tree_leaves(got.state),
                     jax.tree_util.tree_leaves(sharding.state_shardings(got.state, mesh))):
        assert x.sharding.is_equivalent_to(sh, x.ndim), (x.shape, x.sharding, sh)
    assert got.state.cache.layers[0].window.sharding.spec == (P("data") if data > 1 else P())
    assert not [w for w in caught if "donated" in str(w.message)], [str(w.message) for w in caught]

    # the round's collectives: the experts' token exchange; no expert weight or cache array
    # gathered (identified by the dims of its shard, or of the whole array)
    found = sharded.collectives(got.round_hlo)
    assert bool(found["reduce-scatter"]) == (data > 1), found  # MoE outputs back to their requests
    assert found["all-reduce"] or model == 1, found
    arrays = sharded.forbidden_arrays(m, got.state)
    n_caches = 8 if data > 1 else 0  # window; compressor and indexer kv, score, entries; drafter ring
    assert len(arrays) == 2 * 3 + n_caches, [(a.shape, a.sharding.spec) for a in arrays]  # + w1, w2, w3 x 2
    assert not sharded.gathers_of(got.round_hlo, arrays), found["all-gather"]


@pytest.mark.parametrize("data, model", [(1, 8), (2, 4), (8, 1)])
def test_expert_parallel_moe_moves_tokens_not_experts(data, model):
    """One grouped MoE layer (32 FP4 experts with their scales, as in the checkpoint) on each mesh,
    8 requests split over data as the activations are: the same output as on one device, and its
    compiled HLO holds exactly the token exchange of ``moe.expert_parallel``: an all-gather of the
    tokens and their routing over data and a reduce-scatter of the outputs back to them, an
    all-reduce of the outputs over model; no expert weight moves."""
    from benchmarks import sharded

    cfg = sharded.small_config()
    num = Numerics(dtype=jnp.float32, param_dtype=jnp.float32, weight_format="official", kernels="xla")
    plain = dspark_jax.Model(DeepSeekV4(cfg, num, rngs=nnx.Rngs(1)))
    assert plain.module.layers[0].ffn.impl == "grouped"
    mesh = sharding.make_mesh(model=model, data=data)
    m = sharding.shard_model(plain, mesh)
    assert m.module.layers[0].ffn.experts.mesh is not None and plain.module.layers[0].ffn.experts.mesh is None

    @functools.partial(jax.jit, static_argnames="graphdef")
    def moe(graphdef, state, x, ids):
        return nnx.merge(graphdef, state).layers[0].ffn(x, ids)

    rng = np.random.default_rng(0)
    b, t, d, k = 8, 4, cfg.hidden_size, cfg.num_experts_per_tok
    x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    want = np.asarray(moe(plain.graphdef, plain.state, x, ids))
    requests = jax.sharding.NamedSharding(mesh, P(sharding.batch_axes(b, mesh)))
    x, ids = jax.device_put(x, requests), jax.device_put(ids, requests)
    got = moe(m.graphdef, m.state, x, ids)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert got.sharding.is_equivalent_to(requests, 3)  # back on the requests' devices

    found = sharded.collectives(moe.lower(m.graphdef, m.state, x, ids).compile().as_text())
    size = lambda kind: [sharded.result_bytes(item.rsplit(" ", 1)[0]) for item in found[kind]]  # noqa: E731
    w1 = m.module.layers[0].ffn.experts.w1[...]
    assert w1.sharding.spec != P() and w1.dtype == jnp.uint8  # packed FP4, split over the devices
    n = b * t
    tokens = [n * d * 4, n * k * 4, n * k * 4]  # f32 x, f32 routing weights, s32 expert ids
    assert sorted(size("all-gather")) == ([] if data == 1 else sorted(tokens)), found
    assert sum(tokens) < w1.nbytes // 8  # less than one device's share of one expert matrix
    assert size("reduce-scatter") == ([] if data == 1 else [n // data * d * 4]), found
    assert size("all-reduce") == ([] if model == 1 else [n // data * d * 4]), found
    assert not found["all-to-all"] and not found["collective-permute"], found


def test_fp8_linears_run_per_device():
    """The checkpoint's FP8 linears (e4m3 codes, 128 x 128 block scales) through the Pallas FP8
    GEMM (interpret mode) on a (2, 4) mesh: every kernel runs per device on its shard (column-
    parallel wq_b, row-parallel wo_b, wo_a's grouped GEMM on the device's output groups, wq_a /
    wkv on the device's requests), the logits equal one device's, and the compiled program
    gathers none of their weights or scales."""
    from benchmarks import sharded
    from dspark_jax.api import forward_step

    cfg = sharded.small_config().replace(o_groups=4, o_lora_rank=128)  # wo_a: 4 groups of 128 rows
    plain = sharded.small_model(weight_format="official", cfg=cfg)
    m = sharding.shard_model(plain, sharding.make_mesh(model=4, data=2))
    attn = m.module.layers[0].attn
    assert attn.wq_b.quantized and attn.wq_b.weight[...].dtype == jnp.float8_e4m3fn
    assert (attn.wq_b.spec, attn.wo_a.spec, attn.wo_b.spec, attn.wq_a.spec) == (P("model"), P("model"),
                                                                                P(None, "model"), P())
    ids = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (8, 6)), jnp.int32)
    n = jnp.full((8,), 6, jnp.int32)

    def args(model):
        return model.graphdef, model.state, ids, n, init_cache(cfg, 8, 8, jnp.float32)

    calls = pallas_calls(jax.make_jaxpr(forward_step, static_argnums=0)(*args(m)).jaxpr)
    assert sum(name == "grouped_matmul_fp8" for name, _ in calls) == 9, calls  # the layer's FP8 linears
    assert all(inside for _, inside in calls), calls
    want = np.asarray(forward_step(*args(plain))[0])
    compiled = forward_step.lower(*args(m)).compile()
    got = np.asarray(compiled(*args(m)[1:])[0])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    found = sharded.collectives(compiled.as_text())
    assert found["all-reduce"], found  # wo_b's psum over model
    linears = (attn.wq_b, attn.wo_a, attn.wo_b, attn.indexer.wq_b)
    split = [v.get_value() for lin in linears for v in (lin.weight, lin.scale)]
    assert all(w.sharding.spec != P() for w in split)
    assert not sharded.gathers_of(compiled.as_text(), split), found["all-gather"]
