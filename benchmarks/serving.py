"""Serving benchmarks on the shipped model (or ``--model``), writing JSON under $OUT.

Default mode: continuous batching against static batches: the same prompts (lengths and
max_new_tokens varied, greedy) through ``generate`` with S slots, once streamed (a request
enters as soon as a slot frees) and once as static batches of S (each batch waits for its longest
request). Reports tokens/s of each, whether the outputs are identical, the compiled programs
before and after the timed calls (nothing may compile) and the process's peak memory. Writes
serving.json.

    python benchmarks/serving.py --prompts 48 --slots 8 16

``--schedulers``: verify schedulers against concurrency. For each pool size S: the SPS table of
the pool, profiled by ``serving.profile_sps`` (``round_seconds(tokens)`` times a real ragged
round at each token bucket), printed and saved (sps_S<S>.json); per-round times of the round
variants on one state (static per-request layout, ragged at the top bucket with every slot
verifying everything, which is also what padding the confidence scheduler's round to the top
bucket would cost, and the confidence scheduler's two programs with and without the host sync);
then the prompts streamed
through ``generate`` under each scheduler: accepted tokens/s, mean verify tokens per request
and round, mean accept length, and whether greedy outputs equal the static scheduler's. Writes
schedulers.json.

    python benchmarks/serving.py --schedulers --prompts 32 --slots 4 16
    python benchmarks/serving.py --schedulers --model /path/to/checkpoint --slots 16 64 --context 1024
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

import dspark_jax
from benchmarks.common import environment, out_dir, write_json
from dspark_jax import SamplingParams
from dspark_jax.decoding.generate import _engine, default_model, resolve_model
from dspark_jax.decoding.scheduler import SPSTable
from dspark_jax.decoding.serving import decoding_pool, profile_sps


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--schedulers", action="store_true", help="compare the verify schedulers (see the docstring)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped tiny model)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per bucket for the SPS table")
    ap.add_argument("--round-repeats", type=int, default=25, help="timed rounds per variant for the round times")
    args = ap.parse_args()
    model = default_model() if args.model is None else resolve_model(args.model)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, min(2000, vocab), int(n)).tolist() for n in rng.integers(8, 64, args.prompts)]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in rng.integers(8, 96, args.prompts)]
    eng = _engine(model, model.config.dspark.block_size, None)
    if args.schedulers:
        return schedulers(args, model, eng, prompts, params)

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


def round_times(eng, slots: int, context: int, table: SPSTable, repeats: int) -> dict:
    """Seconds per round (minimum and median of ``repeats``, the variants interleaved so that
    load on the machine hits them alike) of the round variants on one state of ``slots`` decoding
    slots, each call on a copy of it: static (per-request layout, one program), ragged_full
    (packed, every slot verifying γ + 1: the top bucket, which is also what padding the
    confidence scheduler's round to the top bucket would cost), confidence (draft program with
    Algorithm 1, host sync, verify in the bucket of its lengths) and confidence_no_sync (the same
    lengths given by the host: the two programs dispatched at once)."""
    pool = decoding_pool(eng, slots, context)
    flags = dict(sampled=False, top_k=False, top_p=False)
    lens = np.asarray(eng.round_confidence(jax.tree_util.tree_map(jnp.copy, pool), table, **flags)[1].verify_lens)
    variants = {"static": lambda st: eng.round(st, **flags),
                "ragged_full": lambda st: eng.round(st, verify_lens=np.full(slots, eng.gamma + 1), **flags),
                "confidence": lambda st: eng.round_confidence(st, table, **flags),
                "confidence_no_sync": lambda st: eng.round(st, verify_lens=lens, **flags)}
    times = {k: [] for k in variants}
    for i in range(repeats + 1):
        for name, run in variants.items():
            st = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, pool))
            t0 = time.perf_counter()
            jax.block_until_ready(run(st)[1].tokens)
            if i:  # the first call may compile
                times[name].append(time.perf_counter() - t0)
    out = {f"{k}_{f.__name__}_s": float(f(v)) for k, v in times.items() for f in (np.min, np.median)}
    return dict(out, confidence_verify_tokens=int(lens.sum()))


def schedulers(args, model, eng, prompts, params):
    rows = []
    for s in args.slots:
        t0 = time.perf_counter()
        table = profile_sps(eng, s, args.context, repeats=args.repeats)
        print(f"slots {s}: SPS table ({time.perf_counter() - t0:.0f} s) tokens {table.tokens} rounds/s "
              f"{[round(x, 2) for x in table.steps_per_s]}", flush=True)
        table.save(os.path.join(out_dir(), f"sps_S{s}.json"))
        per_round = round_times(eng, s, args.context, table, args.round_repeats)
        print(f"slots {s}: seconds per round {per_round}", flush=True)
        ref = None
        for name in ("static", "confidence", "lagged"):
            def run():
                return dspark_jax.generate(prompts, model=model, sampling=params, slots=s, context=args.context,
                                           scheduler=name, sps_table=table)
            run()  # compiles
            programs = eng.compiled_programs()
            t0 = time.perf_counter()
            res = run()
            wall = time.perf_counter() - t0
            tokens = sum(len(r.tokens) for r in res)
            rounds = sum(r.stats["rounds"] for r in res)
            ref = res if name == "static" else ref
            row = {"slots": s, "scheduler": name, "tokens": tokens, "accepted_tokens_per_s": tokens / wall,
                   "mean_verify_tokens_per_request_round": sum(r.stats["mean_verify_tokens"] * r.stats["rounds"]
                                                               for r in res) / rounds,
                   "mean_accept_length": sum(r.stats["mean_accept_length"] * r.stats["rounds"] for r in res) / rounds,
                   "request_rounds": rounds, "identical_to_static": all(a.tokens == b.tokens for a, b in zip(res, ref)),
                   "compiled_during_timed_call": eng.compiled_programs() - programs}
            print(row, flush=True)
            rows.append(row)
        rows.append({"slots": s, "sps_tokens": list(table.tokens), "sps_steps_per_s": list(table.steps_per_s),
                     "seconds_per_round": per_round})
    write_json("schedulers.json", {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
