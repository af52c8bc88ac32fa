"""Serving benchmarks on the shipped model (or ``--model``), writing JSON under $OUT.

Default mode: continuous batching against static batches: the same prompts (lengths and
max_new_tokens varied, greedy) through ``generate`` with S slots, once streamed (a request
enters as soon as a slot frees) and once as static batches of S (each batch waits for its longest
request). Reports tokens/s of each, whether the outputs are identical, the compiled programs
before and after the timed calls (nothing may compile) and the process's peak memory. Writes
serving.json.

    python benchmarks/serving.py --prompts 48 --slots 8 16

``--many``: many prompts (``--prompts``) streamed through ONE ``generate`` call of ``--slots``
slots against static batches of each ``--static-sizes``: tokens/s of each and the streamed /
best static ratio (with and without the seconds spent compiling a shape met for the first time),
the programs compiled during the timed calls against the distinct shapes called, and the
resident memory sampled every second. Writes serving_many.json.

    python benchmarks/serving.py --many --prompts 1000 --slots 64 --static-sizes 16 32 64 --new-tokens 8 40

``--schedulers``: verify schedulers against concurrency. For each pool size S: every program the
pool will call compiled at once in ``--compile-threads`` threads (``compile_pool``: admit, the
prefill step of each (rows, width) the prompts need, static round, the two draft programs
and the verify program of every token bucket; compiled one after the other as the profile
first called them, they made a 16-slot pool's SPS profile take 197 s on an H200; the JSON
records what compiles after them: nothing should); the SPS table of
the pool, profiled by ``serving.profile_sps`` (``round_seconds(tokens)`` times a real ragged
round at each token bucket), printed and saved (sps_S<S>.json); per-round times of the round
variants on one state (static per-request layout, ragged at the top bucket with every slot
verifying everything, which is also what padding the confidence scheduler's round to the top
bucket would cost, and the confidence scheduler's two programs with and without the host sync);
then the prompts streamed
through ``generate`` under each scheduler, ``--passes`` timed calls each, the schedulers taking
turns (static, confidence, lagged, static, ...; one untimed call each first): median accepted
tokens/s, the ratio of each pass to the static pass beside it, mean verify tokens per request and
round, mean accept length, the static and ragged rounds each scheduler ran, and whether greedy
outputs equal the static scheduler's. Writes schedulers.json after every pool.

    python benchmarks/serving.py --schedulers --prompts 32 --slots 4 16
    python benchmarks/serving.py --schedulers --prompts 32 --slots 16 --context 512 --compile-threads 13
    python benchmarks/serving.py --schedulers --model /path/to/checkpoint --slots 16 64 --context 1024

``--flash``: the verify schedulers on a DeepSeek-V4-Flash slice (``--depth`` layers, random
weights, as benchmarks/decode.py builds it) against concurrency, in the ACCEPTANCE-PROFILE mode
with CALIBRATED confidences (BENCHMARK ONLY, NOT LOSSLESS: ``Engine(accept_profile=...,
profile_confidence=σ)``): draft k of every round gets a confidence c_k, logit-normal with
logit spread σ and mean r_k = p_k / p_{k-1} (the profile's conditional pass rate), which the
schedulers read as the confidence logits of the drafts; the draft then passes with
probability exactly c_k (keyed by request seed and position, so runs repeat). Every slot
decodes throughout (no prefill: caches filled with random rows, lengths set to ``--context``).
For each pool size S (largest first): the pool's programs compiled at once in threads
(``compile_pool``: static round, the two draft programs, the verify program of every token
bucket a pool of S decoding slots reaches; nothing compiles later, the JSON records it), the SPS
table profiled at those buckets (sps_S<S>.json / .png), then
``--rounds`` rounds per scheduler after ``--warmup-rounds``, dispatched as ``serve`` does
(``serving.RoundDispatcher``, outputs read one round late): accepted tokens/s, mean verify
tokens per request and round, accept length. Writes flash_schedulers.json after every pool
size and flash_schedulers.png (Figure 8 of the paper: throughput against concurrency).

    python benchmarks/serving.py --flash            # 2-layer FP8 slice, S = 128 64 32 8 1
    python benchmarks/serving.py --flash --smoke    # the tiny config on the CPU: checks the script

Each pool also reports the clairvoyant bound (``scheduler.clairvoyant_bound``): the most any
verify allocation could gain over the static round on its SPS table. ``--bound-from A B`` takes
two ``--flash`` runs at two depths and extrapolates their tables per layer to the full model
(``full_depth_bound``), where the target's layers weigh more against the drafter's stages:

    OUT=d2 python benchmarks/serving.py --flash --depth 2 --slots 128 64
    OUT=d4 python benchmarks/serving.py --flash --depth 4 --slots 128 64
    python benchmarks/serving.py --bound-from d2/flash_schedulers.json d4/flash_schedulers.json

``--deep D.json`` (with ``--flash``) runs the schedulers a second time at FULL DEPTH BY
EXTRAPOLATION: the run's SPS tables and those of a deeper ``--flash`` run D (same pools and
buckets) give the full model's table per layer (as ``full_depth_bound``); each scheduler then
decides its rounds on the slice by that table (``adapt`` off: the slice's round times would pull
it back to the slice's), and each round's time at full depth is its measured time plus the
extrapolated cost of the missing layers at the program it ran, t_L - t_a (the static round's
or its verify bucket's). Accepted tokens are those of the slice's rounds (acceptance does not
depend on depth in the profile mode):

    OUT=d4 python benchmarks/serving.py --flash --depth 4 --slots 128 64 --fine-buckets
    OUT=d2 python benchmarks/serving.py --flash --depth 2 --slots 128 64 --fine-buckets --deep d4/flash_schedulers.json

``--replay A B`` needs no GPU: the schedulers' decisions at full depth from two ``--flash`` runs
at two depths (any buckets): each pool's full-depth round times (``extrapolate``, interpolated
at the buckets of ``--fine-buckets``) make the table by which the real schedulers, run on the
tiny config's 1-layer slice in the same acceptance-profile mode (acceptance and confidences do
not depend on the model), decide ``--rounds`` rounds; each round is timed by the table at the
program it ran. No dispatch or host time is counted (the ``--deep`` run counts them):

    python benchmarks/serving.py --replay d2/flash_schedulers.json d4/flash_schedulers.json --fine-buckets 2
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import json
import os
import resource
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import dspark_jax
from benchmarks.common import environment, out_dir, write_json
from benchmarks.decode import DEFAULT_PROFILE, at_context, random_state, sliced
from dspark_jax import SamplingParams, config
from dspark_jax.decoding.engine import Engine, chunk_width, logit_normal_means, prefill_rows, verify_buckets
from dspark_jax.decoding.generate import _engine, default_model, resolve_model
from dspark_jax.decoding.progress import CompileWatch
from dspark_jax.decoding.scheduler import SPSTable, clairvoyant_bound, plot_table, profile, table_key
from dspark_jax.decoding.serving import RoundDispatcher, decoding_pool, profile_sps, round_seconds


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RssSampler:
    """The process's resident memory (MiB), sampled every ``period`` seconds in a thread while
    the ``with`` block runs (Linux: /proc/self/statm)."""

    def __init__(self, period: float = 1.0):
        self.period, self.samples = period, []
        self._stop = threading.Event()

    @staticmethod
    def now_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _run(self):
        t0 = time.perf_counter()
        while not self._stop.wait(self.period):
            self.samples.append((time.perf_counter() - t0, self.now_mib()))

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def many(args, model, eng, prompts, params):
    """``--many``: every prompt streamed through one ``generate`` call of S slots, against static
    batches of each ``--static-sizes`` (one call per batch, each waiting for its longest
    request). A first call on the first 2 S prompts compiles the pool's programs; the timed calls
    then report what they compiled (a shape met for the first time compiles once: the programs
    compiled equal the distinct shapes called) and the resident memory sampled every second."""
    def timed(group: int | None, slots: int):
        groups = [range(len(prompts))] if group is None else [range(i, min(i + group, len(prompts)))
                                                              for i in range(0, len(prompts), group)]
        before = eng.compiled_programs()
        out, t0 = [], time.perf_counter()
        with RssSampler() as rss, CompileWatch() as watch:
            for g in groups:
                out += dspark_jax.generate([prompts[i] for i in g], model=model, sampling=[params[i] for i in g],
                                           slots=slots, context=args.context)
        wall = time.perf_counter() - t0
        compile_s = watch.seconds(t0)
        tokens = sum(len(r.tokens) for r in out)
        mib = [m for _, m in rss.samples] or [RssSampler.now_mib()]
        row = {"mode": "stream" if group is None else "static", "slots": slots, "prompts": len(prompts),
               "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "compile_s": compile_s,
               "tokens_per_s_without_compiles": tokens / (wall - compile_s),
               "compiled_during_call": eng.compiled_programs() - before,
               "programs_total": eng.compiled_programs(), "shapes_total": len(eng.compiled_shapes()),
               "rss_mib_first_last_max": (mib[0], mib[-1], max(mib)),
               "rss_mib_samples": rss.samples}
        print({k: v for k, v in row.items() if k != "rss_mib_samples"}, flush=True)
        return out, row

    meta = {"env": environment(), "args": vars(args), "rows": []}
    for s in sorted({args.slots[0], *args.static_sizes}):  # compile every pool size on a few prompts
        dspark_jax.generate(prompts[:2 * s], model=model, sampling=params[:2 * s], slots=s, context=args.context)
    stream, row = timed(None, args.slots[0])
    meta["rows"].append(row)
    for s in args.static_sizes:
        static, row = timed(s, s)
        row["identical_to_stream"] = all(a.tokens == b.tokens for a, b in zip(stream, static))
        meta["rows"].append(row)
        write_json("serving_many.json", meta)
    for key in ("tokens_per_s", "tokens_per_s_without_compiles"):
        best = max((r for r in meta["rows"] if r["mode"] == "static"), key=lambda r: r[key])
        meta[f"stream_over_best_static ({key})"] = meta["rows"][0][key] / best[key]
        print(f"{key}: streamed / best static batch ({best['slots']}): {meta['rows'][0][key] / best[key]:.3f}",
              flush=True)
    write_json("serving_many.json", meta)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--slots", type=int, nargs="+", default=None, help="pool sizes (default 8 16; --flash: "
                    "128 64 32 8 1)")
    ap.add_argument("--context", type=int, default=None, help="cache tokens per slot (default 256; --flash: "
                    "committed tokens per request, 2048)")
    ap.add_argument("--schedulers", action="store_true", help="compare the verify schedulers (see the docstring)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped tiny model)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per bucket for the SPS table")
    ap.add_argument("--round-repeats", type=int, default=25, help="timed rounds per variant for the round times")
    ap.add_argument("--passes", type=int, default=3, help="--schedulers: timed generate calls per scheduler")
    ap.add_argument("--flash", action="store_true", help="the schedulers on a Flash slice, calibrated acceptance "
                    "profile (see the docstring)")
    ap.add_argument("--depth", type=int, default=2, help="--flash: layers of the slice")
    ap.add_argument("--weights", default="fp8", help="--flash: weight format (fp8, official, dense)")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"), help="--flash: target KV pool layout")
    ap.add_argument("--accept-profile", default=",".join(map(str, DEFAULT_PROFILE)),
                    help="--flash: per-position marginal acceptance probabilities (benchmark only)")
    ap.add_argument("--confidence-spread", type=float, default=1.0,
                    help="--flash: standard deviation of the calibrated confidence logits (the shipped model's "
                         "STS-calibrated confidence logits spread 0.8-1.1 per position)")
    ap.add_argument("--rounds", type=int, default=40, help="--flash: timed rounds per scheduler and pool")
    ap.add_argument("--warmup-rounds", type=int, default=4, help="--flash: untimed rounds before them")
    ap.add_argument("--compile-threads", type=int, default=8, help="--flash, --schedulers: programs compiled at "
                    "the same time")
    ap.add_argument("--budget-s", type=float, default=330,
                    help="--flash: skip the remaining pool sizes once this would be passed (0 = none)")
    ap.add_argument("--smoke", action="store_true", help="--flash on the tiny config at CPU sizes")
    ap.add_argument("--many", action="store_true", help="all prompts streamed through one generate call of "
                    "--slots[0] slots against static batches of each --static-sizes (see ``many``)")
    ap.add_argument("--static-sizes", type=int, nargs="+", default=[16, 32, 64], help="--many: static batch sizes")
    ap.add_argument("--new-tokens", type=int, nargs=2, default=(8, 96), metavar=("LOW", "HIGH"),
                    help="max_new_tokens of each prompt drawn from [LOW, HIGH)")
    ap.add_argument("--fine-buckets", type=int, nargs="?", const=1, default=0, metavar="K",
                    help="--flash: ragged verify buckets at every multiple of slots / K above the slots "
                         "(Engine(fine_buckets=K); K 1 if not given)")
    ap.add_argument("--bound-from", nargs=2, metavar=("SHALLOW.json", "DEEP.json"),
                    help="the clairvoyant bound of the full model from two --flash runs at two depths (see "
                         "``full_depth_bound``)")
    ap.add_argument("--deep", metavar="DEEP.json",
                    help="--flash: also run the schedulers at the full model's depth by extrapolation from this "
                         "deeper --flash run (see the docstring)")
    ap.add_argument("--replay", nargs=2, metavar=("SHALLOW.json", "DEEP.json"),
                    help="the schedulers' full-depth rounds replayed on the CPU by the tables of two --flash runs "
                         "(see the docstring)")
    args = ap.parse_args()
    if args.bound_from:
        return full_depth_bound(*args.bound_from)
    if args.replay:
        return replay_full_depth(args)
    if args.flash:
        return flash_schedulers(args)
    args.slots = args.slots or [8, 16]
    args.context = args.context or 256
    model = default_model() if args.model is None else resolve_model(args.model)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, min(2000, vocab), int(n)).tolist() for n in rng.integers(8, 64, args.prompts)]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in rng.integers(*args.new_tokens,
                                                                                          args.prompts)]
    eng = _engine(model, model.config.dspark.block_size, None)
    if args.many:
        return many(args, model, eng, prompts, params)
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
    the confidence schedule, host sync, verify in the bucket of its lengths) and
    confidence_no_sync (the same lengths given by the host: the two programs dispatched at once)."""
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


