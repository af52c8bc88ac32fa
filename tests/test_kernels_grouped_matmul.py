"""Grouped matmul over bf16 / FP8 / FP4 weights: dequantisation, row tiles, kernel vs reference,
gfx950 lowering, and the memory of a DeepSeek-V4-Flash MoE layer.

Interpret mode fills every kernel output with NaN before the kernel runs
(``test_kernels_attention.test_interpret_mode_poisons_outputs``), so a finite result means every
element was written.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dspark_jax import config
from dspark_jax.checkpoint import codecs
from dspark_jax.model.common import Numerics
from dspark_jax.model import quant
from dspark_jax.model.moe import Experts
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import group_metadata as md
from pallas_kernels import lowering

SD = jax.ShapeDtypeStruct


def _quantize(w: np.ndarray, fmt: str) -> gm.Weights:
    """Stacked float weights [G, N, K] encoded like the official checkpoints (numpy codecs)."""
    if fmt == "dense":
        return gm.Weights(jnp.asarray(w, jnp.bfloat16), None, "dense")
    enc = codecs.encode_fp8 if fmt == "fp8" else codecs.encode_fp4
    pairs = [enc(x) for x in w]
    if fmt == "fp8_k128":  # the FP4 codes widened to e4m3, scales per row and 128 inputs
        pairs = [codecs.fp4_to_e4m3_k128(c, s) for c, s in pairs]
    codes = np.stack([c for c, _ in pairs])
    codes = codes.view(np.uint8) if fmt == "fp4" else codes
    return gm.Weights(jnp.asarray(codes), jnp.asarray(np.stack([s for _, s in pairs]).view(np.uint8)), fmt)


def _random_weights(rng, shape, fmt: str) -> gm.Weights:
    # a spread of magnitudes per row so that scale bytes vary (and fp4 uses all its codes)
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 1, shape[:-1] + (1,)))
    return _quantize(w.astype(np.float32), fmt)


def test_dequantize_matches_the_checkpoint_codecs_exactly():
    rng = np.random.default_rng(0)
    w8 = _random_weights(rng, (2, 200, 300), "fp8")  # partial 128-blocks at both edges
    for g in range(2):
        want = codecs.decode_fp8(np.asarray(w8.values[g]), np.asarray(w8.scales[g]))
        np.testing.assert_array_equal(np.asarray(gm.dequantize(w8.group(g), jnp.float32))[0], want)
    # fp4: every byte value (both nibbles of every code) under a spread of scale bytes
    packed = np.tile(np.arange(256, dtype=np.uint8), (3, 1)).reshape(1, 3, 256)
    scales = rng.integers(100, 150, (1, 3, 16)).astype(np.uint8)
    w4 = gm.Weights(jnp.asarray(packed), jnp.asarray(scales), "fp4")
    want = codecs.decode_fp4(packed[0].view(np.int8), scales[0])
    got = np.asarray(gm.dequantize(w4, jnp.float32))[0]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0.0 kept
    # and the bf16 values are the same numbers (exactly representable)
    np.testing.assert_array_equal(np.asarray(gm.dequantize(w4, jnp.bfloat16), np.float32)[0], want)
    # widened to e4m3 codes with scales per 128 inputs: the same values, the four per-32 scales of
    # a 128-input block up to FP4_TO_K128_SPAN (14) binades apart
    span = codecs.FP4_TO_K128_SPAN
    scales = (rng.integers(100, 150, (1, 3, 4, 1)) - rng.integers(0, span + 1, (1, 3, 4, 4))).reshape(1, 3, 16)
    scales[0, :, :4] = [[120, 120 - span, 119, 100]]  # the span exactly, and a block of zero codes below it
    packed[0, :, 48:64] = 0x80  # (+0 and -0)
    scales = scales.astype(np.uint8)
    want = codecs.decode_fp4(packed[0].view(np.int8), scales[0])
    codes, s128 = codecs.fp4_to_e4m3_k128(packed[0], scales[0])
    assert len(np.unique(s128)) > 1
    w8k = gm.Weights(jnp.asarray(codes)[None], jnp.asarray(s128)[None], "fp8_k128")
    np.testing.assert_array_equal(np.asarray(gm.dequantize(w8k, jnp.float32))[0], want)
    np.testing.assert_array_equal(codecs.decode_fp8_k128(codes, s128), want)
    np.testing.assert_array_equal(np.signbit(codecs.decode_fp8_k128(codes, s128)), np.signbit(want))
    # one binade more cannot be held exactly: a clear error naming the tensor and the block
    scales[0, 1, 4:8] = [130, 130 - span - 1, 125, 130]
    with pytest.raises(codecs.CodecError, match=r"experts\.w1: row 1, inputs 128\.\.255"):
        codecs.fp4_to_e4m3_k128(packed[0], scales[0], "experts.w1")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_decodes_every_fp4_byte_and_scale_exactly(dtype):
    """The kernel's in-register FP4 decoding (e2m1 moved into e4m3 bytes, the factor 64 folded
    into the scale) against the codecs: x is the identity, so out[r] is weight column r with no
    rounding; every byte value under every scale byte 2 .. 248 (weights 2**-126 .. 6 * 2**121; bytes
    0 and 1 give subnormal weights, which the dot flushes to zero on CPU)."""
    n, k = 16, 512
    packed = np.tile(np.arange(256, dtype=np.uint8), (n, 1))[None]  # every row: all 256 bytes
    scales = (2 + np.arange(n * k // 32) % 247).astype(np.uint8).reshape(1, n, k // 32)
    w = gm.Weights(jnp.asarray(packed), jnp.asarray(scales), "fp4")
    want = codecs.decode_fp4(packed[0].view(np.int8), scales[0])
    assert set(np.unique(scales)) == set(range(2, 249))
    tile_group, num_tiles = md.dense_tiles(k, 1, 16)
    cfg = gm.GemmConfig(block_n=16, block_k=256)
    out = gm.kernel(jnp.eye(k, dtype=dtype), w, tile_group, num_tiles, block_m=16, out_dtype=jnp.float32,
                    config=cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(out).T, want)


def _check_tiles(ids: np.ndarray, groups: int, bm: int):
    tiles = md.group_tiles(jnp.asarray(ids), groups, bm)
    flat = ids.reshape(-1)
    rop, por = np.asarray(tiles.row_of_pair), np.asarray(tiles.pair_of_row)
    tg, nt = np.asarray(tiles.tile_group), int(tiles.num_tiles[0])
    assert tiles.max_tiles == md.max_tiles(flat.size, groups, bm)
    assert len(set(rop.tolist())) == flat.size  # one row per pair
    np.testing.assert_array_equal(por[rop], np.arange(flat.size))  # inverse maps
    assert (por >= 0).sum() == flat.size
    np.testing.assert_array_equal(tg[rop // bm], flat)  # each pair sits in a tile of its group
    sizes = np.bincount(flat, minlength=groups)
    assert nt == sum(-(-s // bm) for s in sizes)  # no tile more than the padding needs
    assert nt <= tiles.max_tiles
    assert (por[nt * bm:] == -1).all()  # unused tiles hold no pair
    assert sorted(set(tg[:nt].tolist())) == sorted(set(flat.tolist()))  # groups without pairs get no tile
    assert (np.diff(tg[:nt]) >= 0).all()
    for g in set(flat.tolist()):  # token order kept inside a group
        assert (np.diff(rop[flat == g]) > 0).all()
    return tiles


@pytest.mark.parametrize("n,k,groups,bm", [(1, 6, 256, 16), (6, 6, 256, 16), (37, 3, 8, 16), (50, 2, 3, 32)])
def test_group_tiles_on_random_routings(n, k, groups, bm):
    rng = np.random.default_rng(n)
    for _ in range(5):
        ids = np.stack([rng.choice(groups, k, replace=False) for _ in range(n)]).astype(np.int32)
        _check_tiles(ids, groups, bm)


@pytest.mark.parametrize("n,k,groups,bm", [(1, 6, 256, 16), (6, 6, 256, 16), (10, 6, 256, 16), (21, 3, 3, 32),
                                           (7, 5, 100, 64), (64, 1, 8, 16)])
def test_group_tiles_kernel_equals_the_sort(n, k, groups, bm):
    """The one-program layout (counting, no sort) gives the XLA path's integers: distinct experts
    per token, and tokens crowding onto a few groups (several tiles of one group)."""
    rng = np.random.default_rng(n * k)
    for crowded in (False, True):
        ids = (rng.integers(0, min(groups, 3), (n, k)) if crowded else
               np.stack([rng.choice(groups, k, replace=False) for _ in range(n)])).astype(np.int32)
        got = md.tiles_kernel(jnp.asarray(ids), groups, bm, interpret=True)
        want = md.reference(jnp.asarray(ids), groups, bm)
        for field in ("tile_group", "num_tiles", "row_of_pair", "pair_of_row"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), field)
        _check_tiles(ids, groups, bm)  # (the switch: the kernel for these sizes)
    with pytest.raises(ValueError, match="pairs"):
        md.tiles_kernel(jnp.zeros((md.MAX_KERNEL_PAIRS + 1, 1), jnp.int32), groups, bm, interpret=True)
    for impl in ("pallas", "xla"):  # either path names a bad tile
        with pytest.raises(ValueError, match="block_m must be a power of two"):
            md.group_tiles(jnp.asarray(ids), groups, 24, impl=impl)


def test_group_tiles_extremes():
    _check_tiles(np.full((40, 1), 5, np.int32), 8, 16)  # one group takes every row
    _check_tiles(np.arange(16, dtype=np.int32).reshape(8, 2), 16, 16)  # every group one row
    tg, nt = md.dense_tiles(32, 3, 16)
    np.testing.assert_array_equal(np.asarray(tg), [0, 0, 1, 1, 2, 2])
    assert int(nt[0]) == 6


def test_group_tiles_drops_pairs_of_no_group():
    """Pairs with group id = num_groups (expert parallelism: another device's experts) sit in
    tiles past num_tiles, so no program computes them; the others are tiled as without them."""
    rng = np.random.default_rng(4)
    groups, bm = 8, 16
    ids = rng.integers(0, groups + 1, (29, 3)).astype(np.int32)  # about 1 pair in 9 dropped
    flat = ids.reshape(-1)
    kept = flat < groups
    assert 0 < (~kept).sum() < kept.sum()
    tiles = md.group_tiles(jnp.asarray(ids), groups, bm, dropped=True)
    rop, por = np.asarray(tiles.row_of_pair), np.asarray(tiles.pair_of_row)
    tg, nt = np.asarray(tiles.tile_group), int(tiles.num_tiles[0])
    assert nt == sum(-(-s // bm) for s in np.bincount(flat[kept], minlength=groups))
    assert (rop[kept] < nt * bm).all() and (rop[~kept] >= nt * bm).all()
    np.testing.assert_array_equal(tg[rop[kept] // bm], flat[kept])
    assert (tg < groups).all() and nt * bm <= por.size
    np.testing.assert_array_equal(por[rop], np.arange(flat.size))
    # the kernel and its reference leave the dropped pairs' rows at zero
    w = _random_weights(rng, (groups, 32, 128), "fp8")
    x = jnp.asarray(np.where(por[:, None] >= 0, rng.standard_normal((por.size, 128)), 0.0), jnp.bfloat16)
    meta = (tiles.tile_group, tiles.num_tiles)
    cfg = gm.GemmConfig(block_n=32, block_k=64)
    for y in (gm.kernel(x, w, *meta, block_m=bm, out_dtype=jnp.float32, config=cfg, interpret=True),
              gm.reference(x, w, *meta, block_m=bm, out_dtype=jnp.float32)):
        y = np.asarray(y)
        assert (y[rop[~kept]] == 0).all() and np.abs(y[rop[kept]]).max() > 0


def test_pair_tiles_give_every_pair_its_own_tile():
    ids = np.array([[5, 1, 5], [0, 7, 2]], np.int32)  # group 5 twice: read by two tiles
    tiles = md.pair_tiles(jnp.asarray(ids), 16)
    rop, por = np.asarray(tiles.row_of_pair), np.asarray(tiles.pair_of_row)
    np.testing.assert_array_equal(np.asarray(tiles.tile_group), ids.reshape(-1))
    assert int(tiles.num_tiles[0]) == tiles.max_tiles == 6
    np.testing.assert_array_equal(por[rop], np.arange(6))
    assert (por >= 0).sum() == 6 and (rop % 16 == 0).all()


def _oracle(x, w: gm.Weights, tiles) -> np.ndarray:
    wd = np.asarray(gm.dequantize(w, jnp.float32))
    g = np.repeat(np.asarray(tiles.tile_group), tiles.block_m)
    out = np.einsum("mk,mnk->mn", np.asarray(x, np.float32), wd[g])
    out[np.asarray(tiles.pair_of_row) < 0] = 0.0
    return out


ROUTINGS = {
    "uneven": lambda rng: rng.choice([0, 0, 0, 0, 2, 3, 3, 5], (11, 2)),  # empty groups 1, 4, 6, 7
    "one_group": lambda rng: np.full((9, 2), 6),
    "pairs": lambda rng: rng.choice(8, (3, 2)),  # laid out by pair_tiles: one tile per pair
}


@pytest.mark.parametrize("fmt,routing", [("dense", "uneven"), ("fp8", "uneven"), ("fp4", "uneven"),
                                         ("fp8_k128", "uneven"), ("fp4", "one_group"), ("fp8_k128", "one_group"),
                                         ("fp4", "pairs")])
def test_kernel_matches_reference(fmt, routing):
    rng = np.random.default_rng(7)
    g, n, k = 8, 64, 256
    w = _random_weights(rng, (g, n, k), fmt)
    w3 = _random_weights(rng, (g, n, k), fmt)
    ids = ROUTINGS[routing](rng).astype(np.int32)
    ids_j = jnp.asarray(ids)
    tiles = md.pair_tiles(ids_j, 16) if routing == "pairs" else md.group_tiles(ids_j, g, 16)
    pair = np.asarray(tiles.pair_of_row)
    x = np.where(pair[:, None] >= 0, rng.standard_normal((pair.size, k)), 0.0)
    x = jnp.asarray(x, jnp.bfloat16)
    meta = (tiles.tile_group, tiles.num_tiles)
    cfg = gm.GemmConfig(block_n=32, block_k=64 if fmt in ("dense", "fp8") else 128)
    ker = np.asarray(gm.kernel(x, w, *meta, block_m=16, out_dtype=jnp.float32, config=cfg, interpret=True))
    ref = np.asarray(gm.reference(x, w, *meta, block_m=16, out_dtype=jnp.float32))
    want = _oracle(x, w, tiles)
    assert np.isfinite(ker).all()
    scale = np.abs(want).max()
    assert scale > 0.01
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(ker, want, rtol=1e-5, atol=1e-5 * scale)
    assert (ker[pair < 0] == 0).all()

    rw = jnp.asarray(np.where(pair >= 0, rng.random(pair.size), 0.0), jnp.float32)
    h_ker = gm.swiglu_kernel(x, w, w3, rw, *meta, block_m=16, limit=1.0, config=cfg, interpret=True)
    h_ref = gm.swiglu_reference(x, w, w3, rw, *meta, block_m=16, limit=1.0)
    assert np.isfinite(np.asarray(h_ker, np.float32)).all()
    np.testing.assert_allclose(np.asarray(h_ker, np.float32), np.asarray(h_ref, np.float32), rtol=1e-2, atol=1e-3)
    # the clamp is active somewhere (limit 1.0 against products of several units)
    assert np.abs(np.asarray(gm.reference(x, w, *meta, block_m=16))).max() > 1.0


def _uneven_case(rng, fmt: str, g: int = 8, n: int = 64, k: int = 512):
    """Two weights [g, n, k] of ``fmt``, the uneven routing's 16-row tiles, rows (zero where no
    pair) and the kernel's tile metadata."""
    w, w3 = (_random_weights(rng, (g, n, k), fmt) for _ in range(2))
    tiles = md.group_tiles(jnp.asarray(ROUTINGS["uneven"](rng).astype(np.int32)), g, 16)
    pair = np.asarray(tiles.pair_of_row)
    x = jnp.asarray(np.where(pair[:, None] >= 0, rng.standard_normal((pair.size, k)), 0.0), jnp.bfloat16)
    return w, w3, tiles, pair, x, (tiles.tile_group, tiles.num_tiles)


