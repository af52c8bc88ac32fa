"""DSpark drafter training against the frozen target (DeepSpec semantics, adapted to V4).

Per batch of windows x [b, T]:
1. the frozen target runs once: fp32 logits (the teacher distributions p_t) and the hc-means of
   the DSpark target layers; ``main_x = main_norm(main_proj(hidden))``;
2. ``num_anchors`` random anchors a per window (from ``first_anchor`` on: windows of generated
   sequences put them in the continuation, after the prompt); block = [x_a, noise x (γ-1)] at
   positions a .. a+γ-1, slot k predicting x_{a+k+1};
3. each stage attends to its context keys ``kv_norm(wkv(main_x))`` at positions a-W .. a-1
   (strictly before the anchor, W = sliding window) plus the block's own rows, bidirectionally:
   exactly ``DSparkStage.draft_layer`` of inference with committed length L = a;
4. teacher-forced Markov bias with prev = [x_a, x_{a+1} .. x_{a+γ-1}]; confidence logits from
   [Z_k ; W1[prev_k]] (Z = pre-norm hc_head output);
5. loss = 0.1 CE + 0.9 L1(p_d - p_t) + 1.0 BCE(conf, c*), c* = clip(1 - ||p_d - p_t||_1 / 2, 0, 1),
   with position weights exp(-k / 4) times the cumulative validity mask.
Embedding and lm_head are the target's and stay frozen; only ``mtp.*`` parameters train.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dspark_jax.cache import init_cache
from dspark_jax.model.deepseek_v4 import DeepSeekV4
from dspark_jax.model.dspark import context_input
from dspark_jax.model.hyper import hc_head
from dspark_jax.train.optim import TrainState, apply_gradients, cast_like

# Trainable drafter parameters: everything under mtp.* (embedding and lm_head are the target's).
DRAFT_PARAMS = nnx.All(nnx.Param, nnx.PathContains("mtp"))


@dataclass(frozen=True)
class DraftLossConfig:
    num_anchors: int = 128  # anchors per window
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    decay: float = 4.0  # position weights exp(-k / decay), k = 0 .. γ-1

    def __post_init__(self):
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        if self.decay <= 0:
            raise ValueError(f"decay must be positive, got {self.decay}")


# ---------------------------------------------------------------------------- inputs
def sample_anchors(key: Array, batch: int, seq_len: int, num_anchors: int, first: int = 0) -> Int[Array, "b a"]:
    """Distinct anchors per window, uniform over positions first .. seq_len-2 (each has a label), sorted."""
    if not 1 <= num_anchors <= seq_len - 1 - first:
        raise ValueError(f"num_anchors must lie in [1, seq_len-1-first = {seq_len - 1 - first}], got {num_anchors}")
    u = jax.random.uniform(key, (batch, seq_len - 1 - first))
    return (jnp.sort(jax.lax.top_k(u, num_anchors)[1], axis=-1) + first).astype(jnp.int32)


def block_inputs(ids: Int[Array, "b t"], anchors: Int[Array, "b a"], gamma: int, noise_id: int):
    """Block ids [b, a, γ] = [x_a, noise...], positions a+k, labels x_{a+k+1}, label validity."""
    t = ids.shape[1]
    rows = jnp.arange(ids.shape[0])[:, None, None]
    k = jnp.arange(gamma, dtype=jnp.int32)
    pos = anchors[..., None] + k  # [b, a, γ]
    block = jnp.where(k == 0, ids[rows[..., 0], anchors][..., None], noise_id).astype(jnp.int32)
    label_pos = pos + 1
    valid = label_pos < t
    labels = ids[rows, jnp.minimum(label_pos, t - 1)]
    return block, pos, labels, valid


def gather_rows(x: Float[Array, "b t ..."], idx: Int[Array, "b ..."]) -> Array:
    """x[b, idx[b, ...]] with idx clipped into range."""
    b = x.shape[0]
    rows = jnp.arange(b).reshape((b,) + (1,) * (idx.ndim - 1))
    return x[rows, jnp.clip(idx, 0, x.shape[1] - 1)]


# ---------------------------------------------------------------------------- forward
def target_features(model: DeepSeekV4, ids: Int[Array, "b t"]) -> tuple[Float[Array, "b t v"], Array]:
    """The frozen target over full windows: fp32 teacher logits [b, t, v] and the hc-means of the
    DSpark target layers [b, t, k, d] (both without gradient)."""
    b, t = ids.shape
    cache = init_cache(model.cfg, b, t, model.num.dtype)
    logits, hidden, _ = model.forward(ids, jnp.full((b,), t, jnp.int32), cache,
                                      capture=model.cfg.dspark.target_layer_ids, logits="all")
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(hidden)


def context_rings(model: DeepSeekV4, main_x: Float[Array, "b t d"], anchors: Int[Array, "b a"]
                  ) -> tuple[list[Float[Array, "n w e"]], Bool[Array, "n w"]]:
    """Per stage, the context keys of positions a-W .. a-1 of every anchor, flattened to n = b*a
    blocks, and which of them exist (position >= 0)."""
    b, t, _ = main_x.shape
    w = model.cfg.sliding_window
    kpos = anchors[..., None] - w + jnp.arange(w, dtype=jnp.int32)  # [b, a, w]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    rings = []
    for stage in model.mtp:
        kv = stage.attn.project_kv(main_x, pos)  # [b, t, e]
        rings.append(gather_rows(kv, kpos).reshape(-1, w, kv.shape[-1]))
    return rings, (kpos >= 0).reshape(-1, w)


@jax.tree_util.register_dataclass
@dataclass
class DraftOutputs:
    logits: Float[Array, "n g v"]  # Markov-corrected draft logits (fp32)
    confidence: Float[Array, "n g"]  # raw confidence logits


def draft_hidden(model: DeepSeekV4, block: Int[Array, "n g"], pos: Int[Array, "n g"], rings, visible
                 ) -> tuple[Float[Array, "n g d"], Float[Array, "n g v"]]:
    """The drafter's stages over flattened blocks: pre-norm hidden Z and base logits U (fp32)."""
    cfg = model.cfg
    x = model.embed_streams(block)
    for stage, ring in zip(model.mtp, rings):
        x = stage.draft_layer(x, block, pos, ring, visible)
    last = model.mtp[-1]
    z = hc_head(x, last.hc_head_fn[...], last.hc_head_base[...], last.hc_head_scale[...], hc_eps=cfg.hc_eps,
                norm_eps=cfg.rms_norm_eps)  # pre-norm hidden Z
    return z, model.head(last.norm(z), jnp.float32)


