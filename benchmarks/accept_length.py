"""Greedy accept length τ (tokens per round, bonus included) of a model + drafter pair on the
held-out standard-library snippets and on the HumanEval prompts (prompt text only), with the
speculative output checked against target-only decoding token for token. Writes
accept_length.json under $OUT.

    python benchmarks/accept_length.py [--model DIR] [--heldout 32] [--humaneval 164] [--new-tokens 128]

By default every HumanEval prompt and up to 32 held-out snippets (one per held-out file long
enough; 29 from the CPU machine's stdlib, at most 17 on the H200's): measured on 8-16 prompts the
accept length varies more than pairs differ (docs/tiny_model.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np

import dspark_jax
from benchmarks.common import environment, write_json
from benchmarks.tiny_model import heldout_prompts
from dspark_jax.decoding.generate import DEFAULT_MODEL_DIR, cached_load

HUMANEVAL = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "prompts", "humaneval.jsonl")


def humaneval_prompts(path: str, n: int) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f][:n]


def measure(model, prompts: list[str], new_tokens: int) -> dict:
    """τ over every round of every request, and whether speculative == target-only."""
    sp = dspark_jax.SamplingParams(max_new_tokens=new_tokens)
    spec = dspark_jax.generate(prompts, model=model, sampling=sp, speculative=True)
    base = dspark_jax.generate(prompts, model=model, sampling=sp, speculative=False)
    rounds = np.array([r.stats["rounds"] for r in spec])
    taus = np.array([r.stats["mean_accept_length"] for r in spec])
    return {"prompts": len(prompts), "rounds": int(rounds.sum()),
            "tau": float((taus * rounds).sum() / max(1, rounds.sum())),
            "tokens": int(sum(len(r.tokens) for r in spec)),
            "speculative_equals_target_only": all(a.tokens == b.tokens for a, b in zip(spec, base))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--humaneval", type=int, default=164)
    ap.add_argument("--humaneval-file", default=HUMANEVAL)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = cached_load(args.model, dtype=jnp.float32, progress=False)
    result = {"env": environment(), "model": os.path.abspath(args.model), "new_tokens": args.new_tokens}
    sets = {"heldout_stdlib": heldout_prompts(args.heldout)}
    if args.humaneval:
        sets["humaneval"] = humaneval_prompts(args.humaneval_file, args.humaneval)
    for name, prompts in sets.items():
        result[name] = measure(model, prompts, args.new_tokens)
        write_json("accept_length.json", result)
        print(f"[{time.perf_counter() - t0:6.1f} s] {name}: {result[name]}", flush=True)


if __name__ == "__main__":
    main()
