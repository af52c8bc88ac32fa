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
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

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


def group_tiles(group_ids: Int[Array, "n k"], num_groups: int, block_m: int, *, dropped: bool = False) -> GroupTiles:
    """Sort the pairs ``group_ids`` [n, k] by group (stable: token order inside a group) and tile them.

    dropped: pairs whose id is ``num_groups`` belong to no group (expert parallelism: pairs routed
    to another device's experts). They sort after every group, into tiles past ``num_tiles``, so
    no program computes their rows and their outputs are zeros."""
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
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
