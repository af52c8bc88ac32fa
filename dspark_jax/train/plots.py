"""Loss curves and per-position acceptance plots from a run's JSON log.

Usable on its own: ``python -m dspark_jax.train.plots train_log.json training.png``."""

from __future__ import annotations

import json
import sys

import numpy as np


def _ema(y: np.ndarray, alpha: float = 0.05) -> np.ndarray:
    out, acc = np.empty_like(y), y[0]
    for i, v in enumerate(y):
        acc = alpha * v + (1 - alpha) * acc if i else v
        out[i] = acc
    return out


def _series(history: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [(h["step"], h[key]) for h in history if key in h]
    if not rows:
        return np.zeros(0), np.zeros(0)
    s, v = np.asarray(rows, dtype=float).T
    return s, v


def _train_and_eval(ax, phase: dict, keys: tuple[str, ...]) -> None:
    """Per key: the training history as an EMA line and the periodic evaluations as dots."""
    for i, key in enumerate(keys):
        s, v = _series(phase["history"], key)
        if len(v):
            ax.plot(s, _ema(v), color=f"C{i}", label=f"{key} (train EMA)")
        s, v = _series(phase["evals"], key)
        if len(v):
            ax.plot(s, v, "o", color=f"C{i}", ms=4)


def plot_training(log: dict, path: str) -> None:
    """One figure: target loss, drafter loss terms, teacher-forced accept length during training,
    and held-out acceptance by draft position."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tgt, dr = log["target"]["phase"], log["drafter"]["phase"]
    fig, ax = plt.subplots(1, 4, figsize=(21, 4.3))
    s, v = _series(tgt["history"], "loss")
    ax[0].plot(s, v, alpha=0.3, color="C0")
    ax[0].plot(s, _ema(v), color="C0", label="train (EMA)")
    s, v = _series(tgt["evals"], "loss")
    ax[0].plot(s, v, "o-", color="C3", label="held-out (first eval batch)")
    ax[0].set(title="target: next-token cross-entropy", xlabel="step", ylabel="nats / token")
    _train_and_eval(ax[1], dr, ("loss", "ce", "l1", "conf"))
    ax[1].set(title="drafter: 0.1 CE + 0.9 L1 + 1.0 BCE (dots: first held-out batch)", xlabel="step", yscale="log")
    _train_and_eval(ax[2], dr, ("tau_greedy", "tau_prob"))
    ax[2].set(title="drafter: teacher-forced expected accept length", xlabel="step")
    ev = log["drafter"]["heldout"]
    k = np.arange(1, len(ev["match"]) + 1)
    ax[3].plot(k, ev["conditional_accept_greedy"], "o-", label="greedy: P(accept k | accepted < k)")
    ax[3].plot(k, ev["accept_prob"], "s-", label="sampling (T=1): mean c*_k")
    ax[3].set(xlabel="draft position k", ylabel="acceptance", ylim=(0, 1.02), xticks=k,
              title=f"all held-out batches: tau_greedy {ev['tau_greedy']:.2f}, tau_prob {ev['tau_prob']:.2f}")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m dspark_jax.train.plots train_log.json out.png")
    with open(sys.argv[1]) as f:
        plot_training(json.load(f), sys.argv[2])
