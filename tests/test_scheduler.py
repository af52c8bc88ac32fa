"""Verify-length schedulers: admission math against brute force, non-anticipation by brute
force, the paper's Appendix A counterexample by exact enumeration (on its table and on a bucketed
one), the SPS table and the lagged survival history."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import config
from dspark_jax.decoding import scheduler as sch
from dspark_jax.decoding.sampling import accept_sampled
from dspark_jax.model.common import Numerics
from dspark_jax.train import sts

SHAPES = [(1, 1), (1, 3), (2, 2), (3, 4), (5, 2), (4, 5)]  # (requests, γ)


# ---------------------------------------------------------------------------- random instances
def _instance(rng, r: int, g: int, bucketed: bool = False):
    """Survivals on a 1/16 grid (non-increasing rows, many ties, some zeros), an active mask, and a
    table on a 1/64 grid with many flat steps: over every count 1 .. r(γ+1) (one bucket per token
    count), or ``bucketed`` over a random third of them and r(γ+1) (the buckets of a padded
    engine; one table length per shape keeps the programs compiled once). Every τ · SPS product
    is then exact in float32 and float64, so exact ties are exercised."""
    surv = np.sort(rng.integers(0, 17, size=(r, g)), axis=1)[:, ::-1] / 16.0
    active = rng.random(r) < 0.75
    top = r * (g + 1)
    tokens = np.arange(1, top + 1)
    if bucketed:
        tokens = np.append(np.sort(rng.choice(top - 1, size=(top - 1) // 3, replace=False) + 1), top)
    sps = np.sort(rng.integers(1, 65, size=tokens.size))[::-1] / 64.0
    flat = rng.random(tokens.size) < 0.5  # SPS(b) = SPS(b - 1)
    for b in range(1, tokens.size):
        sps[b] = sps[b - 1] if flat[b] else sps[b]
    return surv, active, sch.SPSTable(tokens=tuple(tokens), steps_per_s=tuple(np.minimum.accumulate(sps)))


def _sps(table, b: int) -> float:  # the ceiling rule, spelled out
    return next(s for t, s in zip(table.tokens, table.steps_per_s) if t >= b)


def _sorted_candidates(surv, active):
    """(survival desc, position asc, request asc), by an explicit Python sort."""
    r, g = surv.shape
    return [(float(surv[i, k]), k, i) for _, k, i in
            sorted((-surv[i, k], k, i) for i in range(r) if active[i] for k in range(g))]


def _reference_algorithm1(surv, active, table):
    """Paper Algorithm 1: admit in order while Θ strictly grows, break at the first that does not."""
    n = int(active.sum())
    lengths = np.where(active, 1, 0)
    b, tau = n, float(n)
    best = tau * _sps(table, b)
    for v, k, i in _sorted_candidates(surv, active):
        b, tau = b + 1, tau + v
        theta = tau * _sps(table, b)
        if not theta > best:
            break
        assert lengths[i] == k + 1, "admitted candidates of a request must form a prefix"
        best, lengths[i] = theta, lengths[i] + 1
    return lengths


def _reference_early_stopping(surv, active, table, cut_at_best: bool = False):
    """Bucket-aware early stopping by its definition: admit the next candidate (value v, taking
    the round to B + 1 tokens) while filling the rest of the bucket of B + 1 with copies of v
    would give a Θ above that of stopping now; the round verifies what was admitted.
    ``cut_at_best``: the variant that admits while that bound beats the best Θ seen so far and
    cuts at the best admitted prefix (NOT lossless: its cut reads values ranked below it)."""
    n = int(active.sum())
    top = n * (surv.shape[1] + 1)  # n + M
    b, tau = n, float(n)
    admitted, best, best_m = [], tau * _sps(table, b), 0
    for v, k, i in _sorted_candidates(surv, active):
        bucket = next(t for t in table.tokens if t >= b + 1)
        bound = (tau + v + (min(bucket, top) - (b + 1)) * v) * _sps(table, b + 1)
        if not bound > (best if cut_at_best else tau * _sps(table, b)):
            break
        b, tau = b + 1, tau + v
        admitted.append(i)
        if tau * _sps(table, b) > best:
            best, best_m = tau * _sps(table, b), len(admitted)
    lengths = np.where(active, 1, 0)
    for i in admitted[:best_m] if cut_at_best else admitted:
        lengths[i] += 1
    return lengths


def _reference_capacity(surv, active, table):
    """argmax over every m of Θ(m), the smallest m on ties, by enumeration."""
    n = int(active.sum())
    values = [v for v, _, _ in _sorted_candidates(surv, active)]
    thetas = [(n + sum(values[:m])) * _sps(table, n + m) for m in range(len(values) + 1)]
    return thetas.index(max(thetas))


def _reference_topk(surv, active, k):
    lengths = np.where(active, 1, 0)
    for _, _, i in _sorted_candidates(surv, active)[:k]:
        lengths[i] += 1
    return lengths


@pytest.mark.parametrize("r,g", SHAPES)
def test_admission_matches_brute_force(r, g):
    """Early stopping, the lagged capacity and top-K against their definitions run in Python, on
    tables with one bucket per token count (where early stopping is the paper's Algorithm 1) and
    on bucketed ones."""
    rng = np.random.default_rng(100 * r + g)
    for i in range(40):
        surv, active, table = _instance(rng, r, g, bucketed=i % 2 == 1)
        s, a = jnp.asarray(surv, jnp.float32), jnp.asarray(active)
        want = _reference_early_stopping(surv, active, table)
        np.testing.assert_array_equal(sch.confidence_lengths(s, a, table), want)
        if i % 2 == 0:
            np.testing.assert_array_equal(want, _reference_algorithm1(surv, active, table))
        k = sch.lagged_capacity(surv, active, table)
        assert k == _reference_capacity(surv, active, table)
        for cap in {0, k, int(rng.integers(0, r * g + 2)), r * g + 3}:
            np.testing.assert_array_equal(sch.allocate_topk(s, a, cap), _reference_topk(surv, active, cap))


def _later_drafts_changed(rng, surv, r: int, k: int) -> list[np.ndarray]:
    """``surv`` with request r's survivals past position k (those that read draft k + 1, the
    draft whose verification is at stake) replaced by other non-increasing values <= a_{r,k}:
    all equal to it, all 0, and random ones on the 1/16 grid."""
    out = []
    for fill in ("equal", "zero", "random", "random"):
        x = surv.copy()
        tail = x.shape[1] - k - 1
        if fill == "equal":
            x[r, k + 1:] = x[r, k]
        elif fill == "zero":
            x[r, k + 1:] = 0.0
        else:
            x[r, k + 1:] = np.sort(rng.integers(0, int(x[r, k] * 16) + 1, tail))[::-1] / 16.0
        out.append(x)
    return out


def test_confidence_schedule_never_reads_the_draft_it_verifies():
    """Non-anticipation by brute force: whether request r verifies draft k + 1 (l_r >= k + 2)
    must not change when the survivals that read that draft (a_{r,k+1} .., through the Markov
    feature) change. Bucket-aware early stopping and top-K at a fixed capacity pass on every
    instance; the power check: the unconstrained argmax and early stopping cut at the best
    admitted prefix fail on some."""
    rng = np.random.default_rng(11)
    r, g = 4, 3
    batch = jax.jit(jax.vmap(sch.bucket_early_stopping, in_axes=(0, None, None, None)))
    violations = {"argmax": 0, "cut_at_best": 0}
    for _ in range(40):
        surv, active, table = _instance(rng, r, g, bucketed=True)
        tokens, steps = jnp.asarray(table.tokens), jnp.asarray(table.steps_per_s)
        cases = [(i, k, x) for i in np.flatnonzero(active) for k in range(g - 1)
                 for x in _later_drafts_changed(rng, surv, i, k)]
        if not cases:
            continue
        got = np.asarray(batch(jnp.asarray(np.stack([surv] + [x for _, _, x in cases]), jnp.float32),
                               jnp.asarray(active), tokens, steps))
        cap = int(rng.integers(0, r * g + 1))
        topk = _reference_topk(surv, active, cap)
        for j, (i, k, x) in enumerate(cases):
            assert (got[0, i] >= k + 2) == (got[1 + j, i] >= k + 2), (surv, x, table)
            assert (topk[i] >= k + 2) == (_reference_topk(x, active, cap)[i] >= k + 2)
            argmax = [_reference_topk(y, active, _reference_capacity(y, active, table))[i] for y in (surv, x)]
            best = [_reference_early_stopping(y, active, table, cut_at_best=True)[i] for y in (surv, x)]
            violations["argmax"] += (argmax[0] >= k + 2) != (argmax[1] >= k + 2)
            violations["cut_at_best"] += (best[0] >= k + 2) != (best[1] >= k + 2)
    assert min(violations.values()) > 0, violations


def test_schedulers_jit_without_host_sync():
    rng = np.random.default_rng(7)
    r, g = 4, 5
    surv, active, table = _instance(rng, r, g, bucketed=True)
    conf = jax.jit(lambda s, a: sch.confidence_lengths(s, a, table))  # the table is a constant
    topk = jax.jit(lambda s, a, k: sch.allocate_topk(s, a, k))  # the capacity is traced
    for _ in range(10):
        surv, active, _ = _instance(rng, r, g)
        s, a = jnp.asarray(surv, jnp.float32), jnp.asarray(active)
        np.testing.assert_array_equal(conf(s, a), _reference_early_stopping(surv, active, table))
        cap = sch.lagged_capacity(surv, active, table)
        np.testing.assert_array_equal(topk(s, a, jnp.int32(cap)), _reference_topk(surv, active, cap))
    assert topk._cache_size() == 1 and conf._cache_size() == 1


def test_topk_gives_prefixes_of_the_best_candidates():
    """Continuous survivals with exact ties inside a request (c_k = 1): for every capacity, each
    request's verified drafts are a prefix, nothing left out beats anything taken, and the total
    is n_active + min(K, n_active·γ)."""
    rng = np.random.default_rng(3)
    r, g = 6, 5
    for _ in range(20):
        c = np.where(rng.random((r, g)) < 0.3, 1.0, rng.random((r, g)))
        surv = np.cumprod(c, axis=1).astype(np.float32)
        active = rng.random(r) < 0.8
        prev = None
        for k in range(r * g + 2):
            lengths = np.asarray(sch.allocate_topk(jnp.asarray(surv), jnp.asarray(active), k))
            n_active = int(active.sum())
            assert lengths.sum() == n_active + min(k, n_active * g)
            assert np.all(lengths[~active] == 0) and np.all((lengths[active] >= 1) & (lengths[active] <= g + 1))
            taken = np.arange(g)[None] < (lengths - 1)[:, None]  # a prefix by construction of l_r
            pool = active[:, None] & np.ones((r, g), bool)
            if taken.any() and (pool & ~taken).any():
                assert surv[taken].min() >= surv[pool & ~taken].max()
            if prev is not None:
                assert np.all(lengths >= prev)
            prev = lengths


def test_ties_break_by_position_then_request():
    surv = jnp.asarray([[0.5, 0.5], [0.5, 0.25]])
    both = jnp.asarray([True, True])
    got = [sch.allocate_topk(surv, both, k).tolist() for k in range(5)]
    # order: (r0, d1), (r1, d1), (r0, d2) [0.5 ties: position, then request], (r1, d2)
    assert got == [[1, 1], [2, 1], [2, 2], [3, 2], [3, 3]]
    # the first draft of request 1 outranks the second of request 0 at equal survival
    assert sch.allocate_topk(jnp.asarray([[0.5, 0.5], [0.5, 0.0]]), both, 2).tolist() == [2, 2]
    # an inactive slot's candidates never count, whatever their survival
    assert sch.allocate_topk(surv, jnp.asarray([False, True]), 2).tolist() == [0, 3]


def test_early_stopping_on_dense_and_bucketed_tables():
    """Θ = 1, 0.9, 1.134 for m = 0, 1, 2 with one bucket per count (the Appendix A numbers): early
    stopping (there Algorithm 1) stops at m = 0; the global argmax takes 2. The same rates with
    counts 2 and 3 in one bucket: Algorithm 1 still stops at 0 (Θ(1) = 0.81), the bucket-aware
    rule fills the bucket (1.134)."""
    dense = sch.SPSTable(tokens=(1, 2, 3), steps_per_s=(1.0, 0.5, 0.45))
    surv, active = np.array([[0.8, 0.72]]), np.array([True])
    assert sch.confidence_lengths(jnp.asarray(surv), jnp.asarray(active), dense).tolist() == [1]
    assert sch.lagged_capacity(surv, active, dense) == 2
    bucketed = sch.SPSTable(tokens=(1, 3), steps_per_s=(1.0, 0.45))
    assert _reference_algorithm1(surv, active, bucketed).tolist() == [1]
    assert sch.confidence_lengths(jnp.asarray(surv), jnp.asarray(active), bucketed).tolist() == [3]
    flat = sch.SPSTable(tokens=(3,), steps_per_s=(1.0,))  # one bucket: every positive survival pays
    assert sch.confidence_lengths(jnp.asarray(surv), jnp.asarray(active), flat).tolist() == [3]


def test_early_stopping_crosses_a_bucket_edge_that_pays():
    """The H200 case (docs/benchmarks.md, 2026-12-02; its SPS table of 128 slots): 128 slots
    verify their anchors in the first bucket, and the first draft past it costs 4.7 % of the
    rounds for 0.7 % more τ, so Algorithm 1 verifies the anchors alone. The bucket-aware rule
    takes what the global argmax takes here: every draft when the drafter is sure, the best 128
    (the 256-token bucket) when it is not."""
    table = sch.SPSTable(tokens=(128, 256, 512, 768), steps_per_s=(29.94, 28.52, 25.08, 23.68))
    active = np.ones(128, bool)
    for hi, lo, tokens in ((0.9, 0.6, 768), (0.3, 0.05, 256)):  # c_k of request r: hi .. lo over r
        surv = np.cumprod(np.full((128, 5), hi) - (hi - lo) * np.arange(128)[:, None] / 127, axis=1)
        assert _reference_algorithm1(surv, active, table).sum() == 128
        got = np.asarray(sch.confidence_lengths(jnp.asarray(surv, jnp.float32), jnp.asarray(active), table))
        assert got.sum() == tokens == 128 + sch.lagged_capacity(surv, active, table)
        np.testing.assert_array_equal(got, _reference_topk(surv, active, tokens - 128))


# ---------------------------------------------------------------------------- Appendix A
A, B = 0, 1
P_TARGET, P_DRAFT = np.array([0.7, 0.3]), np.array([0.5, 0.5])
APPENDIX_TABLE = sch.SPSTable(tokens=(1, 2, 3), steps_per_s=(1.0, 0.5, 0.45))
ACCEPT = jax.jit(accept_sampled)  # the project's chain rejection sampling
GRID = 20  # midpoints of 20 equal cells: every acceptance threshold here (0.6, 1) is a cell edge


def _current_survival(x1: int) -> np.ndarray:
    c2 = 0.9 if x1 == A else 0.0  # the confidence of d_2 reads d_1 through the Markov feature
    return np.array([[0.8, 0.8 * c2]])


def _first_token_distribution(verify_len) -> np.ndarray:
    """Exact distribution of the first emitted token: enumerate d_1, d_2 ~ p_d and the acceptance
    uniform on a grid, run the project's chain rejection sampling (``accept_sampled``) on the
    ``verify_len(d_1) - 1`` verified drafts, and take d_1 if accepted, else the bonus
    distribution it returns (the residual, or p_target when no draft is verified)."""
    u = (np.arange(GRID) + 0.5) / GRID
    out = np.zeros(2)
    for x1 in (A, B):
        for x2 in (A, B):
            n = int(verify_len(x1)) - 1
            assert 0 <= n <= 2
            drafts = jnp.asarray(np.tile([x1, x2], (GRID, 1))[:, :n], jnp.int32)
            q = jnp.log(jnp.asarray(np.tile(P_DRAFT, (GRID, n, 1)), jnp.float32))
            p = jnp.log(jnp.asarray(np.tile(P_TARGET, (GRID, n + 1, 1)), jnp.float32))
            uniforms = jnp.asarray(np.stack([u, np.full(GRID, 0.5)], axis=1)[:, :n], jnp.float32)
            a, log_bonus = ACCEPT(drafts, q, p, uniforms)
            first = np.where(np.asarray(a)[:, None] >= 1, np.eye(2)[x1][None], np.exp(np.asarray(log_bonus)))
            out += P_DRAFT[x1] * P_DRAFT[x2] * first.mean(axis=0)
    return out


BUCKETED_TABLE = sch.SPSTable(tokens=(1, 3), steps_per_s=(1.0, 0.45))  # the same rates, 2 and 3 tokens in one bucket


def test_appendix_a_unconstrained_search_is_not_lossless():
    """A global argmax over the CURRENT survivals verifies d_1 only when d_1 = A makes d_2 look
    good: the output becomes (0.85, 0.15), on either table. So does bucket-aware early stopping
    cut at its best admitted prefix instead of its last: on the bucketed table it admits d_1 in
    both cases (filling the bucket could pay), then keeps it only if d_2 made that bucket pay."""
    one = np.array([True])

    for table in (APPENDIX_TABLE, BUCKETED_TABLE):
        def unconstrained(x1, table=table):  # global argmax over the CURRENT survivals, no early stop
            s = _current_survival(x1)
            return sch.allocate_topk(jnp.asarray(s), jnp.asarray(one), sch.lagged_capacity(s, one, table))[0]

        assert [int(unconstrained(x)) for x in (A, B)] == [3, 1]
        np.testing.assert_allclose(_first_token_distribution(unconstrained), [0.85, 0.15], atol=1e-6)

    def cut_at_best(x1):
        return _reference_early_stopping(_current_survival(x1), one, BUCKETED_TABLE, cut_at_best=True)[0]

    assert [int(cut_at_best(x)) for x in (A, B)] == [3, 1]
    np.testing.assert_allclose(_first_token_distribution(cut_at_best), [0.85, 0.15], atol=1e-6)


def test_appendix_a_early_stopping_and_lagged_are_lossless():
    """Early stopping verifies d_1 or not whatever d_1 is: never on the Appendix A table (there
    Algorithm 1), always on the bucketed one (d_2 too when d_1 = A); the lagged scheduler with
    any capacity fixed before the round. The output is the target's (0.7, 0.3)."""
    one = np.array([True])

    for table, lengths in ((APPENDIX_TABLE, [1, 1]), (BUCKETED_TABLE, [3, 2])):
        def early_stopping(x1, table=table):
            return sch.confidence_lengths(jnp.asarray(_current_survival(x1)), jnp.asarray(one), table)[0]

        assert [int(early_stopping(x)) for x in (A, B)] == lengths
        np.testing.assert_allclose(_first_token_distribution(early_stopping), P_TARGET, atol=1e-6)
    # lagged: K from survivals of an older round (whichever d_1 that round drew), allocation on the current ones
    for older in (_current_survival(A), _current_survival(B)):
        k = sch.lagged_capacity(older, one, APPENDIX_TABLE)

        def lagged(x1, k=k):
            return sch.allocate_topk(jnp.asarray(_current_survival(x1)), jnp.asarray(one), k)[0]

        np.testing.assert_allclose(_first_token_distribution(lagged), P_TARGET, atol=1e-6)
    for k in range(3):  # any capacity fixed before the round
        dist = _first_token_distribution(
            lambda x1: sch.allocate_topk(jnp.asarray(_current_survival(x1)), jnp.asarray(one), k)[0])
        np.testing.assert_allclose(dist, P_TARGET, atol=1e-6)


