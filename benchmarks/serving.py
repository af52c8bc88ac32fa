"""Continuous batching against static batches on the shipped model: the same prompts (lengths
and max_new_tokens varied, greedy) through ``generate`` with S slots, once streamed (a request
enters as soon as a slot frees) and once as static batches of S (each batch waits for its longest
request). Reports tokens/s of each, whether the outputs are identical, the compiled programs
before and after the timed calls (nothing may compile) and the process's peak memory. Writes
serving.json under $OUT.

    python benchmarks/serving.py --prompts 48 --slots 8 16
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

import dspark_jax
from benchmarks.common import environment, write_json
from dspark_jax import SamplingParams
from dspark_jax.decoding.generate import _engine, default_model


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    model = default_model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 2000, int(n)).tolist() for n in rng.integers(8, 64, args.prompts)]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in rng.integers(8, 96, args.prompts)]
    eng = _engine(model, model.config.dspark.block_size, None)

    def run(group: int | None, slots: int):
        """All prompts in one streamed call (group None) or in static batches of ``group``."""
        groups = [range(len(prompts))] if group is None else [range(i, min(i + group, len(prompts)))
                                                              for i in range(0, len(prompts), group)]
        out, t0 = [], time.perf_counter()
        for g in groups:
            out += dspark_jax.generate([prompts[i] for i in g], model=model, sampling=[params[i] for i in g],
                                       slots=slots, context=args.context)
        return out, time.perf_counter() - t0

    rows = []
    for s in args.slots:
        run(None, s)  # compiles the pool's programs
        run(s, s)
        programs, rss = eng.compiled_programs(), peak_rss_mib()
        stream, t_stream = run(None, s)
        static, t_static = run(s, s)
        tokens = sum(len(r.tokens) for r in stream)
        row = {"slots": s, "prompts": len(prompts), "tokens": tokens,
               "stream_tokens_per_s": tokens / t_stream, "static_tokens_per_s": tokens / t_static,
               "stream_over_static": t_static / t_stream,
               "identical": all(a.tokens == b.tokens for a, b in zip(stream, static)),
               "compiled_during_timed_calls": eng.compiled_programs() - programs,
               "peak_rss_mib_before": rss, "peak_rss_mib_after": peak_rss_mib()}
        print(row, flush=True)
        rows.append(row)
    write_json("serving.json", {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
