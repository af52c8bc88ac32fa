"""``dspark_jax.generate``: prompts in, tokens / text / finish reasons / statistics out."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dspark_jax.api import InputError, Model, check_kv_cache, load
from dspark_jax.config import MAX_VERIFY_TOKENS
from dspark_jax.decoding.engine import Engine
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.sharding import model_mesh, shard_model

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny")
_DEFAULT: dict[str, Model] = {}


@dataclasses.dataclass
class Result:
    tokens: list[int]
    text: str | None
    finish_reason: str  # "stop" (a stop token / string) or "length" (max_new_tokens)
    stats: dict[str, Any]


def default_model() -> Model:
    """The trained tiny DeepSeek-V4 + DSpark pair shipped in ``dspark_jax/assets``."""
    if "tiny" not in _DEFAULT:
        if not os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
            raise FileNotFoundError(f"the default model is missing from {DEFAULT_MODEL_DIR}; pass model=")
        _DEFAULT["tiny"] = load(DEFAULT_MODEL_DIR, dtype=jnp.float32, progress=False)
    return _DEFAULT["tiny"]


def resolve_model(model) -> Model:
    if model is None:
        return default_model()
    if isinstance(model, Model):
        return model
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isdir(model):
            raise InputError(f"unknown model {model!r}: not a Model and not a checkpoint directory")
        return load(model)
    raise InputError(f"unknown model {model!r}: pass a dspark_jax.Model, a checkpoint directory or None")


def _sharded(model: Model, mesh) -> Model:
    """The model with parameters placed on ``mesh`` (kept, so compiled engines are reused)."""
    cache = model.__dict__.setdefault("_sharded", {})
    if id(mesh) not in cache:
        cache[id(mesh)] = (mesh, shard_model(model, mesh))
    return cache[id(mesh)][1]


def _engine(model: Model, gamma: int, drafter, kv_cache: str = "bf16") -> Engine:
    cache = model.__dict__.setdefault("_engines", {})
    key = (gamma, drafter, kv_cache)
    if key not in cache:
        cache[key] = Engine(model, gamma=gamma, drafter=drafter, kv_layout=kv_cache)
    return cache[key]


def cache_length(config, ids: list[np.ndarray], params: list[SamplingParams]) -> int:
    """KV-cache length of a batch: its longest prompt + max_new_tokens + one verify block, rounded
    up to 128 (so batches of similar lengths share one compiled engine) but never past the model
    context + one verify block."""
    need = max(len(p) + sp.max_new_tokens for p, sp in zip(ids, params)) + MAX_VERIFY_TOKENS
    return min(-(-need // 128) * 128, config.max_position_embeddings + MAX_VERIFY_TOKENS)


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
    try:
        ids = np.asarray(prompt)
    except Exception as e:  # ragged nested lists and the like
        raise InputError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}") from e
    if ids.ndim != 1:
        raise InputError(f"a prompt of token ids must be one-dimensional, got shape {ids.shape}")
    if ids.size == 0:
        raise InputError("a prompt is empty")
    return model.check_ids(ids, "prompt token ids")


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
             drafter=None) -> list[Result]:
    """Generate continuations for a batch of prompts.

    prompts: a string or token-id list, or a list of them. model: a ``Model``, a checkpoint
    directory, or None for the shipped default model. sampling: one ``SamplingParams`` for all
    requests or one per request. mesh: a ``jax.sharding.Mesh`` (``dspark_jax.sharding.make_mesh``)
    to spread the model over; a model loaded with ``mesh=`` already is. kv_cache: "bf16" (KV rows
    in the compute dtype) or "fp8" (448 e4m3 nope dims + 64 bf16 rope dims, 640 B per row: about
    1.4x the context in the same memory; exact for models run with ``quant_sim``). speculative: DSpark drafting + lossless verification (False:
    target-only decoding). Greedy speculative output equals greedy target-only output token for
    token; sampled output follows the target distribution.
    """
    model = resolve_model(model)
    if mesh is not None and model_mesh(model) is not mesh:
        model = _sharded(model, mesh)
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts) > 0
                                    and isinstance(prompts[0], (int, np.integer))):  # one token-id list
        prompts = [prompts]
    if len(prompts) == 0:
        raise InputError("no prompts given")
    ids = [prompt_ids(model, p) for p in prompts]
    if sampling is None:
        sampling = SamplingParams()
    params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(ids)
    if len(params) != len(ids):
        raise InputError(f"got {len(params)} SamplingParams for {len(ids)} prompts")
    params = [p if isinstance(p, SamplingParams) else SamplingParams(**p) for p in params]
    params = [_with_stops(model, p) for p in params]
    cfg = model.config
    gamma = 0
    if speculative:
        if cfg.dspark is None and drafter is None:
            raise InputError("this checkpoint has no DSpark drafter (no mtp.* stages); use speculative=False")
        gamma = cfg.dspark.block_size if drafter is None else drafter.gamma
    for i, (p, sp) in enumerate(zip(ids, params)):
        if len(p) + sp.max_new_tokens > cfg.max_position_embeddings:
            raise InputError(f"request {i}: prompt ({len(p)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds "
                             f"the model context of {cfg.max_position_embeddings} tokens")
    max_len = cache_length(cfg, ids, params)
    seeds = [sp.seed if sp.seed is not None else (seed * 1_000_003 + i) % (2**31) for i, sp in enumerate(params)]

    check_kv_cache(kv_cache)
    engine = _engine(model, gamma, drafter, kv_cache)
    t0 = time.perf_counter()
    bs = engine.init_state(ids, params, seeds, max_len)
    bs, first = engine.prefill(bs, ids)
    t_prefill = time.perf_counter() - t0

    b = len(ids)
    out = [[int(first[i])] for i in range(b)]
    accepts: list[list[int]] = [[] for _ in range(b)]
    confs: list[list[np.ndarray]] = [[] for _ in range(b)]
    done = [False] * b
    reason = ["length"] * b
    finish_time = [0.0] * b
    flags = dict(sampled=any(sp.temperature > 0 for sp in params), top_k=any(sp.top_k > 0 for sp in params),
                 top_p=any(sp.top_p < 1.0 for sp in params))
    bar = tqdm(total=sum(sp.max_new_tokens for sp in params), disable=not progress, unit="tok")

    def finish(i: int) -> bool:
        """Truncate request i at stops / max_new_tokens; True if it is finished."""
        toks, sp = out[i], params[i]
        for j, t in enumerate(toks):
            if t in sp.stop:
                out[i], reason[i] = toks[:j], "stop"
                return True
        text_stops = [s for s in sp.stop if isinstance(s, str)]
        if text_stops and model.tokenizer is not None:
            text = model.tokenizer.decode(toks)
            for s in text_stops:
                if s in text:
                    reason[i] = "stop"
                    while toks and s in model.tokenizer.decode(toks):
                        toks = toks[:-1]
                    out[i] = toks
                    return True
        if len(toks) >= sp.max_new_tokens:
            out[i] = toks[:sp.max_new_tokens]
            return True
        return False

    t_decode = time.perf_counter()
    for i in range(b):
        done[i] = finish(i)
        finish_time[i] = time.perf_counter() - t_decode
    bar.update(b)
    pending = None
    while True:
        if not all(done):
            if any(done):  # requests the host stopped (e.g. on a stop string) stop on the device too
                bs = dataclasses.replace(bs, active=bs.active & jnp.asarray([not d for d in done]))
            bs, res = engine.round(bs, **flags)
        else:
            res = None
        if pending is not None:
            toks, n_new, acc, conf = jax.device_get((pending.tokens, pending.n_new, pending.accepted,
                                                     pending.confidence))
            now = time.perf_counter() - t_decode
            for i in range(b):
                if done[i] or n_new[i] == 0:
                    continue
                out[i].extend(int(t) for t in toks[i, :n_new[i]])
                accepts[i].append(int(acc[i]))
                if gamma and drafter is None:
                    confs[i].append(conf[i])
                bar.update(int(n_new[i]))
                if finish(i):
                    done[i], finish_time[i] = True, now
        if res is None:
            break
        pending = res
    bar.close()

    results = []
    for i in range(b):
        stats = _histogram_stats(accepts[i], gamma)
        stats.update(_confidence_stats(confs[i], model.sts_temperatures))
        stats.update(new_tokens=len(out[i]), prompt_tokens=int(len(ids[i])), prefill_s=t_prefill,
                     decode_s=finish_time[i], gamma=gamma,
                     tokens_per_s=len(out[i]) / finish_time[i] if finish_time[i] > 0 else float("nan"))
        text = model.tokenizer.decode(out[i]) if model.tokenizer is not None else None
        results.append(Result(tokens=out[i], text=text, finish_reason=reason[i], stats=stats))
    return results
