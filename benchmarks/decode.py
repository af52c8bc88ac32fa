"""Per-user decode speed of DSpark rounds vs target-only steps at DeepSeek-V4-Flash dimensions.

Measured on slices of the model and extrapolated to the full 43 layers + 3 drafter stages.

What runs. For every weight format, batch and context the script times the jitted round of the
engine, compiled ahead of time, in two modes: ``target`` (γ = 0, one token per step) and ``dspark``
(γ = 5: the 3 drafter stages and the Markov loop, the 6-token verify forward, acceptance, commit).
Each call runs ``--rounds-per-call`` rounds (``Engine.rounds``; default ``generate``'s
``ROUNDS_PER_CALL`` = 4, what ``generate`` hands the device per call; 1 times ``Engine.round``, one
round per call). Calls are dispatched back to back as the engine's host loop does and timed per
round (``--rounds`` rounds per repeat, median of ``--repeats``; the repeats pass over every depth
and mode of a context in turn, ``time_rounds``), each repeat's clock starting once an untimed call
dispatched ahead of it is done (``--lead-call``), so that the device is busy throughout.

Acceptance-profile mode (the default, ``--accept-profile 0.896,0.776,0.656,0.552,0.450``): random
weights accept almost nothing, so the DSpark engine runs with ``Engine(accept_profile=...)``
(BENCHMARK ONLY, NOT LOSSLESS): every computation of the round runs, but the number of accepted
drafts of each request is drawn from the given per-position marginal acceptance profile (mean
accept length 1 + sum = 4.33 for the default). The accept length is measured from the rounds'
outputs and gives the speed-up: speedup = tau * t_step / t_round. ``--accept-profile real`` keeps
the real acceptance instead.

Cheap prefill. No prompt is run: the caches are allocated once per batch at the largest context
(+ slack for the timed rounds), every row of every cache (window rings, compressor rings,
compressed entries, indexer keys, drafter context rings) is filled with random values, and the
committed lengths are set to each context in turn. A round then does all its work at that
context. The cost follows the committed lengths, except the C4 layers' indexer, which scores
every allocated entry (max_len / 4 per request) in float32: at contexts below the allocation its
cost is the allocation's (recorded as ``indexer_scores_allocated_entries``; ``--alloc each``
allocates per context instead, one compile per context).

Extrapolation to the full model (written into the JSON as ``method``). The slices are the first n
layers of Flash (``flash_slice``), always with 3 drafter taps (the last 3 layers of the slice;
the 2-layer slice taps layers 0, 0, 1) so the drafter has the real input size. With two depths
d1 < d2 (default 2 and 4: layers 2 and 3 are one C4 layer with the indexer and hash-routed MoE and
one C128 layer with learned routing; Flash's layers after the first two alternate C4 / C128):

    per_layer = (t(d2) - t(d1)) / (d2 - d1)
    t(43)     = t(d2) + (43 - d2) * per_layer

for the target step and for the DSpark round alike. The drafter's 3 stages, the embedding, the
head and the accept / commit step are in every measurement and cancel in the difference, so they
enter t(43) as measured (the drafter does not depend on depth: it always reads 3 tapped layers).
The 39 extrapolated layers (4..42) are 20 C4 + 19 C128; the pair average puts them at 19.5 each,
an error of half a (C4 - C128) layer difference.

Roofline. Bytes a step must read: the target's weights (embedding rows excepted; routed experts
only those the step's tokens pick, expected distinct experts E * (1 - (1 - k/E)^tokens)) plus the
KV it attends to (window rows, the indexer's top-k C4 entries, all C128 entries, and the C4
indexer keys up to the committed length); the round adds the drafter's weights (for 5 tokens per
request), its context rings, the head once and the Markov matrix once per draft. Divided by the
copy bandwidth measured in the same run (the faster of its measures at the run's start and end,
``stricter_ceilings``). Approximate FLOPs (2 per weight per token + attention and indexer dot
products) against the bf16 matmul rate of the same run.

Writes decode.json (after every measurement, so a killed run keeps its results), decode.png and
decode.md (tables) under $OUT. Batches run in the order given, each compiling its 4 programs
(2 depths x 2 modes) at once; ``--budget-s`` skips a batch when the time spent plus the previous
batch's duration would pass it. The 2- and 4-layer FP8 slices hold 34 + 46 GiB of weights;
``--slices each`` builds and measures one depth at a time (the deepest slice's memory only), e.g.
for deeper pairs, whose per-layer difference is less affected by host time at batch 1.

Each measured round also records the time its calls alone took on the host (``host_s``, per
round: a call's time / ``--rounds-per-call``; one call of k rounds costs the host about what one
round's call does, so k rounds per call divide the host's share of a round by k). A
round no longer than that (``HOST_BOUND``) measured the host's dispatch rather than the device,
unless the calls were waiting for the device: once the device falls behind, each call returns
only when an earlier round is done (on an H200 host whose dispatch took 1.0 ms, the calls of the
6- and 8-layer steps took 1.7-1.8 ms, of rounds of 1.8-2.0). So a round is marked host-bound
("target host-bound" in the table) when its calls took ``HOST_BOUND`` of its time and it took no
longer than ``HOST_SLACK`` times the fastest dispatch of its batch (the smallest ``host_s``): at
batch 1 the 2-layer slice's step, and on a slower host the 4-layer's.

``--spans`` runs each program's calls once more under the profiler after the timing and records
each round's device span (its call's first kernel's start to its last kernel's end, calls
dispatched back to back, divided by the rounds per call; ``span_s``) and busy time (``busy_s``);
the spans are extrapolated like the wall times (``span_step_ms``, ``span_round_ms``,
``span_step_over_byte_roofline``, ``span_speedup``): the device's time for a step without the
host's calls, which at one round per call take most of a batch-1 round's wall time at depths 2
and 6 and move it between runs. Where the host bounds the rounds the spans hold its waits inside
a call (an H200's 2-layer batch-1 step at one round per call: span 0.735 ms, wall 0.705, busy
0.560); at four rounds per call they agreed with the wall times within 1 %.

``--variants`` times launch switch sets side by side in the same way (``benchmarks.common.
launch_variants``: each set's programs traced under its switches, every set's rounds interleaved
with the others'), e.g. ``--modes target --variants "|--wq-b-apart"``: an A/B of a switch whose
difference is not swamped by the drift between processes. Each variant's difference to the base
in the same pass (median, quartiles, share of passes faster) is printed and written
(``paired_differences``). Target-only passes read a few microseconds: with DSpark rounds of two
variants in the same passes, even identical 2-layer steps differed by -25 us (quartiles -72 / -2)
on an H200.

``--options engine,xla`` times every round under the engine's compiler options
(``compile_cache.COMPILER_OPTIONS``) and under XLA's defaults side by side, interleaved as the
depths and modes are, each with its own extrapolation (and records each program's temporary
bytes).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python benchmarks/decode.py --batch 1,32,8,64 --budget-s 470
    python benchmarks/decode.py --weights official --batch 1,32 --budget-s 470   # FP4 experts
    python benchmarks/decode.py --smoke     # the tiny config on CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import concurrent.futures
import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import dspark_jax
from benchmarks.common import (add_launch_options, add_split_option, apply_launch_options,
                               apply_split_option, ceilings, environment, launch_variants, out_dir,
                               with_moe_one_row, with_pdl, write_json)
from dspark_jax import SamplingParams, config
from dspark_jax.decoding.engine import Engine
from dspark_jax.decoding.generate import ROUNDS_PER_CALL
from pallas_kernels import grouped_matmul as gm, kv_fp8

DEFAULT_PROFILE = (0.896, 0.776, 0.656, 0.552, 0.450)
# A measured round whose calls alone took this share of its time or more is marked host-bound
HOST_BOUND = 0.9
# ... and took at most this multiple of the fastest dispatch of its batch (calls that did not wait)
HOST_SLACK = 1.15
# ``--options``: the rounds' compiler options (``Engine(compiler_options=...)``; None: the engine's)
OPTION_SETS = {"engine": None, "xla": {}}

METHOD = (
    "Per-layer cost from two slice depths d1 < d2 (first n layers of the full model, 3 drafter taps "
    "at every depth): per_layer = (t(d2) - t(d1)) / (d2 - d1); t(full) = t(d2) + (full - d2) * "
    "per_layer, for the target step and for the DSpark round alike. Drafter stages, embedding, head "
    "and accept / commit are in every measurement and enter t(full) as measured. speed-up = tau * "
    "t_step / t_round with tau the accept length measured in the same rounds (k rounds per call, "
    "timed per round; acceptance profile: "
    "benchmark only, every computation kept, accepted drafts drawn from the profile). Caches filled "
    "with random rows, committed lengths set to the context (no prefill run).")


# ---------------------------------------------------------------------------- configs
def sliced(full: config.ModelConfig, depth: int) -> config.ModelConfig:
    """The first ``depth`` layers of ``full`` with 3 drafter taps: the slice's last three layers,
    the first one repeated when the slice has fewer (the drafter keeps its real input size)."""
    if not 1 <= depth <= full.num_hidden_layers:
        raise ValueError(f"depth must lie in [1, {full.num_hidden_layers}], got {depth}")
    n_taps = len(full.dspark.target_layer_ids)
    taps = tuple(max(0, depth - n_taps + i) for i in range(n_taps))
    return full.replace(num_hidden_layers=depth, compress_ratios=full.compress_ratios[:depth],
                        num_hash_layers=min(full.num_hash_layers, depth),
                        dspark=dataclasses.replace(full.dspark, target_layer_ids=taps))


def layer_kinds(cfg: config.ModelConfig, layers) -> str:
    names = {0: "window", 4: "C4"}
    return ", ".join(f"{i}: {names.get(cfg.compress_ratios[i], f'C{cfg.compress_ratios[i]}')} "
                     f"{'hash' if cfg.is_hash_layer(i) else 'learned'}" for i in layers)


# ---------------------------------------------------------------------------- extrapolation
def extrapolate(times: dict[int, float], full_layers: int) -> dict | None:
    """``times`` = {depth: seconds} of one program at two or more depths: the per-layer cost from
    the smallest and the largest depth and the cost at ``full_layers`` (None with fewer than 2)."""
    if len(times) < 2:
        return None
    d1, d2 = min(times), max(times)
    per_layer = (times[d2] - times[d1]) / (d2 - d1)
    return {"d1": d1, "d2": d2, "per_layer_s": per_layer, "fixed_s": times[d1] - d1 * per_layer,
            "full_s": times[d2] + (full_layers - d2) * per_layer}


# ---------------------------------------------------------------------------- roofline
def weight_parts(cfg: config.ModelConfig, weight_format: str) -> dict:
    """Bytes and matmul weight counts of the model by part, from the abstract model (no memory):
    per target layer (non-routed bytes / weights, bytes / weights of one routed expert), the head,
    the drafter stages (same split) and the Markov matrix."""
    from flax import nnx

    from dspark_jax.model.common import Numerics
    from dspark_jax.model.deepseek_v4 import DeepSeekV4

    def flat(fmt):
        num = Numerics(dtype="bfloat16", param_dtype="bfloat16", weight_format=fmt)
        state = nnx.state(nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0))))
        return {tuple(str(x) for x in key): var for key, var in nnx.to_flat_state(state)}

    stored, dense = flat(weight_format), flat("dense")  # bytes as stored; weights counted unpacked
    zero = {"bytes": 0, "weights": 0, "expert_bytes": 0, "expert_weights": 0}
    parts = {"layers": [dict(zero) for _ in range(cfg.num_hidden_layers)], "mtp": dict(zero),
             "head": dict(zero), "markov_w2_bytes": 0}
    for k, var in stored.items():
        nbytes = math.prod(var.shape) * jnp.dtype(var.dtype).itemsize
        logical = dense.get(k)  # scales exist only in the quantised formats
        is_matrix = logical is not None and len(logical.shape) >= 2 and not k[-1].startswith("hc_")
        weights = math.prod(logical.shape) if is_matrix else 0
        if k[0] == "embed" or "markov_w1" in k:
            continue  # a step reads one row per token of these tables
        if k[0] == "layers":
            part = parts["layers"][int(k[1])]
        elif k[0] == "mtp":
            part = parts["mtp"]
            if "markov_w2" in k:
                parts["markov_w2_bytes"] += nbytes
        else:
            part = parts["head"]
        if "experts" in k and "shared_experts" not in k:
            part["expert_bytes"] += nbytes / cfg.n_routed_experts
            part["expert_weights"] += weights / cfg.n_routed_experts
        else:
            part["bytes"] += nbytes
            part["weights"] += weights
    return parts


def distinct_experts(cfg: config.ModelConfig, tokens: int) -> float:
    """Expected distinct routed experts picked by ``tokens`` tokens of k uniform distinct picks."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def kv_read_bytes(cfg: config.ModelConfig, layers: int, context: int, kv_layout: str = "bf16") -> float:
    """KV bytes one request's queries read per layer stack at ``context`` committed tokens."""
    row = kv_fp8.row_bytes(cfg.head_dim, cfg.qk_rope_head_dim) if kv_layout == "fp8" else 2 * cfg.head_dim
    total = 0.0
    for i in range(layers):
        ratio = cfg.compress_ratios[i]
        total += min(context, cfg.sliding_window) * row
        if ratio == 4:
            total += min(cfg.index_topk, context // 4) * row + (context // 4) * cfg.index_head_dim * 2
        elif ratio:
            total += (context // ratio) * row
    return total


def attention_flops(cfg: config.ModelConfig, layers: int, context: int) -> float:
    """FLOPs of one query token's attention and indexer dot products over ``layers`` layers."""
    h, d = cfg.num_attention_heads, cfg.head_dim
    total = 0.0
    for i in range(layers):
        ratio = cfg.compress_ratios[i]
        keys = min(context, cfg.sliding_window)
        if ratio == 4:
            keys += min(cfg.index_topk, context // 4)
            total += 2 * cfg.index_n_heads * cfg.index_head_dim * (context // 4)
        elif ratio:
            keys += context // ratio
        total += 4 * h * d * keys
    return total


def roofline(cfg: config.ModelConfig, parts: dict, batch: int, context: int, kv_layout: str) -> dict:
    """Bytes and FLOPs of a target step (1 token per request) and a DSpark round (6-token verify +
    the drafter on 5 tokens per request) over the model described by ``cfg`` / ``parts``."""
    g = cfg.dspark.block_size
    n = cfg.num_hidden_layers

    def forward(tokens_per_request: int) -> tuple[float, float]:
        tokens = batch * tokens_per_request
        ex = distinct_experts(cfg, tokens)
        k = cfg.num_experts_per_tok
        nbytes = sum(p["bytes"] + ex * p["expert_bytes"] for p in parts["layers"]) + parts["head"]["bytes"]
        nbytes += batch * kv_read_bytes(cfg, n, context, kv_layout)
        flops = 2 * tokens * (sum(p["weights"] + k * p["expert_weights"] for p in parts["layers"])
                              + parts["head"]["weights"])
        flops += tokens * attention_flops(cfg, n, context)
        return nbytes, flops

    step_bytes, step_flops = forward(1)
    verify_bytes, verify_flops = forward(g + 1)
    m, s = parts["mtp"], cfg.dspark.num_stages  # m: all stages together (expert_*: one expert of each stage)
    draft_tokens = batch * g
    ring = cfg.sliding_window + g
    draft_bytes = (m["bytes"] + distinct_experts(cfg, draft_tokens) * m["expert_bytes"] + parts["head"]["bytes"]
                   + (g - 1) * parts["markov_w2_bytes"] + batch * s * ring * 2 * cfg.head_dim)
    draft_flops = 2 * draft_tokens * (m["weights"] + cfg.num_experts_per_tok * m["expert_weights"]
                                      + parts["head"]["weights"]) + draft_tokens * s * 4 * cfg.num_attention_heads \
        * cfg.head_dim * ring
    return {"step_bytes": step_bytes, "step_flops": step_flops,
            "round_bytes": verify_bytes + draft_bytes, "round_flops": verify_flops + draft_flops}


# ---------------------------------------------------------------------------- measurement
def random_state(eng: Engine, batch: int, alloc: int, seed: int):
    """A batch state with every cache row random (as after a long prefill) and lengths 0."""
    cfg = eng.model.config
    params = [SamplingParams(max_new_tokens=2**30)] * batch
    bs = eng.init_state([np.zeros(1, np.int32)] * batch, params, list(range(batch)), alloc)
    keys = iter(jax.random.split(jax.random.key(seed), 4096))

    def fill(x):
        if isinstance(x, kv_fp8.Fp8Rows):
            return kv_fp8.quantize(jax.random.normal(next(keys), x.shape, jnp.float32))
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jax.random.normal(next(keys), x.shape, jnp.float32).astype(x.dtype)
        return x

    is_pool = lambda x: isinstance(x, kv_fp8.Fp8Rows)  # noqa: E731
    cache = dataclasses.replace(bs.cache, layers=jax.tree.map(fill, bs.cache.layers, is_leaf=is_pool))
    draft = None if bs.draft is None else jax.tree.map(fill, bs.draft)
    anchor = jax.random.randint(next(keys), (batch,), 3, cfg.vocab_size - 1, jnp.int32)
    return eng.place(dataclasses.replace(bs, cache=cache, draft=draft, anchor=anchor))


def at_context(bs, context: int):
    """The same state with every request's committed length set to ``context``."""
    lengths = jnp.full_like(bs.cache.lengths, context)
    return dataclasses.replace(bs, cache=dataclasses.replace(bs.cache, lengths=lengths),
                               n_generated=jnp.zeros_like(bs.n_generated), active=jnp.ones_like(bs.active))


def time_rounds(programs: dict, rounds: int, repeats: int, warmup: int = 2, per_call: int = 1,
                lead: bool = True) -> dict:
    """Seconds per round and tokens per round per request of every program (key -> (compiled,
    params, state)), whose calls each run ``per_call`` rounds: after ``warmup`` calls of each,
    ``repeats`` passes over all of them in turn, each timing ``calls_for(rounds, per_call)`` calls
    dispatched back to back; the median per program over the passes.
    ``lead``: each pass first dispatches one untimed call, then the first timed one, and starts its
    clock when the untimed call is done, so that the device is busy from the clock's start and every
    timed call's dispatch runs while an earlier call computes, as in a long generation. Without it
    (the method before 2026-12-06) the clock also held the first timed call's dispatch, during which
    the device had nothing to run: at batch 1 that call took 0.4 ms at 2 layers and 1.0 ms at 6 on
    an H100 host (more parameters to pass), so ``rounds`` = 16 added ~10 us per layer to the
    per-layer difference that the 43-layer extrapolation multiplies (rounds = 8, ~20 us;
    docs/benchmarks.md, 2026-12-06 (last)). The clock then holds one dispatch fewer than the pass
    makes, so a pass's time per round is the larger of the clock's and the dispatch's per round (a
    host-bound program's rate is its dispatch).
    Interleaved, so that a drift of the machine (clocks settling after compilation, another
    process) reaches every program alike: measured one after the other, the first program's time
    moved by up to 25 % between runs, and the 43-layer extrapolation multiplies the depths'
    difference by 19.5. Pass p starts at the (p mod n)-th of the n programs, so each takes every
    place in a pass alike: in a fixed order, the second of two identical 2-layer steps on an H200
    was 18 us slower than the first (the median of 21 paired passes; slower in 17).
    Returns key -> (seconds, tau, final state, seconds of every pass, host seconds): host seconds,
    the median over the passes of the time the calls themselves took per round (the host's
    dispatch; a program whose rounds take no longer than that is host-bound)."""
    calls_per_pass = calls_for(rounds, per_call)
    states = {k: bs for k, (_, _, bs) in programs.items()}
    for key, (compiled, params, _) in programs.items():
        for _ in range(warmup):
            states[key], res = compiled(params, states[key])
            jax.block_until_ready(res.n_new)
    per_round = {k: [] for k in programs}
    host = {k: [] for k in programs}
    new = {k: [] for k in programs}
    keys = list(programs)
    for p in range(repeats):
        for key in keys[p % len(keys):] + keys[:p % len(keys)]:
            compiled, params, _ = programs[key]
            ahead = None
            if lead:  # (untimed: the device computes it while the first timed call is dispatched)
                states[key], ahead = compiled(params, states[key])
            calls = 0.0
            t0 = time.perf_counter()
            for i in range(calls_per_pass):
                c0 = time.perf_counter()
                states[key], res = compiled(params, states[key])
                calls += time.perf_counter() - c0
                new[key].append(res.n_new)
                if i == 0 and ahead is not None:
                    jax.block_until_ready(ahead.n_new)
                    t0 = time.perf_counter()
            jax.block_until_ready(res.n_new)
            dispatch = calls / (calls_per_pass * per_call)
            wall = (time.perf_counter() - t0) / (calls_per_pass * per_call)
            per_round[key].append(max(wall, dispatch) if lead else wall)
            host[key].append(dispatch)
    return {k: (float(np.median(per_round[k])), float(np.mean(np.stack([np.asarray(x) for x in new[k]]))),
                states[k], per_round[k], float(np.median(host[k]))) for k in programs}


def calls_for(rounds: int, per_call: int) -> int:
    """Calls of ``per_call`` rounds each that run at least ``rounds`` rounds."""
    return -(-rounds // per_call)


def trace_spans(programs: dict, rounds: int, per_call: int = 1) -> dict:
    """key -> (median device span of a round, device busy time per round, state after) for every
    (compiled program of ``per_call`` rounds, params, state) of ``programs``: ``calls_for(rounds,
    per_call)`` calls dispatched back to back under the profiler (``profile_step.traced_rounds``).
    A call's span runs from its first kernel's start to its last kernel's end: the device's time
    for its rounds without the host's share around it; a round's span is the call's / per_call."""
    import shutil
    import tempfile

    from benchmarks.profile_step import busy_ns, round_spans_ns, traced_rounds

    calls, out = calls_for(rounds, per_call), {}
    for key, (compiled, params, bs) in programs.items():
        root = tempfile.mkdtemp(prefix="dspark_decode_trace_")
        try:
            bs, events, _ = traced_rounds(compiled, params, bs, calls, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        out[key] = (float(np.median(round_spans_ns(events, calls))) / per_call / 1e9,
                    busy_ns(events) / (calls * per_call) / 1e9, bs)
    return out


def temp_bytes(program) -> int | None:
    """The compiled program's temporary buffers (bytes), where the backend reports them."""
    try:
        return int(program.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001  (backends without a memory analysis)
        return None


def custom_calls(program) -> int | None:
    """The compiled program's custom calls (its Pallas kernels, library GEMMs...), counted in its
    HLO text: programs of two launch variants should differ in them."""
    try:
        return program.as_text().count(" custom-call(")
    except Exception:  # noqa: BLE001  (a backend without the text)
        return None


def compile_group(jobs: dict, threads: int, per_call: int = 1, prepare=None) -> dict:
    """Lower every (key -> (engine, state)) program of ``per_call`` greedy rounds (``Engine.round``
    or ``Engine.rounds``) in this thread, each after ``prepare(key)`` where given (a variant's
    switches: jax's trace caches are cleared first, so nothing traced under another's is reused),
    compile them in ``threads`` threads (XLA compiles without the interpreter lock); returns key ->
    (compiled, seconds)."""
    lowered = {}
    flags = dict(sampled=False, top_k=False, top_p=False)
    for key, (eng, bs) in jobs.items():
        if prepare is not None:
            prepare(key)
            jax.clear_caches()
        t0 = time.perf_counter()
        program = (eng._round.lower(eng.params, bs, **flags) if per_call == 1
                   else eng._rounds.lower(eng.params, bs, count=per_call, **flags))
        lowered[key] = (program, time.perf_counter() - t0)

    def one(key):
        t0 = time.perf_counter()
        return lowered[key][0].compile(), lowered[key][1] + time.perf_counter() - t0

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return dict(zip(lowered, pool.map(one, lowered)))


# ---------------------------------------------------------------------------- summary
def summarize(results: list[dict], full: config.ModelConfig, parts: dict, ceil: dict,
              kv_layout: str) -> list[dict]:
    """Per (weights, compiler options, batch, context): measured values per depth and the
    full-model extrapolation.
    ``parts`` maps (weights, layers) to ``weight_parts`` of that slice (or of the full model); the
    byte rooflines are given where it has an entry."""
    bw, peak = ceil["copy_GBps"] * 1e9, ceil["bf16_matmul_TFLOPs"] * 1e12
    rows = []
    def key(r):
        return r["weights"], r.get("options", "engine"), r.get("variant", ""), r["batch"], r["context"]

    for w, opt, var, b, c in sorted({key(r) for r in results}):
        sel = [r for r in results if key(r) == (w, opt, var, b, c)]
        t = {r["depth"]: r["round_s"] for r in sel if r["mode"] == "target"}
        d = {r["depth"]: r["round_s"] for r in sel if r["mode"] == "dspark"}
        tau = {r["depth"]: r["tokens_per_round"] for r in sel if r["mode"] == "dspark"}
        # a round no longer than its calls' own time measured the host's dispatch, not the device
        dispatch = min((r["host_s"] for r in sel if r.get("host_s")), default=0.0)
        host_bound = {(r["depth"], r["mode"]) for r in sel if r.get("host_s", 0.0) >= HOST_BOUND * r["round_s"]
                      and r["round_s"] <= HOST_SLACK * dispatch}
        row = {"weights": w, "options": opt, "variant": var, "batch": b, "context": c, "measured": {}}
        for depth in sorted(t):  # a depth without a DSpark round (``--modes target``): the step's values only
            m = row["measured"][str(depth)] = {"step_ms": 1e3 * t[depth],
                                               "host_bound": sorted(m for dd, m in host_bound if dd == depth)}
            if depth in d:
                m.update({"round_ms": 1e3 * d[depth], "tau": tau[depth], "round_over_step": d[depth] / t[depth],
                          "speedup": tau[depth] * t[depth] / d[depth]})
            if (w, depth) in parts:
                roof = roofline(sliced(full, depth), parts[(w, depth)], b, c, kv_layout)
                m.update({"step_bytes": roof["step_bytes"],
                          "step_over_byte_roofline": t[depth] / (roof["step_bytes"] / bw)})
                if depth in d:
                    m.update({"round_bytes": roof["round_bytes"],
                              "round_over_byte_roofline": d[depth] / (roof["round_bytes"] / bw)})
        et, ed = extrapolate(t, full.num_hidden_layers), extrapolate(d, full.num_hidden_layers)
        if et:
            step = et["full_s"]
            roof = roofline(full, parts[(w, full.num_hidden_layers)], b, c, kv_layout)
            step_roof = max(roof["step_bytes"] / bw, roof["step_flops"] / peak)
            f = row["full"] = {
                "layers": full.num_hidden_layers, "step_ms": 1e3 * step,
                "step_per_layer_ms": 1e3 * et["per_layer_s"], "step_fixed_ms": 1e3 * et["fixed_s"],
                "target_tok_s_per_user": 1 / step, "step_bytes": roof["step_bytes"], "step_flops": roof["step_flops"],
                "step_byte_roofline_ms": 1e3 * roof["step_bytes"] / bw, "step_roofline_ms": 1e3 * step_roof,
                "step_over_byte_roofline": step / (roof["step_bytes"] / bw),
                # against the rate of a large read (the copy's ceiling counts its writes too)
                "step_over_read_roofline": step / (roof["step_bytes"] / (ceil.get("read_GBps", math.nan) * 1e9)),
                "step_over_roofline": step / step_roof}
            if ed:
                tau_full = tau[max(tau)]
                rnd = ed["full_s"]
                round_roof = max(roof["round_bytes"] / bw, roof["round_flops"] / peak)
                roof_ratio = round_roof / step_roof
                f.update({
                    "round_ms": 1e3 * rnd, "tau": tau_full, "round_per_layer_ms": 1e3 * ed["per_layer_s"],
                    "round_fixed_ms": 1e3 * ed["fixed_s"], "round_over_step": rnd / step,
                    "speedup": tau_full * step / rnd, "dspark_tok_s_per_user": tau_full / rnd,
                    "round_bytes": roof["round_bytes"], "round_flops": roof["round_flops"],
                    "round_roofline_ms": 1e3 * round_roof, "round_over_roofline": rnd / round_roof,
                    "roofline_round_over_step": roof_ratio, "roofline_speedup": tau_full / roof_ratio})
            # the same extrapolation of the rounds' device spans (``--spans``), without the host's share
            spans = [extrapolate({r["depth"]: r["span_s"] for r in sel if r["mode"] == m and "span_s" in r},
                                 full.num_hidden_layers) for m in ("target", "dspark")]
            if spans[0]:
                s_step = spans[0]["full_s"]
                f.update({"span_step_ms": 1e3 * s_step,
                          "span_step_over_byte_roofline": s_step / (roof["step_bytes"] / bw)})
                if spans[1] and ed:
                    f.update({"span_round_ms": 1e3 * spans[1]["full_s"],
                              "span_speedup": tau_full * s_step / spans[1]["full_s"]})
        rows.append(row)
    return rows


def label(row: dict) -> str:
    """The weights of a row, its compiler options unless the engine's, its launch variant if any."""
    opt, var = row.get("options", "engine"), row.get("variant", "")
    return row["weights"] + ("" if opt == "engine" else f" ({opt} options)") + (f" [{var}]" if var else "")


def table(rows: list[dict]) -> str:
    head = ("| weights | batch | context | depth | step ms | round ms | round / step | tau | speed-up "
            "| target tok/s/user | DSpark tok/s/user | step / roofline | speed-up at the roofline |")
    lines = [head, "|" + "---|" * 13]
    num = lambda m, k, fmt=".2f": format(m[k], fmt) if k in m else "-"  # noqa: E731  (step-only rows: no round)
    for r in rows:
        for depth, m in r["measured"].items():
            bound = f"; {' and '.join(m['host_bound'])} host-bound" if m.get("host_bound") else ""
            dspark = f"{1e3 * m['tau'] / m['round_ms']:.0f}" if "round_ms" in m else "-"
            lines.append(f"| {label(r)} | {r['batch']} | {r['context']} | {depth} (measured{bound}) | "
                         f"{m['step_ms']:.2f} | {num(m, 'round_ms')} | {num(m, 'round_over_step')} | {num(m, 'tau')} "
                         f"| {num(m, 'speedup')} | {1e3 / m['step_ms']:.0f} | {dspark} | "
                         f"{m.get('step_over_byte_roofline', math.nan):.1f} (bytes) | |")
        if "full" in r:
            f = r["full"]
            lines.append(f"| {label(r)} | {r['batch']} | {r['context']} | **{f['layers']} (extrapolated)** | "
                         f"{f['step_ms']:.2f} | {num(f, 'round_ms')} | {num(f, 'round_over_step')} | {num(f, 'tau')} | "
                         f"**{num(f, 'speedup')}** | {f['target_tok_s_per_user']:.0f} | "
                         f"{num(f, 'dspark_tok_s_per_user', '.0f')} | {f['step_over_roofline']:.1f} | "
                         f"{num(f, 'roofline_speedup')} |")
            if "span_step_ms" in f:
                ratio = f"{f['span_round_ms'] / f['span_step_ms']:.2f}" if "span_round_ms" in f else "-"
                lines.append(f"| {label(r)} | {r['batch']} | {r['context']} | {f['layers']} (device spans, "
                             f"extrapolated) | {f['span_step_ms']:.2f} | {num(f, 'span_round_ms')} | "
                             f"{ratio} | {num(f, 'tau')} | {num(f, 'span_speedup')} "
                             f"| | | {f['span_step_over_byte_roofline']:.2f} (bytes) | |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> dict:
    """The ratios the goals name, per weights and context (full-model extrapolation; the round's where
    it was timed)."""
    names = {"step_over_byte_roofline": "step_over_byte_roofline", "step_over_read_roofline": "step_over_read_roofline",
             "step_over_roofline": "step_over_roofline", "round_over_step": "round_over_step",
             "speedup_with_profile": "speedup", "roofline_round_over_step": "roofline_round_over_step",
             "roofline_speedup_with_profile": "roofline_speedup",
             "span_step_over_byte_roofline": "span_step_over_byte_roofline",
             "span_speedup_with_profile": "span_speedup"}
    return {f"{label(r)} batch {r['batch']} context {r['context']}":
            {goal: r["full"][k] for goal, k in names.items() if k in r["full"]} for r in rows if r.get("full")}


def stricter_ceilings(ceil: dict, again: dict) -> list[dict]:
    """The ceilings measured once more at the end of a run: ``ceil`` takes the faster of the two
    of each (in place; every roofline ratio is taken against it), and the two measurements are
    returned. Measured only at the start, a fresh H200's fastest copy ran at 2.51 TB/s where the
    same machine's later runs reached 2.90-3.03, and a step's ratio to its byte roofline read 1.33
    instead of ~1.6."""
    start = dict(ceil)
    for key in ("copy_GBps", "read_GBps", "bf16_matmul_TFLOPs"):
        if key in again:
            ceil[key] = max(ceil[key], again[key])
    return [start, again]


def paired_differences(results: list[dict]) -> list[dict]:
    """Each ``--variants`` set's rounds against the base set's timed in the same passes: per
    depth, mode, batch and context, the median and quartiles over the passes of the variant's
    time minus the base's (microseconds per round) and the share of passes where it was faster.
    Paired, the difference is free of the drift between passes that moves both alike."""
    def key(r):
        return r["weights"], r.get("options", "engine"), r["depth"], r["mode"], r["batch"], r["context"]

    base = {key(r): r["round_s_passes"] for r in results if r.get("variant") == "base"}
    out = []
    for r in results:
        if r.get("variant") in ("", "base") or key(r) not in base:
            continue
        diff = 1e6 * (np.asarray(r["round_s_passes"]) - np.asarray(base[key(r)]))
        q1, med, q3 = np.percentile(diff, [25, 50, 75])
        out.append({"weights": r["weights"], "options": r.get("options", "engine"), "variant": r["variant"],
                    "depth": r["depth"], "mode": r["mode"], "batch": r["batch"], "context": r["context"],
                    "median_us": float(med), "quartiles_us": [float(q1), float(q3)],
                    "faster_share": float(np.mean(diff < 0)), "passes": int(diff.size)})
    return out


def plot(rows: list[dict], title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = sorted({(label(r), r["context"]) for r in rows})
    for w, c in series:
        sel = sorted((r for r in rows if (label(r), r["context"]) == (w, c)), key=lambda r: r["batch"])
        full = [r for r in sel if "speedup" in r.get("full", {})]  # (rows with a DSpark round)
        if full:
            bs_ = [r["batch"] for r in full]
            line, = ax1.plot(bs_, [r["full"]["speedup"] for r in full], marker="o", label=f"{w} ctx {c}: full")
            ax2.plot(bs_, [r["full"]["dspark_tok_s_per_user"] for r in full], marker="o", color=line.get_color(),
                     label=f"{w} ctx {c}: DSpark, full")
            ax2.plot(bs_, [r["full"]["target_tok_s_per_user"] for r in full], marker="s", ls=":",
                     color=line.get_color(), label=f"{w} ctx {c}: target, full")
        deepest = [(r["batch"], r["measured"][max(r["measured"], key=int)], max(r["measured"], key=int))
                   for r in sel if r["measured"] and "speedup" in r["measured"][max(r["measured"], key=int)]]
        if deepest:
            ax1.plot([b for b, _, _ in deepest], [m["speedup"] for _, m, _ in deepest], marker="x", ls="--",
                     alpha=0.6, label=f"{w} ctx {c}: {deepest[0][2]}-layer slice")
    ax1.axhline(1.0, color="gray", lw=0.8)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
    ax1.set_ylabel("per-user speed-up (acceptance profile)")
    ax2.set_ylabel("tokens / s per user")
    ax2.set_yscale("log")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure_group(models: dict, w: str, b: int, alloc: int, ctxs: list[int], depths: list[int], gamma: int,
                  profile, args, meta: dict, save) -> None:
    """Compile the target and DSpark rounds of every depth for one batch and cache allocation, then
    time them at every context; each result is appended to ``meta`` and saved at once."""
    g0 = time.perf_counter()
    jobs, switches = {}, {}
    for depth in depths:
        for label_, ns in args.variants:
            own = ns.moe_one_row and ns.moe_one_row != args.moe_one_row  # (the slice has the command's)
            model = with_moe_one_row(models[depth], ns.moe_one_row) if own else models[depth]
            for mode in args.modes:
                for opt in args.options:
                    eng = Engine(model, gamma=gamma if mode == "dspark" else 0, kv_layout=args.kv,
                                 accept_profile=profile if mode == "dspark" else None,
                                 compiler_options=with_pdl(OPTION_SETS[opt], ns.xla_pdl))
                    jobs[(depth, mode, opt, label_)] = (eng, random_state(eng, b, alloc, seed=depth))
                    switches[(depth, mode, opt, label_)] = ns
    try:  # each program traced under its variant's switches (read when a step is traced)
        compiled = compile_group(jobs, args.compile_threads, args.rounds_per_call,
                                 prepare=(lambda key: apply_launch_options(switches[key])) if len(args.variants) > 1
                                 else None)
    finally:
        apply_launch_options(args)
    group_compile_s = time.perf_counter() - g0
    for (depth, mode, opt, var), (program, secs) in compiled.items():
        meta["compiles"].append({"weights": w, "batch": b, "alloc": alloc, "depth": depth, "mode": mode,
                                 "options": opt, "variant": var, "lower_compile_s": secs,
                                 "threads": args.compile_threads, "temp_bytes": temp_bytes(program),
                                 "custom_calls": custom_calls(program)})
    print(f"{w} batch {b} alloc {alloc}: {len(compiled)} programs compiled in {group_compile_s:.1f} s "
          f"({', '.join(f'{k[0]}L {k[1]} {k[2]} {k[3]} {v[1]:.0f} s' for k, v in compiled.items())}); custom calls "
          f"{[c['custom_calls'] for c in meta['compiles'][-len(compiled):]]}", flush=True)
    for c in ctxs:  # every depth, mode and variant of one context timed in turn (``time_rounds``)
        timed = time_rounds({key: (compiled[key][0], eng.params, at_context(bs, c)) for key, (eng, bs) in jobs.items()},
                            args.rounds, args.repeats, per_call=args.rounds_per_call, lead=args.lead_call == "on")
        traced = (trace_spans({key: (compiled[key][0], jobs[key][0].params, timed[key][2]) for key in timed},
                              args.rounds, args.rounds_per_call) if args.spans else {})
        for key, (sec, tau, bs, each, host) in timed.items():
            depth, mode, opt, var = key
            r = {"weights": w, "depth": depth, "batch": b, "context": c, "alloc": alloc, "mode": mode, "options": opt,
                 "variant": "" if var == "base" and len(args.variants) == 1 else var,
                 "round_s": sec, "tokens_per_round": tau, "tok_s_per_user": tau / sec, "round_s_passes": each,
                 "host_s": host, "rounds_per_call": args.rounds_per_call}
            if key in traced:
                r["span_s"], r["busy_s"], bs = traced[key]
            jobs[key] = (jobs[key][0], bs)
            meta["results"].append(r)
            print(r, flush=True)
        save()


# ---------------------------------------------------------------------------- main
def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="2,4", help="slice depths (layers); two give the per-layer cost")
    ap.add_argument("--batch", default="1,32,8,64", help="batches, measured in this order")
    ap.add_argument("--context", default="2048,8192,32768", help="committed tokens per request")
    ap.add_argument("--weights", default="fp8",
                    help="comma list of: official (FP8 linears, FP4 experts as in the checkpoints), fp8 (the FP4 "
                         "experts widened to e4m3, same values), dense (bf16)")
    ap.add_argument("--experts", type=int, default=0, help="routed experts (0 = the model's)")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"), help="target KV pool layout")
    ap.add_argument("--accept-profile", default=",".join(map(str, DEFAULT_PROFILE)),
                    help="per-position marginal acceptance probabilities (benchmark only, not lossless), "
                         "or 'real' for the real acceptance")
    ap.add_argument("--alloc", default="max", choices=("max", "each"),
                    help="max: one cache allocation per batch at the largest context (one compile per batch); "
                         "each: one per context (the indexer then scores only that context's entries)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per timed repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lead-call", default="on", choices=("on", "off"),
                    help="on: each timed pass starts when an untimed call dispatched ahead of it is done (the device "
                         "busy from the start, as in a long generation); off: the clock also holds the first timed "
                         "call's dispatch (the method before 2026-12-06)")
    ap.add_argument("--rounds-per-call", type=int, default=ROUNDS_PER_CALL,
                    help="rounds each call runs (Engine.rounds; 1: Engine.round; default generate's)")
    ap.add_argument("--compile-threads", type=int, default=4, help="programs compiled at the same time")
    ap.add_argument("--slices", default="together", choices=("together", "each"),
                    help="together: every depth's slice in memory, each batch's programs compiled at once; each: "
                         "one slice at a time (memory of the deepest slice only, e.g. for --depths 4,8)")
    ap.add_argument("--budget-s", type=float, default=0, help="skip the remaining shapes once this is spent (0 = none)")
    ap.add_argument("--values-max-block-m", type=int, default=0,
                    help="largest row tile of FP8 linears on unquantised rows at decode / verify sizes (wo_a; "
                         "grouped_matmul.VALUES_MAX_BLOCK_M; 0 = the library's)")
    ap.add_argument("--codes-max-block-m", type=int, default=0,
                    help="largest row tile of FP8 linears on quantised rows (fp8 codes) at decode / verify sizes "
                         "(grouped_matmul.LINEAR_CODES_MAX_BLOCK_M; 0 = the library's)")
    ap.add_argument("--dense-copies", action="store_true",
                    help="hold every FP8 linear also dequantised (dspark_jax.with_dense_copies): verify-sized "
                         "calls multiply by the copies in XLA's GEMM")
    ap.add_argument("--sinkhorn", default="auto", choices=("auto", "kernel", "fused"),
                    help="how mHC's steps run (Numerics.sinkhorn): fused = hc_pre + norm and hc_post + hc_pre + "
                         "norm as two Pallas launches each")
    ap.add_argument("--spans", action="store_true",
                    help="after the timing, each program's rounds once more under the profiler: each round's device "
                         "span and busy time, extrapolated like the wall times (span_step_ms, ...)")
    ap.add_argument("--moe-one-row", default="",
                    help="MoE.one_row (xla, select, shared, apart, experts, tile; default: the model's)")
    add_launch_options(ap)
    ap.add_argument("--variants", default="",
                    help="launch switch sets timed side by side, '|'-separated flags of the launch options and "
                         "--moe-one-row on top of this command's (an empty set: the command's own), e.g. "
                         "'|--wq-b-apart|--moe-one-row select'; each row of the results names its set")
    ap.add_argument("--modes", default="target,dspark",
                    help="target (the target-only step), dspark (the DSpark round) or both")
    ap.add_argument("--options", default="engine",
                    help="compiler options of the rounds, timed side by side: engine (the engine's, "
                         "compile_cache.COMPILER_OPTIONS), xla (XLA's defaults); e.g. engine,xla")
    ap.add_argument("--smoke", action="store_true", help="tiny config, CPU-sized: checks the script runs")
    add_split_option(ap)
    args = ap.parse_args(argv)
    if args.values_max_block_m:
        gm.VALUES_MAX_BLOCK_M = args.values_max_block_m
    if args.codes_max_block_m:
        gm.LINEAR_CODES_MAX_BLOCK_M = args.codes_max_block_m
    args.launch_options = apply_launch_options(args)
    args.split_programs = apply_split_option(args)
    args.options = args.options.split(",")
    try:
        args.variants = launch_variants(args.variants, args)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    args.modes = args.modes.split(",")
    if not args.modes or set(args.modes) - {"target", "dspark"}:
        raise SystemExit(f"--modes takes target and / or dspark, got {args.modes}")
    if not args.options or set(args.options) - set(OPTION_SETS):
        raise SystemExit(f"--options takes a list of {sorted(OPTION_SETS)}, got {args.options}")
    start = time.perf_counter()

    full = config.tiny() if args.smoke else config.flash()
    if args.smoke:
        args.depths, args.batch, args.context, args.rounds, args.repeats = "1,2", "2", "64,256", 2, 1
    if args.experts:
        full = full.replace(n_routed_experts=args.experts)
    depths, batches, contexts = ints(args.depths), ints(args.batch), ints(args.context)
    formats = args.weights.split(",")
    profile = None if args.accept_profile == "real" else tuple(float(x) for x in args.accept_profile.split(","))
    gamma = full.dspark.block_size
    if args.rounds_per_call < 1:
        raise SystemExit(f"--rounds-per-call must be >= 1, got {args.rounds_per_call}")
    # rounds a state runs at its context: the timed passes, the warm-up calls and the traced calls
    run = args.rounds_per_call * (calls_for(args.rounds, args.rounds_per_call) * (args.repeats + 1) + 2)
    slack = -(-(gamma + 1) * run // 128) * 128 + 128

    env = environment()
    print(env, flush=True)
    measure_ceilings = (lambda: ceilings(0.0625, 512)) if args.smoke else ceilings
    ceil = measure_ceilings()
    print(ceil, flush=True)
    parts = {(w, n): weight_parts(full if n == full.num_hidden_layers else sliced(full, n), w)
             for w in formats for n in {*depths, full.num_hidden_layers}}
    meta = {
        "env": env, "ceilings": ceil, "method": METHOD,
        "args": {**vars(args), "variants": [label_ for label_, _ in args.variants]},
        "acceptance": ("real acceptance" if profile is None else
                       f"ACCEPTANCE PROFILE (benchmark only, not lossless): {profile}, expected accept length "
                       f"{1 + sum(profile[:gamma]):.3f}"),
        "prefill": "none: caches filled with random rows, committed lengths set to the context",
        "cost_follows": {
            "attention": "committed lengths (the ragged kernel walks only the keys its tokens see)",
            "indexer": ("allocated entries: the C4 indexer scores all max_len / 4 entries per request "
                        "(a bf16 dot accumulating in float32) "
                        + ("(one allocation per batch at the largest context)" if args.alloc == "max"
                           else "(allocated per context)")),
            "compressors, window rings": "fixed per request"},
        "indexer_scores_allocated_entries": True,
        "config": {"full_layers": full.num_hidden_layers, "experts": full.n_routed_experts, "kv": args.kv,
                   "slices": {str(d): layer_kinds(full, range(d)) for d in depths},
                   "difference_layers": layer_kinds(full, range(min(depths), max(depths))),
                   "extrapolated_layers": layer_kinds(full, range(max(depths), full.num_hidden_layers))},
        "results": [], "skipped": [], "errors": [], "compiles": []}

    def save():
        rows = summarize(meta["results"], full, parts, ceil, args.kv)
        write_json("decode.json", {**meta, "summary": rows, "goals": goals(rows),
                                   "paired": paired_differences(meta["results"]),
                                   "elapsed_s": time.perf_counter() - start})
        return rows

    last_group_s = 0.0
    for w in formats:
        if args.budget_s and time.perf_counter() - start + last_group_s > args.budget_s:
            meta["skipped"].append({"weights": w, "reason": "budget"})
            continue
        groups = [(b, [max(contexts)], contexts) if args.alloc == "max" else (b, [c], [c])
                  for b in batches for c in (contexts if args.alloc == "each" else [None])]
        for slice_depths in ([depths] if args.slices == "together" else [[d] for d in depths]):
            models = {}
            for depth in slice_depths:
                t0 = time.perf_counter()
                models[depth] = dspark_jax.init(sliced(full, depth), 0, dtype=jnp.bfloat16, weight_format=w,
                                                quant_sim=True)
                if args.dense_copies:
                    models[depth] = dspark_jax.with_dense_copies(models[depth])
                if args.sinkhorn != "auto":
                    models[depth] = dspark_jax.with_numerics(models[depth], sinkhorn=args.sinkhorn)
                if args.moe_one_row:
                    models[depth] = with_moe_one_row(models[depth], args.moe_one_row)
                print(f"{w}: {depth}-layer slice initialised in {time.perf_counter() - t0:.1f} s "
                      f"({models[depth].weight_bytes / 2**30:.1f} GiB)", flush=True)
            for b, alloc_ctx, ctxs in groups:
                alloc = alloc_ctx[0] + slack
                elapsed = time.perf_counter() - start
                if args.budget_s and elapsed + last_group_s > args.budget_s:
                    meta["skipped"].append({"weights": w, "batch": b, "contexts": ctxs, "depths": slice_depths,
                                            "reason": "budget"})
                    print(f"skipped {w} batch {b} contexts {ctxs} depths {slice_depths}: budget", flush=True)
                    save()
                    continue
                g0 = time.perf_counter()
                try:
                    measure_group(models, w, b, alloc, ctxs, slice_depths, gamma, profile, args, meta, save)
                except Exception as e:  # e.g. out of memory at a large batch: keep the other shapes
                    meta["errors"].append({"weights": w, "batch": b, "contexts": ctxs, "depths": slice_depths,
                                           "error": repr(e)[:2000]})
                    print(f"failed {w} batch {b} depths {slice_depths}: {e!r}"[:2000], flush=True)
                    save()
                last_group_s = time.perf_counter() - g0
            del models  # and what still points at them (compiled rounds), before the next weights
            jax.clear_caches()
            gc.collect()
    meta["ceilings_start_end"] = stricter_ceilings(ceil, measure_ceilings())
    print(ceil, flush=True)
    rows = save()
    title = (f"{'tiny (smoke)' if args.smoke else 'DeepSeek-V4-Flash'}: depths {args.depths} -> "
             f"{full.num_hidden_layers} layers; {env['device']}, {env['date']}, {env['commit']}; "
             + ("real acceptance" if profile is None else
                f"acceptance profile (benchmark only), expected accept length {1 + sum(profile[:gamma]):.2f}"))
    if rows:
        plot(rows, title, os.path.join(out_dir(), "decode.png"))
    text = table(rows)
    with open(os.path.join(out_dir(), "decode.md"), "w") as f:
        f.write(f"{title}\n\n{text}\n")
    print(text, flush=True)
    for k, v in goals(rows).items():
        print(k, {a: round(x, 3) for a, x in v.items()}, flush=True)
    for d in paired_differences(meta["results"]):
        q1, q3 = d["quartiles_us"]
        print(f"paired: {d['weights']} [{d['variant']}] - [base], {d['depth']} layers, {d['mode']}, "
              f"batch {d['batch']}, context {d['context']}: {d['median_us']:+.1f} us per round [{q1:+.1f}, "
              f"{q3:+.1f}], faster in {d['faster_share']:.0%} of {d['passes']} passes", flush=True)


if __name__ == "__main__":
    main()
