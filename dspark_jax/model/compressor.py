"""Gated-pool compressors: C4 (overlapping, with ape) and Cm for any other ratio m (non-overlapping).

Entry w of a Cm layer summarises tokens [w*m, (w+1)*m): per channel, a softmax over the window's
token slots of (gate score + ape[pos % m]) weights the projected kv. C4 overlaps windows: the
first half of the channels ("Ca") of window w-1 and the second half ("Cb") of window w form an
8-slot softmax. Entry w is (re)computed whenever the chunk contains the token closing it,
position (w+1)*m - 1, from per-token projections of the chunk and of recent tokens kept in a
ring (``CompressorState``); a query at position i may use entry w iff w < (i+1) // m.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from dspark_jax.cache import CompressorState, KVPool
from dspark_jax.config import ModelConfig
from dspark_jax.model.common import Chunk, Linear, Numerics
from dspark_jax.model.norms_rope import RMSNorm, layer_inv_freq
from dspark_jax.sharding import per_request
from pallas_kernels import compressor_pool, horizontal
from pallas_kernels.gemv import total


class Compressor(nnx.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, width: int, num: Numerics, *, rotate: bool, rngs: nnx.Rngs):
        self.ratio, self.width, self.rotate = ratio, width, rotate
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        d = cfg.hidden_size
        # bf16 in the checkpoint, applied in fp32 without activation quantisation.
        self.wkv = Linear(d, coff * width, num, rngs=rngs, fp8_act=False, compute_dtype=jnp.float32)
        self.wgate = Linear(d, coff * width, num, rngs=rngs, fp8_act=False, compute_dtype=jnp.float32)
        self.ape = nnx.Param(jnp.zeros((ratio, coff * width), jnp.float32))
        self.norm = RMSNorm(width, cfg.rms_norm_eps)
        self.cfg, self.num = cfg, num
        self.mesh = None  # set by ``dspark_jax.sharding.attach_mesh``: then it runs per device on its requests

    def __call__(self, x: Float[Array, "b t d"], chunk: Chunk, state: CompressorState,
                 projected: tuple[Array, Array] | None = None, pooled: tuple[Array, ...] | None = None
                 ) -> tuple[KVPool, CompressorState]:
        """Compress every window closed inside the chunk; returns all entries and the new state.
        ``x`` is in the chunk's layout (per request or packed); only real tokens reach the state.
        ``projected``: (wkv(x), wgate(x)) when the caller computed them (``Attention``: in one
        launch with its own projections at one row, as the split's partial sums, ``gemv.Partials``,
        which the pooling kernel adds as it loads them). ``pooled``: the outputs of ``pool_part``'s
        kernel when the caller launched it (``Attention``, with its other new rows).

        The projections run token-wise in the chunk's layout (packed: only the real tokens); the
        pooling runs per request. On a mesh every device pools its own requests in a
        ``shard_map`` (``data``; its weights are replicated): left to the partitioner, the gathers
        by window position made it collect every request's rows on every device."""
        if pooled is not None:
            return self._finish(*pooled, state)
        with jax.named_scope("compressor"):
            kv_new, score_new = projected or (self.wkv(x), self.wgate(x))
            if chunk.packing is not None or self.mesh is not None:  # (partial sums: the pooling adds them)
                kv_new, score_new = total(kv_new), total(score_new)
            kv_new, score_new = chunk.unpack(kv_new), chunk.unpack(score_new)  # [b, t, coff*w] fp32
            if self.mesh is None:
                return self._pool(kv_new, score_new, chunk.dense, state)
            graphdef, weights = nnx.split(self)  # passed in: a shard_map body may not close over them
            return per_request(lambda w, *a: nnx.merge(graphdef, w)._pool(*a), self.mesh, kv_new, score_new,
                               chunk.dense, state, replicated=(weights,))

    def _pool_args(self, kv_new: Array, score_new: Array, chunk: Chunk, state: CompressorState
                   ) -> tuple[tuple, dict]:
        """``compressor_pool.pool_write``'s arguments for the chunk's projected rows (per request)."""
        # the softmax pool, then norm, RoPE, the reference's rounding (KV entries: fp8; the indexer's keys:
        # Hadamard + e2m1; without quantisation the indexer's rotation cancels in q.k) and the write of
        # every window the chunk closed, with the ring's update
        quant = ("keys" if self.rotate else "kv") if self.num.quant_sim else None
        args = (state.kv, state.score, kv_new, score_new, self.ape[...], chunk.start, chunk.n_valid, state.entries,
                self.norm.weight[...], layer_inv_freq(self.cfg, self.ratio))
        return args, dict(ratio=self.ratio, overlap=self.overlap, eps=self.norm.eps, quant=quant, dtype=self.num.dtype)

    def _pool(self, kv_new: Float[Array, "b t c"], score_new: Float[Array, "b t c"], chunk: Chunk,
              state: CompressorState) -> tuple[KVPool, CompressorState]:
        """Pool the chunk's projected rows (per-request layout) with the ring's into the entries:
        one launch on the Pallas path (``compressor_pool.pool_write``)."""
        args, kw = self._pool_args(kv_new, score_new, chunk, state)
        entries, ring_kv, ring_score = compressor_pool.pool_write(*args, **kw, impl=self.num.kernel_impl())
        return self._finish(ring_kv, ring_score, entries, state)

    def _finish(self, ring_kv: Array, ring_score: Array, entries: KVPool, state: CompressorState
                ) -> tuple[KVPool, CompressorState]:
        """(entries, the new state) from the pooling's outputs."""
        return entries, dataclasses.replace(state, kv=ring_kv, score=ring_score, entries=entries)

    def pool_part(self, chunk: Chunk, state: CompressorState, projected: tuple[Array, Array]
                  ) -> horizontal.Part | None:
        """A one-token step's pooling and entries' write as a part of the caller's launch
        (``Attention``: with the window's new row; ``projected``: wkv(x), wgate(x) from its shared
        launch), its outputs for ``__call__``'s ``pooled``; None where the kernel does not take
        them (a packed chunk, a mesh, ...)."""
        if chunk.packing is not None or self.mesh is not None:
            return None
        args, kw = self._pool_args(*projected, chunk, state)
        if not compressor_pool.takes_pool_write(*args, **kw, impl=self.num.kernel_impl()):
            return None
        return compressor_pool.pool_write_part(*args, **kw)
