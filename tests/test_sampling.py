"""Lossless speculative sampling: the emitted tokens follow the target distribution."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dspark_jax
from dspark_jax import SamplingParams
from dspark_jax.decoding.sampling import SamplingArrays, accept_sampled, process_logits
from dspark_jax.decoding.scheduler import SPSTable, allocate_topk, confidence_lengths, survival
from tests.helpers import perturb

V, GAMMA, K = 5, 3, 2  # vocabulary, draft length, number of leading emitted tokens compared


def chains(seed):
    """Random order-1 Markov chains: target p(next | prev) and a different draft q(next | prev)."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V) * 0.7, V)
    q = 0.5 * p + 0.5 * rng.dirichlet(np.ones(V), V)  # correlated but different
    return jnp.log(jnp.asarray(p, jnp.float32)), jnp.log(jnp.asarray(q, jnp.float32))


@functools.partial(jax.jit, static_argnames=("n", "u_scale"))
def simulate(logp, logq, key, n, u_scale=1.0):
    """n independent decodes from anchor 0: rounds of γ drafts + verification until K tokens exist."""

    def one(key):
        def round_(carry, key):
            out, count, prev = carry
            kd, ku, kb = jax.random.split(key, 3)
            drafts, cur = [], prev
            for k in range(GAMMA):  # draft chain sampled from q
                cur = jax.random.categorical(jax.random.fold_in(kd, k), logq[cur])
                drafts.append(cur)
            drafts = jnp.stack(drafts)
            path = jnp.concatenate([prev[None], drafts])  # target rows along the drafted path
            q_rows = logq[path[:-1]][None]
            p_rows = logp[path][None]
            u = jax.random.uniform(ku, (1, GAMMA)) * u_scale
            a, resid = accept_sampled(drafts[None], q_rows, p_rows, u)
            bonus = jax.random.categorical(kb, resid[0])[None].astype(jnp.int32)
            emitted = jnp.where(jnp.arange(GAMMA + 1) < a[0], jnp.pad(drafts, (0, 1)), bonus[0])
            for j in range(GAMMA + 1):
                take = (j <= a[0]) & (count + j < K)
                out = jnp.where(take & (jnp.arange(K) == count + j), emitted[j], out)
            return (out, count + a[0] + 1, bonus[0]), None

        (out, _, _), _ = jax.lax.scan(round_, (jnp.zeros(K, jnp.int32), 0, jnp.int32(0)), jax.random.split(key, K))
        return out

    return jax.vmap(one)(jax.random.split(key, n))


def chi2_pvalue(samples, logp):
    p = np.exp(np.asarray(logp, np.float64))
    expected = np.array([p[0, a] * p[a, b] for a in range(V) for b in range(V)])
    counts = np.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V)
    return chi2(counts, expected)


def chi2(counts, expected):
    """Goodness of fit on the cells with an expected count of at least 5."""
    keep = expected * counts.sum() >= 5
    exp = expected[keep] / expected[keep].sum() * counts[keep].sum()
    return stats.chisquare(counts[keep].astype(np.float64), exp.astype(np.float64)).pvalue


def test_chain_rejection_sampling_is_lossless():
    logp, logq = chains(0)
    samples = np.asarray(simulate(logp, logq, jax.random.key(0), 400_000))
    assert chi2_pvalue(samples, logp) > 1e-3
    # the same test detects a 2% bias in the acceptance test (u * 0.98 accepts slightly too often)
    biased = np.asarray(simulate(logp, logq, jax.random.key(1), 400_000, u_scale=0.98))
    assert chi2_pvalue(biased, logp) < 1e-6


R = 4  # requests scheduled together in ``simulate_scheduled``
# buckets of 4 tokens, as a padded engine runs them (the confidence scheduler's bucket-aware rule
# then differs from the paper's Algorithm 1, which is the same rule with a bucket per token count)
STEEP = SPSTable(tokens=(4, 8, 12, 16), steps_per_s=tuple(1.0 / (1.0 + 0.3 * b) for b in (4, 8, 12, 16)))


SCHEDULERS = ("random", "confidence", "lagged")