# ---------------------------------------------------------------------------- survival
def test_survival_from_confidence_logits_and_sts_temperatures():
    rng = np.random.default_rng(0)
    logits = rng.normal(1.0, 3.0, (7, 5))
    temps = (1.12, 1.41, 0.79, 0.63, 0.89)
    got = np.asarray(jax.jit(lambda c: sch.survival(c, temps))(jnp.asarray(logits, jnp.float32)))
    np.testing.assert_allclose(got, sts.survival(logits, temps), rtol=1e-5, atol=1e-7)
    assert np.all(np.diff(got, axis=1) <= 0)
    np.testing.assert_allclose(sch.survival(jnp.asarray(logits)), sts.survival(logits, np.ones(5)), rtol=1e-5)
    with pytest.raises(ValueError, match="expected 5 STS temperatures"):
        sch.survival(jnp.asarray(logits), (1.0, 1.0))
    with pytest.raises(ValueError, match="finite and positive"):
        sch.survival(jnp.asarray(logits), (1.0, 0.0, 1.0, 1.0, 1.0))


# ---------------------------------------------------------------------------- SPS table
KEY = sch.TableKey(device_kind="NVIDIA H200", n_devices=1, model="0123456789abcdef", gamma=5, dtype="bfloat16",
                   weight_format="official", kv_layout="fp8")