def prefill_shapes(eng: Engine, slots: int, prompt_lens: list[int]) -> tuple[tuple[int, int], ...]:
    """Every (rows, chunk width) of the prefill steps a pool of ``slots`` calls for prompts up to
    max(prompt_lens) tokens (``serve`` prefills the p slots reading a prompt, p a power of 2, in
    chunks of the longest unread rest of at most ``Engine.chunk_limit(p)``), and that of
    ``decoding_pool``'s 32-token prompts on every slot."""
    shapes = {(slots, chunk_width(32, eng.chunk_limit(slots)))}
    for p in {prefill_rows(n, slots) for n in range(1, slots + 1)}:
        limit = eng.chunk_limit(p)
        shapes |= {(p, chunk_width(n, limit)) for n in range(1, max(prompt_lens) + 1)}
    return tuple(sorted(shapes))


def schedulers(args, model, eng, prompts, params):
    rows = []
    kinds = count_round_kinds(eng)
    for s in args.slots:
        prefills = prefill_shapes(eng, s, [len(p) for p in prompts])
        buckets = verify_buckets(s, eng.gamma, eng.fine_buckets)
        compile_s = compile_pool(eng, eng.init_slots(s, args.context), buckets, args.compile_threads,
                                 prefills=prefills)
        compiled = eng.compiled_programs()
        print(f"slots {s}: {compiled} programs compiled in {compile_s:.0f} s ({args.compile_threads} threads; "
              f"prefill (rows, width) {list(prefills)})", flush=True)
        t0 = time.perf_counter()
        table = profile_sps(eng, s, args.context, repeats=args.repeats)
        profile_s = time.perf_counter() - t0
        print(f"slots {s}: SPS table ({profile_s:.0f} s, {eng.compiled_programs() - compiled} programs compiled) "
              f"tokens {table.tokens} rounds/s {[round(x, 2) for x in table.steps_per_s]}, static round "
              f"{table.static_steps_per_s:.2f}/s (dominates: {table.static_dominates})", flush=True)
        table.save(os.path.join(out_dir(), f"sps_S{s}.json"))
        per_round = round_times(eng, s, args.context, table, args.round_repeats)
        print(f"slots {s}: seconds per round {per_round}", flush=True)
        names = ("static", "confidence", "lagged")

        def run(name):
            return dspark_jax.generate(prompts, model=model, sampling=params, slots=s, context=args.context,
                                       scheduler=name, sps_table=table)
        ref = {name: run(name) for name in names}  # compiles anything left; static's outputs are the reference
        programs = eng.compiled_programs()
        passes = {name: [] for name in names}
        for _ in range(args.passes):
            for name in names:
                kinds.clear()
                t0 = time.perf_counter()
                res = run(name)
                wall = time.perf_counter() - t0
                passes[name].append(dict(wall_s=wall, res=res, kinds=dict(kinds)))
        for name in names:
            res = passes[name][-1]["res"]
            tokens = sum(len(r.tokens) for r in res)
            rounds = sum(r.stats["rounds"] for r in res)
            walls = [p["wall_s"] for p in passes[name]]
            row = {"slots": s, "scheduler": name, "tokens": tokens,
                   "accepted_tokens_per_s": tokens / statistics.median(walls),
                   "x_static_per_pass": [w0 / w for w0, w in zip((p["wall_s"] for p in passes["static"]), walls)],
                   "wall_s": walls, "rounds_run": [p["kinds"] for p in passes[name]],
                   "mean_verify_tokens_per_request_round": sum(r.stats["mean_verify_tokens"] * r.stats["rounds"]
                                                               for r in res) / rounds,
                   "mean_accept_length": sum(r.stats["mean_accept_length"] * r.stats["rounds"] for r in res) / rounds,
                   "request_rounds": rounds,
                   "identical_to_static": all(a.tokens == b.tokens for p in passes[name] for a, b in
                                              zip(p["res"], ref["static"])),
                   "compiled_during_timed_calls": eng.compiled_programs() - programs}
            print(row, flush=True)
            rows.append(row)
        rows.append({"slots": s, "sps_tokens": list(table.tokens), "sps_steps_per_s": list(table.steps_per_s),
                     "static_steps_per_s": table.static_steps_per_s, "seconds_per_round": per_round,
                     "compile_s": compile_s, "profile_s": profile_s,
                     "compiled_after_compile_pool": eng.compiled_programs() - compiled})
        write_json("schedulers.json", {"env": environment(), "rows": rows})  # after every pool: a killed run keeps it