@pytest.mark.parametrize("fmt,bk", [("fp8", 64), ("fp8", 256), ("fp8_k128", 128)])
def test_folded_scales_match_the_reference(fmt, bk):
    """``GemmConfig.fold_scales``: each weight tile multiplied by its scales in registers (per
    128 x 128 block, or per output row for fp8_k128), the dots accumulating in place: the oracle's
    products, unused tiles zero; the fused SwiGLU as its reference."""
    rng = np.random.default_rng(13)
    w, w3, tiles, pair, x, meta = _uneven_case(rng, fmt)
    cfg = gm.GemmConfig(block_n=32, block_k=bk, fold_scales=True)
    ker = np.asarray(gm.kernel(x, w, *meta, block_m=16, out_dtype=jnp.float32, config=cfg, interpret=True))
    want = _oracle(x, w, tiles)
    assert np.isfinite(ker).all() and (ker[pair < 0] == 0).all()
    np.testing.assert_allclose(ker, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    rw = jnp.asarray(np.where(pair >= 0, rng.random(pair.size), 0.0), jnp.float32)
    h = gm.swiglu_kernel(x, w, w3, rw, *meta, block_m=16, limit=1.0, config=cfg, interpret=True)
    h_ref = gm.swiglu_reference(x, w, w3, rw, *meta, block_m=16, limit=1.0)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h_ref, np.float32), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("fmt,split,bk", [("dense", 2, 64), ("fp8", 4, 64), ("fp4", 2, 128), ("fp8_k128", 4, 128),
                                          ("fp8", 2, 256), ("fp8_k128", 2, 256), ("fp8_k128", 2, 64)])
