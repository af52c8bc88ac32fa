"""The benchmark-only acceptance profile of the engine: accept lengths drawn from a given profile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import SamplingParams
from dspark_jax.decoding.engine import (STREAM_PROFILE, Engine, calibrated_confidence, profile_accepts,
                                        profile_conditionals)

PROFILE = (0.896, 0.776, 0.656, 0.552, 0.450)  # accept length 1 + sum = 4.33


def test_profile_conditionals():
    assert profile_conditionals(PROFILE, 5) == pytest.approx(
        (0.896, 0.776 / 0.896, 0.656 / 0.776, 0.552 / 0.656, 0.450 / 0.552))
    assert profile_conditionals((0.5, 0.5), 4) == (0.5, 1.0, 0.0, 0.0)  # missing positions never pass
    assert profile_conditionals((1.0,) * 7, 3) == (1.0, 1.0, 1.0)  # capped at γ
    assert profile_conditionals((0.0, 0.0), 2) == (0.0, 0.0)
    for bad, gamma in (((0.5, 0.6), 5), ((1.2,), 5), ((-0.1,), 5), ((0.5,), 0)):
        with pytest.raises(ValueError):
            profile_conditionals(bad, gamma)


@jax.jit
def host_uniforms(seeds, positions):
    """uniform(key(seed, position, STREAM_PROFILE)) for every request and position [b, γ]."""
    def one(s, p):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), STREAM_PROFILE))
    return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(seeds, positions)


def test_mean_accept_length_follows_the_profile(tiny_f32):
    """Over 16 requests x 48 rounds the mean accept length lies within 5 standard errors of
    1 + sum(profile), each position's pass rate within 5 standard errors of its p_i, and every
    round's accept count equals the one recomputed on the host from (seed, position, stream)."""
    gamma, batch, rounds = 5, 16, 48
    eng = Engine(tiny_f32, gamma=gamma, accept_profile=PROFILE)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, 20) for _ in range(batch)]
    params = [SamplingParams(max_new_tokens=10_000)] * batch
    seeds = list(range(100, 100 + batch))
    bs = eng.init_state(prompts, params, seeds, 20 + (gamma + 1) * rounds + 16)
    bs, _ = eng.prefill(bs, prompts)
    cond = np.asarray(profile_conditionals(PROFILE, gamma))
    accepted = []
    for r in range(rounds):
        lengths = np.asarray(bs.cache.lengths)
        bs, out = eng.round(bs, sampled=False, top_k=False, top_p=False)
        a = np.asarray(out.accepted)
        assert np.all(np.asarray(out.n_new) == a + 1)
        if r < 3:  # the same draw outside the engine
            u = np.asarray(host_uniforms(np.asarray(seeds, np.uint32), lengths[:, None] + np.arange(1, gamma + 1)))
            np.testing.assert_array_equal(a, np.cumprod(u < cond, axis=1).sum(axis=1))
        accepted.append(a)
    eng._round.lower(eng.params, bs, sampled=True, top_k=True, top_p=True)  # the sampled path traces too
    a = np.concatenate(accepted).astype(np.float64)
    n = a.size
    p = np.asarray(PROFILE)
    var = np.sum((2 * np.arange(1, gamma + 1) - 1) * p) - p.sum() ** 2  # Var(a) = E[a^2] - E[a]^2
    assert abs(1 + a.mean() - (1 + p.sum())) < 5 * np.sqrt(var / n), (a.mean(), p.sum())
    for i in range(gamma):
        rate = np.mean(a >= i + 1)
        assert abs(rate - p[i]) < 5 * np.sqrt(p[i] * (1 - p[i]) / n), (i, rate, p[i])


def test_calibrated_confidences_follow_the_profile(tiny_f32):
    """Calibrated profile confidences (benchmark only; 100k requests, γ = 5, logit spread 2). Every check
    is within 5 standard errors: the mean confidence of draft k is r_k = p_k / p_{k-1}; the rate
    at which draft k passes is p_k; drafts reaching position k with confidences in one decile of
    c_k pass at that decile's mean confidence (acceptance given c is c: a pass rate of r_k for
    every confidence would miss the outer deciles by 80 to 280 standard errors). The draws are
    reproducible, and a round starting at another length draws other confidences for the same
    positions."""
    n, gamma, spread = 100_000, 5, 2.0
    cond = profile_conditionals(PROFILE, gamma)
    seeds = jnp.arange(n, dtype=jnp.int32)
    lengths = jnp.asarray(np.random.default_rng(0).integers(0, 1000, n), jnp.int32)
    draw = jax.jit(lambda s, ln: calibrated_confidence(s, ln, cond, spread))
    logits = draw(seeds, lengths)
    c_dev = jax.nn.sigmoid(logits)  # what the schedulers' survivals and the acceptance read
    a = np.asarray(profile_accepts(seeds, lengths, c_dev))
    c = np.asarray(c_dev, np.float64)
    r, p = np.asarray(cond), np.asarray(PROFILE)
    assert np.all(np.abs(c.mean(0) - r) < 5 * c.std(0) / np.sqrt(n)), (c.mean(0), r)
    rates = np.array([np.mean(a >= k + 1) for k in range(gamma)])
    assert np.all(np.abs(rates - p) < 5 * np.sqrt(p * (1 - p) / n)), (rates, p)
    for k in range(gamma):
        reached = a >= k
        ck, passed = c[reached, k], a[reached] >= k + 1
        edges = np.quantile(ck, np.linspace(0, 1, 11))
        bins = np.clip(np.searchsorted(edges, ck, side="right") - 1, 0, 9)
        for b in range(10):
            sel = bins == b
            mean_c = ck[sel].mean()
            assert abs(passed[sel].mean() - mean_c) < 5 * np.sqrt(max(mean_c * (1 - mean_c), 1e-4) / sel.sum()), \
                (k, b, passed[sel].mean(), mean_c)
    np.testing.assert_array_equal(np.asarray(draw(seeds, lengths)), np.asarray(logits))
    later = np.asarray(draw(seeds, lengths + 1))  # positions L + 2 .. L + γ again, in a round at L + 1
    assert np.mean(later[:, :-1] == np.asarray(logits)[:, 1:]) < 0.01
    with pytest.raises(ValueError, match="needs an accept_profile"):
        Engine(tiny_f32, gamma=gamma, profile_confidence=2.0)
    with pytest.raises(ValueError, match="a logit spread >= 0"):
        Engine(tiny_f32, gamma=gamma, accept_profile=PROFILE, profile_confidence=-1.0)