@functools.partial(jax.jit, static_argnames=("n",))
def simulate_scheduled(logp, logq, conf, key, n, scheduler, capped=True):
    """``simulate`` in groups of R requests whose rounds verify l_r tokens, as a ragged round does,
    chosen by SCHEDULERS[scheduler]: "random" (l_r uniform in 1..γ+1), "confidence" (bucket-aware
    early stopping on the round's survivals) or "lagged" (a capacity drawn before the round, ``allocate_topk`` on
    the round's survivals). The confidence logit of draft k is ``conf[d_{k-1}]``, so survivals
    depend on the drafts. Target rows past l_r - 1 are zero logits (rows a packed verify does not
    compute); acceptance is capped at l_r - 1 (``capped`` False: not capped, the bug to catch)."""

    def group(key):
        def round_(carry, key):
            out, count, prev = carry  # [R, K], [R], [R]
            kd, ku, kb, kc = jax.random.split(key, 4)
            drafts, cur = [], prev
            for k in range(GAMMA):
                cur = jax.random.categorical(jax.random.fold_in(kd, k), logq[cur])
                drafts.append(cur)
            drafts = jnp.stack(drafts, axis=1)  # [R, γ]
            path = jnp.concatenate([prev[:, None], drafts], axis=1)
            surv = survival(conf[path[:, :-1]])
            active = jnp.ones((R,), bool)
            lens = jnp.stack([jax.random.randint(kc, (R,), 1, GAMMA + 2), confidence_lengths(surv, active, STEEP),
                              allocate_topk(surv, active, jax.random.randint(kc, (), 0, R * GAMMA + 1))])[scheduler]
            col = jnp.arange(GAMMA + 1)[None]
            p_rows = jnp.where((col < lens[:, None])[..., None], logp[path], 0.0)
            u = jax.random.uniform(ku, (R, GAMMA))
            a, resid = accept_sampled(drafts, logq[path[:, :-1]], p_rows, u, jnp.where(capped, lens - 1, GAMMA))
            bonus = jax.random.categorical(kb, resid).astype(jnp.int32)
            emitted = jnp.where(col < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
            for j in range(GAMMA + 1):
                take = (j <= a) & (count + j < K)
                out = jnp.where(take[:, None] & (jnp.arange(K)[None] == (count + j)[:, None]), emitted[:, j:j + 1], out)
            return (out, count + a + 1, bonus), None

        init = (jnp.zeros((R, K), jnp.int32), jnp.zeros((R,), jnp.int32), jnp.zeros((R,), jnp.int32))
        (out, _, _), _ = jax.lax.scan(round_, init, jax.random.split(key, K))
        return out

    return jax.vmap(group)(jax.random.split(key, n // R)).reshape(n, K)


def test_ragged_verify_sampling_is_lossless():
    """Verify lengths per request fixed before the drafts (random), by bucket-aware early
    stopping, or by a lagged capacity allocated on the current survivals: the emitted tokens
    follow the target distribution; without the cap at l_r - 1 they do not."""
    logp, logq = chains(0)
    conf = jnp.asarray(np.random.default_rng(1).normal(0.0, 2.0, V), jnp.float32)
    for i, name in enumerate(SCHEDULERS):
        samples = np.asarray(simulate_scheduled(logp, logq, conf, jax.random.key(2 + i), 120_000, i))
        assert chi2_pvalue(samples, logp) > 1e-3, name
    uncapped = np.asarray(simulate_scheduled(logp, logq, conf, jax.random.key(9), 40_000, 0, capped=False))
    assert chi2_pvalue(uncapped, logp) < 1e-6


def test_processing_applies_top_k_and_top_p():
    logits = jnp.log(jnp.asarray([[0.4, 0.3, 0.2, 0.06, 0.04]], jnp.float32))
    sp = lambda **kw: SamplingArrays(**{**dict(temperature=jnp.ones(1), top_k=jnp.zeros(1, jnp.int32),
                                               top_p=jnp.ones(1), seed=jnp.zeros(1, jnp.int32)), **kw})
    keep = lambda x: np.isfinite(np.asarray(x))[0].tolist()
    assert keep(process_logits(logits, sp(top_k=jnp.array([2])))) == [True, True, False, False, False]
    assert keep(process_logits(logits, sp(top_p=jnp.array([0.75])))) == [True, True, True, False, False]
    assert keep(process_logits(logits, sp(top_p=jnp.array([0.7])))) == [True, True, False, False, False]
    x = process_logits(logits, sp(temperature=jnp.array([0.5])))
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(x)), np.asarray(jax.nn.softmax(logits * 2)), rtol=1e-5)


def test_processing_from_the_largest_candidates_equals_sorting_the_vocabulary(monkeypatch):
    """Top-k / top-p read the c largest logits of each row (lax.top_k) where that is enough for
    every row and sort whole rows otherwise; both give exactly what sorting the vocabulary gives.
    Rows: top-k below, at and above c, top-p nuclei inside and reaching past c, greedy rows,
    temperatures; peaked logits so that most nuclei are small, one flat row to force the sort."""
    from dspark_jax.decoding import sampling

    v, c = 512, 16
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(12, 3, v)) * np.geomspace(0.5, 8.0, 12)[:, None, None], jnp.float32)
    arrays = lambda temp, k, p: SamplingArrays(temperature=jnp.asarray(temp, jnp.float32),  # noqa: E731
                                               top_k=jnp.asarray(k, jnp.int32), top_p=jnp.asarray(p, jnp.float32),
                                               seed=jnp.zeros(12, jnp.int32))
    within = arrays([0.7, 1.0, 0.0, 1.3] * 3, [1, 5, 16, 0, 3, 0, 16, 2, 0, 8, 0, 4],
                    [1.0, 0.9, 0.5, 1.0, 0.95, 1.0, 1.0, 0.3, 1.0, 0.99, 1.0, 0.8])
    past = arrays([1.0] * 12, [0, 17, 100, 5, 0, 0, 40, 0, 3, 0, 0, 0],
                  [0.95, 1.0, 0.9, 1.0, 0.999, 0.5, 1.0, 1.0, 0.9, 0.7, 0.95, 0.99])
    proc = jax.jit(process_logits, static_argnames=("use_top_k", "use_top_p", "candidates"))
    for sp in (within, past):
        for flags in (dict(use_top_k=True, use_top_p=True), dict(use_top_k=True, use_top_p=False),
                      dict(use_top_k=False, use_top_p=True)):
            want = np.asarray(proc(logits, sp, candidates=v, **flags))  # sorts the vocabulary
            got = np.asarray(proc(logits, sp, candidates=c, **flags))
            np.testing.assert_array_equal(got, want)
            assert 0 < np.isfinite(want).sum() < want.size
    # the first batch is served by its candidates alone: a poisoned sort does not reach its output;
    # the second batch sorts (its output changes with the poison)
    want = {name: np.asarray(proc(logits, sp, candidates=v)) for name, sp in (("within", within), ("past", past))}
    monkeypatch.setattr(sampling.jnp, "sort", lambda a, axis=-1: jnp.full_like(a, jnp.nan))
    np.testing.assert_array_equal(np.asarray(sampling.process_logits(logits, within, candidates=c)), want["within"])
    assert not np.array_equal(np.asarray(sampling.process_logits(logits, past, candidates=c)), want["past"])


