"""The DeepSeek-V4 target model: a forward over a chunk of new tokens against explicit caches.

The same function serves one-shot prefill, chunked prefill, single-token decode and multi-token
speculative verify: rows of the chunk sit at positions ``cache.lengths[b] + t``. It returns fp32
logits and, for DSpark, the hc-mean of the residual streams after any requested layers.
Parameter paths mirror the official checkpoint names (``layers.3.attn.wq_a.weight``, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from dspark_jax.cache import TargetCache
from dspark_jax.config import ModelConfig
from dspark_jax.model.block import Block, hc_head_of
from dspark_jax.model.common import Chunk, Embedding, Linear, Numerics, Packing
from dspark_jax.model.dspark import DSparkStage
from dspark_jax.model.hyper import hc_unit_params
from dspark_jax.model.norms_rope import RMSNorm


class DeepSeekV4(nnx.Module):
    def __init__(self, cfg: ModelConfig, num: Numerics = Numerics(), *, rngs: nnx.Rngs):
        d, n = cfg.hidden_size, cfg.hc_mult
        self.embed = Embedding(cfg.vocab_size, d, num, rngs=rngs)
        self.layers = nnx.List([
            Block(cfg, num, ratio=cfg.compress_ratios[i], hash_routing=cfg.is_hash_layer(i), rngs=rngs)
            for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = Linear(d, cfg.vocab_size, num, rngs=rngs, fp8_act=False, compute_dtype=jnp.float32)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = hc_unit_params(rngs, n, d, n)
        if cfg.dspark is not None:
            self.mtp = nnx.List([DSparkStage(cfg, s, num, rngs=rngs) for s in range(cfg.dspark.num_stages)])
        self.cfg, self.num = cfg, num
        self.mesh = None  # set by ``dspark_jax.sharding.attach_mesh`` (``block.mhc_mesh``)

    def embed_streams(self, ids: Array) -> Float[Array, "b t n d"]:
        with jax.named_scope("embed"):
            e = self.embed(ids, self.num.dtype)
            return jnp.repeat(e[:, :, None, :], self.cfg.hc_mult, axis=2)

    def logits_from_streams(self, x: Float[Array, "b t n d"]) -> Float[Array, "b t v"]:
        """hc_head -> norm -> lm_head, fp32 logits."""
        with jax.named_scope("head"):
            return self.head(hc_head_of(self, x, self.norm), jnp.float32)

    def forward(self, ids: Int[Array, "b t"], n_valid: Int[Array, " b"], cache: TargetCache, *,
                capture: tuple[int, ...] = (), logits: Literal["all", "last", "none"] = "all",
                packing: Packing | None = None) -> tuple[Array | None, Array | None, TargetCache]:
        """Run a chunk of new tokens through all layers, writing its rows into the caches tentatively.

        Row t of request b sits at position ``cache.lengths[b] + t`` and is real iff t < n_valid[b].
        With ``packing`` (ragged verify) ids are [1, T]: the n_valid[b] tokens of every request
        packed as it says (``Packing``), and logits / hidden come back in that layout.

        Returns (logits [b, t, v] or [b, v] for "last" (row n_valid-1), captured hidden
        [b, t, len(capture), d] or None, updated cache with the SAME committed lengths).
        """
        if packing is not None and (logits == "last" or ids.shape != (1, packing.tokens)):
            raise ValueError(f"a packed chunk needs ids of shape (1, {packing.tokens}) and logits 'all' or 'none', "
                             f"got {ids.shape} and {logits!r}")
        chunk = Chunk(ids=ids, start=cache.lengths, n_valid=n_valid, packing=packing)
        x = self.embed_streams(ids)
        hidden, layers, pending = {}, [], None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer{i}"):
                # each block's last hc_post runs in the next block's first mHC launch (Block.unexpanded)
                x, pending, lc = layer.unexpanded(x, chunk, cache.layers[i], pending)
                layers.append(lc)
                if i in capture or i == last:
                    x, pending = layer.expand(x, pending), None
                if i in capture:
                    hidden[i] = jnp.mean(x.astype(jnp.float32), axis=2).astype(x.dtype)
        out = None
        if logits == "last":
            b = x.shape[0]
            with jax.named_scope("head"):
                last = x[jnp.arange(b), jnp.maximum(chunk.n_valid - 1, 0)][:, None]
            out = self.logits_from_streams(last)[:, 0]
        elif logits == "all":
            out = self.logits_from_streams(x)
        hid = jnp.stack([hidden[i] for i in capture], axis=2) if capture else None
        return out, hid, dataclasses.replace(cache, layers=tuple(layers))
