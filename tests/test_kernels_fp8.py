"""fp8 KV layout and write kernel: bit-exact against the reference KV fake-quantisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.model.quant import fp8_quantize, kv_sim
from pallas_kernels import backend, kv_fp8

D, ROPE = 512, 64


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint8)


def _hard_rows(rng) -> jnp.ndarray:
    """Rows over a wide dynamic range plus the edge cases of the scale rule."""
    n = 48
    x = rng.standard_normal((n, D)) * np.exp(rng.uniform(-14, 14, (n, 1)))
    x[0] = 0.0  # all-zero row: amax floor 1e-4
    x[1] = -0.0  # negative zeros keep their sign
    x[2, :64] = 448.0 * 2.0**-3  # amax exactly 448 * 2**k: the scale is 2**k, codes hit 448
    x[3, :64] = np.linspace(-450.0, 450.0, 64)  # just above 448 * 2**0: the scale doubles
    x[4, :64] = 1e-5 * rng.standard_normal(64)  # below the amax floor
    x[5, :64] = rng.standard_normal(64) * 1e-3  # many codes in the e4m3 subnormal range
    x[5, 0] = 1.0
    x[6, 64:128] = 446.0  # amax just below 448 * 2**0
    return jnp.asarray(x, jnp.bfloat16)


def test_quantize_dequantize_is_bit_exact_kv_sim():
    x = _hard_rows(np.random.default_rng(0))
    q = kv_fp8.quantize(x)
    assert q.nope.shape == (48, D) and q.nope.dtype == jnp.uint8
    assert q.rope.shape == (48, ROPE) and q.rope.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(kv_fp8.dequantize(q)), _bits(kv_sim(x, ROPE)))
    # codes and scales are exactly the reference's act_quant outputs, laid out per DESIGN 4
    codes, scales = fp8_quantize(x[:, :-ROPE], 64)
    nope = np.asarray(q.nope)
    np.testing.assert_array_equal(nope[:, :448], _bits(codes))
    np.testing.assert_array_equal(nope[:, 448:455].astype(np.int32) - 127, np.log2(np.asarray(scales)).astype(int))
    assert (nope[:, 455:] == 0).all()
    np.testing.assert_array_equal(_bits(q.rope), _bits(x[:, -ROPE:]))
    assert _bits(kv_fp8.dequantize(q))[1, 0] == 0x8000  # -0.0 survives


def test_quantize_small_head_dim_and_f32_input():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, 3, 128)) * 7, jnp.float32)  # tiny model: 64 nope + 64 rope
    q = kv_fp8.quantize(x)
    assert q.nope.shape == (5, 3, 128)
    xb = x.astype(jnp.bfloat16)
    np.testing.assert_array_equal(_bits(kv_fp8.dequantize(q)), _bits(kv_sim(xb, 64)))
    assert kv_fp8.row_bytes(512, 64, "fp8") == 640 and kv_fp8.row_bytes(512, 64, "bf16") == 1024


def _poisoned_pool(p: int) -> kv_fp8.Fp8Rows:
    return kv_fp8.Fp8Rows(jnp.full((p, D), 0xAB, jnp.uint8), jnp.full((p, ROPE), jnp.nan, jnp.bfloat16))


@pytest.mark.parametrize("block_rows", [16, 32])
def test_write_kernel_matches_reference_in_place(block_rows):
    rng = np.random.default_rng(2)
    x = _hard_rows(rng)[:45]  # 45 rows: the last block is ragged
    p = 96
    slots = rng.permutation(p)[:45].astype(np.int32)
    slots[[3, 17]] = -1  # skipped
    slots[30] = p + 5  # outside the pool: skipped too
    pool = _poisoned_pool(p)
    out = kv_fp8.write_kernel(pool, jnp.asarray(slots), x, block_rows=block_rows)
    ref = kv_fp8.write_reference(pool, jnp.asarray(slots), x)
    np.testing.assert_array_equal(np.asarray(out.nope), np.asarray(ref.nope))
    np.testing.assert_array_equal(_bits(out.rope), _bits(ref.rope))

    written = slots[(slots >= 0) & (slots < p)]
    untouched = np.setdiff1d(np.arange(p), written)
    assert (np.asarray(out.nope)[untouched] == 0xAB).all()
    assert np.isnan(np.asarray(out.rope, np.float32)[untouched]).all()
    rows = np.nonzero((slots >= 0) & (slots < p))[0]
    got = kv_fp8.dequantize(kv_fp8.Fp8Rows(out.nope[written], out.rope[written]))
    np.testing.assert_array_equal(_bits(got), _bits(kv_sim(x[rows], ROPE)))


def test_write_dispatch_ring_pool_both_impls():
    rng = np.random.default_rng(3)
    b, r = 3, 24
    pool = kv_fp8.Fp8Rows(jnp.full((b, r, D), 0x7F, jnp.uint8), jnp.full((b, r, ROPE), -3.0, jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((6, D)), jnp.bfloat16)
    req, pos = np.array([0, 0, 1, 2, 2, 2]), np.array([23, 24, 5, 47, 48, 49])  # ring wrap
    slots = jnp.asarray(req * r + pos % r, jnp.int32)
    with backend.use("xla"):
        a = kv_fp8.write(pool, slots, x)
    b_ = kv_fp8.write(pool, slots, x, impl="pallas")
    assert a.shape == (b, r, D)
    np.testing.assert_array_equal(np.asarray(a.nope), np.asarray(b_.nope))
    np.testing.assert_array_equal(_bits(a.rope), _bits(b_.rope))
    got = kv_fp8.dequantize(b_)[req, pos % r]
    np.testing.assert_array_equal(_bits(got), _bits(kv_sim(x, ROPE)))


def test_write_under_jit_with_donation():
    rng = np.random.default_rng(4)
    pool = kv_fp8.zeros((32,), D)
    x = jnp.asarray(rng.standard_normal((4, D)), jnp.bfloat16)
    f = jax.jit(lambda p, s, x: kv_fp8.write(p, s, x, impl="pallas"), donate_argnums=0)
    out = f(pool, jnp.asarray([5, -1, 0, 31], jnp.int32), x)
    np.testing.assert_array_equal(_bits(kv_fp8.dequantize(out)[jnp.asarray([5, 0, 31])]),
                                  _bits(kv_sim(x[jnp.asarray([0, 2, 3])], ROPE)))
    assert (np.asarray(out.nope)[[1, 2, 3, 30]] == 0).all()


def test_write_rejects_bad_input():
    pool = kv_fp8.zeros((8,), D)
    x = jnp.zeros((2, D), jnp.bfloat16)
    s = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="rows must be"):
        kv_fp8.write_kernel(pool, s, jnp.zeros((2, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match="slots must be"):
        kv_fp8.write_kernel(pool, jnp.zeros((3,), jnp.int32), x)
    with pytest.raises(ValueError, match="pool dtypes"):
        kv_fp8.write_kernel(kv_fp8.Fp8Rows(pool.nope.astype(jnp.int8), pool.rope), s, x)
    with pytest.raises(ValueError, match="block_rows"):
        kv_fp8.write_kernel(pool, s, x, block_rows=24)
    with pytest.raises(ValueError, match="rope_dim"):
        kv_fp8.quantize(jnp.zeros((2, 512)), rope_dim=32)
    with pytest.raises(TypeError, match="Fp8Rows"):
        kv_fp8.write(jnp.zeros((8, D), jnp.bfloat16), s, x)
    with pytest.raises(ValueError, match="implementation"):
        kv_fp8.write(pool, s, x, impl="triton")
