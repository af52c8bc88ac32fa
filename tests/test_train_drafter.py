"""Drafter training: teacher-forced blocks equal the inference drafter, loss terms equal a plain
reference computation, anchors / blocks / context windows follow DeepSpec's rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.model.dspark import draft_block, init_draft_cache, write_context
from dspark_jax.train.drafter import (DraftLossConfig, block_inputs, context_rings, drafter_batch,
                                      dspark_losses, free_draft, sample_anchors, target_features)
from dspark_jax.model.dspark import context_input

T = 40


def jitted(fn, model):
    """fn(model, *args) jitted over the model's state."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda st, *args: fn(nnx.merge(graphdef, st), *args)), state


@pytest.fixture(scope="module")
def batch(tiny_f32):
    model = tiny_f32.module
    ids = jnp.asarray(np.random.default_rng(0).integers(4, model.cfg.vocab_size, (2, T)), jnp.int32)
    # anchors: first position (no context), inside and beyond the window (8), and near the end
    anchors = jnp.array([[0, 3, 20, 38], [1, 9, 30, 35]], jnp.int32)
    features, state = jitted(target_features, model)
    logits, hidden = features(state, ids)
    return model, ids, anchors, logits, hidden


def test_teacher_forced_blocks_equal_the_inference_drafter(batch):
    """With the drafter's picks forced to the true tokens, ``draft_block`` (context ring written
    from the committed prefix, L = anchor) gives the training forward's logits and confidence."""
    model, ids, anchors, logits, hidden = batch
    cfg = DraftLossConfig(num_anchors=4)
    train_fwd, state = jitted(lambda m, *a: drafter_batch(m, *a, cfg)[0], model)
    out = train_fwd(state, logits, hidden, ids, anchors)
    g = model.cfg.dspark.block_size

    def inference(m, hidden_b, anchor, length, labels):
        cache = init_draft_cache(m.cfg, 1, jnp.float32, fill=1e4)  # unwritten slots must stay unseen
        # commit the context rows 0 .. L-1 (rows beyond L are written nowhere: n_commit = L)
        cache = write_context(m.mtp, cache, hidden_b, jnp.zeros((1,), jnp.int32), length)
        out = draft_block(m, cache, anchor, length, lambda lg, k: labels[k][None])
        return out.logits, out.confidence

    infer, _ = jitted(inference, model)
    for b in range(2):
        for j in range(anchors.shape[1]):
            a = int(anchors[b, j])
            labels = ids[b, jnp.minimum(a + 1 + jnp.arange(g), T - 1)]
            ref_logits, ref_conf = infer(state, hidden[b:b + 1], ids[b:b + 1, a], jnp.array([a], jnp.int32), labels)
            i = b * anchors.shape[1] + j
            scale = float(jnp.max(jnp.abs(ref_logits)))
            assert float(jnp.max(jnp.abs(ref_logits[0] - out.logits[i]))) < 1e-5 * scale
            np.testing.assert_allclose(ref_conf[0], out.confidence[i], rtol=1e-5, atol=1e-6)


def test_context_rings_hold_the_window_strictly_before_the_anchor(batch):
    model, ids, anchors, logits, hidden = batch
    w = model.cfg.sliding_window
    main_x = context_input(model.mtp, hidden)
    rings, visible = context_rings(model, main_x, anchors)
    kv = model.mtp[1].attn.project_kv(main_x, jnp.broadcast_to(jnp.arange(T), (2, T)))
    for b in range(2):
        for j, a in enumerate(np.asarray(anchors[b])):
            n = b * anchors.shape[1] + j
            want = np.arange(a - w, a)
            np.testing.assert_array_equal(np.asarray(visible[n]), want >= 0)
            got = np.asarray(rings[1][n])[want >= 0]
            np.testing.assert_allclose(got, np.asarray(kv[b, want[want >= 0]]), rtol=1e-6)


def test_block_inputs_and_anchors():
    ids = jnp.arange(100, 120, dtype=jnp.int32)[None]
    block, pos, labels, valid = block_inputs(ids, jnp.array([[0, 16]]), 5, noise_id=2)
    np.testing.assert_array_equal(block[0], [[100, 2, 2, 2, 2], [116, 2, 2, 2, 2]])
    np.testing.assert_array_equal(pos[0, 1], [16, 17, 18, 19, 20])
    np.testing.assert_array_equal(labels[0, 0], [101, 102, 103, 104, 105])
    np.testing.assert_array_equal(valid[0, 1], [True, True, True, False, False])  # labels past the window
    a = np.asarray(sample_anchors(jax.random.key(0), 3, 64, 20))
    assert a.shape == (3, 20) and a.min() >= 0 and a.max() <= 62
    assert all(len(set(r)) == 20 and (np.diff(r) > 0).all() for r in a)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(jax.random.key(0), 1, 10, 10)
    a = np.asarray(sample_anchors(jax.random.key(1), 4, 64, 30, first=32))  # the continuation of a 32-token prompt
    assert a.min() >= 32 and a.max() <= 62 and all(len(set(r)) == 30 for r in a)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(jax.random.key(0), 1, 64, 32, first=32)


