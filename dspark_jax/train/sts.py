"""Sequential Temperature Scaling (STS) of the DSpark confidence head.

The scheduler uses survival scores a_k = Π_{i<=k} sigmoid(c_i / T_i) as the probability that the
first k drafts are all accepted. STS fits one temperature per position, left to right: for
position k, a 1-D grid search picks the T_k minimising the expected calibration error (ECE,
equal-width bins) of a_k against the observed prefix-acceptance labels, with T_1 .. T_{k-1}
already fixed. Temperatures are positive, so the ranking of confidences at a position is kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


def _check(conf: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    conf, labels = np.asarray(conf, np.float64), np.asarray(labels)
    if conf.shape != labels.shape:
        raise ValueError(f"confidence shape {conf.shape} does not match label shape {labels.shape}")
    if conf.size == 0:
        raise ValueError("no samples to calibrate on")
    if not np.all(np.isfinite(conf)):
        raise ValueError("confidence values contain NaN or inf")
    if not np.all((labels == 0) | (labels == 1)):
        raise ValueError("labels must be 0 or 1")
    return conf, labels.astype(np.float64)


def ece(prob: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> float:
    """Expected calibration error with ``n_bins`` equal-width bins on [0, 1]:
    Σ_bins |bin| / n * |mean(prob in bin) - mean(label in bin)|."""
    prob, labels = _check(prob, labels)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    if np.any((prob < 0) | (prob > 1)):
        raise ValueError("probabilities must lie in [0, 1]")
    prob, labels = prob.ravel(), labels.ravel()
    bins = np.minimum((prob * n_bins).astype(np.int64), n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    gap = np.abs(np.bincount(bins, prob, n_bins) - np.bincount(bins, labels, n_bins))
    return float(np.sum(gap) / prob.size) if count.sum() else 0.0


def auc(score: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied scores counted one half); NaN if only one
    class is present."""
    score, labels = _check(score, labels)
    score, labels = score.ravel(), labels.ravel()
    n_pos, n_neg = labels.sum(), labels.size - labels.sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    r = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # 1-based ranks, ties averaged
    return float((r[labels == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def survival(conf_logits: np.ndarray, temperatures) -> np.ndarray:
    """a_k = Π_{i<=k} sigmoid(c_i / T_i) for confidence logits [n, γ]."""
    t = np.asarray(temperatures, np.float64)
    return np.cumprod(sigmoid(np.asarray(conf_logits, np.float64) / t), axis=-1)


def default_grid() -> np.ndarray:
    """41 temperatures log-spaced over [0.1, 10] (1.0 included)."""
    return np.logspace(-1.0, 1.0, 41)


@dataclass(frozen=True)
class STSResult:
    temperatures: tuple[float, ...]
    ece_before: tuple[float, ...]  # per position, identity temperatures
    ece_after: tuple[float, ...]
    auc_before: tuple[float, ...]
    auc_after: tuple[float, ...]
    n_samples: int
    n_bins: int
    grid: tuple[float, ...]

    def to_json(self, **extra) -> dict:
        """JSON-ready dict (an undefined AUC, with one class only, becomes null)."""
        mean = lambda xs: float(np.mean(xs))
        return dict(temperatures=list(self.temperatures), ece_before=mean(self.ece_before),
                    ece_after=mean(self.ece_after), ece_before_per_position=list(self.ece_before),
                    ece_after_per_position=list(self.ece_after), auc_before_per_position=json_floats(self.auc_before),
                    auc_after_per_position=json_floats(self.auc_after), n_samples=self.n_samples, n_bins=self.n_bins,
                    grid=[float(self.grid[0]), float(self.grid[-1]), len(self.grid)], **extra)


def json_floats(xs) -> list[float | None]:
    return [float(x) if np.isfinite(x) else None for x in xs]


def fit_sts(conf_logits: np.ndarray, prefix_accepted: np.ndarray, *, grid: np.ndarray | None = None,
            n_bins: int = 15) -> STSResult:
    """Fit per-position temperatures left to right.

    conf_logits [n, γ]: raw confidence logits of n draft blocks; prefix_accepted [n, γ]: 1 iff the
    first k+1 drafts of the block were all accepted (non-increasing along each row)."""
    conf, labels = _check(conf_logits, prefix_accepted)
    if conf.ndim != 2:
        raise ValueError(f"expected [n, γ] arrays, got shape {conf.shape}")
    if np.any(np.diff(labels, axis=-1) > 0):
        raise ValueError("prefix_accepted must be non-increasing along each row (a prefix of accepted drafts)")
    grid = default_grid() if grid is None else np.asarray(grid, np.float64)
    if grid.ndim != 1 or grid.size == 0 or np.any(grid <= 0):
        raise ValueError("the temperature grid must be a non-empty 1-D array of positive values")
    g = conf.shape[1]
    temps = np.ones(g)
    prev = np.ones(conf.shape[0])
    for k in range(g):
        errs = [ece(prev * sigmoid(conf[:, k] / t), labels[:, k], n_bins) for t in grid]
        temps[k] = grid[int(np.argmin(errs))]
        prev = prev * sigmoid(conf[:, k] / temps[k])
    before, after = survival(conf, np.ones(g)), survival(conf, temps)
    per = lambda f, s: tuple(f(s[:, k], labels[:, k]) for k in range(g))
    return STSResult(temperatures=tuple(float(t) for t in temps), ece_before=per(ece, before),
                     ece_after=per(ece, after), auc_before=per(auc, before), auc_after=per(auc, after),
                     n_samples=int(conf.shape[0]), n_bins=n_bins, grid=tuple(float(x) for x in grid))


def write_sts(path: str, result: STSResult, **extra) -> None:
    with open(path, "w") as f:
        json.dump(result.to_json(**extra), f, indent=2)


# ---------------------------------------------------------------------------- calibration of a run
def prefix_labels(accepted: np.ndarray, gamma: int) -> np.ndarray:
    """[n, γ] labels from accepted-draft counts: label_k = 1 iff the first k+1 drafts were accepted."""
    return (np.arange(gamma)[None] < np.asarray(accepted)[:, None]).astype(np.float64)


def fit_and_test(fit_conf: np.ndarray, fit_labels: np.ndarray, test_conf: np.ndarray, test_labels: np.ndarray,
                 **extra) -> tuple[dict, dict]:
    """Fit on (fit_conf, fit_labels); ECE / AUC before and after on (test_conf, test_labels).
    Returns the sts.json content and the test measurements."""
    res = fit_sts(fit_conf, fit_labels)
    g = fit_conf.shape[1]
    test = {}
    for name, temps in (("before", np.ones(g)), ("after", res.temperatures)):
        surv = survival(test_conf, temps)
        test[f"ece_{name}_per_position"] = [ece(surv[:, k], test_labels[:, k]) for k in range(g)]
        test[f"auc_{name}_per_position"] = json_floats([auc(surv[:, k], test_labels[:, k]) for k in range(g)])
        test[f"ece_{name}"] = float(np.mean(test[f"ece_{name}_per_position"]))
    test["blocks"] = int(test_conf.shape[0])
    return res.to_json(fit_blocks=int(fit_conf.shape[0]), test=test, **extra), test


def calibrate_blocks(blocks: list[dict]) -> tuple[dict, dict]:
    """STS on teacher-forced held-out blocks whose γ labels are all inside their window:
    temperatures fitted on the even-numbered evaluation batches, ECE / AUC measured on the
    odd-numbered ones (on the same batches when there is only one)."""
    def gather(part):
        c = np.concatenate([b["confidence"] for b in part])
        match = np.concatenate([b["match"] for b in part])
        full = np.concatenate([b["valid"] for b in part]).all(-1)
        return c[full].astype(np.float64), np.cumprod(match[full], axis=-1).astype(np.float64)

    fit_part, test_part = blocks[0::2], blocks[1::2] or blocks[0::2]
    return fit_and_test(*gather(fit_part), *gather(test_part),
                        labels="greedy prefix acceptance, teacher-forced on held-out files: label_k = 1 iff the "
                               "draft argmax equals the target argmax at positions 1..k given the true prefix")


def calibrate_rounds(rounds: dict, gamma: int) -> tuple[dict, dict]:
    """STS on simulated greedy decoding rounds (``generate.simulate_rounds``): the confidences the
    scheduler sees in free decoding and whether the drafts were accepted. Temperatures fitted on
    the rounds of even-numbered sequences, measured on the odd-numbered ones (on the same rounds
    when there is one sequence)."""
    conf, labels = rounds["confidence"], prefix_labels(rounds["accepted"], gamma)
    even = rounds["sequence"] % 2 == 0
    odd = ~even if (~even).any() else even
    return fit_and_test(conf[even], labels[even], conf[odd], labels[odd],
                        labels="greedy decoding rounds replayed on greedy continuations of held-out prefixes: "
                               "label_k = 1 iff the first k drafts (the drafter's own Markov chain) equal the "
                               "target's greedy tokens")
