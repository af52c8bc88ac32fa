"""The shipped tiny DeepSeek-V4 + DSpark pair on held-out code: accept length τ at γ = 5,
per-position conditional acceptance, confidence calibration (ECE / AUC) before and after STS,
and DSpark vs target-only tokens/s measured in the same run (all prompts as one batch, and one
request at a time). Writes tiny_model.json / .png
under $OUT.

    python benchmarks/tiny_model.py --prompts 8 --new-tokens 128
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np

from benchmarks.common import environment, out_dir, write_json
from dspark_jax import SamplingParams
from dspark_jax.cli import speed_comparison
from dspark_jax.decoding.engine import Engine
from dspark_jax.decoding.generate import default_model, prompt_ids
from dspark_jax.train import sts
from dspark_jax.train.corpus import CorpusConfig, build_corpus


def heldout_prompts(n: int, lines: int = 12) -> list[str]:
    """Snippets of the held-out files (a third of the way into each file, whole lines)."""
    corpus = build_corpus(CorpusConfig())
    out = []
    for _, text in corpus.heldout:
        rows = text.splitlines(keepends=True)
        if len(rows) < 3 * lines:
            continue
        out.append("".join(rows[len(rows) // 3:len(rows) // 3 + lines]).rstrip("\n"))  # see examples/quickstart.py
        if len(out) == n:
            break
    return out


def round_records(model, prompts: list[str], new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(accepted drafts a [rounds], raw confidence logits [rounds, γ]) of every active round."""
    eng = Engine(model, gamma=model.config.dspark.block_size)
    ids = [prompt_ids(model, p) for p in prompts]
    params = [SamplingParams(max_new_tokens=new_tokens)] * len(ids)
    max_len = -(-(max(len(i) for i in ids) + new_tokens + 32) // 128) * 128
    bs = eng.init_state(ids, params, list(range(len(ids))), max_len)
    bs, _ = eng.prefill(bs, ids)
    accepted, conf = [], []
    while bool(np.any(np.asarray(bs.active))):
        active = np.asarray(bs.active)
        bs, out = eng.round(bs, sampled=False, top_k=False, top_p=False)
        a, c = jax.device_get((out.accepted, out.confidence))
        accepted.append(a[active])
        conf.append(c[active])
    return np.concatenate(accepted), np.concatenate(conf)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    model = default_model()
    g = model.config.dspark.block_size
    prompts = heldout_prompts(args.prompts)
    a, c = round_records(model, prompts, args.new_tokens)
    lengths = a + 1
    labels = (a[:, None] > np.arange(g)[None]).astype(np.int64)  # draft k+1 accepted
    per_pos = [float(labels[:, k][labels[:, k - 1] == 1].mean()) if k else float(labels[:, 0].mean())
               for k in range(g)]
    calib = {}
    for name, temps in (("before_sts", np.ones(g)), ("after_sts", np.asarray(model.sts_temperatures or np.ones(g)))):
        surv = sts.survival(c, temps)
        calib[name] = {"temperatures": temps.tolist(), "ece": sts.ece(surv, labels),
                       "ece_per_position": [sts.ece(surv[:, k], labels[:, k]) for k in range(g)],
                       "auc_per_position": [sts.auc(surv[:, k], labels[:, k]) for k in range(g)]}

    sp = SamplingParams(max_new_tokens=args.new_tokens)
    speed = speed_comparison(model, prompts, sp, repeats=args.repeats)
    same = all(x.tokens == y.tokens for x, y in zip(speed["dspark"]["results"], speed["target_only"]["results"]))
    single = [speed_comparison(model, [p], sp, repeats=args.repeats) for p in prompts]  # one request at a time
    speed_b1 = {k: {"seconds": sum(r[k]["seconds"] for r in single), "tokens": sum(r[k]["tokens"] for r in single)}
                for k in ("target_only", "dspark")}
    for v in speed_b1.values():
        v["tokens_per_s"] = v["tokens"] / v["seconds"]
    speed_b1["speedup"] = speed_b1["dspark"]["tokens_per_s"] / speed_b1["target_only"]["tokens_per_s"]
    same = same and all(r["dspark"]["results"][0].tokens == r["target_only"]["results"][0].tokens for r in single)
    result = {
        "env": environment(), "prompts": len(prompts), "new_tokens": args.new_tokens, "gamma": g,
        "rounds": int(len(a)), "tau": float(lengths.mean()),
        "accept_length_histogram": np.bincount(lengths, minlength=g + 2)[1:].tolist(),
        "per_position_conditional_acceptance": per_pos, "calibration": calib,
        "speed": {k: {kk: vv for kk, vv in v.items() if kk != "results"} if isinstance(v, dict) else v
                  for k, v in speed.items()},
        "speed_batch1": speed_b1,
        "greedy_speculative_equals_target_only": same,
    }
    print(result)
    write_json("tiny_model.json", result)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ax[0].bar(range(1, g + 1), per_pos)
    ax[0].set_xlabel("draft position k")
    ax[0].set_ylabel("P(d_k accepted | d_<k accepted)")
    ax[0].set_ylim(0, 1)
    ax[0].set_title(f"τ = {lengths.mean():.2f} (γ = {g})")
    ax[1].bar(range(1, g + 2), result["accept_length_histogram"])
    ax[1].set_xlabel("tokens per round (accepted + bonus)")
    ax[1].set_ylabel("rounds")
    fig.suptitle(f"held-out stdlib code, greedy, {result['env']['device']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir(), "tiny_model.png"), dpi=120)


if __name__ == "__main__":
    main()
