"""Loss curves and per-position acceptance plots from a run's JSON log.

Usable on its own: ``python -m dspark_jax.train.plots train_log.json out_dir``."""

from __future__ import annotations

import json
import os
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


def plot_loss_curves(log: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tgt, dr = log["target"]["phase"], log["drafter"]["phase"]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.2))
    s, v = _series(tgt["history"], "loss")
    ax[0].plot(s, v, alpha=0.3, color="C0")
    ax[0].plot(s, _ema(v), color="C0", label="train (EMA)")
    s, v = _series(tgt["evals"], "loss")
    ax[0].plot(s, v, "o-", color="C3", label="held-out")
    ax[0].set(title="target: next-token cross-entropy", xlabel="step", ylabel="nats / token")
    for i, key in enumerate(("loss", "ce", "l1", "conf")):
        s, v = _series(dr["history"], key)
        if len(v):
            ax[1].plot(s, _ema(v), color=f"C{i}", label=f"{key} (train EMA)")
        s, v = _series(dr["evals"], key)
        if len(v):
            ax[1].plot(s, v, "o", color=f"C{i}", ms=4)
    ax[1].set(title="drafter: 0.1 CE + 0.9 L1 + 1.0 BCE (dots: held-out)", xlabel="step", yscale="log")
    for i, key in enumerate(("tau_greedy", "tau_prob")):
        s, v = _series(dr["history"], key)
        if len(v):
            ax[2].plot(s, _ema(v), color=f"C{i}", label=f"{key} (train EMA)")
        s, v = _series(dr["evals"], key)
        if len(v):
            ax[2].plot(s, v, "o", color=f"C{i}", ms=4)
    ax[2].set(title="drafter: teacher-forced expected accept length", xlabel="step")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_positions(log: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = log["drafter"]["heldout"]
    k = np.arange(1, len(ev["match"]) + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(k, ev["conditional_accept_greedy"], "o-", label="greedy: P(accept k | accepted < k)")
    ax.plot(k, ev["accept_prob"], "s-", label="sampling (T=1): mean c*_k")
    ax.set(xlabel="draft position k", ylabel="acceptance", ylim=(0, 1.02),
           title=f"held-out, teacher-forced: tau_greedy {ev['tau_greedy']:.2f}, tau_prob {ev['tau_prob']:.2f}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(log: dict, out_dir: str) -> list[str]:
    paths = [os.path.join(out_dir, "loss_curves.png"), os.path.join(out_dir, "acceptance_by_position.png")]
    plot_loss_curves(log, paths[0])
    plot_positions(log, paths[1])
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m dspark_jax.train.plots train_log.json out_dir")
    with open(sys.argv[1]) as f:
        print(plot_all(json.load(f), sys.argv[2]))
