"""Cache pytrees of the target model, addressed by absolute position (DESIGN 4).

Nothing is ever undone. Every row lives at a slot derived from its absolute position, and which
rows are real is derived from the committed length ``lengths[b]``:

- window ring: ``[B, R, d]`` with ``R = sliding_window + MAX_VERIFY_TOKENS``, slot = pos % R;
- compressor inputs: per-token (kv, gate score) rows ``[B, Rc, coff*w]`` (fp32), slot = pos % Rc;
- compressed entries (and indexer keys): ``[B, N, w]`` indexed by window number.

A forward over a chunk writes its rows tentatively; rejecting tokens after a verify is just
setting ``lengths`` to the accepted length (``commit``). The ring slack guarantees that a
tentative row can only overwrite rows no query will read again, and a compressed entry closed
by a rejected token is recomputed from the real token before any query can see it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dspark_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CompressorState:
    kv: Float[Array, "b rc cw"]  # projected kv of recent tokens (fp32)
    score: Float[Array, "b rc cw"]  # projected gate scores of recent tokens (fp32, without ape)
    entries: Float[Array, "b n w"]  # compressed entries by window number


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    window: Float[Array, "b r d"]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetCache:
    layers: tuple[LayerCache, ...]
    lengths: Int[Array, " b"]  # committed tokens per request
    max_len: int = dataclasses.field(metadata=dict(static=True), default=0)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def _compressor_state(batch: int, ratio: int, width: int, ring: int, n_entries: int, dtype, fill) -> CompressorState:
    coff = 2 if ratio == 4 else 1
    return CompressorState(kv=jnp.full((batch, ring, coff * width), fill, jnp.float32),
                           score=jnp.full((batch, ring, coff * width), fill, jnp.float32),
                           entries=jnp.full((batch, n_entries, width), fill, dtype))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, *, fill: float = 0.0) -> TargetCache:
    """Empty caches for ``batch`` requests of up to ``max_len`` tokens each (prompt + generation +
    one verify block of slack). ``fill`` lets tests poison unwritten storage."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if not 1 <= max_len <= cfg.max_position_embeddings:
        raise ValueError(f"max_len must lie in [1, max_position_embeddings={cfg.max_position_embeddings}], "
                         f"got {max_len}")
    layers = []
    for i, ratio in enumerate(cfg.compress_ratios):
        window = jnp.full((batch, cfg.window_ring_size, cfg.head_dim), fill, dtype)
        comp = idx = None
        if ratio:
            n = -(-max_len // ratio)
            ring = cfg.compressor_ring_size(ratio)
            comp = _compressor_state(batch, ratio, cfg.head_dim, ring, n, dtype, fill)
            if ratio == 4:
                idx = _compressor_state(batch, ratio, cfg.index_head_dim, ring, n, dtype, fill)
        layers.append(LayerCache(window=window, compressor=comp, indexer=idx))
    return TargetCache(layers=tuple(layers), lengths=jnp.zeros((batch,), jnp.int32), max_len=max_len)


def commit(cache: TargetCache, n_tokens: Int[Array, " b"]) -> TargetCache:
    """Accept ``n_tokens`` more tokens per request (everything written beyond stays tentative)."""
    return dataclasses.replace(cache, lengths=cache.lengths + n_tokens.astype(jnp.int32))


def ring_positions(lengths: Int[Array, " b"], ring: int) -> Int[Array, "b r"]:
    """Absolute position held by each ring slot (the latest committed one), -1 if none yet."""
    s = jnp.arange(ring, dtype=jnp.int32)[None]
    last = lengths[:, None] - 1
    return last - jnp.mod(last - s, ring)


def ring_write_slots(lengths: Int[Array, " b"], n_valid: Int[Array, " b"], t: int, ring: int) -> Int[Array, "b t"]:
    """Ring slots for the rows of a chunk; rows that are padding or that an even later row of the
    same chunk overwrites get the out-of-range slot ``ring`` (dropped by the scatter)."""
    row = jnp.arange(t, dtype=jnp.int32)[None]
    keep = (row < n_valid[:, None]) & (row >= n_valid[:, None] - ring)
    return jnp.where(keep, jnp.mod(lengths[:, None] + row, ring), ring)


def scatter_rows(buf: Float[Array, "b r ..."], slots: Int[Array, "b t"], rows: Float[Array, "b t ..."]) -> Array:
    """buf[b, slots[b, t]] = rows[b, t]; out-of-range slots are dropped."""
    b = jnp.arange(buf.shape[0])[:, None]
    return buf.at[b, slots].set(rows.astype(buf.dtype), mode="drop")


def cache_bytes(cache: TargetCache) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