# ---------------------------------------------------------------------------- --flash
SCHEDULERS = ("static", "confidence", "lagged")
GREEDY = dict(sampled=False, top_k=False, top_p=False)


def count_round_kinds(eng: Engine) -> collections.Counter:
    """Counts of the rounds ``eng`` runs from now on by kind ("static", "confidence", "lagged"):
    wraps its three round methods on the instance."""
    counts = collections.Counter()
    for kind, method in (("static", "round"), ("confidence", "round_confidence"), ("lagged", "round_lagged")):
        def counted(*a, _f=getattr(eng, method), _k=kind, **k):
            counts[_k] += 1
            return _f(*a, **k)
        setattr(eng, method, counted)
    return counts


def _copy(state):
    return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, state))


def _even(tokens: int, slots: int) -> np.ndarray:
    """``tokens`` verify tokens spread evenly over ``slots`` slots (as ``round_seconds`` does)."""
    return np.full(slots, tokens // slots) + (np.arange(slots) < tokens % slots)


def compile_pool(eng: Engine, pool, buckets: tuple[int, ...], threads: int,
                 prefills: tuple[tuple[int, int], ...] = ()) -> float:
    """Compile every program the runs on ``pool`` call before anything is timed, in ``threads``
    threads (XLA compiles without the interpreter lock; tracing takes it in turn): the static
    round, the two draft programs (with the confidence schedule, for any table over ``buckets``;
    without) and the verify program of every bucket, called on drafts of the draft program's
    shapes, so that no two threads compile the same program; with ``prefills`` also those of a
    pool that takes requests (``serve``): admit and the prefill step of each (rows, width). Only the shapes of ``pool`` matter (an empty
    pool of ``Engine.init_slots`` will do; one device, committed as ``Engine.place`` leaves it).
    Returns the seconds spent."""
    t0 = time.perf_counter()
    slots = pool.anchor.shape[0]
    no_table = (jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.float32))
    shapes, _ = jax.eval_shape(functools.partial(eng._draft_step, top_k=False, top_p=False, schedule=False),
                               eng.params, pool, *no_table)
    # committed as the draft program's outputs are (jax compiles apart for uncommitted inputs)
    drafted = jax.device_put(jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), shapes),
                             next(iter(pool.anchor.devices())))
    placeholder = SPSTable(tokens=buckets, steps_per_s=(1.0,) * len(buckets))
    jobs = [lambda: eng.round(_copy(pool), **GREEDY),
            lambda: eng._draft_program(_copy(pool), False, False, None),
            lambda: eng._draft_program(_copy(pool), False, False, placeholder)]
    # host lengths and capacity as the engine passes them (numpy: jax arrays would compile apart)
    jobs += [lambda b=b: eng._verify_step(eng.params, _copy(pool), drafted,
                                          np.asarray(_even(b, slots), np.int32), np.int32(-1), tokens=b, **GREEDY)
             for b in buckets]
    if prefills:
        jobs.append(lambda: eng.admit(_copy(pool), {}, np.zeros(slots, bool)))
        jobs += [lambda p=p, c=c: eng.prefill_step(_copy(pool), np.arange(p), np.zeros((p, c), np.int32),
                                                   np.ones(p, np.int32), np.ones(p, bool))
                 for p, c in prefills]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
        for out in ex.map(lambda f: jax.block_until_ready(f()), jobs):
            del out
    return time.perf_counter() - t0


