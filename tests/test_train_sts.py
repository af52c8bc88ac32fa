"""STS calibration of the confidence head: ECE, AUC, the left-to-right temperature fit."""

import numpy as np
import pytest

from dspark_jax.train.sts import auc, default_grid, ece, fit_sts, sigmoid, survival


def test_ece_hand_computed():
    prob = np.array([0.05, 0.15, 0.95, 0.91, 0.5])
    labels = np.array([0, 1, 1, 0, 1])
    # 10 bins: {0.05}: |0.05-0|, {0.15}: |0.15-1|, {0.5}: |0.5-1|, {0.95, 0.91}: |1.86-1|
    expected = (0.05 + 0.85 + 0.5 + 0.86) / 5
    assert ece(prob, labels, n_bins=10) == pytest.approx(expected)
    assert ece(np.array([1.0, 0.0]), np.array([1, 0]), n_bins=15) == 0.0  # edges land in the end bins


def test_auc_matches_pairwise_count():
    rng = np.random.default_rng(0)
    score = np.round(rng.normal(size=300), 1)  # rounding creates ties
    labels = (rng.random(300) < sigmoid(2 * score)).astype(int)
    pos, neg = score[labels == 1], score[labels == 0]
    pairwise = np.mean(pos[:, None] > neg[None]) + 0.5 * np.mean(pos[:, None] == neg[None])
    assert auc(score, labels) == pytest.approx(pairwise)
    assert np.isnan(auc(score, np.ones(300)))


def _synthetic(scale: float, n: int = 6000, g: int = 5, seed: int = 0):
    """True per-position acceptance logits; the head reports them multiplied by ``scale``."""
    rng = np.random.default_rng(seed)
    true = rng.normal(1.0, 1.5, (n, g)) + np.linspace(1.0, -0.5, g)
    accepted = rng.random((n, g)) < sigmoid(true)
    return scale * true, np.cumprod(accepted, axis=1)


@pytest.mark.parametrize("scale", [3.0, 0.4])  # over- and under-confident heads
def test_sts_lowers_ece_on_miscalibrated_confidence(scale):
    raw, prefix = _synthetic(scale)
    res = fit_sts(raw, prefix)
    before, after = np.mean(res.ece_before), np.mean(res.ece_after)
    assert after < 0.5 * before
    assert after < 0.03
    # Temperatures undo the scale at the first position (later ones also absorb the product).
    assert res.temperatures[0] == pytest.approx(scale, rel=0.25)
    # A positive temperature keeps the order of the scores at each position.
    np.testing.assert_allclose(res.auc_before[0], res.auc_after[0])
    # Held-out samples drawn the same way are calibrated by the fitted temperatures as well.
    raw2, prefix2 = _synthetic(scale, seed=1)
    surv = survival(raw2, res.temperatures)
    assert np.mean([ece(surv[:, k], prefix2[:, k]) for k in range(5)]) < 0.5 * before


def test_sts_keeps_a_calibrated_head():
    raw, prefix = _synthetic(1.0)
    res = fit_sts(raw, prefix)
    assert res.temperatures[0] == pytest.approx(1.0, rel=0.15)
    assert np.mean(res.ece_after) <= np.mean(res.ece_before) + 1e-3
    assert 1.0 in np.round(default_grid(), 12)


def test_sts_rejects_bad_input():
    raw, prefix = _synthetic(1.0, n=50)
    with pytest.raises(ValueError, match="shape"):
        fit_sts(raw[:, :4], prefix)
    with pytest.raises(ValueError, match="0 or 1"):
        fit_sts(raw, prefix * 0.5)
    bad = prefix.copy()
    bad[:, -1] = 1
    bad[:, 0] = 0
    with pytest.raises(ValueError, match="non-increasing"):
        fit_sts(raw, bad)
    with pytest.raises(ValueError, match="NaN"):
        fit_sts(np.where(raw > 0, np.nan, raw), prefix)
    with pytest.raises(ValueError, match="positive"):
        fit_sts(raw, prefix, grid=np.array([0.0, 1.0]))
