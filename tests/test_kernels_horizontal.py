"""Independent kernels in one launch (``pallas_kernels.horizontal``): each part's program ids and
in-place outputs as in a launch of its own, a C4 layer's new rows (the window's row with q_norm,
the compressor's and the indexer's pooling) bit for bit against their own launches, the lowering
for gfx950 and NVIDIA, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from dspark_jax.config import tiny
from dspark_jax.model.norms_rope import layer_inv_freq
from pallas_kernels import compressor_pool, horizontal, kv_rows, lowering
from pallas_kernels.gemv import Partials
from tests.helpers import pallas_calls

SD = jax.ShapeDtypeStruct


def _ids_part(grid: tuple[int, int]) -> horizontal.Part:
    """Writes each program's ids into its element of [g0, g1]: out[i, j] = 100 i + j + 1."""
    def body(ids, out_ref):
        i, j = ids
        out_ref[pl.ds(i, 1), pl.ds(j, 1)] = jnp.full((1, 1), 100 * i + j + 1, jnp.int32)
    return horizontal.Part(body, grid, (), (SD(grid, jnp.int32),), name="ids")


def _double_part(x: jax.Array) -> horizontal.Part:
    """Doubles x [n, 8] in place, a row per program."""
    def body(ids, x_in, x_out):
        (i,) = ids
        x_out[pl.ds(i, 1), :] = 2 * x_in[pl.ds(i, 1), :]
    return horizontal.Part(body, (x.shape[0],), (x,), (SD(x.shape, x.dtype),), {0: 0}, name="double")


def test_parts_run_with_their_own_program_ids():
    """Parts of 2-D and 1-D grids laid end to end: every element written with its part's ids, the
    in-place part's input doubled; alone, a part runs on its own grid."""
    x = jnp.arange(40, dtype=jnp.float32).reshape(5, 8) - 7.5
    parts = [_ids_part((3, 4)), _double_part(x), _ids_part((2, 5))]
    fn = lambda x: horizontal.launch([parts[0], _double_part(x), parts[2]], interpret=True)  # noqa: E731
    jaxpr = jax.make_jaxpr(fn)(x)
    assert [n for n, _ in pallas_calls(jaxpr.jaxpr)] == ["ids_double_ids"]
    (a,), (doubled,), (b,) = fn(x)
    np.testing.assert_array_equal(np.asarray(a), 100 * np.arange(3)[:, None] + np.arange(4)[None] + 1)
    np.testing.assert_array_equal(np.asarray(b), 100 * np.arange(2)[:, None] + np.arange(5)[None] + 1)
    np.testing.assert_array_equal(np.asarray(doubled), 2 * np.asarray(x))
    ((alone,),) = horizontal.launch([_ids_part((3, 4))], interpret=True)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(a))
    with pytest.raises(ValueError, match="at least one part"):
        horizontal.launch([])


