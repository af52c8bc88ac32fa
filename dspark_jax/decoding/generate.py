"""``dspark_jax.generate``: prompts in, tokens / text / finish reasons / statistics out."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.api import InputError, Model, check_int, check_kv_cache, load
from dspark_jax.config import MAX_VERIFY_TOKENS
from dspark_jax.decoding.engine import SCHEDULERS, Engine
from dspark_jax.decoding.progress import CompileWatch, TokenBar
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.decoding.scheduler import SPSTable
from dspark_jax.decoding.serving import profile_sps, serve
from dspark_jax.memory import plan_slots
from dspark_jax.sharding import model_mesh, shard_model

MIN_CONTEXT = 256  # smallest cache length per slot
MAX_SLOTS = 64  # largest slot pool generate picks by itself (pass slots= for more)
DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny")
_LOADED: dict[tuple, tuple[tuple, Model]] = {}  # (directory, load options) -> (file stamps, model)


@dataclasses.dataclass
class Result:
    tokens: list[int]
    text: str | None
    finish_reason: str  # "stop" (a stop token / string) or "length" (max_new_tokens)
    stats: dict[str, Any]


def cached_load(path: str | os.PathLike, *, progress: bool = True, **options) -> Model:
    """``load(path, **options)``, kept for the rest of the process: a later call with the same
    directory and options returns the same ``Model``, with the engines it has compiled, unless a
    file of the directory changed in between (then it is loaded again)."""
    real = os.path.realpath(path)
    key = (real, tuple(sorted(options.items())))
    stamps = tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(real) if e.is_file()))
    if key not in _LOADED or _LOADED[key][0] != stamps:
        _LOADED[key] = (stamps, load(path, progress=progress, **options))
    return _LOADED[key][1]


def default_model() -> Model:
    """The trained tiny DeepSeek-V4 + DSpark pair shipped in ``dspark_jax/assets``, in float32."""
    if not os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        raise FileNotFoundError(f"the default model is missing from {DEFAULT_MODEL_DIR}; pass model=")
    return cached_load(DEFAULT_MODEL_DIR, dtype=jnp.float32, progress=False)


def resolve_model(model, progress: bool = False) -> Model:
    """``generate``'s ``model`` argument as a Model (a directory: ``cached_load`` with the defaults of
    ``load``)."""
    if model is None:
        return default_model()
    if isinstance(model, Model):
        return model
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isdir(model):
            raise InputError(f"unknown model {model!r}: not a Model and not a checkpoint directory")
        return cached_load(model, progress=progress)
    raise InputError(f"unknown model {model!r}: pass a dspark_jax.Model, a checkpoint directory or None")


def greedy_exact(model: Model, kv_cache: str = "bf16") -> bool:
    """Whether greedy output can be expected not to depend on how the computation is shaped:
    speculative equal to target-only decoding token for token, a request in a batch equal to the
    request alone.

    The acceptance rule is exact; what varies is the target's own arithmetic. A verify call holds
    γ + 1 tokens per request where target-only decoding holds 1, and batches differ in prefill
    chunks and padding; XLA picks a matmul's reduction order by its shape (on the CPU a one-row
    product takes a matrix-vector kernel), so the logits of the same token differ between call
    shapes in every dtype. In float32 the difference is about 1e-5 (the shipped model: at most
    1.2e-5 between 1-, 6- and 16-token calls), far below the gap between the two largest logits
    in practice, and greedy outputs agree in every test on the CPU. Rounding intermediates to a
    short mantissa turns it into differences large enough to flip near-tied argmaxes: bf16
    computation (up to 0.7 on the shipped model's logits; 1 of 5 prompts changed within 96
    tokens) and ``quant_sim``'s fp8 activations (a random tiny model: 2 of 3 prompts changed
    between batched and alone). fp8 KV rows round cached values the same way, rarely enough that
    no change showed in 8 float32 prompts, which is no guarantee. GPUs have not been verified.

    True only for float32 computation without fake quantisation, with bf16-layout KV pools, on
    the CPU. Sampling follows the target distribution exactly either way.
    """
    platforms = {d.platform for d in jax.tree_util.tree_leaves(model.state)[0].devices()}
    num = model.numerics
    return platforms == {"cpu"} and num.dtype == jnp.float32 and not num.quant_sim and kv_cache == "bf16"


def _sharded(model: Model, mesh) -> Model:
    """The model with parameters placed on ``mesh`` (kept, so compiled engines are reused)."""
    cache = model.__dict__.setdefault("_sharded", {})
    if id(mesh) not in cache:
        cache[id(mesh)] = (mesh, shard_model(model, mesh))
    return cache[id(mesh)][1]


# Static rounds ``generate`` hands the device per call by default. The shipped model through
# ``generate`` on an H200 (docs/benchmarks.md, 2026-12-05): target-only 1.56 / 0.80 / 0.48 ms
# per round at 1 / 2 / 4, DSpark 1.54 / 1.05 / 0.92 ms; on this project's 2-core CPU 1.14-1.26x
# (target-only) and 1.07-1.15x (DSpark) faster per round at 4 than at 1. A request that finishes
# inside a call leaves its slot idle for the call's remaining rounds (at most 3).
ROUNDS_PER_CALL = 4


def _engine(model: Model, gamma: int, drafter, kv_cache: str = "bf16",
            rounds_per_call: int = ROUNDS_PER_CALL) -> Engine:
    cache = model.__dict__.setdefault("_engines", {})
    key = (gamma, drafter, kv_cache, rounds_per_call)
    if key not in cache:
        cache[key] = Engine(model, gamma=gamma, drafter=drafter, kv_layout=kv_cache, rounds_per_call=rounds_per_call)
    return cache[key]


def sps_table(model=None, *, slots: int, context: int, kv_cache: str = "bf16", repeats: int = 5,
              fine_buckets: int = 0) -> SPSTable:
    """The rounds-per-second table of DSpark decoding with ``slots`` slots of ``context`` tokens
    (``serving.profile_sps``: a real ragged round timed at every token bucket of that pool), for
    ``generate(..., scheduler=..., sps_table=)``; ``SPSTable.save`` / ``load`` keep it. Uses the
    engine ``generate`` uses, so the programs compiled here serve later calls. The buckets:
    powers of 2 (``fine_buckets`` 0), or every multiple of slots / k above the slots
    (``fine_buckets`` = k: k γ + 1 more verify programs, and the schedulers' gain at full depth on
    large pools, README); ``generate`` runs the schedulers' rounds in the table's buckets."""
    model = resolve_model(model)
    if model.config.dspark is None:
        raise InputError("this checkpoint has no DSpark drafter (no mtp.* stages): nothing to schedule")
    check_kv_cache(kv_cache)
    engine = _engine(model, model.config.dspark.block_size, None, kv_cache, 1)
    return profile_sps(engine, check_int("slots", slots, lo=1), check_int("context", context, lo=1), repeats=repeats,
                       fine_buckets=check_int("fine_buckets", fine_buckets, lo=0))


def cache_length(config, ids: list[np.ndarray], params: list[SamplingParams]) -> int:
    """Cache tokens per slot for these requests: the longest prompt + max_new_tokens + one verify
    block, rounded up to a power of 2 (at least MIN_CONTEXT, so calls of similar lengths share
    compiled programs) but never past the model context + one verify block."""
    need = max(len(p) + sp.max_new_tokens for p, sp in zip(ids, params)) + MAX_VERIFY_TOKENS
    return min(max(MIN_CONTEXT, 1 << (need - 1).bit_length()), config.max_position_embeddings + MAX_VERIFY_TOKENS)


def slot_count(model: Model, n_requests: int, context: int, gamma: int, kv_cache: str,
               memory_budget: int | None = None) -> int:
    """Default slot pool size: the requests rounded up to a power of 2, at most MAX_SLOTS, and at
    most what ``memory.plan_slots`` fits into the budget (default: the free device memory)."""
    plan = plan_slots(model.config, context, layout=kv_cache, gamma=gamma, dtype=model.numerics.dtype,
                      budget_bytes=memory_budget)
    if plan.max_requests < 1:
        raise InputError(f"the caches of one request of {context} tokens ({plan.bytes_per_request:,} B) do not "
                         f"fit into {plan.budget_bytes:,} B of memory")
    return min(plan.max_requests, MAX_SLOTS, 1 << (n_requests - 1).bit_length())


def prompt_ids(model: Model, prompt) -> np.ndarray:
    """Token ids of one prompt as ``generate`` feeds them (strings: tokenized, BOS prepended)."""
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise InputError("string prompts need a model with a tokenizer; pass token ids instead")
        if not prompt:
            raise InputError("a prompt is empty")
        ids = model.tokenizer.encode(prompt).ids
        bos = model.config.bos_token_id
        return np.asarray(([bos] if not ids or ids[0] != bos else []) + ids, np.int32)
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        raise InputError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    ids = model.check_ids(prompt, "prompt token ids")
    if ids.ndim != 1:
        raise InputError(f"a prompt of token ids must be one-dimensional, got shape {ids.shape}")
    return ids


def _prompt_list(prompts) -> list:
    """``generate``'s ``prompts`` argument as a list of prompts."""
    sequence = isinstance(prompts, (list, tuple)) or (isinstance(prompts, np.ndarray) and prompts.ndim > 0)
    if isinstance(prompts, str) or (sequence and len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))):
        return [prompts]  # one prompt
    if not sequence:
        raise InputError(f"prompts must be a string, a list of token ids, or a list of those; "
                         f"got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise InputError("no prompts given")
    return list(prompts)


def _sampling_list(sampling, n: int) -> list[SamplingParams]:
    """``generate``'s ``sampling`` argument as one SamplingParams per prompt."""
    if sampling is None:
        sampling = SamplingParams()
    if isinstance(sampling, (SamplingParams, dict)):
        sampling = [sampling] * n
    if not isinstance(sampling, (list, tuple)):
        raise InputError(f"sampling must be a SamplingParams, a dict of its fields, or a list of them (one per "
                         f"prompt); got {type(sampling).__name__}")
    if len(sampling) != n:
        raise InputError(f"got {len(sampling)} SamplingParams for {n} prompts")
    out = []
    for p in sampling:
        if isinstance(p, dict):
            try:
                p = SamplingParams(**p)
            except TypeError as e:  # an unknown field
                raise InputError(f"sampling: {e}") from None
        if not isinstance(p, SamplingParams):
            raise InputError(f"sampling entries must be SamplingParams or dicts, got {type(p).__name__}")
        out.append(p)
    return out


def _with_stops(model: Model, params: SamplingParams) -> SamplingParams:
    """Check the stops, add EOS (unless ignore_eos), and turn strings that are one special token
    of the tokenizer into token ids (token ids also stop the request on the device)."""
    stops = list(params.stop)
    if not params.ignore_eos:
        stops.append(model.config.eos_token_id)
    out = []
    for s in stops:
        if isinstance(s, str):
            if model.tokenizer is None:
                raise InputError("string stop sequences need a model with a tokenizer")
            tid = model.tokenizer.token_to_id(s)
            s = tid if tid is not None else s
        if isinstance(s, int) and not 0 <= s < model.config.vocab_size:
            raise InputError(f"stop token id {s} is outside the vocabulary")
        if s not in out:
            out.append(s)
    return dataclasses.replace(params, stop=tuple(out))


def _confidence_stats(conf: list[np.ndarray], temps) -> dict[str, Any]:
    """Mean calibrated confidence sigmoid(c_k / T_k) of the drafts at each block position."""
    if not conf:
        return {}
    c = np.stack(conf)  # [rounds, γ] raw logits
    t = np.asarray(temps if temps is not None else np.ones(c.shape[1]), np.float64)
    return {"mean_confidence": (1 / (1 + np.exp(-c / t))).mean(0).tolist()}


def _histogram_stats(accept: list[int], gamma: int) -> dict[str, Any]:
    rounds = len(accept)
    lengths = np.asarray(accept, np.int64) + 1  # accepted drafts + bonus
    hist = np.bincount(lengths, minlength=gamma + 2)[1:].tolist() if rounds else [0] * (gamma + 1)
    per_pos = []
    for k in range(1, gamma + 1):  # P(draft k accepted | drafts < k accepted)
        reached = int(np.sum(lengths >= k))
        per_pos.append(float(np.sum(lengths >= k + 1)) / reached if reached else float("nan"))
    return {"rounds": rounds, "mean_accept_length": float(lengths.mean()) if rounds else float("nan"),
            "accept_length_histogram": hist, "per_position_acceptance": per_pos}


def generate(prompts, *, model=None, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             speculative: bool = True, mesh=None, seed: int = 0, progress: bool = False, kv_cache: str = "bf16",
             drafter=None, slots: int | None = None, context: int | None = None,
             memory_budget: int | None = None, scheduler: str = "static",
             sps_table: SPSTable | None = None, rounds_per_call: int = ROUNDS_PER_CALL) -> list[Result]:
    """Generate continuations for any number of prompts.

    prompts: a string or token-id list, or a list of them. model: a ``Model``, a checkpoint
    directory (loaded with ``load``'s defaults, bf16, once: later calls with the same directory
    reuse the model and its compiled programs, see ``cached_load``), or None for the shipped
    default model (float32). sampling: one ``SamplingParams`` (or dict of its fields) for all
    requests or one per request. mesh: a ``jax.sharding.Mesh`` (``dspark_jax.sharding.make_mesh``)
    to spread the model over; a model loaded with ``mesh=`` already is. seed: derives the seeds of
    requests whose SamplingParams have none. kv_cache: "bf16" (KV rows in the compute dtype) or
    "fp8" (448 e4m3 nope dims + 64 bf16 rope dims, 640 B per row, and indexer keys in e4m3 with a
    scale per 32 dims, 132 B per key: 1.58x the DeepSeek-V4-Flash requests of 32K tokens in the
    same memory; exact for models run with ``quant_sim``). speculative: DSpark drafting + lossless
    verification (False: target-only decoding). progress: a progress bar on stderr with the
    phases prefill / compiling / decode.

    Serving (``dspark_jax.decoding.serving``): the requests stream through a pool of ``slots``
    slots with caches of ``context`` tokens each; a request takes a free slot when one opens,
    its prompt is prefilled in chunks between decoding rounds, and the slot is reused as soon as
    it finishes. context: cache tokens per slot (default: the longest prompt + max_new_tokens +
    one verify block, rounded up to a power of 2). slots: default the number of prompts rounded
    up to a power of 2, at most 64 and at most what fits into ``memory_budget`` bytes (default:
    90% of the free device memory) by ``memory.plan_slots`` for this context and KV layout.
    Calls with the same slots and context reuse every compiled program.

    scheduler: how many drafts each round verifies: "static" (all γ), "confidence" (the DSpark
    paper's early stopping on the round's confidences, seeing whole token buckets:
    ``scheduler.bucket_early_stopping``) or "lagged" (a capacity from
    confidences two rounds old, given to the drafts of highest current confidence); both trade
    verify work for accepted tokens by the rounds-per-second table ``sps_table``
    (``dspark_jax.decoding.scheduler.SPSTable``, e.g. from ``sps_table``; without one they
    verify everything, with a warning); their ragged rounds run in the table's token buckets
    (``sps_table(..., fine_buckets=k)`` times finer ones). Every scheduler is lossless.
    rounds_per_call: static rounds handed to the device per call (``Engine``; default
    ``ROUNDS_PER_CALL`` = 4): the host's cost of a call is paid once per that many rounds; the
    same tokens. A request that finishes inside a call leaves its slot idle for the call's
    remaining rounds (1: one round per call). Ragged rounds (the "confidence" and "lagged"
    schedulers) run one per call.

    Lossless: sampled output follows the target distribution exactly, and greedy output is the
    argmax of the target's logits at every step. Whether those logits, hence the greedy tokens,
    are the same as target-only decoding computes them depends on the arithmetic: in float32 on
    the CPU greedy speculative output equals greedy target-only output (and a request among
    others equals the request alone) token for token; in bf16, with ``quant_sim`` or fp8 KV rows,
    the target's logits differ slightly between a (γ + 1)-token verify call and a 1-token call
    and near ties can flip. ``stats["greedy_exact"]`` says which case a result is in; see
    ``greedy_exact``.

    Each ``Result.stats`` holds: ``new_tokens``, ``prompt_tokens``, ``gamma``, ``rounds``,
    ``mean_accept_length`` (tokens per round, bonus included), ``accept_length_histogram``,
    ``per_position_acceptance``, ``mean_verify_tokens`` (tokens verified per round, anchor
    included), ``mean_confidence`` (DSpark), ``compile_s`` (seconds this call
    spent tracing and compiling, or loading compiled programs from the disk cache; 0 when every
    program was compiled by an earlier call), ``prefill_s`` (from taking a slot to the first
    token) and ``decode_s`` (from there to the last token), both without compile time,
    ``tokens_per_s`` (new tokens / decode_s), ``slots``, ``context`` and ``greedy_exact``.
    """
    prompts = _prompt_list(prompts)
    params = _sampling_list(sampling, len(prompts))
    seed = check_int("seed", seed)
    check_kv_cache(kv_cache)
    if scheduler not in SCHEDULERS:
        raise InputError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
    if sps_table is not None and not isinstance(sps_table, SPSTable):
        raise InputError(f"sps_table must be a dspark_jax.decoding.scheduler.SPSTable, got {type(sps_table).__name__}")
    model = resolve_model(model, progress)
    if mesh is not None and model_mesh(model) is not mesh:
        model = _sharded(model, mesh)
    ids = [prompt_ids(model, p) for p in prompts]
    params = [_with_stops(model, p) for p in params]
    cfg = model.config
    gamma = 0
    if speculative:
        if cfg.dspark is None and drafter is None:
            raise InputError("this checkpoint has no DSpark drafter (no mtp.* stages); use speculative=False")
        gamma = cfg.dspark.block_size if drafter is None else drafter.gamma
    elif scheduler != "static":
        raise InputError(f"the {scheduler!r} scheduler needs speculative decoding")
    for i, (p, sp) in enumerate(zip(ids, params)):
        if len(p) + sp.max_new_tokens > cfg.max_position_embeddings:
            raise InputError(f"request {i}: prompt ({len(p)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds "
                             f"the model context of {cfg.max_position_embeddings} tokens")
    if context is None:
        context = cache_length(cfg, ids, params)
    context = check_int("context", context, lo=1, hi=cfg.max_position_embeddings + MAX_VERIFY_TOKENS + 1)
    for i, (p, sp) in enumerate(zip(ids, params)):
        if len(p) + sp.max_new_tokens + MAX_VERIFY_TOKENS > context:
            raise InputError(f"request {i}: prompt ({len(p)} tokens) + max_new_tokens ({sp.max_new_tokens}) + "
                             f"{MAX_VERIFY_TOKENS} verify tokens exceeds the context of {context} tokens per slot")
    if slots is None:
        if memory_budget is not None:
            memory_budget = check_int("memory_budget", memory_budget, lo=1)
        slots = slot_count(model, len(ids), context, gamma, kv_cache, memory_budget)
    slots = check_int("slots", slots, lo=1)
    seeds = [sp.seed if sp.seed is not None else (seed * 1_000_003 + i) % (2**31) for i, sp in enumerate(params)]
    engine = _engine(model, gamma, drafter, kv_cache, check_int("rounds_per_call", rounds_per_call, lo=1))
    with CompileWatch() as watch:
        bar = TokenBar([sp.max_new_tokens for sp in params], watch, progress)
        watch.on_start = bar.compiling
        try:
            out = serve(engine, ids, params, seeds, slots=slots, max_len=context, tokenizer=model.tokenizer,
                        on_progress=bar.show, track_confidence=drafter is None, scheduler=scheduler,
                        sps_table=sps_table)
        finally:
            bar.close()

    exact = greedy_exact(model, kv_cache)
    compile_s = watch.seconds()
    results = []
    for i in range(len(ids)):
        t_in, t_first, t_end = out.admitted[i], out.first[i], out.finished[i]
        prefill_s = t_first - t_in - watch.seconds(t_in, t_first)
        decode_s = t_end - t_first - watch.seconds(t_first, t_end)
        stats = _histogram_stats(out.accepts[i], gamma)
        stats["mean_verify_tokens"] = float(np.mean(out.verified[i])) if out.verified[i] else float("nan")
        stats.update(_confidence_stats(out.confidences[i], model.sts_temperatures))
        tokens = out.tokens[i]
        stats.update(new_tokens=len(tokens), prompt_tokens=int(len(ids[i])), compile_s=compile_s,
                     prefill_s=prefill_s, decode_s=decode_s, gamma=gamma, greedy_exact=exact, slots=slots,
                     context=context, tokens_per_s=len(tokens) / decode_s if decode_s > 0 else float("nan"))
        text = model.tokenizer.decode(tokens) if model.tokenizer is not None else None
        results.append(Result(tokens=tokens, text=text, finish_reason=out.reason[i], stats=stats))
    return results