def test_isotonic_fit_pools_violators():
    np.testing.assert_allclose(sch.isotonic_increasing([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]), [1, 2.5, 2.5, 4])
    np.testing.assert_allclose(sch.isotonic_increasing([1.0, 3.0, 2.0], [1, 1, 3]), [1, 2.25, 2.25])
    np.testing.assert_allclose(sch.isotonic_increasing([5.0, 1.0, 1.0], [1, 1, 1]), [7 / 3] * 3)


def test_fit_noisy_times_gives_monotone_table():
    rng = np.random.default_rng(1)
    counts = [1, 2, 4, 8, 16, 32, 64, 128]
    truth = {t: 0.010 + 0.0002 * t for t in counts}
    times = {t: list(truth[t] * (1 + 0.3 * rng.standard_normal(5)).clip(0.2)) for t in counts}
    times[8] = [0.5, 0.001, 0.002, 0.0015, 0.9]  # a noisy count: its median undercuts its neighbours
    table = sch.fit_table(times, KEY)
    assert table.tokens == tuple(counts)
    assert all(b <= a for a, b in zip(table.steps_per_s, table.steps_per_s[1:]))
    medians = [float(np.median(times[t])) for t in counts]
    np.testing.assert_allclose(table.measured_steps_per_s, 1 / np.asarray(medians))
    np.testing.assert_allclose(table.steps_per_s, 1 / sch.isotonic_increasing(medians, [5] * len(counts)))
    assert table.steps_per_s != table.measured_steps_per_s  # the violation was repaired, not kept
    with pytest.raises(ValueError, match="non-increasing"):
        sch.SPSTable(tokens=(1, 2), steps_per_s=(1.0, 2.0))
    with pytest.raises(ValueError, match="strictly increasing"):
        sch.SPSTable(tokens=(2, 2), steps_per_s=(1.0, 1.0))
    with pytest.raises(ValueError, match="positive seconds"):
        sch.fit_table({4: [0.1, -1.0]})