def test_split_k_matches_the_reference(fmt, split, bk):
    """K split over programs: fp32 partial products summed after the kernel, then rounded (and,
    fused SwiGLU, activated) as by the unsplit kernel; unused tiles stay zero. FP8 steps of 256
    inputs span two scale blocks (one product each)."""
    rng = np.random.default_rng(11)
    w, w3, tiles, pair, x, meta = _uneven_case(rng, fmt)
    n, k = w.shape[1:]
    cfg = gm.GemmConfig(block_n=32, block_k=bk, split_k=split)
    assert cfg.fit(n, k, fmt).split_k == split and cfg.fit(n, k, fmt).block_k == bk
    ker = np.asarray(gm.kernel(x, w, *meta, block_m=16, out_dtype=jnp.float32, config=cfg, interpret=True))
    want = _oracle(x, w, tiles)
    assert np.isfinite(ker).all() and (ker[pair < 0] == 0).all()
    np.testing.assert_allclose(ker, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # bf16 output: the rounded sum, as the unsplit kernel gives it
    unsplit = dataclasses.replace(cfg, split_k=1)
    y16 = gm.kernel(x, w, *meta, block_m=16, config=cfg, interpret=True)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(
        gm.kernel(x, w, *meta, block_m=16, config=unsplit, interpret=True), np.float32), rtol=1e-2, atol=1e-3)

    rw = jnp.asarray(np.where(pair >= 0, rng.random(pair.size), 0.0), jnp.float32)
    h_split = gm.swiglu_kernel(x, w, w3, rw, *meta, block_m=16, limit=1.0, config=cfg, interpret=True)
    h_ref = gm.swiglu_reference(x, w, w3, rw, *meta, block_m=16, limit=1.0)
    assert h_split.dtype == x.dtype and np.isfinite(np.asarray(h_split, np.float32)).all()
    np.testing.assert_allclose(np.asarray(h_split, np.float32), np.asarray(h_ref, np.float32), rtol=1e-2, atol=1e-3)
    assert (np.asarray(h_split, np.float32)[pair < 0] == 0).all()


