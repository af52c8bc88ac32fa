"""The DSpark drafter (``mtp.{0..S-1}`` of the DSpark checkpoints).

One round drafts a block of γ tokens in parallel from ids [anchor, noise × (γ-1)] at positions
L .. L+γ-1 (L = committed length; the anchor is the last emitted token, not yet in any cache):

- the target's hidden states are injected only through attention keys: stage 0 owns
  ``main_x = main_norm(main_proj(concat of target-layer hc-means))``; every stage keeps a ring of
  context keys kv_norm(wkv(main_x)) (RoPE, fp8 nope dims) for committed positions;
- each stage is a V4 block whose window-only attention (theta 10000, no YaRN) sees the last
  ``sliding_window`` committed context rows plus all γ block rows (non-causal inside the block);
- the last stage owns hc_head / norm (the lm_head is the target's), the Markov head
  (logits_k = U_k + W2 W1[prev_k], sampled left to right) and the confidence head
  c_k = proj([Z_k ; W1[prev_k]]) on the pre-norm hidden Z.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dspark_jax.cache import ring_write_slots, scatter_rows
from dspark_jax.config import ModelConfig
from dspark_jax.model.attention import ragged_attention, sink_attention
from dspark_jax.model.block import Block, hc_head_of
from dspark_jax.model.common import Linear, Numerics, Packing, matmul_f32, normal_init
from dspark_jax.model.hyper import hc_unit_params
from dspark_jax.model.norms_rope import RMSNorm
from pallas_kernels import attention_metadata


class MarkovHead(nnx.Module):
    """Rank-r bigram bias B(prev, .) = markov_w2 @ markov_w1[prev]."""

    def __init__(self, cfg: ModelConfig, num: Numerics, *, rngs: nnx.Rngs):
        r = cfg.dspark.markov_rank
        self.markov_w1 = nnx.Module()
        self.markov_w1.weight = nnx.Param(normal_init(rngs, (cfg.vocab_size, r), num.param_dtype))
        self.markov_w2 = nnx.Module()
        self.markov_w2.weight = nnx.Param(normal_init(rngs, (cfg.vocab_size, r), num.param_dtype))

    def feature(self, prev: Int[Array, "..."]) -> Float[Array, "... r"]:
        return jnp.take(self.markov_w1.weight[...], prev, axis=0).astype(jnp.float32)

    def bias(self, feature: Float[Array, "... r"]) -> Float[Array, "... v"]:
        return matmul_f32(feature, self.markov_w2.weight[...])


class DSparkStage(Block):
    def __init__(self, cfg: ModelConfig, stage: int, num: Numerics, *, rngs: nnx.Rngs):
        super().__init__(cfg, num, ratio=0, hash_routing=False, rngs=rngs)
        ds, d = cfg.dspark, cfg.hidden_size
        if stage == 0:
            self.main_proj = Linear(len(ds.target_layer_ids) * d, d, num, rngs=rngs)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if stage == ds.num_stages - 1:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.hc_head_fn, self.hc_head_base, self.hc_head_scale = hc_unit_params(rngs, cfg.hc_mult, d, cfg.hc_mult)
            self.markov_head = MarkovHead(cfg, num, rngs=rngs)
            self.confidence_head = nnx.Module()
            self.confidence_head.proj = Linear(d + ds.markov_rank, 1, num, rngs=rngs, fp8_act=False,
                                               compute_dtype=jnp.float32)

    def draft_layer(self, x: Float[Array, "b g n d"], ids: Int[Array, "b g"], pos: Int[Array, "b g"],
                    ring: Float[Array, "b r d"], ring_visible: Bool[Array, "b r"] | None = None, *,
                    lengths: Int[Array, " b"] | None = None) -> Float[Array, "b g n d"]:
        """The block rows through this stage: keys = visible context rows + all block rows.

        Inference passes ``lengths`` (committed tokens; the block sits at positions lengths ..
        lengths + g - 1) with the stage's context ``ring``: the block rows are written into a copy
        of the ring and the ragged attention dispatcher (Pallas kernel or its reference, by
        ``Numerics.kernels``) sees the last ``window`` committed positions plus the block. Training
        passes gathered context rows with ``ring_visible`` and takes the dense math (it needs
        gradients)."""
        y, post, comb = self.attn_in(x)
        with jax.named_scope("attention"):
            f = self._block_attention(y, pos, ring, ring_visible, lengths)
        return self.ffn_out(*self.ffn_in(f, x, post, comb), ids)

    def _block_attention(self, y, pos, ring, ring_visible, lengths) -> Float[Array, "b g d"]:
        q, _ = self.attn.project_q(y, pos, rope=lengths is None)  # (inference: normed and rotated by the kernel)
        kv = self.attn.project_kv(y, pos).astype(ring.dtype)
        b, g, h, d = q.shape
        scale = self.cfg.head_dim**-0.5
        if lengths is None:
            parts = [(ring, jnp.broadcast_to(ring_visible[:, None, :], (b, g, ring.shape[1]))),
                     (kv, jnp.ones((b, g, g), bool))]
            return self.attn.project_out(sink_attention(q, parts, self.attn.attn_sink[...], scale), pos)
        slots = ring_write_slots(lengths, jnp.full((b,), g, jnp.int32), g, ring.shape[1])

        def attend(q, sink, r):  # per device on a mesh (``Attention.per_device``); rotated back as well
            meta = attention_metadata.draft(r["lengths"], block=g, window=self.cfg.sliding_window)
            return ragged_attention(q.reshape(-1, *q.shape[2:]), r["ring"], None, sink, meta, scale=scale,
                                    impl=self.num.kernel_impl(), out_rope=(r["pos"].reshape(-1), self.attn.inv_freq),
                                    q_rope=self.attn.ragged_q_rope(r["pos"].reshape(-1))).reshape(q.shape)

        o = self.attn.per_device(attend, q, dict(ring=scatter_rows(ring, slots, kv), lengths=lengths, pos=pos))
        return self.attn.project_out(o, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftCache:
    """Per-stage rings of context keys for committed positions (slot = pos % R)."""

    rings: tuple[Float[Array, "b r d"], ...]


def init_draft_cache(cfg: ModelConfig, batch: int, dtype=jnp.bfloat16, *, fill: float = 0.0) -> DraftCache:
    shape = (batch, cfg.window_ring_size, cfg.head_dim)
    return DraftCache(rings=tuple(jnp.full(shape, fill, dtype) for _ in range(cfg.dspark.num_stages)))


def context_input(stages, hidden: Float[Array, "b t k d"]) -> Float[Array, "b t d"]:
    """main_x = main_norm(main_proj(concat_k hidden[..., k, :])), shared by all stages."""
    s0 = stages[0]
    return s0.main_norm(s0.main_proj(hidden.reshape(*hidden.shape[:2], -1)))


def write_context(stages, cache: DraftCache, hidden: Float[Array, "b t k d"], start: Int[Array, " b"],
                  n_commit: Int[Array, " b"], packing: Packing | None = None) -> DraftCache:
    """Insert context keys of the first ``n_commit[b]`` rows (positions start[b] + t) into every ring.
    With ``packing``, ``hidden`` is [1, T, k, d] in that layout (the keys are computed on the
    packed rows, then written per request)."""
    with jax.named_scope("context"):
        return _write_context(stages, cache, hidden, start, n_commit, packing)


def _write_context(stages, cache: DraftCache, hidden: Float[Array, "b t k d"], start: Int[Array, " b"],
                   n_commit: Int[Array, " b"], packing: Packing | None) -> DraftCache:
    main_x = context_input(stages, hidden)
    t = hidden.shape[1] if packing is None else packing.width
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    rings = []
    for stage, ring in zip(stages, cache.rings):
        if packing is None:
            kv = stage.attn.project_kv(main_x, pos)
        else:
            kv = packing.unpack(stage.attn.project_kv(main_x, packing.pack(pos)))
        rings.append(scatter_rows(ring, ring_write_slots(start, n_commit, t, ring.shape[1]), kv))
    return DraftCache(rings=tuple(rings))


@dataclasses.dataclass
class DraftOutput:
    tokens: Int[Array, "b g"]  # d_1 .. d_γ
    logits: Float[Array, "b g v"]  # Markov-corrected logits the tokens were drawn from (fp32)
    confidence: Float[Array, "b g"]  # raw confidence logits (apply sigmoid(c / T_k))


def draft_block(model, cache: DraftCache, anchor: Int[Array, " b"], lengths: Int[Array, " b"],
                pick: Callable[[Float[Array, "b v"], int], Int[Array, " b"]]) -> DraftOutput:
    """One parallel draft pass plus the sequential Markov loop; ``pick(logits, k)`` chooses d_{k+1}."""
    cfg = model.cfg
    ds = cfg.dspark
    stages = model.mtp
    b, g = anchor.shape[0], ds.block_size
    ids = jnp.concatenate([anchor[:, None], jnp.full((b, g - 1), ds.noise_token_id, jnp.int32)], axis=1)
    pos = lengths[:, None] + jnp.arange(g, dtype=jnp.int32)[None]
    x = model.embed_streams(ids)
    for s, (stage, ring) in enumerate(zip(stages, cache.rings)):
        with jax.named_scope(f"stage{s}"):
            x = stage.draft_layer(x, ids, pos, ring, lengths=lengths)
    last = stages[-1]
    with jax.named_scope("head"):
        z = hc_head_of(last, x)  # pre-norm hidden Z [b, g, d]
        base = model.head(last.norm(z), jnp.float32)  # U [b, g, v]

    markov = last.markov_head
    prev, tokens, logits, feats = anchor, [], [], []
    with jax.named_scope("markov"):
        for k in range(g):  # γ is small and static: unrolled, all inside the caller's jit
            f = markov.feature(prev)
            lk = base[:, k] + markov.bias(f)
            prev = pick(lk, k).astype(jnp.int32)
            tokens.append(prev), logits.append(lk), feats.append(f)
        feats = jnp.stack(feats, axis=1)
    with jax.named_scope("confidence"):
        conf = last.confidence_head.proj(jnp.concatenate([z.astype(jnp.float32), feats], axis=-1),
                                         jnp.float32)[..., 0]
    return DraftOutput(tokens=jnp.stack(tokens, axis=1), logits=jnp.stack(logits, axis=1), confidence=conf)
