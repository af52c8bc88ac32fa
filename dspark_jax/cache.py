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
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dspark_jax.config import MAX_VERIFY_TOKENS, ModelConfig
from dspark_jax.sharding import per_request
from pallas_kernels import kv_fp8
from pallas_kernels.attention_metadata import ring_positions  # noqa: F401 (slot -> position, re-exported)

KV_LAYOUTS = ("bf16", "fp8")
KEY_BLOCK = 32  # indexer key dims per scale in the fp8 layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8Keys:
    """Indexer keys in the fp8 layout: ``codes`` uint8 [..., d] holds float8_e4m3fn codes and
    ``scales`` uint8 [..., d / KEY_BLOCK] the ue8m0 exponent (log2(scale) + 127) of each block of
    32 dims: d + d / 32 bytes per key (132 B for 128 dims instead of 256 B in bf16). The scale is
    2 ** ceil(log2(amax / 448)); the reference's keys (e2m1 values times a power of two per 32
    dims, ``quant.fp4_sim``) are stored exactly."""

    codes: Array
    scales: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)


def quantize_keys(keys: Float[Array, "... d"]) -> Fp8Keys:
    x = keys.astype(jnp.float32)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // KEY_BLOCK, KEY_BLOCK)
    ratio = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), 1e-30) / kv_fp8.FP8_MAX
    mant, exp = jnp.frexp(ratio)  # ratio = mant * 2**exp, mant in [0.5, 1): 2**ceil(log2 ratio)
    k = jnp.where(mant == 0.5, exp - 1, exp).astype(jnp.int32)
    codes = jnp.clip(xb / jnp.ldexp(jnp.float32(1), k)[..., None], -kv_fp8.FP8_MAX, kv_fp8.FP8_MAX)
    codes = jax.lax.bitcast_convert_type(codes.astype(jnp.float8_e4m3fn), jnp.uint8).reshape(x.shape)
    return Fp8Keys(codes=codes, scales=(k + 127).astype(jnp.uint8))