@pytest.fixture(scope="module")
def vocab8_model():
    """The tiny config with a vocabulary of 8 and its three kinds of layers once each (window-only,
    C4 + indexer, C128: the samples' cost is the model's work per token), the three-stage drafter
    reading all three, every parameter perturbed (one model for both parametrisations below, which
    then share its compiled prefill programs)."""
    cfg = dspark_jax.config.tiny().replace(vocab_size=8, num_hidden_layers=3, compress_ratios=(0, 4, 128),
                                           dspark=dspark_jax.config.DSparkConfig(
                                               block_size=GAMMA, noise_token_id=7, target_layer_ids=(0, 1, 2),
                                               markov_rank=4))
    return perturb(dspark_jax.init(cfg, 3, dtype=jnp.float32), 3, scale=3.0)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_engine_sampling_matches_target_distribution(vocab8_model, params):
    """End to end with a model of vocabulary 8: the first two tokens of speculative samples follow
    the target's exact joint distribution (computed from its logits)."""
    m = vocab8_model
    prompt = [0, 3, 5, 2, 6, 4]
    n = 2048
    res = dspark_jax.generate([prompt] * n, model=m, sampling=[SamplingParams(max_new_tokens=2, seed=i, ignore_eos=True, **params)
                                                              for i in range(n)])
    assert np.mean([r.stats["mean_accept_length"] for r in res]) > 1.05  # drafts do get accepted
    assert chi2_target_pvalue(m, prompt, params, res) > 1e-4


