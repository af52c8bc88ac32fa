"""Row tiles for grouped matmuls (the routed experts): which rows go to which group.

A mixture-of-experts layer sends every token to ``k`` experts: ``P = n * k`` (token, expert)
pairs. The grouped matmul wants them sorted by expert and cut into tiles of ``block_m`` rows that
each belong to one expert, so that a program multiplies one tile by one expert's weights. Each
expert's rows are padded up to a multiple of ``block_m``:

    rows  [ e0 e0 e0 -- | e3 e3 e3 e3 | e3 -- -- -- | e7 -- -- -- | unused tiles ... ]
    tiles [     e0      |     e3      |     e3      |     e7      | ...              ]

Experts that no token chose get no tile, so their weights are never read. The number of tiles in
use depends on the routing; the arrays are sized by the static bound ``max_tiles``
(``P / block_m`` full tiles plus one partial tile per expert that can be busy), so memory grows
with tokens x top-k, never with tokens x experts.

``group_tiles`` builds the layout with XLA (a scatter, two cumulative sums, a stable sort and
gathers: a chain of launches, 15-17 us on an H200 for the 36 pairs of a batch-1 verify, on the
critical path before the experts), or, for at most ``MAX_KERNEL_PAIRS`` pairs on the Pallas path, with
``tiles_kernel``: one program that counts instead of sorting. A pair's row is its group's first
row plus the pairs of its group before it (the stable order), every row's pair the pair whose row
it is, every tile's group the number of groups that end at or before the tile's first row:
comparisons of every pair with every group and pair, the same integers as the XLA path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend

if TYPE_CHECKING:
    from jaxtyping import Array, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GroupTiles:
    """Where every (token, expert) pair sits in the tiled row layout.

    tile_group [T]: the group (expert) of each tile; tiles at or past ``num_tiles`` are unused
        (their group is clipped to a valid index and their rows are padding).
    num_tiles [1]: tiles in use.
    row_of_pair [P]: row of pair p = token * k + j.
    pair_of_row [T * block_m]: pair of each row, -1 for padding rows.
    """

    tile_group: Int[Array, " T"]
    num_tiles: Int[Array, " 1"]
    row_of_pair: Int[Array, " P"]
    pair_of_row: Int[Array, " M"]
    block_m: int = dataclasses.field(metadata=dict(static=True), default=16)

    @property
    def max_tiles(self) -> int:
        return self.tile_group.shape[0]

    @property
    def num_rows(self) -> int:
        return self.max_tiles * self.block_m


def max_tiles(num_pairs: int, num_groups: int, block_m: int) -> int:
    """Static bound on the tiles ``num_pairs`` rows need when each group is padded to ``block_m``:
    sum_g ceil(size_g / block_m) <= (P + busy * (block_m - 1)) / block_m, busy = min(groups, P)."""
    busy = min(num_groups, num_pairs)
    return max(1, (num_pairs + busy * (block_m - 1)) // block_m)


def _check_block_m(block_m: int) -> None:
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")


def group_tiles(group_ids: Int[Array, "n k"], num_groups: int, block_m: int, *, dropped: bool = False,
                impl: str | None = None) -> GroupTiles:
    """Sort the pairs ``group_ids`` [n, k] by group (stable: token order inside a group) and tile them.

    dropped: pairs whose id is ``num_groups`` belong to no group (expert parallelism: pairs routed
    to another device's experts). They sort after every group, into tiles past ``num_tiles``, so
    no program computes their rows and their outputs are zeros. ``impl`` (``pallas_kernels.backend``):
    "pallas" takes ``tiles_kernel`` for up to ``MAX_KERNEL_PAIRS`` pairs without dropped ones."""
    if not dropped and 1 <= group_ids.size <= MAX_KERNEL_PAIRS and backend.resolve(impl) == "pallas":
        return tiles_kernel(group_ids, num_groups, block_m)
    return reference(group_ids, num_groups, block_m, dropped=dropped)


def reference(group_ids: Int[Array, "n k"], num_groups: int, block_m: int, *, dropped: bool = False) -> GroupTiles:
    """``group_tiles`` in XLA: a stable sort of the pairs by group."""
    _check_block_m(block_m)
    buckets = num_groups + 1 if dropped else num_groups
    flat = group_ids.reshape(-1).astype(jnp.int32)
    p = flat.shape[0]
    sizes = jnp.zeros((buckets,), jnp.int32).at[flat].add(1)
    padded = (sizes + block_m - 1) // block_m * block_m
    end = jnp.cumsum(padded)  # padded rows of groups 0..g
    order = jnp.argsort(flat, stable=True)
    g_sorted = flat[order]
    first = (jnp.cumsum(sizes) - sizes)[g_sorted]  # sorted index of the group's first pair
    row_sorted = (end - padded)[g_sorted] + jnp.arange(p, dtype=jnp.int32) - first
    row_of_pair = jnp.zeros((p,), jnp.int32).at[order].set(row_sorted)
    t = max_tiles(p, buckets, block_m)
    pair_of_row = jnp.full((t * block_m,), -1, jnp.int32).at[row_of_pair].set(jnp.arange(p, dtype=jnp.int32))
    tile_start = jnp.arange(t, dtype=jnp.int32) * block_m
    tile_group = jnp.sum(end[None, :] <= tile_start[:, None], axis=1, dtype=jnp.int32)
    return GroupTiles(tile_group=jnp.minimum(tile_group, num_groups - 1),
                      num_tiles=end[num_groups - 1:num_groups] // block_m,
                      row_of_pair=row_of_pair, pair_of_row=pair_of_row, block_m=block_m)


# The most pairs ``tiles_kernel`` takes: one program compares every pair with every group
# ([pairs, groups]) and pair, in registers (64 x 256 at most: 10 tokens x top-6 of Flash's 256 experts).
MAX_KERNEL_PAIRS = 64


def _tiles_kernel(ids_ref, tile_group_ref, num_tiles_ref, row_of_pair_ref, pair_of_row_ref, *, p: int, e: int,
                  bm: int, t: int, pp: int, ep: int, tp: int, br: int):
    pair = jnp.arange(pp, dtype=jnp.int32)
    pair_ok = pair < p
    ids = pltriton.load(ids_ref.at[pair], mask=pair_ok, other=-1)  # [pp]; padding pairs: no group
    group = jnp.arange(ep, dtype=jnp.int32)
    chose = ids[:, None] == group[None, :]  # [pp, ep]
    padded = (jnp.sum(chose.astype(jnp.int32), axis=0) + bm - 1) // bm * bm  # each group's rows
    end = jnp.cumsum(padded)  # rows of groups 0..g
    first = jnp.sum(jnp.where(chose, (end - padded)[None, :], 0), axis=1)  # the pair's group's first row
    before = (ids[:, None] == ids[None, :]) & (pair[None, :] < pair[:, None])  # same group, earlier pair
    rows = jnp.where(pair_ok, first + jnp.sum(before.astype(jnp.int32), axis=1), -1)
    pltriton.store(row_of_pair_ref.at[pair], rows, mask=pair_ok)
    one = jnp.zeros((1,), jnp.int32)
    pltriton.store(num_tiles_ref.at[one], one + jnp.sum(padded) // bm)
    tile = jnp.arange(tp, dtype=jnp.int32)
    ended = (end[None, :] <= (tile * bm)[:, None]) & (group[None, :] < e)  # [tp, ep]
    pltriton.store(tile_group_ref.at[tile], jnp.minimum(jnp.sum(ended.astype(jnp.int32), axis=1), e - 1),
                   mask=tile < t)
    for r0 in range(0, t * bm, br):  # each row's pair (-1: padding)
        row = r0 + jnp.arange(br, dtype=jnp.int32)
        owner = jnp.max(jnp.where(rows[None, :] == row[:, None], pair[None, :], -1), axis=1)
        pltriton.store(pair_of_row_ref.at[row], owner, mask=row < t * bm)


@functools.partial(jax.jit, static_argnames=("num_groups", "block_m", "interpret"))
def _tiles_pallas(flat, *, num_groups: int, block_m: int, interpret: bool):
    p = flat.shape[0]
    t = max_tiles(p, num_groups, block_m)
    pp, ep, tp = (backend.next_power_of_2(v) for v in (p, num_groups, t))
    br = min(128, backend.next_power_of_2(t * block_m))
    kernel = functools.partial(_tiles_kernel, p=p, e=num_groups, bm=block_m, t=t, pp=pp, ep=ep, tp=tp, br=br)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=(1,),
            out_shape=(i32(t), i32(1), i32(p), i32(t * block_m)),
            compiler_params=backend.compiler_params(8, 1),
            interpret=interpret,
            name="group_tiles",
        )(flat)


def tiles_kernel(group_ids: Int[Array, "n k"], num_groups: int, block_m: int, *,
                 interpret: bool | None = None) -> GroupTiles:
    """``group_tiles`` (no dropped pairs) as one Pallas program, for at most ``MAX_KERNEL_PAIRS``
    pairs; the same integers as ``reference``."""
    flat = group_ids.reshape(-1).astype(jnp.int32)
    if not 1 <= flat.shape[0] <= MAX_KERNEL_PAIRS:
        raise ValueError(f"tiles_kernel takes 1 to {MAX_KERNEL_PAIRS} pairs, got {flat.shape[0]}")
    _check_block_m(block_m)
    tile_group, num_tiles, row_of_pair, pair_of_row = _tiles_pallas(
        flat, num_groups=num_groups, block_m=block_m, interpret=backend.interpret_mode(interpret))
    return GroupTiles(tile_group=tile_group, num_tiles=num_tiles, row_of_pair=row_of_pair, pair_of_row=pair_of_row,
                      block_m=block_m)


def pair_tiles(group_ids: Int[Array, "n k"], block_m: int) -> GroupTiles:
    """One tile per pair, in pair order, with the pair in the tile's first row: no sort and no
    scatter, only index arithmetic, so it costs no kernel launch of its own. For the few pairs of a
    decode step, where sorted tiles hold one row each anyway; a group chosen by two pairs is read twice."""
    flat = group_ids.reshape(-1).astype(jnp.int32)
    p = flat.shape[0]
    rows = jnp.arange(p * block_m, dtype=jnp.int32)
    return GroupTiles(tile_group=flat, num_tiles=jnp.full((1,), p, jnp.int32),
                      row_of_pair=jnp.arange(p, dtype=jnp.int32) * block_m,
                      pair_of_row=jnp.where(rows % block_m == 0, rows // block_m, -1), block_m=block_m)


def dense_tiles(rows_per_group: int, num_groups: int, block_m: int) -> tuple[Int[Array, " T"], Int[Array, " 1"]]:
    """(tile_group, num_tiles) for ``num_groups`` groups of the same ``rows_per_group`` rows (a
    multiple of ``block_m``), laid out group after group: a batched matmul, or a plain one (1 group)."""
    if rows_per_group % block_m:
        raise ValueError(f"rows_per_group ({rows_per_group}) must be a multiple of block_m ({block_m})")
    per = rows_per_group // block_m
    t = per * num_groups
    return jnp.arange(t, dtype=jnp.int32) // per, jnp.full((1,), t, jnp.int32)
