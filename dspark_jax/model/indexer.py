"""Lightning indexer of C4 layers: picks the top-k compressed entries for every query.

score[t, s] = sum_h w[t, h] * relu(q_I[t, h] . K_I[s]), with w = weights_proj(x) / sqrt(d_I * n_I),
entries s >= (t+1) // 4 masked, k = min(index_topk, #entries), non-causal picks returned as -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from dspark_jax.cache import CompressorState
from dspark_jax.config import ModelConfig
from dspark_jax.model.common import Chunk, Linear, Numerics
from dspark_jax.model.compressor import Compressor
from dspark_jax.model.norms_rope import layer_inv_freq
from dspark_jax.sharding import per_request
from pallas_kernels import index_scores as scoring
from pallas_kernels import kv_rows
from pallas_kernels.gemv import total
from pallas_kernels.top_k import top_k


def visible_entries(positions: Int[Array, "b t"], ratio: int) -> Int[Array, "b t"]:
    """Number of compressed entries a query may use: entry w is visible iff w < (pos + 1) // ratio."""
    return (positions + 1) // ratio


def index_scores(q: Float[Array, "b t h d"], keys: Float[Array, "b n d"], w: Float[Array, "b t h"]
                 ) -> Float[Array, "b t n"]:
    """score[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s]) in float32.

    bf16 x bf16 products are exact in float32, so bf16 operands go to a bf16 dot accumulating in
    float32: the reference's float32 scores (up to summation order), without float32 copies of
    the keys."""
    dt = jnp.promote_types(q.dtype, keys.dtype)
    s = jnp.einsum("bthd,bnd->bthn", q.astype(dt), keys.astype(dt), preferred_element_type=jnp.float32)
    return jnp.einsum("bthn,bth->btn", jax.nn.relu(s), w.astype(jnp.float32))


class Indexer(nnx.Module):
    def __init__(self, cfg: ModelConfig, num: Numerics, *, rngs: nnx.Rngs):
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, num, rngs=rngs)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, num, rngs=rngs, fp8_act=False)
        self.compressor = Compressor(cfg, 4, self.head_dim, num, rotate=True, rngs=rngs)
        self.cfg, self.num = cfg, num
        self.mesh = None  # set by ``dspark_jax.sharding.attach_mesh``: the top-k then runs per device

    def x_linears(self) -> tuple[Linear, ...]:
        """The linears of the layer input x: weights_proj, the compressor's wkv and wgate."""
        return (self.weights_proj, self.compressor.wkv, self.compressor.wgate)

    def __call__(self, x: Float[Array, "b t d"], qr: Float[Array, "b t r"], chunk: Chunk, state: CompressorState,
                 projected: tuple[Array, ...] | None = None, *, rounded: bool = False,
                 pooled: tuple[Array, ...] | None = None, q: Array | None = None
                 ) -> tuple[Int[Array, "b t k"], CompressorState]:
        """``projected``: the ``x_linears``' results when the caller computed them; ``rounded``:
        qr holds the quantised values wq_b takes (``Linear(rounded=True)``); ``pooled``: the
        compressor's pooling when the caller launched it (``Compressor.pool_part``); ``q``:
        wq_b(qr) (its split's partial sums) when the caller computed it."""
        with jax.named_scope("indexer"):
            return self._top_entries(x, qr, chunk, state, projected, rounded, pooled, q)

    def _top_entries(self, x: Float[Array, "b t d"], qr: Float[Array, "b t r"], chunk: Chunk,
                     state: CompressorState, projected: tuple[Array, ...] | None, rounded: bool,
                     pooled: tuple[Array, ...] | None, q: Array | None
                     ) -> tuple[Int[Array, "b t k"], CompressorState]:
        """Projections in the chunk's layout; scores and top-k per request (a packed chunk's
        queries are unpacked, their picks packed back)."""
        w_raw, *kv_score = projected or (self.weights_proj(x), None, None)
        # queries: wq_b (at one token its split's partial sums), RoPE, the Hadamard rotation and e2m1
        # (with quant_sim): on the Pallas path finished inside the scores' kernel as it loads them
        # (``kv_rows.QueryRows``), a packed chunk's in a launch of their own (``kv_rows.query_rows``)
        q = self.wq_b(qr, rounded=rounded, partials=True) if q is None else q
        q = kv_rows.QueryRows(q.reshape(*x.shape[:2], self.n_heads, self.head_dim), chunk.positions,
                              layer_inv_freq(self.cfg, 4), quant="keys" if self.num.quant_sim else None, dtype=x.dtype)
        impl = self.num.kernel_impl() if self.mesh is None else "xla"
        if chunk.packing is not None:  # (finished in their own launch; else in the scores' kernel)
            q = q.finish(impl)
        keys, state = self.compressor(x, chunk, state, None if projected is None else tuple(kv_score),
                                      pooled=pooled)  # [b, n, d_I]

        # the scores of the entries visible to each query (the others -inf; fp8 keys: exact in bf16),
        # one launch on the Pallas path (``pallas_kernels.index_scores``), then their top-k (-1: none)
        n = keys.shape[1]
        limit = visible_entries(chunk.dense.positions, 4)
        w_raw = w_raw if chunk.packing is None else chunk.unpack(total(w_raw, x.dtype))
        score = scoring.scores(chunk.unpack(q), keys, w_raw, limit, scale=self.head_dim**-0.5 * self.n_heads**-0.5,
                               dtype=x.dtype, impl=impl)
        top = per_request(lambda sc, lim: top_k(sc, min(self.topk, n), lim, impl=self.num.kernel_impl()), self.mesh,
                          score, limit)
        return chunk.pack(top), state