def test_ceiling_lookup_and_buckets():
    table = sch.SPSTable(tokens=(4, 8, 16), steps_per_s=(3.0, 2.0, 1.0))
    b = np.arange(1, 17)
    want = np.where(b <= 4, 3.0, np.where(b <= 8, 2.0, 1.0))
    np.testing.assert_array_equal(table.steps_per_second(b), want)
    np.testing.assert_array_equal(table.steps_per_second(jnp.asarray(b), jnp), want)
    assert [table.bucket(x) for x in (1, 4, 5, 9, 16)] == [4, 4, 8, 16, 16]
    with pytest.raises(ValueError, match="stops at 16 verify tokens"):
        table.steps_per_second(np.array([17]))
    with pytest.raises(ValueError, match="profile up to at least 20"):  # 4 slots x (γ + 1) = 20 > 16
        sch.confidence_lengths(jnp.ones((4, 4)), jnp.ones(4, bool), table)


def test_table_json_round_trip_and_stale_key(tmp_path):
    table = sch.fit_table({1: [0.01, 0.011], 6: [0.012], 12: [0.02, 0.018, 0.019]}, KEY, {"context": 8192})
    path = str(tmp_path / "sps.json")
    table.save(path)
    assert sch.SPSTable.load(path, KEY) == table
    for field, other in [("device_kind", "AMD Instinct MI355X"), ("n_devices", 8), ("model", "fedcba9876543210"),
                         ("gamma", 7), ("dtype", "float32"), ("weight_format", "dense"), ("kv_layout", "bf16")]:
        with pytest.raises(sch.StaleTableError, match=field):
            sch.SPSTable.load(path, dataclasses.replace(KEY, **{field: other}))
    (tmp_path / "other.json").write_text(json.dumps({"temperatures": [1.0]}))
    with pytest.raises(ValueError, match="not an SPS table"):
        sch.SPSTable.load(str(tmp_path / "other.json"), KEY)
    with pytest.raises(FileNotFoundError):
        sch.SPSTable.load(str(tmp_path / "missing.json"), KEY)