def run_rounds(eng: Engine, pool, scheduler: str, table: SPSTable, warmup: int, rounds: int,
               adapt: bool = True) -> dict:
    """``warmup`` then ``rounds`` timed rounds of every slot of (a copy of) ``pool`` under
    ``scheduler``, dispatched and read as ``serve`` does (the host reads a round's outputs after
    dispatching the next one). ``programs``: the timed rounds per program run ("static" or the
    verify bucket)."""
    slots = pool.anchor.shape[0]
    disp = RoundDispatcher(eng, scheduler, table, slots, adapt=adapt)
    programs = collections.Counter()
    running = list(range(slots))
    bs, pending, t0 = _copy(pool), None, None
    tokens = verified = 0

    def read(index, res):
        nonlocal tokens, verified
        n_new, conf, lens = jax.device_get((res.n_new, res.confidence, res.verify_lens))
        disp.read(index, running, n_new, conf)
        if index >= warmup:
            tokens, verified = tokens + int(n_new.sum()), verified + int(lens.sum())

    for t in range(warmup + rounds):
        if t == warmup:  # the untimed rounds done and read
            if pending is not None:
                read(*pending)
                pending = None
            t0 = time.perf_counter()
        bs, res, index = disp.dispatch(bs, running, GREEDY)
        if t >= warmup:
            kind, bucket = disp.last_program
            programs[kind if bucket is None else str(bucket)] += 1
        if pending is not None:
            read(*pending)
        pending = (index, res)
    read(*pending)
    wall = time.perf_counter() - t0
    return {"scheduler": scheduler, "slots": slots, "rounds": rounds, "seconds": wall, "accepted_tokens": tokens,
            "accepted_tokens_per_s": tokens / wall, "rounds_per_s": rounds / wall,
            "mean_verify_tokens_per_request": verified / (slots * rounds),
            "mean_accept_length": tokens / (slots * rounds),
            "ragged_slowdown": None if disp.times is None else disp.times.slowdown(), "programs": dict(programs)}