def confidence_logits(model: DeepSeekV4, z: Float[Array, "n g d"], feat: Float[Array, "n g r"]) -> Float[Array, "n g"]:
    """Raw confidence logits from [Z_k ; W1[prev_k]]."""
    proj = model.mtp[-1].confidence_head.proj
    return proj(jnp.concatenate([z.astype(jnp.float32), feat], axis=-1), jnp.float32)[..., 0]


def draft_forward(model: DeepSeekV4, block: Int[Array, "n g"], pos: Int[Array, "n g"], rings, visible,
                  prev: Int[Array, "n g"]) -> DraftOutputs:
    """The drafter over flattened blocks with a teacher-forced Markov chain (same modules and order
    of operations as ``dspark.draft_block``, with ``prev`` given instead of sampled)."""
    z, base = draft_hidden(model, block, pos, rings, visible)
    markov = model.mtp[-1].markov_head
    feat = markov.feature(prev)
    return DraftOutputs(logits=base + markov.bias(feat), confidence=confidence_logits(model, z, feat))


def free_draft(model: DeepSeekV4, block: Int[Array, "n g"], pos: Int[Array, "n g"], rings, visible
               ) -> tuple[Int[Array, "n g"], Float[Array, "n g"]]:
    """Greedy drafts as in decoding: the Markov chain runs on the drafter's own argmax tokens
    (prev_1 = anchor, prev_k = d_{k-1}). Returns the drafts and their raw confidence logits."""
    z, base = draft_hidden(model, block, pos, rings, visible)
    markov = model.mtp[-1].markov_head
    prev, tokens, feats = block[:, 0], [], []
    for k in range(block.shape[1]):
        f = markov.feature(prev)
        prev = jnp.argmax(base[:, k] + markov.bias(f), axis=-1).astype(jnp.int32)
        tokens.append(prev), feats.append(f)
    return jnp.stack(tokens, axis=1), confidence_logits(model, z, jnp.stack(feats, axis=1))