@pytest.mark.parametrize("fmt,split", [("fp8_k128", 2), ("fp8", 4), ("fp8_k128", 1)])
def test_swiglu_quantised_out(fmt, split):
    """``quantised_out``: the SwiGLU half's result quantised as w2's input (``ActQuant.of``). After a
    K split in one launch from the partial sums (``swiglu_quantise``): with two parts bit for bit the
    codes and amax of the unfused path's rounded SwiGLU (a sum of two is the same in any order);
    with four, its values to the sums' order; unsplit: ``ActQuant.of`` of the kernel's output. The
    reference path gives the same kind of result."""
    rng = np.random.default_rng(13)
    w, w3, tiles, pair, x, meta = _uneven_case(rng, fmt, n=256)
    cfg = gm.GemmConfig(block_n=32, block_k=128, split_k=split)
    rw = jnp.asarray(np.where(pair >= 0, rng.random(pair.size), 0.0), jnp.float32)
    kw = dict(block_m=16, limit=1.0, config=cfg, interpret=True)
    got = gm.swiglu_kernel(x, w, w3, rw, *meta, quantised_out=True, **kw)
    want = gm.ActQuant.of(gm.swiglu_kernel(x, w, w3, rw, *meta, **kw))
    assert isinstance(got, gm.ActQuant) and got.codes.shape == (pair.size, 256) and got.amax.shape == (pair.size, 2)
    assert np.asarray(got.amax).max() > 0 and (np.asarray(got.amax)[pair < 0] == 0).all()
    if split <= 2:
        np.testing.assert_array_equal(np.asarray(got.codes, np.float32), np.asarray(want.codes, np.float32))
        np.testing.assert_array_equal(np.asarray(got.amax), np.asarray(want.amax))
    else:
        v, r = np.asarray(got.values(), np.float32), np.asarray(want.values(), np.float32)
        np.testing.assert_allclose(v, r, rtol=2**-3, atol=1e-6)
        assert np.mean(v == r) > 0.95
    jaxpr = str(jax.make_jaxpr(lambda x: gm.swiglu_kernel(x, w, w3, rw, *meta, quantised_out=True, block_m=16,
                                                            limit=1.0, config=cfg, interpret=False))(x))
    assert ("swiglu_quantise" in jaxpr) == (split > 1)
    ref = gm.grouped_swiglu(x, w, w3, rw, *meta, block_m=16, limit=1.0, impl="xla", quantised_out=True)
    assert isinstance(ref, gm.ActQuant)
    np.testing.assert_allclose(np.asarray(ref.values(), np.float32), np.asarray(want.values(), np.float32),
                               rtol=2**-3, atol=1e-3)


@pytest.mark.parametrize("split", [1, 2])
def test_extra_weights_take_the_tiles_of_group_g(split):
    """``extra``: tiles of group G (one past the routed groups) multiply one more weight of its own
    format in the same launch (a shared expert beside the routed ones). Its tiles equal a launch
    of that weight alone, the routed tiles a launch without it, bit for bit (the same programs);
    both equal the reference's, which takes the same extra weight. Rows as codes (quantised in the
    kernel for the SwiGLU, as ``ActQuant`` for the product), fp8_k128 routed and fp8 extra."""
    rng = np.random.default_rng(21)
    g, n, k = 3, 256, 512
    w1, w2, w3 = (_random_weights(rng, s, "fp8_k128") for s in ((g, n, k), (g, k, n), (g, n, k)))
    e1, e2, e3 = (_random_weights(rng, s, "fp8") for s in ((1, n, k), (1, k, n), (1, n, k)))
    ids = np.array([[2, 0, g], [1, 2, g]], np.int32)  # two tokens, two routed experts and the extra
    tiles = md.pair_tiles(jnp.asarray(ids), 16)
    pair = np.asarray(tiles.pair_of_row)
    rows = np.where(pair[:, None] >= 0, rng.standard_normal((pair.size, k)), 0.0)
    rows = gm.QuantRows(jnp.asarray(rows, jnp.bfloat16))
    rw = jnp.asarray(np.where(pair >= 0, np.where(np.repeat(ids.reshape(-1), 16) == g, 1.0, rng.random(pair.size)),
                              0.0), jnp.float32)
    meta = (tiles.tile_group, tiles.num_tiles)
    cfg = gm.GemmConfig(block_n=64, block_k=128, split_k=split)
    kw = dict(block_m=16, config=cfg, interpret=True)
    h = gm.swiglu_kernel(rows, w1, w3, rw, *meta, limit=1.0, quantised_out=True, extra=(e1, e3), **kw)
    y = np.asarray(gm.kernel(h, w2, *meta, out_dtype=jnp.float32, extra=e2, **kw))
    extra_rows = np.repeat(ids.reshape(-1) == g, 16)
    # the extra tiles alone (group 0 of the extra weights), the routed tiles alone (their own groups)
    alone = jnp.where(jnp.asarray(ids.reshape(-1)) == g, 0, tiles.tile_group), tiles.num_tiles
    h_x = gm.swiglu_kernel(rows, e1, e3, rw, *alone, limit=1.0, quantised_out=True, **kw)
    h_r = gm.swiglu_kernel(rows, w1, w3, rw, *alone, limit=1.0, quantised_out=True, **kw)
    for a, b, c in ((h.codes, h_x.codes, h_r.codes), (h.amax, h_x.amax, h_r.amax)):
        a, b, c = (np.asarray(v, np.float32) for v in (a, b, c))
        np.testing.assert_array_equal(a[extra_rows], b[extra_rows])
        np.testing.assert_array_equal(a[~extra_rows], c[~extra_rows])
    y_x = np.asarray(gm.kernel(h, e2, *alone, out_dtype=jnp.float32, **kw))
    y_r = np.asarray(gm.kernel(h, w2, *alone, out_dtype=jnp.float32, **kw))
    np.testing.assert_array_equal(y[extra_rows], y_x[extra_rows])
    np.testing.assert_array_equal(y[~extra_rows], y_r[~extra_rows])
    assert np.abs(y[extra_rows & (pair >= 0)]).min() > 0 and np.isfinite(y).all()
    # against the reference with the same extra weights
    h_ref = gm.swiglu_reference(rows, w1, w3, rw, *meta, block_m=16, limit=1.0, extra=(e1, e3))
    np.testing.assert_allclose(np.asarray(h.values(), np.float32), np.asarray(gm.ActQuant.of(h_ref).values(),
                               np.float32), rtol=2**-3, atol=1e-3)
    ref = np.asarray(gm.reference(h, w2, *meta, block_m=16, out_dtype=jnp.float32, extra=e2))
    scale = np.abs(ref).max()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * scale)
    with pytest.raises(ValueError, match="one group of"):
        gm.kernel(h, w2, *meta, extra=w2, **kw)
    with pytest.raises(ValueError, match="cannot take the rows"):
        gm.kernel(h, w2, *meta, extra=_random_weights(rng, (1, k, n), "dense"), **kw)


@pytest.mark.parametrize("fmt,split,bk,bm", [("fp8", 1, 128, 16), ("fp8", 4, 256, 16), ("fp8", 1, 64, 16),
                                             ("fp8", 1, 128, 32),
                                             ("fp8_k128", 2, 128, 16), ("fp8_k128", 1, 256, 16),
                                             ("fp8_k128", 1, 128, 32),
                                             ("fp4", 1, 128, 16), ("dense", 2, 64, 16)])
