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
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, out_dir, write_json
from dspark_jax import SamplingParams
from dspark_jax.cli import speed_comparison
from dspark_jax.compile_cache import enable_compile_cache
from dspark_jax import load
from dspark_jax.decoding.generate import DEFAULT_MODEL_DIR, _engine, cache_length, default_model, prompt_ids
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
    """(accepted drafts a [rounds], raw confidence logits [rounds, γ]) of every active round, on the
    engine (and cache length) that ``generate`` uses, so nothing compiles twice."""
    eng = _engine(model, model.config.dspark.block_size, None)
    ids = [prompt_ids(model, p) for p in prompts]
    params = [SamplingParams(max_new_tokens=new_tokens)] * len(ids)
    bs = eng.init_state(ids, params, list(range(len(ids))), cache_length(model.config, ids, params))
    bs, _ = eng.prefill(bs, ids)
    accepted, conf = [], []
    while bool(np.any(np.asarray(bs.active))):
        active = np.asarray(bs.active)
        bs, out = eng.round(bs, sampled=False, top_k=False, top_p=False)
        a, c = jax.device_get((out.accepted, out.confidence))
        accepted.append(a[active])
        conf.append(c[active])
    return np.concatenate(accepted), np.concatenate(conf)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margins(model, prompts: list[str], results: list) -> list[np.ndarray]:
    """Per request, the target's top-1 minus top-2 logit at each generated token, teacher-forced
    over prompt + output in one batched call (sequences right-padded: causal, so padding after a
    sequence does not change its logits)."""
    seqs = [np.concatenate([prompt_ids(model, p), np.asarray(r.tokens, np.int32)]) for p, r in zip(prompts, results)]
    ids = np.zeros((len(seqs), max(len(q) for q in seqs)), np.int32)
    for i, q in enumerate(seqs):
        ids[i, :len(q)] = q
    logits = np.asarray(model.logits(ids))
    out = []
    for i, (q, r) in enumerate(zip(seqs, results)):
        top2 = np.sort(logits[i, len(q) - len(r.tokens) - 1:len(q) - 1], axis=-1)[:, -2:]
        out.append(top2[:, 1] - top2[:, 0])
    return out


def mismatches(spec: list, base: list, margins: list[np.ndarray]) -> list[dict]:
    """Where speculative and target-only greedy outputs part, and the target's top-2 margin there
    (over the target-only output): a tie within rounding points at shape-dependent arithmetic, a
    wide margin at a bug."""
    out = []
    for i, (x, y, m) in enumerate(zip(spec, base, margins)):
        j = first_difference(x.tokens, y.tokens)
        if j is not None:
            out.append({"request": i, "token": j, "target_top2_margin": float(m[j]) if j < len(m) else None})
    return out


def plot(result: dict, path: str) -> None:
    """Conditional acceptance by draft position and the accept-length histogram."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g, per_pos = result["gamma"], result["per_position_conditional_acceptance"]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ax[0].bar(range(1, g + 1), per_pos)
    ax[0].set_xlabel("draft position k")
    ax[0].set_ylabel("P(d_k accepted | d_<k accepted)")
    ax[0].set_ylim(0, 1)
    ax[0].set_title(f"τ = {result['tau']:.2f} (γ = {g})")
    ax[1].bar(range(1, g + 2), result["accept_length_histogram"])
    ax[1].set_xlabel("tokens per round (accepted + bonus)")
    ax[1].set_ylabel("rounds")
    fig.suptitle(f"held-out stdlib code, greedy, {result['env']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _say(t0: float, msg: str) -> None:
    print(f"[tiny_model {time.perf_counter() - t0:6.1f} s] {msg}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--single", type=int, default=None,
                    help="prompts also measured one request at a time (default: all)")
    ap.add_argument("--matmul-precision", default="highest", choices=("highest", "default"),
                    help="float32 matmuls in true float32 (the library default) or at the backend's default "
                         "(TF32 on NVIDIA GPUs)")
    args = ap.parse_args()

    enable_compile_cache()
    t0 = time.perf_counter()
    model = default_model() if args.matmul_precision == "highest" else \
        load(DEFAULT_MODEL_DIR, dtype=jnp.float32, progress=False, matmul_precision=args.matmul_precision)
    g = model.config.dspark.block_size
    prompts = heldout_prompts(args.prompts)
    sp = SamplingParams(max_new_tokens=args.new_tokens)
    result = {"env": environment(), "prompts": len(prompts), "new_tokens": args.new_tokens, "gamma": g,
              "matmul_precision": args.matmul_precision}
    _say(t0, f"{len(prompts)} held-out prompts on {result['env']['device']}")

    # every stage writes what it has measured so far: a run cut short still reports
    speed = speed_comparison(model, prompts, sp, repeats=args.repeats)
    same = speed["outputs_identical"]
    result["speed"] = {k: {kk: vv for kk, vv in v.items() if kk != "results"} if isinstance(v, dict) else v
                       for k, v in speed.items()}
    result["greedy_speculative_equals_target_only"] = same
    margins = top2_margins(model, prompts, speed["target_only"]["results"])
    result["mismatches"] = mismatches(speed["dspark"]["results"], speed["target_only"]["results"], margins)
    flat = np.concatenate(margins)
    result["target_top2_margin"] = {"tokens": int(flat.size), "min": float(flat.min()),
                                    **{f"below_{t:g}": int((flat < t).sum()) for t in (1e-1, 3e-2, 1e-2, 1e-3, 1e-4)}}
    write_json("tiny_model.json", result)
    _say(t0, f"batch of {len(prompts)}: speed-up {speed['speedup']:.2f}x, tau {speed['dspark']['mean_accept_length']:.2f}")

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
    result.update(rounds=int(len(a)), tau=float(lengths.mean()),
                  accept_length_histogram=np.bincount(lengths, minlength=g + 2)[1:].tolist(),
                  per_position_conditional_acceptance=per_pos, calibration=calib)
    write_json("tiny_model.json", result)
    _say(t0, f"tau {result['tau']:.2f} over {len(a)} rounds")
    plot(result, os.path.join(out_dir(), "tiny_model.png"))

    single, batch_invariant = [], True  # last: every new prompt length compiles anew
    for i, p in enumerate(prompts[:args.single]):  # one request at a time
        single.append(speed_comparison(model, [p], sp, repeats=args.repeats))
        same = same and single[-1]["dspark"]["results"][0].tokens == single[-1]["target_only"]["results"][0].tokens
        # is target-only decoding itself independent of the batch it runs in?
        batch_invariant &= single[-1]["target_only"]["results"][0].tokens == speed["target_only"]["results"][i].tokens
        speed_b1 = {k: {"seconds": sum(r[k]["seconds"] for r in single), "tokens": sum(r[k]["tokens"] for r in single)}
                    for k in ("target_only", "dspark")}
        for v in speed_b1.values():
            v["tokens_per_s"] = v["tokens"] / v["seconds"]
        speed_b1["speedup"] = speed_b1["dspark"]["tokens_per_s"] / speed_b1["target_only"]["tokens_per_s"]
        result.update(speed_batch1=dict(speed_b1, requests=len(single)), greedy_speculative_equals_target_only=same,
                      target_only_batch_equals_single=batch_invariant)
        write_json("tiny_model.json", result)
        _say(t0, f"{len(single)} single requests: speed-up {speed_b1['speedup']:.2f}x")

    _say(t0, "done")
    print(result)


if __name__ == "__main__":
    main()
