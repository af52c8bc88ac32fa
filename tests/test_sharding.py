"""Sharding rules and sharded loading on 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dspark_jax
from dspark_jax import config, sharding
from dspark_jax.checkpoint import hf
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4
from tests.checkpoint_helpers import flat_params, random_model


def _specs(cfg, mesh):
    abstract = nnx.eval_shape(lambda: DeepSeekV4(cfg, Numerics(), rngs=nnx.Rngs(0)))
    return {p: s.spec for p, s in sharding.param_shardings(abstract, cfg, mesh).items()}


def test_rules_for_real_dimensions():
    assert len(jax.devices()) == 8
    cfg = config.flash_slice(4)  # real Flash widths: window-only, C4 + indexer and C128 layers + DSpark
    specs = _specs(cfg, sharding.make_mesh())
    model = "model"
    expect = {
        "embed.weight": P(model), "head.weight": P(model),
        "layers.2.attn.wq_b.weight": P(model), "layers.2.attn.attn_sink": P(model),
        "layers.2.attn.wo_a.weight": P(model), "layers.2.attn.wo_b.weight": P(None, model),
        "layers.2.attn.indexer.wq_b.weight": P(model), "layers.2.attn.indexer.weights_proj.weight": P(model),
        "layers.3.ffn.experts.w1": P(model), "layers.3.ffn.experts.w2": P(model),
        "layers.3.ffn.shared_experts.w3.weight": P(model), "layers.3.ffn.shared_experts.w2.weight": P(None, model),
        "mtp.2.markov_head.markov_w2.weight": P(model),
        # small or shared tensors stay replicated
        "layers.2.attn.wq_a.weight": P(), "layers.2.attn.wkv.weight": P(), "layers.2.attn.kv_norm.weight": P(),
        "layers.2.attn.compressor.wkv.weight": P(), "layers.2.attn.compressor.ape": P(),
        "layers.3.ffn.gate.weight": P(), "layers.3.ffn.gate.bias": P(), "layers.0.ffn.gate.tid2eid": P(),
        "layers.0.hc_attn_fn": P(), "hc_head_fn": P(), "mtp.0.main_proj.weight": P(),
        "mtp.2.confidence_head.proj.weight": P(),
    }
    for path, spec in expect.items():
        assert specs[path] == spec, (path, specs[path], spec)
    # 6 devices divide none of 64 heads, 8 groups, 256 experts, 2048 ffn rows or 129280 vocab rows
    six = _specs(cfg, sharding.make_mesh(model=6, devices=jax.devices()[:6]))
    assert all(s == P() for s in six.values())
    # a (data, model) mesh shards over the model axis only
    two_four = _specs(cfg, sharding.make_mesh(model=4, data=2))
    assert two_four["layers.2.attn.wq_b.weight"] == P(model) and two_four["layers.2.attn.wo_b.weight"] == P(None, model)


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
    assert want["layers.1.ffn.experts.w1"].spec == P("model") and want["embed.weight"].spec == P("model")
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
