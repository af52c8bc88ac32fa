"""Numerics.matmul_precision reaches every matmul that inference traces: the decoding round,
prefill and Model.logits (float32 matmuls in true float32, as the PyTorch reference computes them;
GPUs would otherwise use TF32). On the CPU the arithmetic is the same either way, so these tests
read the traced programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dspark_jax
from dspark_jax import SamplingParams, config
from dspark_jax.api import forward_step
from dspark_jax.cache import init_cache
from dspark_jax.decoding.engine import Engine
from dspark_jax.model.common import Numerics
from tests.helpers import matmul_precisions

HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


@pytest.mark.parametrize("precision", ["highest", "default"])
def test_every_inference_matmul_gets_the_precision(precision):
    m = dspark_jax.init(config.tiny(), 0, dtype=jnp.float32, matmul_precision=precision)
    want = (lambda p: p == HIGHEST) if precision == "highest" else (lambda p: p is None)

    eng = Engine(m, gamma=m.config.dspark.block_size)
    ids = [np.arange(3, 20, dtype=np.int32)]
    bs = eng.init_state(ids, [SamplingParams(max_new_tokens=8)], [0], 128)
    chunk = (jnp.asarray(np.stack(ids)), jnp.full((1,), 17, jnp.int32), jnp.zeros((1, m.config.vocab_size)),
             jnp.ones((1,), bool))
    pre = matmul_precisions(eng._prefill.trace(eng.params, bs, *chunk).jaxpr.jaxpr)  # traced: nothing compiles
    rnd = matmul_precisions(eng._round.trace(eng.params, bs, sampled=True, top_k=False, top_p=False).jaxpr.jaxpr)
    cache = init_cache(m.config, 1, 32, jnp.float32)
    ids2 = jnp.ones((1, 8), jnp.int32)
    fwd = matmul_precisions(forward_step.trace(m.graphdef, m.state, ids2, jnp.full((1,), 8, jnp.int32),
                                               cache).jaxpr.jaxpr)
    for name, found in (("prefill", pre), ("round", rnd), ("forward_step", fwd)):
        assert len(found) > 20, f"{name}: only {len(found)} matmuls found"
        bad = [p for p in found if not want(p)]
        assert not bad, f"{name}: {len(bad)} of {len(found)} matmuls have precision {bad[:3]}"


def test_results_do_not_change_on_cpu():
    """CPU float32 matmuls are float32 either way: the setting changes no logit."""
    ids = np.arange(1, 40, dtype=np.int32)
    lo = dspark_jax.init(config.tiny(), 0, dtype=jnp.float32, matmul_precision="default")
    hi = dspark_jax.init(config.tiny(), 0, dtype=jnp.float32)
    assert hi.numerics.matmul_precision == "highest"  # the library default
    np.testing.assert_array_equal(np.asarray(lo.logits(ids)), np.asarray(hi.logits(ids)))


def test_bad_precision_is_rejected():
    with pytest.raises(ValueError, match="matmul_precision"):
        Numerics(matmul_precision="tf32")