def test_table_key_of_a_model():
    cfg = config.tiny()
    model = types.SimpleNamespace(config=cfg, numerics=Numerics(weight_format="fp8"), state={})  # only what a key reads
    key = sch.table_key(model, gamma=5, kv_layout="fp8")
    assert (key.device_kind, key.n_devices, key.gamma, key.dtype, key.weight_format, key.kv_layout) == (
        jax.devices()[0].device_kind, 1, 5, "bfloat16", "fp8", "fp8")
    assert key.model == sch.config_fingerprint(config.tiny())
    assert key.model != sch.config_fingerprint(cfg.replace(vocab_size=cfg.vocab_size + 1))


def test_uninitialised_table_verifies_everything():
    table = sch.SPSTable.uninitialised(KEY)
    assert not table.initialised
    surv = np.array([[0.9, 0.1, 0.0], [0.2, 0.0, 0.0], [0.5, 0.5, 0.5]])
    active = np.array([True, True, False])
    with pytest.warns(UserWarning, match="uninitialised"):
        got = sch.confidence_lengths(jnp.asarray(surv), jnp.asarray(active), table)
    assert got.tolist() == [4, 4, 0]
    with pytest.warns(UserWarning, match="uninitialised"):
        k = sch.lagged_capacity(surv, active, table)
    assert k == 6 and sch.allocate_topk(jnp.asarray(surv), jnp.asarray(active), k).tolist() == [4, 4, 0]
    with pytest.raises(ValueError, match="uninitialised"):
        table.save("/nonexistent/sps.json")


