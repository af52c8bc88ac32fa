"""Orbax save / restore of converted parameters (fast restart), plain and straight into shardings."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dspark_jax
from dspark_jax import config, sharding
from dspark_jax.checkpoint import hf, orbax
from tests.checkpoint_helpers import flat_params, random_model
from tests.test_tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A tiny model loaded from an fp8 / fp4 official checkpoint (bf16 parameters), with a tokenizer."""
    path = str(tmp_path_factory.mktemp("orbax") / "official")
    hf.save_official(random_model(config.tiny(), seed=7, tokenizer=make_tokenizer()), path, encoding="official")
    return dspark_jax.load(path, progress=False)


def test_save_restore_identical(loaded, tmp_path):
    path = tmp_path / "fast"
    orbax.save(loaded, path)
    assert orbax.is_orbax_checkpoint(path)
    with pytest.raises(FileExistsError):
        orbax.save(loaded, path)
    back = orbax.restore(path)
    assert back.config == loaded.config and back.numerics == loaded.numerics  # bf16, quant_sim from fp8 / fp4
    assert back.numerics.param_dtype == jnp.bfloat16 and back.numerics.quant_sim is True
    assert back.tokenizer is not None and back.tokenizer.get_vocab() == loaded.tokenizer.get_vocab()
    a, b = flat_params(loaded), flat_params(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_restore_into_sharded_layout(loaded, tmp_path):
    path = tmp_path / "fast"
    orbax.save(loaded, path)  # saved from a single device
    mesh = sharding.make_mesh()
    back = orbax.restore(path, mesh=mesh)
    want = sharding.param_shardings(back.module, back.config, mesh)
    a = flat_params(loaded)
    for k, var in nnx.to_flat_state(nnx.state(back.module)):
        p = ".".join(map(str, k))
        assert var[...].sharding == want[p], p
        np.testing.assert_array_equal(np.asarray(var[...]), a[p], err_msg=p)
    assert want["layers.3.ffn.experts.w2"].spec == P("model")


def test_restore_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an orbax checkpoint"):
        orbax.restore(tmp_path)
