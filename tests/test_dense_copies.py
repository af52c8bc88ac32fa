"""Dense copies of the FP8 linears (``dspark_jax.with_dense_copies``): the same values as the FP8
weights, calls of many rows through XLA's GEMM on the copies, decode-sized calls through the kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dspark_jax
from dspark_jax import config, memory, sharding
from dspark_jax.api import forward_step
from dspark_jax.cache import init_cache
from dspark_jax.checkpoint import hf, orbax
from dspark_jax.model import common
from dspark_jax.model.common import Linear, Numerics
from dspark_jax.model.moe import SharedExpert
from tests.helpers import pallas_calls


def _linears(model) -> list[Linear]:
    return [m for _, m in nnx.iter_modules(model.module) if isinstance(m, Linear) and m.quantized]


def _paths(model) -> set[str]:
    return {".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(model.module))}


@pytest.fixture(scope="module")
def fp8_pair():
    """The shipped model's dims with the checkpoint's FP8 linears (XLA path on the CPU), and the
    same model with dense copies."""
    model = dspark_jax.init(config.tiny(), 5, dtype=jnp.bfloat16, weight_format="official", quant_sim=True)
    return model, dspark_jax.with_dense_copies(model)


def test_copies_hold_the_dequantised_weights_and_cost_their_bytes(fp8_pair):
    plain, copied = fp8_pair
    lins = _linears(copied)
    assert lins and all(lin.weight_copy is not None for lin in lins)
    assert all(lin.weight_copy is None for lin in _linears(plain))  # the original is unchanged
    for lin in lins[:4]:
        want = np.asarray(common.gm.dequantize(lin.grouped_weights(), jnp.float32)[0])
        got = np.asarray(lin.weight_copy[...], np.float32)
        assert lin.weight_copy[...].dtype == jnp.bfloat16 and np.abs(want).max() > 0
        np.testing.assert_array_equal(got, want)  # exact: e4m3 times a power of two is a bf16 number
    extra = sum(lin.weight[...].size * 2 for lin in lins)
    assert copied.weight_bytes == plain.weight_bytes + extra
    planned = memory.weight_bytes(plain.config, "official", dense_copies=True)  # the memory planner's count
    assert planned.pop("dense_copies") == extra and sum(planned.values()) == plain.weight_bytes


def test_copies_change_no_logit(fp8_pair):
    plain, copied = fp8_pair
    ids = np.random.default_rng(0).integers(0, plain.config.vocab_size, (2, 40))
    np.testing.assert_array_equal(np.asarray(copied.logits(ids)), np.asarray(plain.logits(ids)))


def test_copies_are_not_saved(fp8_pair, tmp_path):
    plain, copied = fp8_pair
    assert any(p.endswith(".weight_copy") for p in _paths(copied))
    assert hf.official_names(copied.module) == hf.official_names(plain.module)
    orbax.save(copied, tmp_path / "ckpt")
    back = orbax.restore(tmp_path / "ckpt")
    assert _paths(back) == _paths(plain)


@pytest.mark.parametrize("rows", [common.DENSE_COPY_MIN_ROWS - 1, common.DENSE_COPY_MIN_ROWS])
def test_wide_calls_take_the_copy_narrow_ones_the_kernel(rows):
    """Pallas path (interpret mode): below ``DENSE_COPY_MIN_ROWS`` rows a linear with a copy runs
    the FP8 kernel, bit-identical to the same linear without one; from there on it runs XLA's GEMM
    on the copy (no kernel), bit-identical to the XLA reference path, and the shared expert leaves
    its fused SwiGLU kernel for the same reason."""
    num = Numerics(quant_sim=True, weight_format="fp8", kernels="pallas")
    lin = Linear(256, 384, num, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(rows), (rows, 256), jnp.bfloat16)
    kernel = np.asarray(lin(x), np.float32)
    lin.num = Numerics(quant_sim=True, weight_format="fp8", kernels="xla")
    reference = np.asarray(lin(x), np.float32)
    lin.num = num
    lin.keep_dense_copy()
    wide = rows >= common.DENSE_COPY_MIN_ROWS
    assert lin.runs_kernel(x) is not wide
    got = np.asarray(lin(x), np.float32)
    assert np.abs(got).max() > 0
    np.testing.assert_array_equal(got, reference if wide else kernel)
    graphdef, state = nnx.split(lin)
    calls = pallas_calls(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x).jaxpr)
    assert (calls == []) if wide else calls, calls

    cfg = config.tiny().replace(hidden_size=256, moe_intermediate_size=128)
    shared = SharedExpert(cfg, num, rngs=nnx.Rngs(2))
    for w in (shared.w1, shared.w2, shared.w3):
        w.keep_dense_copy()
    assert shared.fused(x) is not wide


def test_copies_are_placed_like_their_weights_and_run_per_device(monkeypatch):
    """On a (2, 4) mesh every copy has its weight's spec, the linears multiply by their local
    copies (no FP8 kernel, no weight gathered) and the logits equal one device's."""
    from benchmarks import sharded

    monkeypatch.setattr(common, "DENSE_COPY_MIN_ROWS", 1)  # every call takes the copies
    cfg = sharded.small_config().replace(o_groups=4, o_lora_rank=128)
    plain = sharded.small_model(weight_format="official", cfg=cfg)
    m = sharding.shard_model(dspark_jax.with_dense_copies(plain), sharding.make_mesh(model=4, data=2))
    attn = m.module.layers[0].attn
    for lin in (attn.wq_b, attn.wo_a, attn.wo_b, attn.wq_a):
        assert lin.weight_copy[...].sharding.spec == lin.weight[...].sharding.spec
    assert attn.wq_b.weight_copy[...].sharding.spec == P("model")
    ids = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (8, 6)), jnp.int32)
    n = jnp.full((8,), 6, jnp.int32)

    def args(model):
        return model.graphdef, model.state, ids, n, init_cache(cfg, 8, 8, jnp.float32)

    calls = pallas_calls(jax.make_jaxpr(forward_step, static_argnums=0)(*args(m)).jaxpr)
    assert not any(name.startswith("grouped_matmul_fp8") for name, _ in calls), calls
    want = np.asarray(forward_step(*args(plain))[0])
    compiled = forward_step.lower(*args(m)).compile()
    got = np.asarray(compiled(*args(m)[1:])[0])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    copies = [lin.weight_copy.get_value() for lin in (attn.wq_b, attn.wo_a, attn.wo_b)]
    assert not sharded.gathers_of(compiled.as_text(), copies)