def test_profile_drops_warmup_and_plots(tmp_path):
    calls = []

    def seconds(tokens):
        calls.append(tokens)
        first = calls.count(tokens) == 1
        return 100.0 if first else 0.01 * (1 + tokens / 64) * (1 + 0.1 * (calls.count(tokens) % 2))

    table = sch.profile(seconds, [16, 1, 4], KEY, repeats=2, warmup=1)
    assert calls == [1, 1, 1, 4, 4, 4, 16, 16, 16]
    assert table.tokens == (1, 4, 16)
    np.testing.assert_allclose(1 / np.asarray(table.measured_steps_per_s), [0.0105 * (1 + t / 64) for t in (1, 4, 16)])
    assert table.static_steps_per_s is None and not table.static_dominates
    sch.plot_table(table, str(tmp_path / "sps.png"))
    assert (tmp_path / "sps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the static round timed the same way (warm-up dropped, median of the repeats)
    static_calls = []

    def static_seconds():
        static_calls.append(1)
        return 100.0 if len(static_calls) == 1 else [0.02, 0.03, 0.01][len(static_calls) - 2]

    calls.clear()
    with_static = sch.profile(seconds, [16, 1, 4], KEY, repeats=3, warmup=1, static_seconds=static_seconds)
    assert len(static_calls) == 4 and with_static.static_steps_per_s == pytest.approx(1 / 0.02)
    sch.plot_table(with_static, str(tmp_path / "sps_static.png"))


def test_lagged_plan_runs_the_static_round_when_its_throughput_wins():
    """Θ(static) = (n + Σ every survival) · SPS_static against Θ(K) = (n + Σ the K largest) ·
    SPS(n + K), brute force over the same lagged survivals."""
    table = sch.SPSTable(tokens=(8, 16, 24), steps_per_s=(300.0, 200.0, 150.0), static_steps_per_s=180.0)
    active = np.array([True, True, True, True])
    confident, unsure = np.full((4, 5), 0.9), np.full((4, 5), 0.1)
    for surv in (confident, unsure):
        k, static_wins = sch.lagged_plan(surv, active, table)
        assert k == sch.lagged_capacity(surv, active, table)
        values = np.sort(surv.ravel())[::-1]
        static = (4 + values.sum()) * 180.0
        lagged = (4 + values[:k].sum()) * table.steps_per_second(np.array([4 + k]))[0]
        assert static_wins == (static >= lagged)
    # confident drafts: 22 expected tokens at 180 rounds/s beat the best ragged round (24 tokens, 150/s)
    assert sch.lagged_plan(confident, active, table) == (20, True)
    # unsure drafts: the anchors plus 4 drafts at 300 rounds/s beat verifying everything
    assert sch.lagged_plan(unsure, active, table) == (4, False)
    assert sch.lagged_plan(confident, active, dataclasses.replace(table, static_steps_per_s=None)) == (20, False)


def test_static_round_dominates_only_when_no_bucket_is_faster(tmp_path):
    """Θ(ragged) = E[accepted of a subset] · SPS(bucket) <= E[accepted of all] · SPS(fastest bucket),
    so a static round at least as fast as the fastest bucket is the best choice whatever the
    confidences; one that is slower is not (the schedulers then decide per round)."""
    base = dict(tokens=(8, 16, 24), steps_per_s=(300.0, 250.0, 240.0))
    assert sch.SPSTable(**base, static_steps_per_s=300.0).static_dominates
    assert sch.SPSTable(**base, static_steps_per_s=450.0).static_dominates
    assert not sch.SPSTable(**base, static_steps_per_s=299.0).static_dominates
    assert not sch.SPSTable(**base).static_dominates
    with pytest.raises(ValueError, match="static rounds per second"):
        sch.SPSTable(**base, static_steps_per_s=0.0)
    table = sch.SPSTable(**base, key=KEY, static_steps_per_s=371.5)
    table.save(str(tmp_path / "sps.json"))
    assert sch.SPSTable.load(str(tmp_path / "sps.json"), KEY) == table


# ---------------------------------------------------------------------------- lag state
def test_survival_history_freshness():
    h = sch.SurvivalHistory(slots=4, gamma=2)
    s0 = np.array([[0.9, 0.5], [0.8, 0.4], [0.7, 0.3], [0.6, 0.2]])
    h.record(0, owner=[5, 7, -1, 9], active=[True, True, False, False], surv=s0)
    got = h.lagged(2, owner=[5, 8, 3, 9])  # slot 1: another request; slot 2: new; slot 3: not decoding then
    np.testing.assert_array_equal(got, [[0.9, 0.5], [1, 1], [1, 1], [1, 1]])
    np.testing.assert_array_equal(h.lagged(3, owner=[5, 7, -1, 9]), np.ones((4, 2)))  # round 1 unknown
    for t in range(1, 6):
        h.record(t, owner=[5, 7, -1, 9], active=[True] * 4, surv=s0 * (t / 10))
    np.testing.assert_array_equal(h.lagged(7, owner=[5, 7, 2, 9])[[0, 1, 3]], s0[[0, 1, 3]] * 0.5)
    assert sorted(h.rounds) == [3, 4, 5]  # only rounds a later schedule can still ask for
    with pytest.raises(ValueError, match="survivals"):
        h.record(6, owner=[5, 7, -1, 9], active=[True] * 4, surv=np.ones((4, 3)))


def test_round_times_before_any_static_round_and_their_expiry():
    """Ragged rounds timed before any static round are held against the latest static median;
    after ``explore_after`` static rounds in a row the ragged times are dropped (measured again)."""
    times = sch.RoundTimes(window=5, explore_after=4)
    times.record("ragged", 0.01, 0.03)  # 3x the table, no static round yet
    assert times.slowdown() == pytest.approx(3.0)
    times.record("static", 0.02, 0.04)  # the static round runs 2x its entry
    assert times.slowdown() == pytest.approx(1.5)
    for _ in range(2):
        times.record("static", 0.02, 0.04)
    assert times.slowdown() == pytest.approx(1.5)  # 3 static rounds in a row: kept
    times.record("static", 0.02, 0.04)  # the 4th: dropped, the next ragged rounds are timed afresh
    assert times.ratios["ragged"] == [] and times.slowdown() == 1.0
    times.record("ragged", 0.01, 0.05)
    times.record("static", 0.02, 0.04)  # a ragged round in between restarts the count
    assert times.slowdown() == pytest.approx(2.5)


def test_round_times_scale_the_ragged_rates_by_their_slowdown_against_the_static_round():
    table = sch.SPSTable(tokens=(8, 16), steps_per_s=(100.0, 50.0), static_steps_per_s=40.0)
    times = sch.RoundTimes(window=3)
    assert times.corrected(table) is table  # nothing measured
    times.record("static", 0.025, 0.05)  # static rounds 2x slower than the table
    assert times.slowdown() == 1.0  # no ragged round measured yet
    for measured in (0.04, 0.06, 0.08, 0.06):  # ragged rounds of 0.01 s predicted: 4x .. 8x, the last 3 kept
        times.record("ragged", 0.01, measured)
    assert [r for r, _ in times.ratios["ragged"]] == pytest.approx([6.0, 8.0, 6.0])
    assert times.slowdown() == pytest.approx(3.0)  # median 6x against the static round's 2x
    fixed = times.corrected(table)
    assert fixed.steps_per_s == pytest.approx((100 / 3, 50 / 3)) and fixed.static_steps_per_s == 40.0
    assert times.corrected(table) is fixed  # built again only when the factor moves
    # static rounds measured slower later: the ragged rounds were 3x slower than the static round
    # of their time, and no newer ragged round says otherwise (comparing old ragged times with new
    # static ones would call them no slower and retry them)
    for _ in range(3):
        times.record("static", 0.025, 0.4)
    assert times.slowdown() == pytest.approx(3.0)
    times.record("ragged", 0.01, 0.16)  # a ragged round as slow as the static rounds now
    times.record("ragged", 0.01, 0.16)
    assert times.slowdown() == 1.0  # median of 3, 1, 1
    with pytest.raises(ValueError, match="kind"):
        times.record("verify", 0.01, 0.01)
    with pytest.raises(ValueError, match="positive"):
        times.record("ragged", 0.0, 0.01)


def test_clairvoyant_bound_on_compute_bound_and_flat_tables():
    rates = (0.896, 0.776, 0.656, 0.552, 0.450)
    slots, g = 8, 5
    counts = tuple(range(slots, slots * (g + 1) + 1, slots))
    # round time proportional to the verify tokens: the bound is (γ + 1) / E[A + 1] with a bucket
    # at every count, and no larger with the ceiling buckets
    linear = sch.SPSTable(tokens=counts, steps_per_s=tuple(1000.0 / t for t in counts))
    got = sch.clairvoyant_bound(linear, rates, slots, g, rounds=4096, seed=1)
    assert got["mean_verify_tokens"] == pytest.approx(1 + sum(rates), rel=0.01)
    assert got["every_count"] == pytest.approx((g + 1) / (1 + sum(rates)), rel=0.01)
    assert 1.0 < got["buckets"] <= got["every_count"]
    # a flat table, or a static round faster than any bucket: nothing to gain
    flat = sch.SPSTable(tokens=counts, steps_per_s=(20.0,) * len(counts))
    assert sch.clairvoyant_bound(flat, rates, slots, g)["every_count"] == pytest.approx(1.0)
    fast_static = dataclasses.replace(linear, static_steps_per_s=200.0)
    assert sch.clairvoyant_bound(fast_static, rates, slots, g)["buckets"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="non-increasing"):
        sch.clairvoyant_bound(linear, (0.5, 0.6, 0.4, 0.3, 0.2), slots, g)
    with pytest.raises(ValueError, match="stops at"):
        sch.clairvoyant_bound(linear, rates, 16, g)