def reference_losses(draft, conf, target, labels, valid, cfg):
    """DeepSpec's loss written out with numpy loops."""
    n, g, _ = draft.shape
    num = dict(ce=0.0, l1=0.0, conf=0.0)
    den = 0.0
    for i in range(n):
        alive = 1.0
        for k in range(g):
            alive *= float(valid[i, k])
            w = np.exp(-k / cfg.decay) * alive
            pd = np.exp(draft[i, k] - draft[i, k].max())
            pd /= pd.sum()
            pt = np.exp(target[i, k] - target[i, k].max())
            pt /= pt.sum()
            l1 = np.abs(pd - pt).sum()
            c = min(max(1 - l1 / 2, 0.0), 1.0)
            s = 1 / (1 + np.exp(-conf[i, k]))
            num["ce"] += w * -np.log(pd[labels[i, k]])
            num["l1"] += w * l1
            num["conf"] += w * -(c * np.log(s) + (1 - c) * np.log(1 - s))
            den += w
    terms = {k: v / den for k, v in num.items()}
    terms["loss"] = cfg.ce_weight * terms["ce"] + cfg.l1_weight * terms["l1"] + cfg.conf_weight * terms["conf"]
    return terms


def test_loss_terms_match_a_reference_computation():
    rng = np.random.default_rng(3)
    n, g, v = 6, 5, 11
    draft = rng.normal(0, 2, (n, g, v))
    target = draft + rng.normal(0, 1.5, (n, g, v))  # partly agreeing teacher
    conf = rng.normal(0, 2, (n, g))
    labels = rng.integers(0, v, (n, g))
    valid = np.ones((n, g), bool)
    valid[1, 3:] = False
    valid[4, 1] = False  # later positions of this block are dropped too (cumulative mask)
    cfg = DraftLossConfig(ce_weight=0.1, l1_weight=0.9, conf_weight=1.0, decay=4.0)
    got = dspark_losses(*(jnp.asarray(x) for x in (draft, conf, target, labels, valid)), cfg)
    ref = reference_losses(draft, conf, target, labels, valid, cfg)
    for k in ("ce", "l1", "conf", "loss"):
        assert float(got[k]) == pytest.approx(ref[k], rel=1e-5), k
    # teacher-forced acceptance metrics over the blocks whose labels are all valid
    full = valid.all(1)
    match = draft.argmax(-1) == target.argmax(-1)
    np.testing.assert_allclose(got["match"], match[full].mean(0), rtol=1e-6)
    assert float(got["tau_greedy"]) == pytest.approx(1 + np.cumprod(match[full], 1).sum(1).mean(), rel=1e-6)
    pd = np.exp(draft) / np.exp(draft).sum(-1, keepdims=True)
    pt = np.exp(target) / np.exp(target).sum(-1, keepdims=True)
    c_star = np.clip(1 - 0.5 * np.abs(pd - pt).sum(-1), 0, 1)
    assert float(got["tau_prob"]) == pytest.approx(1 + np.cumprod(c_star[full], 1).sum(1).mean(), rel=1e-5)


def test_free_drafts_equal_the_inference_drafter_with_greedy_picks(batch):
    """``free_draft`` (the Markov chain on the drafter's own argmax tokens, used to replay decoding
    rounds) gives ``draft_block``'s greedy drafts and confidences."""
    model, ids, anchors, logits, hidden = batch
    g = model.cfg.dspark.block_size

    def free(m, hidden_, ids_, anchors_):
        block, pos, _, _ = block_inputs(ids_, anchors_, g, m.cfg.dspark.noise_token_id)
        rings, visible = context_rings(m, context_input(m.mtp, hidden_), anchors_)
        return free_draft(m, block.reshape(-1, g), pos.reshape(-1, g), rings, visible)

    def inference(m, hidden_b, anchor, length):
        cache = write_context(m.mtp, init_draft_cache(m.cfg, 1, jnp.float32), hidden_b, jnp.zeros((1,), jnp.int32),
                              length)
        out = draft_block(m, cache, anchor, length, lambda lg, k: jnp.argmax(lg, -1))
        return out.tokens, out.confidence

    free_fn, state = jitted(free, model)
    tokens, conf = free_fn(state, hidden, ids, anchors)
    infer, _ = jitted(inference, model)
    for b, j in [(0, 1), (0, 2), (1, 3)]:
        a = int(anchors[b, j])
        ref_tokens, ref_conf = infer(state, hidden[b:b + 1], ids[b:b + 1, a], jnp.array([a], jnp.int32))
        i = b * anchors.shape[1] + j
        np.testing.assert_array_equal(ref_tokens[0], tokens[i])
        np.testing.assert_allclose(ref_conf[0], conf[i], rtol=1e-5, atol=1e-6)