# ---------------------------------------------------------------------------- losses
def position_weights(valid: Bool[Array, "... g"], decay: float) -> Float[Array, "... g"]:
    """exp(-k / decay) times the cumulative validity (positions after an invalid one are dropped)."""
    g = valid.shape[-1]
    mask = jnp.cumprod(valid.astype(jnp.float32), axis=-1)
    return jnp.exp(-jnp.arange(g, dtype=jnp.float32) / decay) * mask


def dspark_losses(draft_logits: Float[Array, "n g v"], conf_logits: Float[Array, "n g"],
                  target_logits: Float[Array, "n g v"], labels: Int[Array, "n g"], valid: Bool[Array, "n g"],
                  cfg: DraftLossConfig) -> dict[str, Array]:
    """The DeepSpec DSpark loss terms and teacher-forced acceptance metrics."""
    w = position_weights(valid, cfg.decay)
    denom = jnp.maximum(jnp.sum(w), 1e-6)
    logp_d = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    p_d = jnp.exp(logp_d)
    p_t = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(logp_d, labels[..., None], axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(p_d - p_t), axis=-1)  # = 2 TV
    c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))  # sampling acceptance probability
    bce = optax.sigmoid_binary_cross_entropy(conf_logits.astype(jnp.float32), c_star)
    terms = dict(ce=jnp.sum(w * ce) / denom, l1=jnp.sum(w * l1) / denom, conf=jnp.sum(w * bce) / denom)
    loss = cfg.ce_weight * terms["ce"] + cfg.l1_weight * terms["l1"] + cfg.conf_weight * terms["conf"]
    return dict(terms, loss=loss, **acceptance_metrics(draft_logits, target_logits, c_star, valid))


def acceptance_metrics(draft_logits, target_logits, c_star, valid) -> dict[str, Array]:
    """Teacher-forced acceptance estimates per position k (DeepSpec's logged metrics).

    accept_prob[k]: mean c*_k (sampling acceptance probability at T = 1);
    tau_prob = 1 + mean_blocks Σ_k Π_{i<=k} c*_i; match[k]: greedy argmax agreement;
    tau_greedy = 1 + mean_blocks Σ_k Π_{i<=k} match_i. Means over blocks whose labels are all valid."""
    full = jnp.all(valid, axis=-1).astype(jnp.float32)[..., None]  # [n, 1]
    n = jnp.maximum(jnp.sum(full), 1.0)
    match = (jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32)
    surv_p, surv_g = jnp.cumprod(c_star, axis=-1), jnp.cumprod(match, axis=-1)
    return dict(accept_prob=jnp.sum(full * c_star, 0) / n, match=jnp.sum(full * match, 0) / n,
                survival_greedy=jnp.sum(full * surv_g, 0) / n,
                tau_prob=1.0 + jnp.sum(full * surv_p) / n, tau_greedy=1.0 + jnp.sum(full * surv_g) / n)


# ---------------------------------------------------------------------------- steps
def drafter_batch(model: DeepSeekV4, target_logits: Float[Array, "b t v"], hidden: Array, ids: Int[Array, "b t"],
                  anchors: Int[Array, "b a"], cfg: DraftLossConfig):
    """Drafter outputs and loss terms for one batch (flattened to n = b * a blocks)."""
    ds = model.cfg.dspark
    g = ds.block_size
    block, pos, labels, valid = block_inputs(ids, anchors, g, ds.noise_token_id)
    rings, visible = context_rings(model, context_input(model.mtp, hidden), anchors)
    prev = jnp.concatenate([block[..., :1], labels[..., :-1]], axis=-1)  # teacher forcing
    flat = lambda x: x.reshape(-1, g)
    out = draft_forward(model, flat(block), flat(pos), rings, visible, flat(prev))
    p_t = gather_rows(target_logits, pos).reshape(-1, g, target_logits.shape[-1])  # row a+k predicts x_{a+k+1}
    metrics = dspark_losses(out.logits, out.confidence, p_t, flat(labels), flat(valid), cfg)
    return out, metrics, (flat(valid), p_t)