def chi2_target_pvalue(m, prompt, params: dict, res) -> float:
    """Chi-square p-value of the results' tokens (all of the same length k, vocabulary 8) against
    the target's exact joint distribution of (x1 .. xk), computed from its logits with the same
    processing (one forward over every continuation); asserts that no sample lies outside it
    (outside top-k / top-p)."""
    samples = np.array([r.tokens for r in res])
    k, v, t = samples.shape[1], 8, len(prompt)
    seqs = np.array([list(prompt) + list(c) for c in itertools.product(range(v), repeat=k - 1)], np.int32)
    logits = m.logits(seqs)[:, t - 1:].reshape(-1, v)  # the rows for x1 .. xk of every sequence
    n = logits.shape[0]
    arr = SamplingArrays(temperature=jnp.full(n, params["temperature"]), top_k=jnp.full(n, params.get("top_k", 0)),
                         top_p=jnp.full(n, params.get("top_p", 1.0)), seed=jnp.zeros(n, jnp.int32))
    probs = np.asarray(jax.nn.softmax(process_logits(logits, arr)), np.float64).reshape(v ** (k - 1), k, v)
    expected = np.ones(1)
    for j in range(k):  # P(x1 .. x_{j+1}): the row of x_{j+1} from any sequence with that prefix
        rows = probs[::v ** (k - 1 - j), j]  # [v^j, v], prefixes in lexicographic order
        expected = (expected[:, None] * rows).reshape(-1)
    counts = np.bincount(np.ravel_multi_index(samples.T, (v,) * k), minlength=v ** k)
    assert counts[expected == 0].sum() == 0  # nothing outside top-k / top-p
    return chi2(counts, expected)


# The buckets of an 8-slot pool, the last 1000x slower: every round verifies at most 16 tokens
# (8 anchors + 8 drafts), so two verify programs (buckets 8 and 16) serve both schedulers, and the
# lagged capacity is 8 drafts even without history. The 16-token bucket is slower than the first
# by more than a draft adds to τ ((8 + a) 0.8 < 8), so Algorithm 1 would verify the anchors alone;
# the bucket-aware rule fills it by the drafts' survivals.
CLIFF = SPSTable(tokens=(8, 16, 32), steps_per_s=(1.0, 0.8, 1e-3))


@pytest.fixture(scope="module")
def scheduled_model():
    """Vocabulary 8, two layers (window-only, C4 with the indexer), one drafter stage (quick to
    compile). STS temperatures of 8 spread the nearly saturated confidences of random weights
    (sigmoids of logits 1 to 30) over about 0.55 to 0.98, so the schedulers' choices vary."""
    cfg = dspark_jax.config.tiny().replace(
        vocab_size=8, num_hidden_layers=2, compress_ratios=(0, 4), num_hash_layers=2,
        dspark=dspark_jax.config.DSparkConfig(block_size=GAMMA, noise_token_id=7, target_layer_ids=(1,),
                                              markov_rank=4, num_stages=1))
    m = perturb(dspark_jax.init(cfg, 3, dtype=jnp.float32), 3, scale=3.0)
    return dspark_jax.Model(m.module, sts_temperatures=(8.0,) * GAMMA)


@pytest.mark.parametrize("scheduler", ["confidence", "lagged"])
def test_scheduled_engine_sampling_matches_target_distribution(scheduled_model, scheduler):
    """End to end under the confidence and lagged schedulers (ragged verify, packed programs,
    verify lengths from the drafts' confidences, acceptance capped at l_r - 1): the first three
    tokens of 1024 speculative samples (temperature 1, top-k 3: 27 cells) follow the target's
    exact joint distribution, and the verify lengths vary between requests. x1 comes from the
    prompt, x2 and x3 from one or two rounds. Power: the engine with the cap at l_r - 1 removed
    emits tokens outside the target's top 3 (unverified rows are zeros) and fails here under
    either scheduler; the paper's Algorithm 1 in place of the bucket-aware rule verifies the
    anchors alone on this table and fails the spread of verify lengths. An anticipating rule in
    place of early stopping changes nothing measurable here (the exact enumeration and the
    brute-force non-anticipation check of test_scheduler cover it)."""
    params = dict(temperature=1.0, top_k=3)
    prompt = [0, 3, 5, 2, 6, 4]
    n = 1024
    res = dspark_jax.generate([prompt] * n, model=scheduled_model, slots=8, scheduler=scheduler, sps_table=CLIFF,
                              sampling=[SamplingParams(max_new_tokens=3, seed=i, ignore_eos=True, **params)
                                        for i in range(n)])
    verify = np.array([r.stats["mean_verify_tokens"] for r in res])
    assert 1.2 < verify.mean() < GAMMA and verify.std() > 0.3, (verify.mean(), verify.std())
    assert np.mean([r.stats["mean_accept_length"] for r in res]) > 1.05  # drafts do get accepted
    assert chi2_target_pvalue(scheduled_model, prompt, params, res) > 1e-4