def dequantize_keys(keys: Fp8Keys, dtype) -> Float[Array, "... d"]:
    codes = jax.lax.bitcast_convert_type(keys.codes, jnp.float8_e4m3fn).astype(jnp.float32)
    lead, d = codes.shape[:-1], codes.shape[-1]
    k = keys.scales.astype(jnp.int32) - 127
    vals = codes.reshape(*lead, d // KEY_BLOCK, KEY_BLOCK) * jnp.ldexp(jnp.float32(1), k)[..., None]
    return vals.reshape(*lead, d).astype(dtype)


# A pool of KV latents or indexer keys: a plain array [b, r, d] (the compute dtype), packed fp8
# KV rows, or fp8 indexer keys.
KVPool = Array | kv_fp8.Fp8Rows | Fp8Keys


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CompressorState:
    kv: Float[Array, "b rc cw"]  # projected kv of recent tokens (fp32)
    score: Float[Array, "b rc cw"]  # projected gate scores of recent tokens (fp32, without ape)
    entries: KVPool  # compressed entries by window number [b, n, w]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    window: KVPool  # [b, r, d]
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


def new_kv_pool(lead: tuple[int, ...], width: int, dtype, layout: str, fill: float = 0.0) -> KVPool:
    """A pool of KV rows: ``bf16`` = plain rows in the compute dtype, ``fp8`` = packed 640 B rows."""
    if layout == "fp8":
        return kv_fp8.quantize(jnp.full((*lead, width), fill, jnp.float32))
    if layout != "bf16":
        raise ValueError(f"kv layout must be one of {KV_LAYOUTS}, got {layout!r}")
    return jnp.full((*lead, width), fill, dtype)


def new_key_pool(lead: tuple[int, ...], width: int, dtype, layout: str, fill: float = 0.0) -> KVPool:
    """A pool of indexer keys: ``bf16`` = plain keys in the compute dtype, ``fp8`` = ``Fp8Keys``."""
    if layout == "fp8":
        return quantize_keys(jnp.full((*lead, width), fill, jnp.float32))
    return jnp.full((*lead, width), fill, dtype)


def _compressor_state(batch: int, ratio: int, width: int, ring: int, n_entries: int, dtype, fill,
                      layout: str = "bf16", keys: bool = False) -> CompressorState:
    coff = 2 if ratio == 4 else 1
    new_pool = new_key_pool if keys else new_kv_pool
    return CompressorState(kv=jnp.full((batch, ring, coff * width), fill, jnp.float32),
                           score=jnp.full((batch, ring, coff * width), fill, jnp.float32),
                           entries=new_pool((batch, n_entries), width, dtype, layout, fill))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, *, kv_layout: str = "bf16",
               fill: float = 0.0) -> TargetCache:
    """Empty caches for ``batch`` requests of up to ``max_len`` tokens each (prompt + generation +
    one verify block of slack). ``kv_layout`` = "fp8" stores the window rings and compressed
    entries as packed fp8 rows (640 B instead of 1024 B) and the indexer keys as ``Fp8Keys``
    (132 B instead of 256 B).
    ``fill`` lets tests poison unwritten storage."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if not 1 <= max_len <= cfg.max_position_embeddings + MAX_VERIFY_TOKENS:  # verify rows past the context
        raise ValueError(f"max_len must lie in [1, max_position_embeddings + {MAX_VERIFY_TOKENS} = "
                         f"{cfg.max_position_embeddings + MAX_VERIFY_TOKENS}], got {max_len}")
    layers = []
    for i, ratio in enumerate(cfg.compress_ratios):
        window = new_kv_pool((batch, cfg.window_ring_size), cfg.head_dim, dtype, kv_layout, fill)
        comp = idx = None
        if ratio:
            n = -(-max_len // ratio)
            ring = cfg.compressor_ring_size(ratio)
            comp = _compressor_state(batch, ratio, cfg.head_dim, ring, n, dtype, fill, kv_layout)
            if ratio == 4:
                idx = _compressor_state(batch, ratio, cfg.index_head_dim, ring, n, dtype, fill, kv_layout, keys=True)
        layers.append(LayerCache(window=window, compressor=comp, indexer=idx))
    return TargetCache(layers=tuple(layers), lengths=jnp.zeros((batch,), jnp.int32), max_len=max_len)


def commit(cache: TargetCache, n_tokens: Int[Array, " b"]) -> TargetCache:
    """Accept ``n_tokens`` more tokens per request (everything written beyond stays tentative)."""
    return dataclasses.replace(cache, lengths=cache.lengths + n_tokens.astype(jnp.int32))


def ring_write_slots(lengths: Int[Array, " b"], n_valid: Int[Array, " b"], t: int, ring: int) -> Int[Array, "b t"]:
    """Ring slots for the rows of a chunk; rows that are padding or that an even later row of the
    same chunk overwrites get the out-of-range slot ``ring`` (dropped by the scatter)."""
    row = jnp.arange(t, dtype=jnp.int32)[None]
    keep = (row < n_valid[:, None]) & (row >= n_valid[:, None] - ring)
    return jnp.where(keep, jnp.mod(lengths[:, None] + row, ring), ring)


def scatter_rows(buf: Float[Array, "b r ..."], slots: Int[Array, "b t"], rows: Float[Array, "b t ..."]) -> Array:
    """buf[b, slots[b, t]] = rows[b, t]; out-of-range slots are dropped. Written per request
    (``vmap``: the request is a batch dim of the scatter), so that a mesh partitioner splitting
    the requests keeps each scatter on its device instead of gathering every request's rows."""
    return jax.vmap(lambda b, s, r: b.at[s].set(r, mode="drop"))(buf, slots, rows.astype(buf.dtype))


def write_kv(pool: KVPool, slots: Int[Array, "b t"], rows: Float[Array, "b t d"], *, impl: str = "xla",
             mesh=None) -> KVPool:
    """pool[b, slots[b, t]] = rows[b, t] (out-of-range slots dropped); fp8 pools quantise the rows
    with the fp8 write kernel (``impl``: "pallas" or "xla"), fp8 keys with ``quantize_keys``.
    mesh: the pools' mesh (``sharding.attach_mesh``); an fp8 write then runs per device on its own
    requests in a ``shard_map`` (a ``pallas_call`` has no partitioning rule)."""
    if isinstance(pool, kv_fp8.Fp8Rows) and mesh is not None:
        return per_request(functools.partial(write_kv, impl=impl), mesh, pool, slots, rows)
    if isinstance(pool, Fp8Keys):
        new = quantize_keys(rows)
        return Fp8Keys(codes=scatter_rows(pool.codes, slots, new.codes),
                       scales=scatter_rows(pool.scales, slots, new.scales))
    if not isinstance(pool, kv_fp8.Fp8Rows):
        return scatter_rows(pool, slots, rows)
    b, r = pool.shape[:2]
    flat = jnp.where(slots < r, jnp.arange(b, dtype=jnp.int32)[:, None] * r + slots, -1).reshape(-1)
    out = kv_fp8.write(pool.reshape(b * r), flat, rows.reshape(-1, rows.shape[-1]), impl=impl)
    return out.reshape(b, r)


def read_kv(pool: KVPool, dtype) -> Float[Array, "b r d"]:
    """All rows of a pool in ``dtype`` (fp8 rows and keys dequantised)."""
    if isinstance(pool, Fp8Keys):
        return dequantize_keys(pool, dtype)
    return kv_fp8.dequantize(pool, dtype) if isinstance(pool, kv_fp8.Fp8Rows) else pool


def cache_bytes(cache: TargetCache) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