def make_drafter_step(graphdef: nnx.GraphDef, draft_dtypes, tx: optax.GradientTransformation, cfg: DraftLossConfig,
                      *, num_anchors: int | None = None, first_anchor: int = 0):
    """Jitted ``(state, frozen, rest, ids, key, lr) -> (state, metrics)``; ``state`` (the drafter's
    fp32 master and optimizer state) is donated. graphdef / draft_dtypes come from
    ``nnx.split(model, DRAFT_PARAMS, nnx.Param, ...)``; ``frozen`` are the target parameters.
    Each window gets ``num_anchors`` anchors (default ``cfg.num_anchors``, at most the positions
    available) at positions ``first_anchor`` .. t-2."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state: TrainState, frozen: nnx.State, rest: nnx.State, ids: Int[Array, "b t"], key, lr):
        b, t = ids.shape
        a = num_anchors if num_anchors is not None else min(cfg.num_anchors, t - 1 - first_anchor)
        anchors = sample_anchors(key, b, t, a, first_anchor)
        merge = lambda master: nnx.merge(graphdef, cast_like(master, draft_dtypes), frozen, rest)
        target_logits, hidden = target_features(merge(state.master), ids)

        def loss_fn(master):
            _, m, _ = drafter_batch(merge(master), target_logits, hidden, ids, anchors, cfg)
            return m["loss"], m

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.master)
        state, gnorm = apply_gradients(state, grads, tx, lr)
        return state, dict(metrics, grad_norm=gnorm)

    return step


def make_drafter_eval(graphdef: nnx.GraphDef, cfg: DraftLossConfig):
    """Jitted ``(draft, frozen, rest, ids, anchors) -> (metrics, per-block arrays)`` on parameters in
    their storage dtypes; per-block arrays feed confidence calibration (STS)."""

    @jax.jit
    def evaluate(draft: nnx.State, frozen: nnx.State, rest: nnx.State, ids: Int[Array, "b t"], anchors):
        model = nnx.merge(graphdef, draft, frozen, rest)
        target_logits, hidden = target_features(model, ids)
        out, metrics, (valid, p_t) = drafter_batch(model, target_logits, hidden, ids, anchors, cfg)
        match = jnp.argmax(out.logits, -1) == jnp.argmax(p_t, -1)
        return metrics, dict(confidence=out.confidence, match=match, valid=valid)

    return evaluate


def make_free_drafts(graphdef: nnx.GraphDef):
    """Jitted ``(draft, frozen, rest, ids, anchors) -> {confidence, accepted}`` per block: greedy
    drafts as in decoding (``free_draft``) at the given anchors, their raw confidence logits, and
    how many lead the target's greedy tokens (the target's argmax at positions a .. a+γ-1)."""

    @jax.jit
    def free_drafts(draft: nnx.State, frozen: nnx.State, rest: nnx.State, ids: Int[Array, "b t"], anchors):
        model = nnx.merge(graphdef, draft, frozen, rest)
        ds = model.cfg.dspark
        g = ds.block_size
        target_logits, hidden = target_features(model, ids)
        block, pos, _, _ = block_inputs(ids, anchors, g, ds.noise_token_id)
        rings, visible = context_rings(model, context_input(model.mtp, hidden), anchors)
        tokens, conf = free_draft(model, block.reshape(-1, g), pos.reshape(-1, g), rings, visible)
        want = jnp.argmax(gather_rows(target_logits, pos), axis=-1).reshape(-1, g)
        accepted = jnp.sum(jnp.cumprod((tokens == want).astype(jnp.int32), axis=-1), axis=-1)
        return dict(confidence=conf, accepted=accepted)

    return free_drafts