def _layer_rows(rng, b: int, quant_sim: bool):
    """A C4 layer's one-token new rows at small widths: the window's (512-row pool of 128 dims, wkv's
    8 partial sums) with q_norm (256 dims, wq_a's 8), the compressor's (C = 256) and the indexer's
    (C = 128) pooling from their projections' 8 partial sums, NaN-poisoned entries."""
    f32 = jnp.float32
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), f32)  # noqa: E731
    start = jnp.asarray(rng.integers(0, 2000, b) // 4 * 4 + 3, jnp.int32)  # every request closes a window
    ones = jnp.ones((b,), jnp.int32)
    window = (jnp.asarray(rng.standard_normal((b, 512, 128)) * 50, jnp.bfloat16), (start % 512)[:, None],
              start[:, None], Partials(normal(8, b, 1, 128)), jnp.asarray(rng.uniform(0.5, 1.5, 128), f32),
              layer_inv_freq(tiny(), 0))
    rows = dict(eps=1e-6, quant="kv" if quant_sim else None, dtype=jnp.bfloat16, norm_x=Partials(normal(8, b, 256)),
                norm_weight=jnp.asarray(rng.uniform(0.5, 1.5, 256), f32), norm_eps=1e-6, rounded=quant_sim)
    pools = []
    for c, quant in ((256, "kv"), (128, "keys")):
        w = c // 2
        args = (normal(b, 24, c), 2 * normal(b, 24, c), Partials(normal(8, b, 1, c)), Partials(2 * normal(8, b, 1, c)),
                normal(4, c), start, ones, jnp.full((b, 512, w), jnp.nan, jnp.bfloat16),
                jnp.asarray(rng.uniform(0.5, 1.5, w), f32), layer_inv_freq(tiny(), 4))
        pools.append((args, dict(ratio=4, overlap=True, eps=1e-6, quant=quant if quant_sim else None,
                                 dtype=jnp.bfloat16)))
    return window, rows, pools


@pytest.mark.parametrize("quant_sim", [False, True])
def test_layer_rows_in_one_launch_equal_their_own_launches(quant_sim):
    """The window's row with q_norm and both compressors' pooling and entries in one launch: every
    output bit for bit as from each kernel launched alone; each pool's closed window written."""
    window, rows, pools = _layer_rows(np.random.default_rng(3 + quant_sim), 3, quant_sim)
    parts = [kv_rows.rows_and_norm_part(*window, **rows, impl="pallas")]
    parts += [compressor_pool.pool_write_part(*args, **kw) for args, kw in pools]
    assert all(p is not None for p in parts)
    got = horizontal.launch(parts, name="new_rows_x3", interpret=True)
    alone = [kv_rows.write_rows_and_norm(*window, **rows, impl="pallas")]
    for args, kw in pools:
        entries, ring_kv, ring_score = compressor_pool.pool_write_kernel(*args, **kw)
        alone.append((ring_kv, ring_score, entries))
    assert [len(g) for g in got] == [2 + quant_sim, 3, 3]
    for g_outs, a_outs in zip(got, alone):
        for g, a in zip(g_outs, a_outs):
            assert g.shape == a.shape and g.dtype == a.dtype
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(a, np.float32))
    start = np.asarray(pools[0][0][5])
    for _, _, entries in got[1:]:
        e = np.asarray(entries, np.float32)
        closed = e[np.arange(3), start // 4]
        assert np.isfinite(closed).all() and np.isnan(np.delete(e[0], start[0] // 4, axis=0)).all()


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
def test_flash_layer_rows_lower_for_gpus(arch, platform):
    """A Flash C4 layer's new rows at one token (the window's 512-dim row from wkv's 8 partial sums
    with q_norm's 1024 dims, quantised; the compressor's C = 1024 and the indexer's C = 256 pooling
    into 2k-context entries): one Triton call."""
    freq, freq4 = layer_inv_freq(tiny(), 0), layer_inv_freq(tiny(), 4)
    f32, i32 = jnp.float32, jnp.int32

    def fn(pool, slots, kv, q_a, weight, q_weight, rings, projected, ape, start, entries, w_norm):
        parts = [kv_rows.rows_part(pool, slots, slots, Partials(kv), weight, jnp.asarray(freq), Partials(q_a),
                                   q_weight, eps=1e-6, quant="kv", ratio=0, dtype=jnp.dtype(jnp.bfloat16),
                                   norm_eps=1e-6, norm_rounded=True)]
        for i, quant in enumerate(("kv", "keys")):
            parts.append(compressor_pool.pool_write_part(
                rings[i], rings[i], Partials(projected[i]), Partials(projected[i]), ape[i], start, start, entries[i],
                w_norm[i], freq4, ratio=4, overlap=True, eps=1e-6, quant=quant, dtype=jnp.bfloat16))
        return horizontal.launch(parts, name="new_rows_x3", interpret=False)

    widths = (512, 128)
    text = lowering.lower(fn, SD((1, 512, 512), jnp.bfloat16), SD((1, 1), i32), SD((8, 1, 1, 512), f32),
                          SD((8, 1, 1024), f32), SD((512,), f32), SD((1024,), f32),
                          [SD((1, 24, 2 * w), f32) for w in widths], [SD((8, 1, 1, 2 * w), f32) for w in widths],
                          [SD((4, 2 * w), f32) for w in widths], SD((1,), i32),
                          [SD((1, 512, w), jnp.bfloat16) for w in widths], [SD((w,), f32) for w in widths],
                          arch=arch, platform=platform)
    assert lowering.count_triton_calls(text) == 1 and "new_rows_x3" in text
