"""Do replayed decoding rounds equal real ones? Greedy speculative decoding of held-out snippets
with the engine, then ``train.generate.simulate_rounds`` on the same prompt + output: the accepted
drafts of every round and their confidence logits must agree (STS is fitted on replayed rounds).

``PYTHONPATH=. python benchmarks/check_replay.py [--model DIR] [--prompts N] [--new-tokens N]``
(default: the shipped model in float32, 4 prompts, 96 tokens).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))

from dspark_jax.decoding.generate import (_decode, _engine, _with_stops, cache_length, cached_load,  # noqa: E402
                                          default_model, prompt_ids)
from dspark_jax.decoding.progress import CompileWatch, TokenBar  # noqa: E402
from dspark_jax.decoding.sampling import SamplingParams  # noqa: E402
from dspark_jax.train import drafter as drafter_lib  # noqa: E402
from dspark_jax.train.generate import simulate_rounds  # noqa: E402
from tiny_model import heldout_prompts  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    args = p.parse_args()
    model = default_model() if args.model is None else cached_load(args.model, dtype=jnp.float32, progress=False)
    gamma = model.config.dspark.block_size
    ids = [prompt_ids(model, s) for s in heldout_prompts(args.prompts)]
    params = [_with_stops(model, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))] * len(ids)
    with CompileWatch() as watch:
        bar = TokenBar([args.new_tokens] * len(ids), watch, False)
        out, accepts, confs, *_ = _decode(model, _engine(model, gamma, None), ids, params, [0] * len(ids),
                                          cache_length(model.config, ids, params), bar, True)
    graphdef, draft, frozen, rest = nnx.split(model.module, drafter_lib.DRAFT_PARAMS, nnx.Param, ...)
    free_drafts = drafter_lib.make_free_drafts(graphdef)
    equal = total = 0
    worst_conf = 0.0
    for i, prompt in enumerate(ids):
        seq = np.concatenate([prompt, np.asarray(out[i], np.int32)])[None]
        replay = simulate_rounds(free_drafts, draft, frozen, rest, seq, len(prompt), gamma, 1)
        n = min(len(replay["accepted"]), len(accepts[i]))  # the replay stops where the labels leave the sequence
        a_engine = np.asarray(accepts[i][:n])
        equal += int(np.sum(replay["accepted"][:n] == a_engine))
        total += n
        worst_conf = max(worst_conf, float(np.max(np.abs(replay["confidence"][:n] - np.stack(confs[i][:n])))))
        print(f"prompt {i}: {n} rounds, engine accept length {np.mean(a_engine + 1):.3f}, "
              f"replayed {np.mean(replay['accepted'][:n] + 1):.3f}")
    print(f"{equal} of {total} rounds accept the same drafts; largest confidence-logit difference {worst_conf:.2e}")
    return 0 if equal == total else 1


if __name__ == "__main__":
    sys.exit(main())
