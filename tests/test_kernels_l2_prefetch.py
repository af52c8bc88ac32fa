"""The L2 prefetch (``pallas_kernels.l2_prefetch``): it reads every element of its arrays once
(the token's checksum equals the arrays' exact sum: small integers, so float32 sums are exact),
for FP8 codes, bf16, float32 and integer arrays, several at once, more programs than chunks and
fewer; a linear that takes its token computes what it computes without it; the lowering for
gfx950 and NVIDIA; bad input.

Interpret mode fills outputs with NaN before the kernel runs: a finite checksum means every
program wrote its sum."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm
from pallas_kernels import lowering
from pallas_kernels.gemv import gemv, gemv_swiglu
from pallas_kernels.l2_prefetch import checksum, prefetch
from tests.test_kernels_grouped_matmul import _random_weights

SD = jax.ShapeDtypeStruct


def _ints(rng, shape, dtype, high=8):
    return np.asarray(rng.integers(1, high, shape)).astype(dtype)


@pytest.mark.parametrize("programs", [1, 3, 8, 200])
def test_every_element_is_read_once(programs):
    rng = np.random.default_rng(programs)
    arrays = [_ints(rng, (384, 1024), ml_dtypes.float8_e4m3fn),  # an FP8 weight: 768 chunks of 512 lanes
              _ints(rng, (7, 48), np.float32),  # 336 elements: 16 lanes x 21 rows, an odd row count
              _ints(rng, (3, 2, 256), ml_dtypes.bfloat16),
              _ints(rng, (3, 5), np.uint8)]  # 15 elements: one lane
    want = sum(float(np.asarray(a, np.float64).sum()) for a in arrays)
    tok = prefetch(tuple(jnp.asarray(a) for a in arrays), jnp.ones((2,)), programs=programs)
    assert tok.shape == (programs,) and np.isfinite(np.asarray(tok)).all()
    assert float(checksum(tok)) == want
    # one element more or less read would change the sum (every value is at least 1)
    arrays[0][-1, -1] = ml_dtypes.float8_e4m3fn(32)
    assert float(checksum(prefetch(tuple(jnp.asarray(a) for a in arrays), jnp.ones((2,)), programs=programs))) != want


def test_a_linear_taking_the_token_computes_the_same():
    rng = np.random.default_rng(0)
    w = _random_weights(rng, (1, 256, 512), "fp8")
    w3 = _random_weights(rng, (1, 256, 512), "fp8")
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16)
    group = jnp.zeros((1,), jnp.int32)
    tok = prefetch((w.values, w.scales), x)
    np.testing.assert_array_equal(np.asarray(gemv(gm.QuantRows(x), w, group, after=(tok,)), np.float32),
                                  np.asarray(gemv(gm.QuantRows(x), w, group), np.float32))
    got = gemv_swiglu(gm.QuantRows(x), w, w3, group, limit=10.0, after=(tok, x))
    want = gemv_swiglu(gm.QuantRows(x), w, w3, group, limit=10.0)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_lowers_for_gpus(arch, platform):
    wq_b = SD((32768, 1024), jnp.float8_e4m3fn)
    text = lowering.lower(lambda w, s, a: prefetch((w, s), a, interpret=False), wq_b, SD((256, 8), jnp.uint8),
                          SD((1, 4096), jnp.bfloat16), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "l2_prefetch" in text
    # the linear with the token: still one launch
    w = gm.Weights(SD((1, 32768, 1024), jnp.float8_e4m3fn), SD((1, 256, 8), jnp.uint8), "fp8")
    text = lowering.lower(lambda x, w, t: gemv(gm.QuantRows(x), w, jnp.zeros((1,), jnp.int32), after=(t,),
                                               interpret=False), SD((1, 1024), jnp.bfloat16), w,
                          SD((128,), jnp.float32), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1


def test_bad_input_is_named():
    ok = jnp.ones((16,), jnp.float32)
    with pytest.raises(ValueError, match="at least one array"):
        prefetch((), ok)
    with pytest.raises(ValueError, match="at least one program"):
        prefetch((ok,), ok, programs=0)
    with pytest.raises(ValueError, match="non-empty"):
        prefetch((jnp.ones((0, 4)),), ok)
    with pytest.raises(ValueError, match="numeric"):
        prefetch((jnp.ones((16,), bool),), ok)