def test_fp8_rows_match_the_rounded_rows(fmt, split, bk, bm):
    """Rows given as e4m3 codes with per-128 scales (``ActQuant``): against ``fp8`` / ``fp8_k128``
    weights the kernel multiplies codes by codes and scales the sums per 128 inputs (and per
    weight block or output column); the result is the product
    of the rows' values (``fp8_sim`` of x), which the other formats, prefill's row tiles and the
    reference multiply. A 64-input step widens to a whole scale block."""
    rng = np.random.default_rng(5)
    g, n, k = 8, 64, 512
    w, w3 = (_random_weights(rng, (g, n, k), fmt) for _ in range(2))
    tiles = md.group_tiles(jnp.asarray(ROUTINGS["uneven"](rng).astype(np.int32)), g, bm)
    pair = np.asarray(tiles.pair_of_row)
    # rows of very different magnitudes per 128-block, so that the rows' scales matter
    x = rng.standard_normal((pair.size, k)) * np.exp(rng.uniform(-4, 4, (pair.size, k // 128))).repeat(128, 1)
    x = jnp.asarray(np.where(pair[:, None] >= 0, x, 0.0), jnp.bfloat16)
    rows = gm.ActQuant.of(x)
    np.testing.assert_array_equal(np.asarray(rows.values(), np.float32), np.asarray(quant.fp8_sim(x, 128), np.float32))
    meta = (tiles.tile_group, tiles.num_tiles)
    cfg = gm.GemmConfig(block_n=32, block_k=bk, split_k=split)
    ker = np.asarray(gm.kernel(rows, w, *meta, block_m=bm, out_dtype=jnp.float32, config=cfg, interpret=True))
    want = _oracle(quant.fp8_sim(x, 128), w, tiles)
    assert np.isfinite(ker).all() and (ker[pair < 0] == 0).all()
    np.testing.assert_allclose(ker, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    ref = np.asarray(gm.reference(rows, w, *meta, block_m=bm, out_dtype=jnp.float32))
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    rw = jnp.asarray(np.where(pair >= 0, rng.random(pair.size), 0.0), jnp.float32)
    h = gm.swiglu_kernel(rows, w, w3, rw, *meta, block_m=bm, limit=1.0, config=cfg, interpret=True)
    h_ref = gm.swiglu_reference(quant.fp8_sim(x, 128), w, w3, rw, *meta, block_m=bm, limit=1.0)
    assert h.dtype == x.dtype and np.isfinite(np.asarray(h, np.float32)).all()
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h_ref, np.float32), rtol=1e-2, atol=1e-3)
    jaxpr = str(jax.make_jaxpr(lambda r: gm.kernel(r, w, *meta, block_m=bm, config=cfg, interpret=False))(rows))
    # the fp8 x fp8 kernel, under its own name: fp8 weights in decode / verify row tiles
    codes = fmt in ("fp8", "fp8_k128") and bm == 16
    assert (f"grouped_matmul_{fmt}_a8" in jaxpr) == codes

    # rows the kernel quantises itself (QuantRows): the same codes and scales, the same result
    raw = gm.QuantRows(x)
    got = np.asarray(gm.kernel(raw, w, *meta, block_m=bm, out_dtype=jnp.float32, config=cfg, interpret=True))
    np.testing.assert_array_equal(got, ker)
    h_raw = gm.swiglu_kernel(raw, w, w3, rw, *meta, block_m=bm, limit=1.0, config=cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(h_raw, np.float32), np.asarray(h, np.float32))
    np.testing.assert_array_equal(np.asarray(gm.reference(raw, w, *meta, block_m=bm, out_dtype=jnp.float32)), ref)
    closed = jax.make_jaxpr(lambda r: gm.kernel(r, w, *meta, block_m=bm, config=cfg, interpret=False))(raw)
    assert (f"grouped_matmul_{fmt}_a8q" in str(closed)) == codes
    # with fp8 dots nothing quantises the rows outside the kernel; elsewhere XLA rounds them first
    outside = _outside_kernels(closed.jaxpr)
    assert "pallas_call" in outside and ("reduce_max" in outside) == (not codes)


def _outside_kernels(jaxpr) -> set[str]:
    """The primitives of a jaxpr and its sub-jaxprs, not looking inside pallas_call kernels."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if hasattr(sub, "eqns"):
                    names |= _outside_kernels(sub)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    names |= _outside_kernels(sub.jaxpr)
    return names


def test_kernel_quantises_blocks_as_the_reference():
    """``_quantise_block`` (the kernel's act_quant of one 128-input block) against ``ActQuant.of``:
    identical codes and scales, with blocks at every power-of-two boundary of the scale (amax =
    448 * 2**e and its bf16 neighbours), tiny and zero blocks and the bf16 extremes."""
    rng = np.random.default_rng(3)
    amaxes = [448.0 * 2.0**e for e in range(-40, 40, 3)]
    amaxes = amaxes + [float(np.nextafter(np.float32(a), np.float32(np.inf))) for a in amaxes] + [1e-5, 1e-4, 0.0]
    blocks = []
    for a in amaxes:
        b = rng.uniform(-1, 1, 128) * a
        b[rng.integers(128)] = a  # the block's largest magnitude is a itself
        blocks.append(b)
    blocks.append(np.full(128, 3.3895e38))  # near bf16's largest value
    x = jnp.asarray(np.stack(blocks), jnp.bfloat16)
    want = gm.ActQuant.of(x)
    codes, scales = gm._quantise_block(x)
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), np.asarray(want.codes).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales)[:, 0], np.asarray(want.scales())[:, 0])
    assert len(np.unique(np.asarray(scales))) > 20
    np.testing.assert_array_equal(np.asarray(gm.act_scale_inverse(want.amax)) * np.asarray(want.scales()), 1.0)


def test_fp8_rows_are_checked():
    x = jnp.ones((16, 256), jnp.bfloat16)
    rows = gm.ActQuant.of(x)
    w = _random_weights(np.random.default_rng(0), (1, 32, 256), "fp8")
    meta = md.dense_tiles(16, 1, 16)
    with pytest.raises(ValueError, match="ActQuant amax must be float32"):
        gm.kernel(gm.ActQuant(rows.codes, rows.amax[:, :1], x.dtype), w, *meta, block_m=16)
    with pytest.raises(ValueError, match="ActQuant codes must be float8_e4m3fn"):
        gm.kernel(gm.ActQuant(x, rows.amax, x.dtype), w, *meta, block_m=16)


def test_act_scale_equals_the_reference_division():
    """The kernel's scale of quantised rows from amax's exponent bits against the reference's
    ``pow2_ceil(max(amax, 1e-4) / 448)``: random magnitudes over the whole fp32 range, every
    multiple of 448 by a power of two and its float neighbours (where a rounded quotient could
    cross the power of two), the floor and below."""
    assert (gm.ACT_AMAX_FLOOR, gm.ACT_FP8_MAX) == (quant.FP8_AMAX_FLOOR, quant.FP8_MAX)
    rng = np.random.default_rng(0)
    edges = np.float32(448.0) * np.exp2(np.arange(-30, 100, dtype=np.float32))
    near = np.concatenate([np.nextafter(edges, np.float32(0)), edges, np.nextafter(edges, np.float32(np.inf))])
    tiny = np.asarray([0.0, 1e-30, 9.99e-5, 1e-4, 1.0001e-4], np.float32)
    wide = np.exp2(rng.uniform(-30, 120, 200_000)).astype(np.float32)
    fine = np.float32(448.0) * (1.75 + rng.uniform(-1e-5, 1e-5, 200_000)).astype(np.float32)  # m near 1.75
    amax = jnp.asarray(np.concatenate([near, tiny, wide, fine]))
    want = np.asarray(quant.fp8_scales_of_amax(amax))
    got = np.asarray(gm.act_scale(amax))
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) > 100


def test_decode_configs_split_k_only_where_programs_are_few():
    # Flash decode at one token: the shared expert's w1 (N 2048, K 4096) has 32 column tiles of 64
    # and 32 loop steps of 128: split 8 (4 steps each) is the most the minimum steps allow
    cfg = gm.default_config(16, "fp8", n=2048, k=4096, tiles=1)
    assert cfg.split_k == 8 and 4096 // 128 // cfg.split_k == gm.SPLIT_MIN_STEPS
    # the routed experts' 6 pair tiles x 32 column tiles: split 2 reaches the target; their down
    # projection (6 x 64 column tiles) has enough programs already
    assert gm.default_config(16, "fp8_k128", n=2048, k=4096, tiles=6).split_k == 2
    assert gm.default_config(16, "fp8_k128", n=4096, k=2048, tiles=6).split_k == 1
    # unsplit routed experts (a 6-token verify's 36 pairs, the step's down projection) stream
    # 256-input steps in 3 stages; the split step SwiGLU keeps 128-input steps in 4
    for n, k, t in ((2048, 4096, 36), (4096, 2048, 36), (4096, 2048, 6)):
        cfg = gm.default_config(16, "fp8_k128", n=n, k=k, tiles=t)
        assert (cfg.split_k, cfg.block_k, cfg.num_stages) == (1, 256, 3)
    cfg = gm.default_config(16, "fp8_k128", n=2048, k=4096, tiles=6)
    assert (cfg.block_k, cfg.num_stages) == (128, 4)
    # FP4's fused SwiGLU (two weights decoded per program) in 32-column tiles, one weight in 64
    assert gm.default_config(16, "fp4", n=2048, k=4096, tiles=6, weights=2).block_n == 32
    assert gm.default_config(16, "fp4", n=4096, k=2048, tiles=6).block_n == 64
    assert gm.default_config(32, "fp4", n=2048, k=4096, tiles=6, weights=2).block_n == 64
    assert gm.default_config(16, "fp4", n=2048, k=4096, tiles=6).split_k == 1  # FP4: faster unsplit
    # the split keeps at least SPLIT_MIN_STEPS loop steps per program (K 1024: 8 steps of 128)
    assert gm.default_config(16, "fp8", n=512, k=1024, tiles=1).split_k == 2
    # enough programs already (wq_b: N 32768), prefill row tiles, and unknown shapes: no split
    assert gm.default_config(16, "fp8", n=32768, k=1024, tiles=1).split_k == 1
    assert gm.default_config(64, "fp8", n=2048, k=4096, tiles=1).split_k == 1
    assert gm.default_config(16, "fp8").split_k == 1
    assert gm.split_for(1, 100) == 16 and gm.split_for(1, 100, min_steps=50) == 2
    with pytest.raises(ValueError, match="split_k must be a power of two"):
        gm.GemmConfig(split_k=3)


def test_row_tile_follows_rows_per_group():
    # plain matmuls: by the rows alone
    assert [gm.block_m_for(m) for m in (1, 256, 257, 2048, 2049)] == [16, 16, 32, 32, 64]
    # Flash experts (256): 16 while they average <= 16 pairs each (a batch-32 verify's 192 tokens
    # x top-6 = 1152 pairs, a batch-64 one's 2304), 32 up to 32 each (768 or 1024 tokens), then
    # the plain rule (a 2048-token prefill: 12288 pairs, 48 per expert: 64)
    assert gm.block_m_for(1152, 256) == gm.block_m_for(2304, 256) == gm.block_m_for(4096, 256) == 16
    assert gm.block_m_for(4097, 256) == gm.block_m_for(6144, 256) == gm.block_m_for(8192, 256) == 32
    assert gm.block_m_for(8193, 256) == gm.block_m_for(12288, 256) == 64
    # few experts: never above the plain rule
    assert gm.block_m_for(128, 8) == 16 and gm.block_m_for(200, 8) == 16 and gm.block_m_for(300, 8) == 32


def test_batched_matmul_is_a_plain_matmul_per_group():
    rng = np.random.default_rng(3)
    w = _random_weights(rng, (3, 128, 256), "fp8")
    x = jnp.asarray(rng.standard_normal((3, 5, 256)), jnp.bfloat16)
    want = np.einsum("gmk,gnk->gmn", np.asarray(x, np.float32), np.asarray(gm.dequantize(w, jnp.float32)))
    for impl in ("xla", "pallas"):
        got = np.asarray(gm.batched_matmul(x, w, out_dtype=jnp.float32, impl=impl))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # quantised rows (the reference's FP8 GEMM input): the product of the rounded rows
    want8 = np.einsum("gmk,gnk->gmn", np.asarray(quant.fp8_sim(x, 128), np.float32),
                      np.asarray(gm.dequantize(w, jnp.float32)))
    got8 = np.asarray(gm.batched_matmul(x[:1], w.group(0), act_quant=True, out_dtype=jnp.float32, impl="pallas"))
    np.testing.assert_allclose(got8, want8[:1], rtol=1e-5, atol=1e-4)
    # one row tile: the kernel quantises the rows; more tiles: XLA quantises them first
    assert isinstance(gm.quantised_rows(x[0, :1].repeat(16, 0), 16), gm.QuantRows)
    assert isinstance(gm.quantised_rows(x[0, :1].repeat(32, 0), 16), gm.ActQuant)
    x40 = jnp.asarray(rng.standard_normal((1, 40, 256)), jnp.bfloat16)
    w0 = np.asarray(gm.dequantize(w.group(0), jnp.float32))[0]
    want40 = np.asarray(quant.fp8_sim(x40[0], 128), np.float32) @ w0.T
    got40 = np.asarray(gm.batched_matmul(x40, w.group(0), act_quant=True, out_dtype=jnp.float32, impl="pallas"))
    np.testing.assert_allclose(got40[0], want40, rtol=1e-5, atol=1e-4)


def test_plain_linear_tiles(monkeypatch):
    # Flash linears (outputs per group, groups): wq_b, wo_b, wq_a, wo_a
    wq_b, wo_b, wq_a, wo_a = (32768, 1), (4096, 1), (1024, 1), (1024, 8)
    tile = lambda rows, quantised, shape: gm.plain_linear_tiles(rows, quantised, *shape)
    # up to the rows: one 16-row tile at a decode step or a batch-1 verify
    assert {tile(m, True, s) for m in (1, 6, 16) for s in (wq_b, wo_b, wq_a)} == {(16, True)}
    assert tile(6, False, wo_a) == (16, None)
    # a batch-32 step (32 rows): 32-row codes only where one tile still runs >= 128 programs
    assert [tile(32, True, s)[0] for s in (wq_b, wo_b, wq_a)] == [32, 16, 16] and tile(32, False, wo_a)[0] == 16
    # a batch-32 verify (192 rows): codes in 32-row tiles (at most), wo_a's values in 64; wq_a keeps 16
    assert [tile(192, True, s) for s in (wq_b, wo_b, wq_a)] == [(32, True), (32, True), (16, True)]
    assert tile(192, False, wo_a) == (64, None) and tile(384 // 2, False, wo_a)[0] == 64
    # 64- and 128-slot verifies (384, 768 rows) still take codes; wq_a 32-row tiles once they run >= 128 programs
    assert [tile(384, True, s) for s in (wq_b, wo_b, wq_a)] == [(32, True), (32, True), (16, True)]
    assert [tile(768, True, s) for s in (wq_b, wo_b, wq_a)] == [(32, True), (32, True), (32, True)]
    assert tile(768, False, wo_a) == (64, None)
    # prefill sizes: block_m_for and the kernel's own codes rule
    assert tile(gm.LINEAR_VERIFY_MAX_ROWS + 1, True, wq_b) == (32, None) and tile(4096, False, wo_a) == (64, None)
    monkeypatch.setattr(gm, "LINEAR_CODES_MAX_BLOCK_M", 64)
    assert tile(192, True, wq_b) == (64, True)
    monkeypatch.setattr(gm, "LINEAR_CODES_MAX_BLOCK_M", 16)
    monkeypatch.setattr(gm, "VALUES_MAX_BLOCK_M", 16)
    assert tile(192, True, wq_b) == (16, True) and tile(192, False, wo_a) == (16, None)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_k128"])
def test_linears_multiply_codes_in_larger_row_tiles(monkeypatch, fmt):
    """With codes allowed in 64-row tiles a verify-sized linear (40 rows: one tile the kernel
    quantises itself; 100 rows: two tiles quantised first) still gives the product of the rounded
    rows, and the kernel really takes codes there (not its own rule's values)."""
    monkeypatch.setattr(gm, "LINEAR_CODES_MAX_BLOCK_M", 64)
    monkeypatch.setattr(gm, "LINEAR_MIN_PROGRAMS", 1)  # these small weights: one 128-column block
    rng = np.random.default_rng(11)
    w, w3 = _random_weights(rng, (1, 128, 256), fmt), _random_weights(rng, (1, 128, 256), fmt)
    w0 = np.asarray(gm.dequantize(w, jnp.float32))[0]
    for m in (40, 100):
        x = jnp.asarray(rng.standard_normal((1, m, 256)) * 3, jnp.bfloat16)
        got = np.asarray(gm.batched_matmul(x, w, act_quant=True, out_dtype=jnp.float32, impl="pallas"))[0]
        np.testing.assert_allclose(got, np.asarray(quant.fp8_sim(x[0], 128), np.float32) @ w0.T, rtol=1e-5, atol=1e-4)
        got = gm.batched_swiglu(x[0], w, w3, limit=1.0, act_quant=True, impl="pallas")
        want = gm.batched_swiglu(x[0], w, w3, limit=1.0, act_quant=True, impl="xla")
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
        # the kernel multiplies codes: quantising the one tile itself (40 rows) or given them (100)
        jaxpr = str(jax.make_jaxpr(lambda x: gm.batched_matmul(x, w, act_quant=True, impl="pallas"))(x))
        assert f"grouped_matmul_{fmt}_a8{'q' if m <= 64 else ''}" in jaxpr
    rows = gm.ActQuant.of(jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16))
    assert isinstance(gm._kernel_rows(rows, w, 64, codes=True), gm.ActQuant)
    assert not isinstance(gm._kernel_rows(rows, w, 64), gm.ActQuant)  # the kernel's own rule: values


FLASH = dict(e=256, d=4096, i=2048)


def _flash_weights(fmt: str, n: int, k: int) -> gm.Weights:
    e = FLASH["e"]
    if fmt == "fp4":
        return gm.Weights(SD((e, n, k // 2), jnp.uint8), SD((e, n, k // 32), jnp.uint8), "fp4")
    if fmt == "fp8":
        return gm.Weights(SD((e, n, k), jnp.float8_e4m3fn), SD((e, n // 128, k // 128), jnp.uint8), "fp8")
    if fmt == "fp8_k128":
        return gm.Weights(SD((e, n, k), jnp.float8_e4m3fn), SD((e, n, k // 128), jnp.uint8), "fp8_k128")
    return gm.Weights(SD((e, n, k), jnp.bfloat16), None, "dense")


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
@pytest.mark.parametrize("pairs", [36, md.MAX_KERNEL_PAIRS])  # a batch-1 verify of 6 tokens x top-6; the most
def test_group_tiles_kernel_lowers_for_gpus(arch, platform, pairs):
    text = lowering.lower(lambda ids: md.tiles_kernel(ids, FLASH["e"], 16, interpret=False),
                          SD((pairs,), jnp.int32), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and '"group_tiles"' in text


@pytest.mark.parametrize("fmt", ["fp4", "fp8_k128", "fp8", "dense"])
@pytest.mark.parametrize("pairs", [6, 36, 12288])  # 1 decode token, 6 verify tokens, 2048 prefill tokens x top-6
def test_flash_shapes_lower_for_gfx950(fmt, pairs):
    bm = gm.block_m_for(pairs, FLASH["e"])
    t = pairs if pairs <= 16 else md.max_tiles(pairs, FLASH["e"], bm)  # pair tiles at one token
    split = gm.default_config(bm, fmt, n=FLASH["i"], k=FLASH["d"], tiles=t).split_k
    assert (split > 1) == (pairs == 6 and fmt != "fp4")  # one token: K split (3-d grid, fp32 partials); FP4 unsplit
    i32 = jnp.int32
    meta = (SD((t,), i32), SD((1,), i32))
    x = SD((t * bm, FLASH["d"]), jnp.bfloat16)
    w13 = _flash_weights(fmt, FLASH["i"], FLASH["d"])
    text = lowering.lower(lambda x, w, rw, tg, nt: gm.swiglu_kernel(x, w, w, rw, tg, nt, block_m=bm, limit=10.0,
                                                                     interpret=False),
                          x, w13, SD((t * bm,), jnp.float32), *meta)
    assert lowering.count_triton_calls(text) == 1
    h = SD((t * bm, FLASH["i"]), jnp.bfloat16)
    text = lowering.lower(lambda h, w, tg, nt: gm.kernel(h, w, tg, nt, block_m=bm, interpret=False),
                          h, _flash_weights(fmt, FLASH["d"], FLASH["i"]), *meta)
    assert lowering.count_triton_calls(text) == 1
    if gm.takes_codes(fmt, bm):  # quantised rows at decode / verify: e4m3 x e4m3 dots
        rows = gm.ActQuant(SD((t * bm, FLASH["d"]), jnp.float8_e4m3fn), SD((t * bm, FLASH["d"] // 128), jnp.float32))
        text = lowering.lower(lambda r, w, rw, tg, nt: gm.swiglu_kernel(r, w, w, rw, tg, nt, block_m=bm, limit=10.0,
                                                                         interpret=False),
                              rows, w13, SD((t * bm,), jnp.float32), *meta)
        assert lowering.count_triton_calls(text) == 1 and "grouped_matmul_" + fmt + "_a8" in text
        text = lowering.lower(lambda x, w, rw, tg, nt: gm.swiglu_kernel(gm.QuantRows(x), w, w, rw, tg, nt, block_m=bm,
                                                                         limit=10.0, interpret=False),
                              x, w13, SD((t * bm,), jnp.float32), *meta)  # rows quantised in the kernel
        assert lowering.count_triton_calls(text) == 1 and "grouped_matmul_" + fmt + "_a8q" in text
        # the SwiGLU quantised as w2's input: after a K split, one more launch (swiglu_quantise)
        text = lowering.lower(lambda r, w, rw, tg, nt: gm.swiglu_kernel(r, w, w, rw, tg, nt, block_m=bm, limit=10.0,
                                                                         interpret=False, quantised_out=True).codes,
                              rows, w13, SD((t * bm,), jnp.float32), *meta)
        assert lowering.count_triton_calls(text) == 1 + (split > 1) and ("swiglu_quantise" in text) == (split > 1)


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
@pytest.mark.parametrize("learned", [True, False])
@pytest.mark.parametrize("unsplit", [0, 32])
def test_routed_swiglu_lowers_for_gpus(monkeypatch, arch, platform, learned, unsplit):
    """A Flash decode step's routed SwiGLU deciding its pairs' routing (``Route``: the router's
    8 partial sums, the bias or the hashed experts): K split with ``swiglu_quantise``, or unsplit."""
    monkeypatch.setattr(gm, "ONE_TOKEN_SWIGLU_BLOCK_N", unsplit)
    e, k, bm = FLASH["e"], 6, 16
    rows = gm.ActQuant(SD((k * bm, FLASH["d"]), jnp.float8_e4m3fn), SD((k * bm, FLASH["d"] // 128), jnp.float32))
    route = gm.Route(SD((8, e), jnp.float32), SD((e,), jnp.float32) if learned else SD((1, k), jnp.int32), n=1, k=k)
    w13 = _flash_weights("fp8_k128", FLASH["i"], FLASH["d"])
    text = lowering.lower(lambda r, w, route, nt: gm.swiglu_kernel(r, w, w, None, route, nt, block_m=bm, limit=10.0,
                                                                   interpret=False, quantised_out=True),
                          rows, w13, route, SD((1,), jnp.int32), arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 + (unsplit == 0) and "_routed" in text


@pytest.mark.parametrize("bm", [32, 64])
def test_verify_sized_linears_lower_codes_in_larger_tiles_for_gfx950(bm):
    """A Flash linear (wo_b: 4096 x 8192, fp8 weights) on quantised rows as codes in 32- and 64-row
    tiles (``plain_linear_tiles`` with a raised ``LINEAR_CODES_MAX_BLOCK_M``): given codes (192
    rows) and quantising its one tile itself; and wo_a's bf16 rows (8 groups) as values, also with
    ``fold_scales``."""
    n, k, t = 4096, 8192, 192 // bm
    w = gm.Weights(SD((1, n, k), jnp.float8_e4m3fn), SD((1, n // 128, k // 128), jnp.uint8), "fp8")
    meta = (SD((t,), jnp.int32), SD((1,), jnp.int32))
    rows = gm.ActQuant(SD((t * bm, k), jnp.float8_e4m3fn), SD((t * bm, k // 128), jnp.float32))
    text = lowering.lower(lambda r, w, tg, nt: gm.kernel(r, w, tg, nt, block_m=bm, interpret=False, codes=True),
                          rows, w, *meta)
    assert lowering.count_triton_calls(text) == 1 and "grouped_matmul_fp8_a8" in text
    text = lowering.lower(lambda x, w, tg, nt: gm.kernel(gm.QuantRows(x), w, tg, nt, block_m=bm, interpret=False,
                                                         codes=True), SD((bm, k), jnp.bfloat16), w,
                          SD((1,), jnp.int32), SD((1,), jnp.int32))
    assert lowering.count_triton_calls(text) == 1 and "grouped_matmul_fp8_a8q" in text
    g, r, i = 8, 1024, 4096  # wo_a: 8 groups of [1024, 4096]
    wa = gm.Weights(SD((g, r, i), jnp.float8_e4m3fn), SD((g, r // 128, i // 128), jnp.uint8), "fp8")
    fold = gm.GemmConfig(block_n=128, block_k=64, num_stages=4, fold_scales=True)  # opt-in: scales in the tiles
    for cfg in (None, fold):
        text = lowering.lower(lambda x, w, tg, nt: gm.kernel(x, w, tg, nt, block_m=bm, interpret=False, config=cfg),
                              SD((g * t * bm, i), jnp.bfloat16), wa, SD((g * t,), jnp.int32), SD((1,), jnp.int32))
        assert lowering.count_triton_calls(text) == 1


def _flash_experts_temp_bytes(tokens: int) -> int:
    cfg = config.flash(dspark=False)
    num = Numerics(weight_format="official", kernels="xla")
    experts = nnx.eval_shape(lambda: Experts(cfg, num, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(experts)
    k = cfg.num_experts_per_tok

    def layer(state, x, w, idx):
        return nnx.merge(graphdef, state).grouped(x, w, idx)

    args = (state, SD((tokens, cfg.hidden_size), jnp.bfloat16), SD((tokens, k), jnp.float32), SD((tokens, k), jnp.int32))
    compiled = jax.jit(layer).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_flash_moe_layer_memory_grows_with_tokens_times_topk():
    """A DeepSeek-V4-Flash routed-expert layer (256 FP4 experts, top-6) compiled for the CPU path:
    temporaries stay under 2 GiB at 2048 tokens and grow by about rows x (D + I) bf16 values per
    extra routed row, not with experts x tokens (the dense-GEMM expansion needs 2048 x 256 x 2048
    fp32 values = 4 GiB for one matrix). Both sizes take the prefill row tile (64), whose padding
    is part of the bound (fewer tokens take 16-row tiles and pad less)."""
    assert gm.block_m_for(1536 * 6, 256) == gm.block_m_for(2048 * 6, 256) == 64
    t1536, t2048 = _flash_experts_temp_bytes(1536), _flash_experts_temp_bytes(2048)
    assert t2048 < 2 * 2**30, t2048
    cfg = config.flash()
    per_row = (cfg.hidden_size + cfg.moe_intermediate_size) * 2  # bf16 x rows and h rows
    extra_rows = (2048 - 1536) * cfg.num_experts_per_tok
    assert t2048 - t1536 < 6 * extra_rows * per_row, (t1536, t2048)


def test_weight_bytes_of_the_official_formats():
    """The planner's weight bytes equal a real model's, and Flash's FP4 / FP8 weights take a
    fraction of bf16 (routed experts 0.5 + 1/32 bytes per weight instead of 2; the whole model with
    its DSpark stages about 155 GiB, against 567 GiB in bf16)."""
    import dspark_jax
    from dspark_jax import memory

    cfg = config.tiny().replace(n_routed_experts=24)
    for fmt in ("official", "fp8", "dense"):  # the model init builds, as shapes (its bytes: shapes and dtypes)
        model = dspark_jax.Model(nnx.eval_shape(lambda: dspark_jax.init(cfg, 0, weight_format=fmt).module))
        assert sum(memory.weight_bytes(cfg, fmt).values()) == model.weight_bytes
        assert f"weights={fmt}" in repr(model)
    one = config.flash_slice(1, dspark=False)
    q, d = memory.weight_bytes(one, "official"), memory.weight_bytes(one, "dense")
    assert q["routed_experts"] * 2 / (0.5 + 1 / 32) == d["routed_experts"]
    assert q["other"] < 0.95 * d["other"]  # FP8 attention / shared-expert matrices (embed and head stay bf16)
    flash = sum(memory.weight_bytes(config.flash(), "official").values())
    assert 150 * 2**30 < flash < 160 * 2**30  # 284 B parameters + 3 DSpark stages