def plot_flash(rows: list[dict], title: str, path: str) -> None:
    """Figure 8 of the paper: accepted tokens/s, the ratio to static and the verify tokens per
    request against concurrency, one line per scheduler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    static = {r["slots"]: r["accepted_tokens_per_s"] for r in rows if r["scheduler"] == "static"}
    for name, marker in zip(SCHEDULERS, "osD"):
        sel = sorted((r for r in rows if r["scheduler"] == name), key=lambda r: r["slots"])
        x = [r["slots"] for r in sel]
        axes[0].plot(x, [r["accepted_tokens_per_s"] for r in sel], marker=marker, label=name)
        axes[1].plot(x, [r["accepted_tokens_per_s"] / static[r["slots"]] for r in sel], marker=marker, label=name)
        axes[2].plot(x, [r["mean_verify_tokens_per_request"] for r in sel], marker=marker, label=name)
    for ax, label in zip(axes, ("accepted tokens / s", "throughput / static", "verify tokens per request and round")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (decoding slots)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def flash_schedulers(args):
    start = time.perf_counter()
    if args.smoke:
        args.slots, args.context, args.rounds, args.warmup_rounds, args.repeats = [4, 2], 64, 6, 2, 2
        args.budget_s = 0
    slots_list = args.slots or [128, 64, 32, 8, 1]
    context = args.context or 2048
    full = config.tiny() if args.smoke else config.flash()
    cfg = sliced(full, args.depth)
    profile_p = tuple(float(x) for x in args.accept_profile.split(","))
    deep = load_deep(args.deep, args, profile_p) if args.deep else None
    env = environment()
    print(env, flush=True)
    t0 = time.perf_counter()
    model = dspark_jax.init(cfg, 0, dtype=jnp.bfloat16, weight_format=args.weights, quant_sim=True)
    init_s = time.perf_counter() - t0
    print(f"{args.depth}-layer slice ({args.weights}) initialised in {init_s:.1f} s "
          f"({model.weight_bytes / 2**30:.1f} GiB)", flush=True)
    gamma = cfg.dspark.block_size
    eng = Engine(model, gamma=gamma, kv_layout=args.kv, accept_profile=profile_p,
                 profile_confidence=args.confidence_spread, fine_buckets=args.fine_buckets)
    slack = -(-(gamma + 1) * (args.warmup_rounds + args.rounds + 4) // 128) * 128 + 128
    meta = {"env": env, "args": vars(args), "config": "tiny (smoke)" if args.smoke else "flash",
            "depth": args.depth, "context": context, "cache_tokens_per_slot": context + slack, "init_s": init_s,
            "acceptance": (f"ACCEPTANCE PROFILE WITH CALIBRATED CONFIDENCES (benchmark only, not lossless): "
                           f"marginal pass rates {profile_p} (expected accept length "
                           f"{1 + sum(profile_p[:gamma]):.3f} when everything is verified); draft k's confidence "
                           f"c_k logit-normal, logit spread {args.confidence_spread}, mean p_k / p_(k-1); the "
                           f"draft passes with probability c_k"),
            "confidence_auc": confidence_auc(profile_p[:gamma], args.confidence_spread),
            "method": ("every slot decodes throughout (random cache rows, lengths set to the context, no prefill); "
                       "per pool: all programs compiled first, the SPS table profiled at the token buckets a pool "
                       "of decoding slots reaches, then each scheduler's rounds dispatched as serve does"),
            "pools": [], "rows": [], "skipped": []}
    rows = meta["rows"]
    if deep is not None:
        meta["full_depth"] = {"layers": full.num_hidden_layers, "deep_run": {"path": args.deep, "depth": deep["depth"],
                                                                              "env": deep["env"]},
                              "method": ("FULL DEPTH BY EXTRAPOLATION: each scheduler decides on the slice by the "
                                         "full model's SPS table (per-layer extrapolation of this run's and the deep "
                                         "run's tables, adapt off); a round's full-depth time is its measured time "
                                         "plus t_L - t_a of the program it ran (static round or verify bucket)"),
                              "rows": []}
    last_pool_s = 0.0
    for slots in slots_list:
        if args.budget_s and time.perf_counter() - start + last_pool_s > args.budget_s:
            meta["skipped"].append(slots)
            print(f"skipped {slots} slots: budget", flush=True)
            continue
        p0 = time.perf_counter()
        pool = at_context(random_state(eng, slots, context + slack, seed=slots), context)
        # the buckets a pool of S decoding slots reaches
        buckets = tuple(b for b in verify_buckets(slots, gamma, eng.fine_buckets) if b >= slots)
        compile_s = compile_pool(eng, pool, buckets, args.compile_threads)
        programs = eng.compiled_programs()
        print(f"slots {slots}: {programs} programs so far, this pool's compiled in {compile_s:.1f} s "
              f"(buckets {buckets})", flush=True)
        key = table_key(model, gamma=gamma, kv_layout=args.kv)
        seconds = round_seconds(eng, pool)
        table = profile(seconds, buckets, key, repeats=args.repeats, meta=dict(slots=slots, context=context),
                        static_seconds=lambda: seconds(None))
        table.save(os.path.join(out_dir(), f"sps_S{slots}.json"))
        plot_table(table, os.path.join(out_dir(), f"sps_S{slots}.png"))
        bound = clairvoyant_bound(table, profile_p, slots, gamma)
        print(f"slots {slots}: SPS tokens {table.tokens} rounds/s {[round(x, 2) for x in table.steps_per_s]}, "
              f"static round {table.static_steps_per_s:.2f}/s (dominates: {table.static_dominates}); "
              f"clairvoyant bound x static: {bound['buckets']:.3f} (these buckets), "
              f"{bound['every_count']:.3f} (a bucket at every count)", flush=True)
        for name in SCHEDULERS:
            row = run_rounds(eng, pool, name, table, args.warmup_rounds, args.rounds)
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        full_depth = None if deep is None else run_full_depth(args, eng, pool, table, deep, full.num_hidden_layers,
                                                              profile_p, gamma, meta["full_depth"]["rows"])
        compiled_in_runs = eng.compiled_programs() - programs
        last_pool_s = time.perf_counter() - p0
        meta["pools"].append({"slots": slots, "buckets": list(buckets), "compile_s": compile_s,
                              "compiled_during_profile_and_runs": compiled_in_runs, "pool_s": last_pool_s,
                              "sps_tokens": list(table.tokens), "sps_steps_per_s": list(table.steps_per_s),
                              "sps_measured_steps_per_s": list(table.measured_steps_per_s),
                              "sps_static_steps_per_s": table.static_steps_per_s,
                              "clairvoyant_bound_x_static": bound, "full_depth": full_depth})
        meta["elapsed_s"] = time.perf_counter() - start
        write_json("flash_schedulers.json", meta)
    title = (f"{'tiny (smoke)' if args.smoke else 'DeepSeek-V4-Flash'} {args.depth}-layer slice, {args.weights}, "
             f"context {context}; {env['device']}, {env['date']}, {env['commit']}; acceptance profile with "
             f"calibrated confidences (benchmark only, logit spread {args.confidence_spread})")
    if rows:
        plot_flash(rows, title, os.path.join(out_dir(), "flash_schedulers.png"))
    print("| slots | scheduler | accepted tokens/s | x static | verify tokens per request | accept length |")
    static = {r["slots"]: r["accepted_tokens_per_s"] for r in rows if r["scheduler"] == "static"}
    for r in rows:
        print(f"| {r['slots']} | {r['scheduler']} | {r['accepted_tokens_per_s']:.0f} | "
              f"{r['accepted_tokens_per_s'] / static[r['slots']]:.3f} | {r['mean_verify_tokens_per_request']:.2f} | "
              f"{r['mean_accept_length']:.2f} |", flush=True)
    if deep is not None and meta["full_depth"]["rows"]:
        full_rows = [dict(r, accepted_tokens_per_s=r["full_depth_accepted_tokens_per_s"])
                     for r in meta["full_depth"]["rows"]]
        plot_flash(full_rows, title.replace(f"{args.depth}-layer slice", f"{full.num_hidden_layers} layers "
                                            f"EXTRAPOLATED from {args.depth}- and {deep['depth']}-layer slices"),
                   os.path.join(out_dir(), "flash_schedulers_full_depth.png"))
        print_full_depth(meta["full_depth"]["rows"], full.num_hidden_layers, "extrapolated")
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)


def rounds_at_full_depth(eng: Engine, pool, full_table: SPSTable, args, bucket_s: dict[int, float], static_s: float,
                         *, measured: bool) -> list[dict]:
    """Each scheduler's rounds on ``pool`` decided by the full model's table (``adapt`` off: the
    slice's round times would pull it back to the slice's), timed as ``program_seconds`` of the
    programs run, plus the measured wall time with ``measured`` (then ``bucket_s`` and ``static_s``
    are the missing layers' costs)."""
    rows = []
    for name in SCHEDULERS:
        row = run_rounds(eng, pool, name, full_table, args.warmup_rounds, args.rounds, adapt=False)
        seconds = (row["seconds"] if measured else 0.0) + program_seconds(row["programs"], bucket_s, static_s)
        rows.append(dict(row, full_depth_seconds=seconds,
                         full_depth_accepted_tokens_per_s=row["accepted_tokens"] / seconds))
    return rows


def print_full_depth(rows: list[dict], layers: int, how: str) -> None:
    print(f"| slots | scheduler | {layers}-layer accepted tokens/s ({how}) | x static | verify tokens per request "
          f"| static rounds | buckets run |")
    static = {r["slots"]: r["full_depth_accepted_tokens_per_s"] for r in rows if r["scheduler"] == "static"}
    for r in rows:
        print(f"| {r['slots']} | {r['scheduler']} | {r['full_depth_accepted_tokens_per_s']:.0f} | "
              f"{r['full_depth_accepted_tokens_per_s'] / static[r['slots']]:.3f} | "
              f"{r['mean_verify_tokens_per_request']:.2f} | {r['programs'].get('static', 0)} | "
              f"{ {k: v for k, v in r['programs'].items() if k != 'static'} } |", flush=True)


def program_seconds(programs: dict[str, int], bucket_s: dict[int, float], static_s: float) -> float:
    """Seconds of the rounds ``programs`` counts ("static" or a verify bucket: rounds run), at
    ``static_s`` per static round and ``bucket_s`` per bucket (a bucket below the smallest one
    given at the smallest one's: round time is non-decreasing in tokens, so this over-counts)."""
    first = min(bucket_s)
    return sum(n * (static_s if k == "static" else bucket_s[max(int(k), first)]) for k, n in programs.items())


def confidence_auc(pass_rates: tuple[float, ...], spread: float, n: int = 200_000, seed: int = 0) -> list[float]:
    """Per draft position k, the AUC of the survival c_1 ... c_k (the product of the calibrated
    confidences ``Engine(profile_confidence=spread)`` draws) against "drafts 1 .. k all pass", by
    simulation (Mann-Whitney ranks): how much the confidences tell the schedulers. The DSpark paper
    reports 0.81-0.90 for its calibrated confidence head (Fig. 6)."""
    rates = np.asarray(pass_rates, np.float64)
    cond = rates / np.concatenate([[1.0], rates[:-1]])
    rng = np.random.default_rng(seed)
    logits = np.asarray(logit_normal_means(tuple(cond), spread)) + spread * rng.standard_normal((n, len(cond)))
    conf = 1 / (1 + np.exp(-logits))
    survival_k, passed_k = np.cumprod(conf, 1), np.cumprod(rng.random(conf.shape) < conf, 1).astype(bool)
    out = []
    for k in range(len(cond)):
        ranks = np.empty(n)
        ranks[np.argsort(survival_k[:, k], kind="stable")] = np.arange(1, n + 1)
        pos = int(passed_k[:, k].sum())
        out.append(float((ranks[passed_k[:, k]].sum() - pos * (pos + 1) / 2) / (pos * (n - pos))))
    return out


def replay_full_depth(args) -> dict:
    """``--replay`` (see the docstring). Writes flash_replay.json."""
    a, ra, b, rb, pairs = depth_pair(args.replay, "--replay")
    full = config.flash()
    layers, gamma = full.num_hidden_layers, full.dspark.block_size
    profile_p = tuple(float(x) for x in ra["args"]["accept_profile"].split(","))
    spread = args.confidence_spread
    cfg = sliced(config.tiny(), 1)
    if cfg.dspark.block_size != gamma:
        raise ValueError(f"the tiny config drafts {cfg.dspark.block_size} tokens, the Flash config {gamma}")
    model = dspark_jax.init(cfg, 0, dtype=jnp.float32)
    eng = Engine(model, gamma=gamma, accept_profile=profile_p, profile_confidence=spread,
                 fine_buckets=args.fine_buckets)
    context = 64
    slack = -(-(gamma + 1) * (args.warmup_rounds + args.rounds + 4) // 128) * 128 + 128
    out = {"env": environment(), "args": vars(args), "depths": [a, b], "layers": layers, "runs": list(args.replay),
           "confidence_auc": confidence_auc(profile_p[:gamma], spread),
           "method": ("REPLAY: the real schedulers decide each round on the tiny config's 1-layer slice in the "
                      "acceptance-profile mode by the full model's table (per-layer extrapolation of two --flash "
                      "runs' tables, interpolated at these buckets); each round timed by that table at the "
                      "program it ran; no dispatch or host time"), "pools": []}
    for pa, pb in pairs:
        slots = pa["slots"]
        times, static = extrapolate(pa, pb, a, b, layers)
        buckets = [t for t in verify_buckets(slots, gamma, eng.fine_buckets) if t >= slots]
        table = table_at(buckets, pa["sps_tokens"], times, static)
        bucket_s = [1 / x for x in table.steps_per_s]
        pool = at_context(random_state(eng, slots, context + slack, seed=slots), context)
        rows = rounds_at_full_depth(eng, pool, table, args, dict(zip(buckets, bucket_s)), static, measured=False)
        out["pools"].append({"slots": slots, "buckets": buckets, "round_s": bucket_s, "static_round_s": static,
                             "clairvoyant_bound_x_static": clairvoyant_bound(table, profile_p, slots, gamma),
                             "rows": rows})
        write_json("flash_replay.json", out)
    print_full_depth([r for p in out["pools"] for r in p["rows"]], layers, "replayed")
    return out


def run_full_depth(args, eng: Engine, pool, table: SPSTable, deep: dict, layers: int, profile_p, gamma: int,
                   out_rows: list[dict]) -> dict | None:
    """The schedulers on ``pool`` at full depth by extrapolation (``--deep``, see the docstring):
    appends a row per scheduler to ``out_rows``; returns the pool's full-depth table and bound."""
    slots = pool.anchor.shape[0]
    pb = {p["slots"]: p for p in deep["pools"]}.get(slots)
    if pb is None or tuple(pb["sps_tokens"]) != table.tokens:
        print(f"slots {slots}: the deep run has no pool of these buckets; no full-depth rows", flush=True)
        return None
    pa = {"sps_steps_per_s": table.steps_per_s, "sps_static_steps_per_s": table.static_steps_per_s}
    times, static = extrapolate(pa, pb, args.depth, deep["depth"], layers)
    full_table = SPSTable(tokens=table.tokens, steps_per_s=tuple(1 / times), static_steps_per_s=1 / static)
    bound = clairvoyant_bound(full_table, profile_p, slots, gamma)
    extra = {t: float(tl) - 1 / sa for t, tl, sa in zip(table.tokens, times, table.steps_per_s)}
    by_bucket = {t: round(1e3 * float(x), 1) for t, x in zip(table.tokens, times)}
    print(f"slots {slots}: {layers}-layer round ms by bucket {by_bucket}, "
          f"static {1e3 * static:.1f}; clairvoyant bound x static {bound['buckets']:.3f}", flush=True)
    for row in rounds_at_full_depth(eng, pool, full_table, args, extra, static - 1 / table.static_steps_per_s,
                                    measured=True):
        out_rows.append(row)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return {"tokens": list(table.tokens), "round_s": times.tolist(), "static_round_s": static,
            "clairvoyant_bound_x_static": bound}


def extrapolate(shallow: dict, deep: dict, a: int, b: int, layers: int) -> tuple[np.ndarray, float]:
    """Round times of the ``layers``-layer model per SPS-table bucket and of its static round, from
    the pools ``shallow`` and ``deep`` (``sps_steps_per_s``, ``sps_static_steps_per_s``) of slices of
    a < b layers: per layer, t_L = t_a + (L - a) (t_b - t_a) / (b - a) (the drafter's stages and
    the head are in both slices, so they stay fixed); bucket times made non-decreasing in tokens,
    as the fitted tables are."""
    extra = (layers - a) / (b - a)
    ta, tb = (1 / np.asarray(p["sps_steps_per_s"]) for p in (shallow, deep))
    times = np.maximum.accumulate(ta + extra * (tb - ta))
    sa, sb = (1 / p["sps_static_steps_per_s"] for p in (shallow, deep))
    static = float(sa + extra * (sb - sa))
    if times[0] <= 0 or static <= 0:
        raise ValueError(f"extrapolating to {layers} layers gave round times {times.tolist()} s, static {static} s: "
                         f"the {b}-layer run's rounds are not slower than the {a}-layer run's (a noisy run?)")
    return times, static


def load_deep(path: str, args, profile_p: tuple[float, ...]) -> dict:
    """The deeper --flash run of ``--deep``, checked to match this run's settings."""
    with open(path) as f:
        deep = json.load(f)
    if deep["depth"] <= args.depth:
        raise ValueError(f"--deep: {path} is a {deep['depth']}-layer run, not deeper than this {args.depth}-layer one")
    theirs = {k: deep["args"].get(k) for k in ("weights", "kv", "fine_buckets", "smoke")}
    ours = {k: getattr(args, k) for k in theirs}
    if theirs != ours or tuple(float(x) for x in deep["args"]["accept_profile"].split(",")) != profile_p:
        raise ValueError(f"--deep: {path} ran with {theirs} and profile {deep['args']['accept_profile']}, this run "
                         f"with {ours} and {profile_p}")
    return deep


def depth_pair(paths, option: str) -> tuple[int, dict, int, dict, list[tuple[dict, dict]]]:
    """Two ``--flash`` runs (JSON paths) ordered by depth, a < b, checked to share an acceptance
    profile, and their pools of the same slots and buckets as (shallow, deep) pairs."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    (a, ra), (b, rb) = sorted(((r["depth"], r) for r in runs), key=lambda x: x[0])
    if a == b:
        raise ValueError(f"{option} needs runs at two depths, both are {a}-layer slices")
    if ra["args"]["accept_profile"] != rb["args"]["accept_profile"]:
        raise ValueError(f"{option}: the two runs used different acceptance profiles")
    deep = {p["slots"]: p for p in rb["pools"]}
    pairs = [(pa, deep[pa["slots"]]) for pa in ra["pools"]
             if pa["slots"] in deep and deep[pa["slots"]]["sps_tokens"] == pa["sps_tokens"]]
    return a, ra, b, rb, pairs


def table_at(counts, tokens, times: np.ndarray, static: float) -> SPSTable:
    """The table of round ``times`` at ``tokens`` (and the static round's ``static`` s), at the
    token ``counts`` by linear interpolation."""
    return SPSTable(tokens=tuple(counts), steps_per_s=tuple(1 / np.interp(counts, tokens, times)),
                    static_steps_per_s=1 / static)


def full_depth_bound(shallow_path: str, deep_path: str) -> dict:
    """The clairvoyant bound (``scheduler.clairvoyant_bound``) of the full-depth model, from the SPS
    tables of two ``--flash`` runs at depths a < b (same slots, buckets, profile): every round time
    (each bucket's and the static round's) extrapolated per layer, t_L = t_a + (L - a) (t_b - t_a)
    / (b - a), L the full model's layers (the drafter's stages and the head are in both slices,
    so they stay fixed). Prints a table and writes flash_full_depth_bound.json."""
    a, ra, b, rb, pairs = depth_pair((shallow_path, deep_path), "--bound-from")
    full = config.tiny() if ra["config"].startswith("tiny") else config.flash()
    layers, gamma = full.num_hidden_layers, full.dspark.block_size
    rates = tuple(float(x) for x in ra["args"]["accept_profile"].split(","))
    out = {"depths": [a, b], "layers": layers, "accept_profile": rates, "pools": []}
    print(f"| slots | static round ms ({a} / {b} / {layers} layers) | clairvoyant bound x static, {a} layers "
          f"| {layers} layers (these buckets / every count) | {layers} layers, finer buckets |")
    for pa, pb in pairs:
        times, static_full = extrapolate(pa, pb, a, b, layers)
        static = [1 / pa["sps_static_steps_per_s"], 1 / pb["sps_static_steps_per_s"], static_full]
        tables = [SPSTable(tokens=p["sps_tokens"], steps_per_s=p["sps_steps_per_s"],
                           static_steps_per_s=p["sps_static_steps_per_s"]) for p in (pa, pb)]
        tables.append(SPSTable(tokens=pa["sps_tokens"], steps_per_s=tuple(1 / t for t in times),
                               static_steps_per_s=1 / static[2]))
        bounds = [clairvoyant_bound(t, rates, pa["slots"], gamma) for t in tables]
        # finer buckets at full depth (``Engine(fine_buckets=k)``: every multiple of S / k above S),
        # round times interpolated between the profiled counts
        s = pa["slots"]
        finer = {}
        for name, counts in ((f"multiples_of_{-(-s // k)}", [t for t in verify_buckets(s, gamma, k) if t >= s])
                             for k in (2, 1)):
            finer[name] = clairvoyant_bound(table_at(counts, pa["sps_tokens"], times, static[2]), rates, s,
                                            gamma)["buckets"]
        out["pools"].append({"slots": pa["slots"], "tokens": pa["sps_tokens"], "full_round_s": times.tolist(),
                             "static_round_s": static, "bounds": dict(zip((str(a), str(b), str(layers)), bounds)),
                             f"bound_{layers}_finer_buckets": finer})
        print(f"| {pa['slots']} | {' / '.join(f'{1e3 * t:.1f}' for t in static)} | {bounds[0]['buckets']:.3f} | "
              f"{bounds[2]['buckets']:.3f} / {bounds[2]['every_count']:.3f} | "
              + " / ".join(f"{k}: {v:.3f}" for k, v in finer.items()) + " |", flush=True)
    write_json("flash_full_depth_bound.json", out)
    return out


if __name__ == "__main__":
    main()
