"""The decoding engine: chunked prefill, the jitted speculative round, and a thin host loop.

One round (DESIGN 3), a single jitted function with the batch state donated:
  1 draft   ids [anchor, noise x (γ-1)] through the DSpark stages, Markov loop -> d_1..d_γ, q, confidence
  2 verify  target forward on [anchor, d_1..d_γ] at positions L..L+γ (rows written tentatively),
            capturing the hc-means the drafter reads
  3 accept  greedy prefix match or chain rejection sampling -> a accepted drafts and a bonus token
  4 commit  L += a + 1; draft rings get the context keys of the a + 1 committed rows; anchor = bonus
Target-only decoding is the same round with γ = 0 (verify = [anchor]). The host dispatches rounds
and reads each round's tokens one round later, so it never waits for the device in between;
requests stop on the device (stop token ids, max_new_tokens), so a late read costs no capacity.

Ragged verify (schedulers "confidence" / "lagged", or verify lengths from the host): slot r
verifies its first l_r tokens [anchor, d_1 .. d_{l_r - 1}], 0 <= l_r <= γ + 1, the tokens of all
slots front-packed on one axis of a power-of-2 bucket (``verify_bucket``; ``model.common.Packing``):
token-wise layers (projections, MoE, mHC, norms, lm_head) run on the packed tokens, attention
through ``cu_q_lens``, the caches' writes per request (``Chunk.unpack``); acceptance is capped at
l_r - 1. Such a round is two programs, the draft (compiled once per pool) and the verify /
accept / commit of one bucket; the top bucket (slots x (γ + 1) rows) verifies in the
per-request layout, where packing would only add gathers. The static round (every slot verifies
γ + 1) stays one program in the per-request layout: one program, no gathers (CPU, 16 slots: 20-25 %
faster than the packed top bucket; benchmarks/serving.py --schedulers prints both).

The batch is a pool of slots (``init_slots``): ``admit`` gives free slots to new requests (length
back to 0), ``prefill_step`` feeds one chunk of their prompts and draws their first tokens,
computing those slots' rows only, and rounds run over the whole pool, slots without a running
request committing nothing; the host loop that streams requests through the pool is
``serving.serve``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from dspark_jax.api import check_int
from dspark_jax.cache import TargetCache, commit, init_cache
from dspark_jax.compile_cache import COMPILER_OPTIONS
from dspark_jax.decoding.sampling import (STREAM_ACCEPT, STREAM_BONUS, STREAM_DRAFT, SamplingArrays, SamplingParams,
                                          accept_greedy, accept_sampled, pick_tokens, process_logits, request_keys)
from dspark_jax.decoding.scheduler import SPSTable, allocate_topk, bucket_early_stopping, survival
from dspark_jax.model.common import Packing
from dspark_jax.model.dspark import DraftCache, DraftOutput, draft_block, init_draft_cache, write_context
from dspark_jax.sharding import model_mesh, state_shardings

PREFILL_CHUNK = 2048  # the longest prefill chunk of one row
PREFILL_TOKENS = 2048  # rows x chunk width of one prefill program (its activations and temporaries)
MIN_PREFILL_CHUNK = 16  # prefill chunks are powers of 2 from here up to ``Engine.chunk_limit``
STOP_WIDTH = 8  # stop token ids a slot checks on the device (more are checked by the host only)
STREAM_PROFILE = 4  # random stream of the benchmark-only acceptance profile (see Engine)
STREAM_PROFILE_CONFIDENCE = 5  # its calibrated confidences (see ``calibrated_confidence``)
MIN_VERIFY_BUCKET = 8  # packed verify widths are powers of 2 from here (see ``verify_bucket``)
SCHEDULERS = ("static", "confidence", "lagged")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BatchState:
    cache: TargetCache
    draft: DraftCache | None
    anchor: Int[Array, " b"]  # last emitted token, not yet in the caches
    active: Bool[Array, " b"]
    n_generated: Int[Array, " b"]
    max_new: Int[Array, " b"]
    stop_ids: Int[Array, "b s"]  # -1 padded
    sampling: SamplingArrays


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundOutput:
    tokens: Int[Array, "b g1"]  # emitted tokens, -1 beyond n_new
    n_new: Int[Array, " b"]  # a + 1 for active requests, else 0
    accepted: Int[Array, " b"]  # a: drafts accepted
    confidence: Float[Array, "b g"]  # raw confidence logits of the drafts (empty when γ = 0)
    verify_lens: Int[Array, " b"]  # tokens verified (anchor + drafts), 0 for slots without a running request
    host: Int[Array, "b w"]  # all of the above in one array (``pack_round``): the serving loop's one read


def pack_round(tokens, n_new, accepted, confidence, verify_lens) -> Int[Array, "b w"]:
    """[b, 2γ + 4] int32: tokens (γ + 1), n_new, accepted, verify_lens, then the confidences'
    float32 bits (γ). Reading a round's outputs is then one device-to-host copy instead of five
    (each costs about 80 us of host time on an H200: docs/benchmarks.md)."""
    bits = jax.lax.bitcast_convert_type(confidence.astype(jnp.float32), jnp.int32)
    return jnp.concatenate([tokens, n_new[:, None], accepted[:, None], verify_lens[:, None], bits], axis=1)


def unpack_round(host: np.ndarray, gamma: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``pack_round``'s array, read on the host, back into (tokens, n_new, accepted, confidence, verify_lens)."""
    host = np.asarray(host)
    g1 = gamma + 1
    if host.ndim != 2 or host.shape[1] != 2 * gamma + 4:
        raise ValueError(f"a packed round for gamma = {gamma} has {2 * gamma + 4} columns, got shape {host.shape}")
    return (host[:, :g1], host[:, g1], host[:, g1 + 1], np.ascontiguousarray(host[:, g1 + 3:]).view(np.float32),
            host[:, g1 + 2])


# A drafter maps (model, draft cache, anchor [b], lengths [b], pick) to a DraftOutput.
Drafter = Callable[..., DraftOutput]


def _stopped(tokens: Int[Array, "b n"], valid: Bool[Array, "b n"], stop_ids: Int[Array, "b s"]) -> Bool[Array, " b"]:
    hit = (tokens[:, :, None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0) & valid[:, :, None]
    return jnp.any(hit, axis=(1, 2))


def profile_conditionals(profile, gamma: int) -> tuple[float, ...]:
    """Conditional pass probabilities p_i / p_{i-1} (p_0 = 1) of the first γ positions of a marginal
    acceptance profile (missing positions: 0)."""
    p = [float(x) for x in profile]
    if gamma < 1:
        raise ValueError("accept_profile needs speculative decoding (gamma > 0)")
    if any(not 0.0 <= x <= 1.0 for x in p) or any(b > a for a, b in zip(p, p[1:])):
        raise ValueError(f"accept_profile must be non-increasing probabilities in [0, 1], got {profile}")
    p = (p + [0.0] * gamma)[:gamma]
    prev = [1.0] + p[:-1]
    return tuple(x / q if q > 0 else 0.0 for x, q in zip(p, prev))


def logit_normal_means(cond: tuple[float, ...], spread: float) -> tuple[float, ...]:
    """μ_k such that E[sigmoid(μ_k + spread · Z)] = r_k = cond[k], Z ~ N(0, 1) (Gauss-Hermite
    quadrature of 96 nodes and bisection, both to ~1e-12; r_k = 0 or 1: μ_k = -inf or +inf)."""
    x, w = np.polynomial.hermite.hermgauss(96)
    z, w = np.sqrt(2.0) * x, w / np.sqrt(np.pi)
    mean = lambda mu: float(np.sum(w / (1.0 + np.exp(-(mu + spread * z)))))  # noqa: E731
    out = []
    for r in cond:
        if r <= 0.0 or r >= 1.0:
            out.append(-np.inf if r <= 0.0 else np.inf)
            continue
        lo, hi = -60.0, 60.0
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if mean(mid) < r else (lo, mid)
        out.append(0.5 * (lo + hi))
    return tuple(out)


def calibrated_confidence(seed: Int[Array, " b"], lengths: Int[Array, " b"], cond: tuple[float, ...],
                          spread: float) -> Float[Array, "b g"]:
    """BENCHMARK ONLY: confidence logits that are calibrated for an acceptance profile.

    Draft k of a round at committed length L (position L + k) gets the logit μ_k + spread · z,
    z ~ N(0, 1) from key(seed, L + k, STREAM_PROFILE_CONFIDENCE) folded with L (a later round
    drafting the same position draws anew: the schedulers' choices of a round must not be
    reused), with μ_k chosen so that its confidence c_k = sigmoid(logit) has mean r_k = cond[k - 1],
    the profile's conditional pass probability (``logit_normal_means``; r_k of 0 or 1: c_k = r_k).
    ``spread`` = 0: every c_k = r_k; larger: confidences nearer 0 or 1, that tell the scheduler
    more. ``profile_accepts`` with pass probabilities sigmoid(logits) accepts d_k (given d_1 ..
    d_{k-1}) with probability exactly its confidence."""
    means = logit_normal_means(cond, spread)
    z = jnp.stack([jax.vmap(jax.random.normal)(request_keys(seed, lengths + k + 1, STREAM_PROFILE_CONFIDENCE,
                                                            round_start=lengths)) for k in range(len(cond))], axis=1)
    return jnp.asarray(means, jnp.float32)[None] + jnp.float32(spread) * z


def profile_accepts(seed: Int[Array, " b"], lengths: Int[Array, " b"], pass_prob: Float[Array, "b g"],
                    limit: Int[Array, " b"] | None = None) -> Int[Array, " b"]:
    """BENCHMARK ONLY: accepted drafts of a round at committed length L when draft k passes, given
    that the drafts before it passed, with probability pass_prob[:, k - 1]: it passes iff u_k <
    pass_prob, u_k = uniform(key(seed, L + k, STREAM_PROFILE)); a = the passes before the first
    failure, at most ``limit``. A round's count depends only on the u of positions up to its first
    failure (or its cap), all of which the next round, starting past them, never reads again."""
    u = jnp.stack([jax.vmap(jax.random.uniform)(request_keys(seed, lengths + k + 1, STREAM_PROFILE))
                   for k in range(pass_prob.shape[1])], axis=1)  # [b, γ]
    a = jnp.sum(jnp.cumprod((u < pass_prob).astype(jnp.int32), axis=1), axis=1)
    return a if limit is None else jnp.minimum(a, jnp.maximum(limit, 0))


class Engine:
    """Compiled prefill / round functions for one model, γ and drafter.

    gamma: draft tokens per round (0 = target-only decoding). drafter: None = the model's DSpark
    drafter; tests pass an oracle with the same signature as ``draft_block``. kv_layout: "bf16" or
    "fp8" target KV pools (the drafter's context rings stay in the compute dtype).

    accept_profile: BENCHMARK ONLY, NOT LOSSLESS. None (the default) = real acceptance. A tuple
    (p_1, p_2, ...) of per-position marginal acceptance probabilities (p_i = probability that draft
    i is accepted; non-increasing, in [0, 1]; positions beyond the tuple have probability 0, those
    beyond γ are ignored) keeps the round's work (draft, verify forward, target logits, argmax or
    draw of the bonus) but replaces the number of accepted drafts a of each request by a draw from
    the profile (the real acceptance test, a few comparisons per request, is then unused):
    draft i passes with the conditional probability p_i / p_{i-1}, decided by a uniform from
    (seed, position, STREAM_PROFILE), so runs are deterministic. The bonus token is the target's
    token after those a drafts (argmax, or a draw for sampled requests). The emitted tokens are then
    NOT the target's: this exists only to time decoding at a given accept length (E[a] = sum p_i).

    profile_confidence: BENCHMARK ONLY, with ``accept_profile``. None (the default): the drafter's
    confidences are kept (they say nothing about the profile's draws). A spread σ >= 0: the
    drafter's confidences are replaced by calibrated ones, logit-normal with standard deviation σ
    and mean confidence r_k = p_k / p_{k-1} at draft k (``calibrated_confidence``), which the
    schedulers read, and draft k passes with probability c_k instead of r_k (``profile_accepts``):
    acceptance given the confidence is the confidence, and the pass rates are still the profile's.
    STS temperatures are then not applied (the confidences are calibrated already).

    scheduler: how many tokens each slot verifies per round by default (``serving.serve`` and
    ``generate`` take it per call too): "static" (γ + 1 each, the per-request layout),
    "confidence" (bucket-aware early stopping on the round's own confidences, the paper's
    Algorithm 1 where each token count is its own bucket: ``round_confidence``) or "lagged"
    (capacity from confidences two rounds old, allocated by the current ones: ``round_lagged``),
    with the rounds-per-second table ``sps_table`` (``scheduler.SPSTable``; None or uninitialised:
    every slot verifies everything, as "static"). Survivals use the model's STS temperatures.
    adapt_sps: serving corrects the table's ragged rates by the round times it measures
    (``scheduler.RoundTimes``; False: choices from the table alone, the same on every run).
    A scheduler's ragged rounds run in the token buckets of its table (``table_bucket``).
    fine_buckets: the buckets of ragged rounds given no table (``round``'s ``verify_lens``, hence
    the buckets ``serving.profile_sps`` times by default): 0 powers of 2, k > 0 multiples of
    slots / k above the slots (``verify_bucket``).
    compiler_options: XLA options of the engine's programs (default
    ``compile_cache.COMPILER_OPTIONS``: on GPUs, kernels that share no buffer run concurrently;
    ``{}``: XLA's defaults and the ``XLA_FLAGS`` environment).
    rounds_per_call: static rounds (every slot verifies γ + 1 tokens) handed to the device per
    call of the serving loop (``rounds``: one program looping over the round on the device,
    outputs stacked). The host's cost of a call (every parameter array, per device) is paid once
    per ``rounds_per_call`` rounds; a request that finishes inside a call leaves its slot idle for
    the call's remaining rounds (they run and emit nothing for it; a slot freed inside a call takes
    its next request at the next call). 1 (the default here; ``generate`` takes
    ``generate.ROUNDS_PER_CALL``): one round per call. Ragged rounds (the
    "confidence" and "lagged" schedulers) stay one per call.
    """

    def __init__(self, model, *, gamma: int, drafter: Drafter | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 prefill_tokens: int = PREFILL_TOKENS, kv_layout: str = "bf16",
                 accept_profile: tuple[float, ...] | None = None, scheduler: str = "static",
                 sps_table: SPSTable | None = None, profile_confidence: float | None = None, adapt_sps: bool = True,
                 fine_buckets: int = 0, compiler_options: dict | None = None, rounds_per_call: int = 1):
        cfg = model.config
        self.rounds_per_call = check_int("rounds_per_call", rounds_per_call, lo=1)
        check_scheduler(scheduler, gamma)
        if profile_confidence is not None and (accept_profile is None or not np.isfinite(profile_confidence)
                                               or profile_confidence < 0):
            raise ValueError("profile_confidence (a logit spread >= 0) needs an accept_profile, got "
                             f"{profile_confidence!r} with accept_profile {accept_profile!r}")
        self.profile_confidence = None if profile_confidence is None else float(profile_confidence)
        self.scheduler, self.sps_table = scheduler, sps_table
        self.adapt_sps = adapt_sps  # serving corrects the table by measured round times (serving.RoundDispatcher)
        if not (isinstance(fine_buckets, (bool, int, np.integer)) and fine_buckets >= 0):
            raise ValueError(f"fine_buckets must be an integer >= 0 (0: power-of-2 buckets), got {fine_buckets!r}")
        self.fine_buckets = int(fine_buckets)  # ragged verify buckets at multiples of slots / k (``verify_bucket``)
        self.last_bucket: int | None = None  # verify bucket of the last ragged round (host)
        self.round_times: dict = {}  # scheduler.RoundTimes per pool, scheduler and table, across serve calls
        # STS temperatures of the model's drafter (none for an oracle or calibrated profile confidences)
        self.temperatures = model.sts_temperatures if drafter is None and profile_confidence is None else None
        if gamma > 0 and drafter is None and cfg.dspark is None:
            raise ValueError("this model has no DSpark drafter (no mtp.* stages): use speculative=False")
        if gamma < 0 or (gamma > 0 and drafter is None and gamma != cfg.dspark.block_size):
            raise ValueError(f"gamma must be the drafter's block size {cfg.dspark.block_size if cfg.dspark else 0}, "
                             f"got {gamma}")
        self.model, self.gamma = model, gamma
        self.accept_profile = None if accept_profile is None else tuple(float(x) for x in accept_profile)
        self._profile_cond = None if accept_profile is None else profile_conditionals(accept_profile, gamma)
        self.drafter = drafter or draft_block
        self.prefill_chunk, self.prefill_tokens, self.kv_layout = prefill_chunk, prefill_tokens, kv_layout
        self.uses_rings = cfg.dspark is not None and gamma > 0
        self.capture = tuple(cfg.dspark.target_layer_ids) if self.uses_rings else ()
        self.mesh = model_mesh(model)
        # The parameters as a flat list of arrays, the first argument of every program: a list
        # flattens in C++ at each call, an nnx.State in Python (the shipped model's 293 arrays:
        # 0.33 ms per call against 0.06 ms on the CPU; Flash has 1,937).
        self.params, self._params_def = jax.tree_util.tree_flatten(model.state)
        scoped = model.numerics.scoped  # float32 matmuls as the model's Numerics say
        if compiler_options is not None and not isinstance(compiler_options, dict):
            raise ValueError(f"compiler_options must be a dict of XLA options, got {compiler_options!r}")
        self.compiler_options = dict(COMPILER_OPTIONS if compiler_options is None else compiler_options)
        jit = functools.partial(jax.jit, compiler_options=self.compiler_options or None)
        self._prefill = jit(scoped(self._prefill_impl), donate_argnums=(1,))
        self._first = jit(scoped(self._first_impl), donate_argnums=(1,))
        self._prefill_rows = jit(scoped(self._prefill_rows_impl), donate_argnums=(1,))
        self._admit = jit(self._admit_impl, donate_argnums=(0,))
        self._shapes: set[tuple] = set()  # (program, slots, width or flags) of every call made
        self._empty: dict[tuple, Callable] = {}  # (rows, max_len, active, stop width) -> program building a state
        self._round = jit(scoped(self._round_impl), donate_argnums=(1,), static_argnames=("sampled", "top_k", "top_p"))
        self._rounds = jit(scoped(self._rounds_impl), donate_argnums=(1,),
                           static_argnames=("count", "sampled", "top_k", "top_p"))
        self._draft_step = jit(scoped(self._draft_impl), static_argnames=("top_k", "top_p", "schedule"))
        self._verify_step = jit(scoped(self._verify_impl), donate_argnums=(1,),
                                static_argnames=("sampled", "top_k", "top_p", "tokens"))

    # ------------------------------------------------------------------ device functions
    def _module(self, params: list[Array]):
        """The model's module with the parameters ``params`` (``self.params`` or their tracers)."""
        return nnx.merge(self.model.graphdef, jax.tree_util.tree_unflatten(self._params_def, params))

    def _prefill_impl(self, params, bs: BatchState, ids, n_valid, last_logits, is_last):
        model = self._module(params)
        start = bs.cache.lengths
        lg, hid, cache = model.forward(ids, n_valid, bs.cache, capture=self.capture, logits="last")
        draft = bs.draft
        if self.uses_rings:
            draft = write_context(model.mtp, draft, hid, start, n_valid)
        bs = dataclasses.replace(bs, cache=commit(cache, n_valid), draft=draft)
        return self._placed(bs), jnp.where(is_last[:, None], lg, last_logits)

    def _first_impl(self, params, bs: BatchState, last_logits, starting):
        """The first generated token, drawn from the prompt's last logits, for the slots whose
        prompt is complete (``starting``); the other slots keep their state."""
        sp = bs.sampling
        keys = request_keys(sp.seed, bs.cache.lengths, STREAM_BONUS)
        tok = pick_tokens(keys, process_logits(last_logits, sp), sp.greedy)
        n = jnp.ones_like(bs.n_generated)
        active = (n < bs.max_new) & ~_stopped(tok[:, None], jnp.ones_like(tok[:, None], bool), bs.stop_ids)
        return self._placed(dataclasses.replace(bs, anchor=jnp.where(starting, tok, bs.anchor),
                                                n_generated=jnp.where(starting, n, bs.n_generated),
                                                active=jnp.where(starting, active, bs.active))), tok

    def _prefill_rows_impl(self, params, bs: BatchState, rows, ids, n_valid, is_last):
        """One prefill chunk of the slots ``rows`` [p] (distinct) and the first token of those
        whose prompt it completes (``is_last``): their rows of every state leaf (all lead with the
        slot) are gathered into a batch of p, prefilled as a batch of p and put back; the pool's
        other slots are neither read nor computed. The gathered rows are a temporary copy of
        those slots' caches, so ``serving.serve`` gathers at most an eighth of the pool and
        prefills more readers on the whole pool (rows = every slot in order: in place, no copy).
        A row with ``n_valid`` 0 comes back unchanged."""
        whole = rows.shape[0] == bs.anchor.shape[0]  # every slot, in slot order: in place, nothing gathered
        sub = bs if whole else jax.tree_util.tree_map(lambda x: x[rows], bs)
        last = jnp.zeros((rows.shape[0], self.model.config.vocab_size), jnp.float32)
        sub, last = self._prefill_impl(params, sub, ids, n_valid, last, is_last)
        sub, first = self._first_impl(params, sub, last, is_last)
        if whole:
            return sub, first
        return self._placed(jax.tree_util.tree_map(lambda x, y: x.at[rows].set(y), bs, sub)), first

    def _admit_impl(self, bs: BatchState, admit, release, max_new, stop_ids, sampling: SamplingArrays):
        """Slots taking a new request (``admit``) restart at length 0, inactive until their first
        token, with the request's limits and sampling parameters; slots whose request the host
        finished (``release``) stop. Nothing is cleared: the caches rewind by length."""
        def pick(new, old):
            return jnp.where(admit.reshape(admit.shape + (1,) * (old.ndim - 1)), new, old)

        cache = dataclasses.replace(bs.cache, lengths=jnp.where(admit, 0, bs.cache.lengths))
        return self._placed(dataclasses.replace(
            bs, cache=cache, anchor=jnp.where(admit, 0, bs.anchor), active=bs.active & ~admit & ~release,
            n_generated=jnp.where(admit, 0, bs.n_generated), max_new=pick(max_new, bs.max_new),
            stop_ids=pick(stop_ids, bs.stop_ids), sampling=jax.tree_util.tree_map(pick, sampling, bs.sampling)))

    def _round_impl(self, params, bs: BatchState, *, sampled: bool, top_k: bool, top_p: bool):
        """One round in which every slot verifies γ + 1 tokens (per-request layout [slots, γ + 1]);
        its phases are named scopes ("draft", "verify", "accept_commit") so that a device profile
        can attribute every kernel (benchmarks/profile_step.py)."""
        model = self._module(params)
        proc = functools.partial(process_logits, sp=bs.sampling, use_top_k=top_k, use_top_p=top_p)
        with jax.named_scope("draft"):
            drafts, q_logits, conf = self._draft_tokens(model, bs, proc, sampled)
        with jax.named_scope("verify"):
            logits, hid, cache, _ = self._verify(model, bs, drafts, None, None)
        with jax.named_scope("accept_commit"):
            return self._accept_commit(model, bs, drafts, q_logits, conf, logits, hid, cache, proc, sampled)

    def _rounds_impl(self, params, bs: BatchState, *, count: int, sampled: bool, top_k: bool, top_p: bool):
        """``count`` rounds of ``_round_impl`` in one program: a loop of a known trip count on the
        device (``lax.scan``: the round compiled once), each round starting from the state the one
        before committed; outputs stacked [count, ...]. The loop never stops early: a stopping test
        would be a device value the host reads at every round (XLA's GPU runtime copies a while
        loop's predicate to the host each iteration unless its trip count is known), which would
        make the call wait for the device. Rounds after every slot has finished emit nothing."""
        def one(state, _):
            return self._round_impl(params, state, sampled=sampled, top_k=top_k, top_p=top_p)

        return jax.lax.scan(one, bs, None, length=count)

    def _draft_impl(self, params, bs: BatchState, sps_tokens, sps_steps, *, top_k: bool, top_p: bool,
                    schedule: bool):
        """The first program of a ragged round: the draft phase, and with ``schedule`` the verify
        lengths of bucket-aware early stopping on its confidences, by the SPS table given as
        arrays (``sps_tokens``, ``sps_steps``: one program for every table of that length)."""
        model = self._module(params)
        proc = functools.partial(process_logits, sp=bs.sampling, use_top_k=top_k, use_top_p=top_p)
        with jax.named_scope("draft"):
            drafted = self._draft_tokens(model, bs, proc)
        if not schedule:
            return drafted, None
        return drafted, bucket_early_stopping(survival(drafted[2], self.temperatures), bs.active, sps_tokens,
                                              sps_steps)

    def _verify_impl(self, params, bs: BatchState, drafted, verify_lens, capacity, *, sampled: bool, top_k: bool,
                     top_p: bool, tokens: int):
        """The second program of a ragged round: verify packed on ``tokens`` rows (in the top
        bucket, every slot's γ + 1 tokens in the per-request layout: as many rows, no packing),
        acceptance and commit. Slot r verifies its first l_r tokens (anchor and drafts; 0 = none: the slot
        commits nothing this round; slots without a running request verify nothing): l_r =
        ``verify_lens[r]``, or for ``capacity`` >= 0 (lagged) 1 + the slot's drafts among the
        capacity's best by this round's survivals (``scheduler.allocate_topk``)."""
        model = self._module(params)
        proc = functools.partial(process_logits, sp=bs.sampling, use_top_k=top_k, use_top_p=top_p)
        drafts, q_logits, conf = drafted
        if self.gamma > 0:
            top = allocate_topk(survival(conf, self.temperatures), bs.active, jnp.maximum(capacity, 0))
            verify_lens = jnp.where(capacity >= 0, top, verify_lens)
        lens = jnp.where(bs.active, verify_lens, 0).astype(jnp.int32)
        top = tokens == lens.shape[0] * (self.gamma + 1)  # the top bucket: the static round's layout
        with jax.named_scope("verify"):
            logits, hid, cache, packing = self._verify(model, bs, drafts, None if top else lens, tokens)
        with jax.named_scope("accept_commit"):
            return self._accept_commit(model, bs, drafts, q_logits, conf, logits, hid, cache, proc, sampled,
                                       lens, packing)

    def _draft_tokens(self, model, bs: BatchState, proc, sampled: bool = True):
        """d_1..d_γ [b, γ], the logits they were drawn from [b, γ, v] and their confidences [b, γ]
        (sampled False: every request is greedy, the drafts are argmaxes and no draws are made)."""
        sp, g, lengths = bs.sampling, self.gamma, bs.cache.lengths
        b = lengths.shape[0]
        if g == 0:
            return (jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, model.cfg.vocab_size), jnp.float32),
                    jnp.zeros((b, 0), jnp.float32))

        def pick(logits_k, k):  # d_{k+1} sits at position L + k + 1, drawn by this round (sampling.py)
            if not sampled:
                return jnp.argmax(proc(logits_k), axis=-1).astype(jnp.int32)
            keys = request_keys(sp.seed, lengths + k + 1, STREAM_DRAFT, round_start=lengths)
            return pick_tokens(keys, proc(logits_k), sp.greedy)

        d = self.drafter(model, bs.draft, bs.anchor, lengths, pick)
        if self.profile_confidence is not None:  # benchmark only: calibrated for the acceptance profile
            return d.tokens, d.logits, calibrated_confidence(sp.seed, lengths, self._profile_cond,
                                                             self.profile_confidence)
        return d.tokens, d.logits, d.confidence

    def _verify(self, model, bs: BatchState, drafts, lens, tokens: int | None):
        """Target forward on [anchor, d_1..d_γ] at positions L..L+γ: all of them per request
        (``lens`` None), or the first lens[r] of slot r packed on ``tokens`` rows. Returns logits
        [b, γ + 1, v] (rows not verified: 0), captured hidden (in the layout of the forward), the
        cache with the rows written tentatively, and the packing (None: per request)."""
        ids = jnp.concatenate([bs.anchor[:, None], drafts], axis=1)
        b, width = ids.shape
        if lens is None:
            logits, hid, cache = model.forward(ids, jnp.full((b,), width, jnp.int32), bs.cache, capture=self.capture)
            return logits, hid, cache, None
        packing = Packing.from_lens(lens, width=width, tokens=tokens)
        logits, hid, cache = model.forward(packing.pack(ids), lens, bs.cache, capture=self.capture, packing=packing)
        return packing.unpack(logits), hid, cache, packing

    def _accept_commit(self, model, bs: BatchState, drafts, q_logits, conf, logits, hid, cache, proc, sampled: bool,
                       lens=None, packing: Packing | None = None):
        """Acceptance (greedy or chain rejection sampling) of at most lens - 1 drafts (``lens``
        None: all γ), the emitted tokens, and the commit (slots verifying nothing commit nothing)."""
        sp, g = bs.sampling, self.gamma
        lengths, was_active = bs.cache.lengths, bs.active
        b = lengths.shape[0]
        limit = None if lens is None else lens - 1  # drafts verified
        a, bonus = accept_greedy(drafts, logits, limit)
        if sampled:
            u = jnp.stack([jax.vmap(jax.random.uniform)(request_keys(sp.seed, lengths + k + 1, STREAM_ACCEPT))
                           for k in range(g)] + [jnp.zeros((b,))], axis=1)[:, :g]
            a_s, resid = accept_sampled(drafts, proc(q_logits), proc(logits), u, limit)
            keys = request_keys(sp.seed, lengths + a_s + 1, STREAM_BONUS)  # the bonus sits at L + a + 1
            bonus_s = jax.vmap(jax.random.categorical)(keys, resid).astype(jnp.int32)
            a, bonus = jnp.where(sp.greedy, a, a_s), jnp.where(sp.greedy, bonus, bonus_s)

        if self.accept_profile is not None:  # benchmark only: a from the profile, not from the drafts
            a, bonus = self._profile_accept(sp, lengths, logits, conf, proc, sampled, limit)

        commits = was_active if lens is None else was_active & (lens > 0)
        n_new = jnp.where(commits, a + 1, 0)
        col = jnp.arange(g + 1)[None]
        tokens = jnp.where(col < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
        tokens = jnp.where(col < n_new[:, None], tokens, -1)
        draft = bs.draft
        if self.uses_rings:
            draft = write_context(model.mtp, draft, hid, lengths, n_new, packing)
        n_gen = bs.n_generated + n_new
        active = was_active & (n_gen < bs.max_new) & ~_stopped(tokens, col < n_new[:, None], bs.stop_ids)
        bs = dataclasses.replace(bs, cache=commit(cache, n_new), draft=draft, n_generated=n_gen, active=active,
                                 anchor=jnp.where(commits, bonus, bs.anchor))
        verified = jnp.where(was_active, g + 1, 0) if lens is None else lens
        accepted, verified = jnp.where(commits, a, 0), verified.astype(jnp.int32)
        return self._placed(bs), RoundOutput(tokens=tokens, n_new=n_new, accepted=accepted, confidence=conf,
                                             verify_lens=verified,
                                             host=pack_round(tokens, n_new, accepted, conf, verified))

    def _profile_accept(self, sp: SamplingArrays, lengths, logits, conf, proc, sampled: bool, limit=None):
        """Accepted drafts drawn from ``accept_profile`` (benchmark only; at most ``limit``): with
        the profile's conditional pass probabilities, or with ``profile_confidence`` the calibrated
        confidences ``conf``; and the bonus token after them."""
        if self.profile_confidence is not None:
            pass_prob = jax.nn.sigmoid(conf)  # the value the schedulers' survivals read (no STS)
        else:
            pass_prob = jnp.broadcast_to(jnp.asarray(self._profile_cond, jnp.float32)[None], conf.shape)
        a = profile_accepts(sp.seed, lengths, pass_prob, limit)
        row = jnp.take_along_axis(logits, a[:, None, None], axis=1)[:, 0]  # target logits after a drafts
        bonus = jnp.argmax(row, axis=-1).astype(jnp.int32)
        if sampled:
            keys = request_keys(sp.seed, lengths + a + 1, STREAM_BONUS)
            bonus_s = jax.vmap(jax.random.categorical)(keys, proc(row)).astype(jnp.int32)
            bonus = jnp.where(sp.greedy, bonus, bonus_s)
        return a, bonus

    def _placed(self, bs: BatchState) -> BatchState:
        """The state a program returns, constrained to the layout it is given in
        (``sharding.state_shardings``) on a mesh: every program's output state has its input's
        shardings, so the donated input buffers are reused and the next call compiles nothing new."""
        return bs if self.mesh is None else jax.lax.with_sharding_constraint(bs, state_shardings(bs, self.mesh))

    # ------------------------------------------------------------------ host side
    @staticmethod
    def _sampling_arrays(params: list[SamplingParams], seeds: list[int]) -> SamplingArrays:
        return SamplingArrays(temperature=np.asarray([p.temperature for p in params], np.float32),
                              top_k=np.asarray([p.top_k for p in params], np.int32),
                              top_p=np.asarray([p.top_p for p in params], np.float32),
                              seed=np.asarray(seeds, np.uint32).astype(np.int32))

    @staticmethod
    def _stop_array(params: list[SamplingParams], width: int) -> np.ndarray:
        """Stop token ids per request, -1 padded to ``width`` (ids past it are left to the host)."""
        stop = np.full((len(params), width), -1, np.int32)
        for i, p in enumerate(params):
            ids = [s for s in p.stop if isinstance(s, int)][:width]
            stop[i, :len(ids)] = ids
        return stop

    def _empty_state(self, b: int, max_len: int, stop: np.ndarray, max_new, sampling: SamplingArrays,
                     active: bool) -> BatchState:
        """A state of ``b`` rows with empty caches, built by one program straight into its layout
        (``_layout``): made one operation at a time, a pool's ~100 cache arrays were each
        dispatched from the host (about 20 ms per ``generate`` call by an H200 profile of the
        shipped model), and on a mesh made whole on one device before being resharded. At Flash
        dimensions the program has no temporaries and each device writes only its shard
        (docs/benchmarks.md)."""
        cfg, dtype = self.model.config, self.model.numerics.dtype
        args = (np.asarray(stop, np.int32), np.asarray(max_new, np.int32), sampling)

        def build(stop_ids, max_new_, sampling_) -> BatchState:
            return BatchState(cache=init_cache(cfg, b, max_len, dtype, kv_layout=self.kv_layout),
                              draft=init_draft_cache(cfg, b, dtype) if self.uses_rings else None,
                              anchor=jnp.zeros((b,), jnp.int32), active=jnp.full((b,), active),
                              n_generated=jnp.zeros((b,), jnp.int32), max_new=max_new_, stop_ids=stop_ids,
                              sampling=sampling_)

        key = (b, max_len, active, args[0].shape[1])
        if key not in self._empty:
            self._empty[key] = jax.jit(build, out_shardings=self._layout(jax.eval_shape(build, *args)))
        return self._empty[key](*args)

    def _layout(self, tree):
        """Where the engine keeps a state (arrays or shapes): the model's mesh by
        ``sharding.state_shardings``, else the device of the model's parameters."""
        if self.mesh is not None:
            return state_shardings(tree, self.mesh)
        leaf = jax.tree_util.tree_leaves(self.model.state)[0]
        device = next(iter(leaf.devices())) if isinstance(leaf, jax.Array) else jax.devices()[0]
        return jax.tree_util.tree_map(lambda _: jax.sharding.SingleDeviceSharding(device), tree)

    def place(self, bs: BatchState) -> BatchState:
        """``bs`` committed to the model's device (off a mesh) or laid out on its mesh
        (``_layout``). Every state the engine builds is, and so must be a state built by hand
        (benchmarks): a program's outputs are committed when any input is (loaded weights are),
        and jax compiles a program apart for uncommitted inputs, so an uncommitted first state
        would compile each program twice (its first call, then the calls on outputs)."""
        return jax.device_put(bs, self._layout(bs))

    def init_state(self, prompts: list[np.ndarray], params: list[SamplingParams], seeds: list[int],
                   max_len: int) -> BatchState:
        """A batch of these requests, one per row (a static batch: see ``prefill``)."""
        width = max(1, max(len([s for s in p.stop if isinstance(s, int)]) for p in params))
        return self._empty_state(len(prompts), max_len, self._stop_array(params, width),
                                 [p.max_new_tokens for p in params], self._sampling_arrays(params, seeds), True)

    def init_slots(self, slots: int, max_len: int) -> BatchState:
        """A pool of ``slots`` free slots of ``max_len`` cache tokens each (see ``admit``)."""
        free = [SamplingParams()] * slots
        return self._empty_state(slots, max_len, self._stop_array(free, STOP_WIDTH), np.ones(slots),
                                 self._sampling_arrays(free, [0] * slots), False)

    def admit(self, bs: BatchState, entering: dict[int, tuple[SamplingParams, int]],
              release: np.ndarray) -> BatchState:
        """Slot s of ``entering`` takes a new request (its SamplingParams and seed): its length goes
        back to 0 and it stays inactive until ``prefill_step`` has drawn its first token. Slots
        set in ``release`` (requests the host finished) stop."""
        s_count = bs.anchor.shape[0]
        admit = np.zeros(s_count, bool)
        params, seeds = [SamplingParams()] * s_count, [0] * s_count
        for s, (p, seed) in entering.items():
            admit[s], params[s], seeds[s] = True, p, seed
        self._shapes.add(("admit", s_count, bs.cache.max_len))
        return self._admit(bs, admit, np.asarray(release, bool),
                           np.asarray([p.max_new_tokens for p in params], np.int32),
                           self._stop_array(params, bs.stop_ids.shape[1]),
                           self._sampling_arrays(params, seeds))

    def prefill_step(self, bs: BatchState, rows: np.ndarray, ids: np.ndarray, n_valid: np.ndarray,
                     is_last: np.ndarray) -> tuple[BatchState, Array]:
        """One prefill chunk ``ids`` [p, c] for the slots ``rows`` [p] (distinct; ``n_valid`` real
        tokens each, 0 for a row that only pads the call to a size of ``prefill_rows``), then the
        first generated token of the rows whose prompt it completes (``is_last``). Only these p
        slots are computed: the cost follows the prompts being read, not the pool. Returns the
        state and the tokens [p] (meaningful where ``is_last``), one program per (p, c)."""
        rows = np.asarray(rows)
        p, c = ids.shape
        if rows.shape != (p,) or len(set(rows.tolist())) != p or rows.min() < 0 or rows.max() >= bs.anchor.shape[0]:
            raise ValueError(f"rows must be {p} distinct slots of the pool of {bs.anchor.shape[0]}, got {rows.tolist()}")
        if p == bs.anchor.shape[0] and rows.tolist() != list(range(p)):
            raise ValueError(f"a prefill step of every slot takes them in slot order, got rows {rows.tolist()}")
        self._shapes.add(("prefill", bs.anchor.shape[0], bs.cache.max_len, p, c))
        return self._prefill_rows(self.params, bs, np.asarray(rows, np.int32), np.asarray(ids, np.int32),
                                  np.asarray(n_valid, np.int32), np.asarray(is_last, bool))

    def prefill(self, bs: BatchState, prompts: list[np.ndarray]) -> tuple[BatchState, np.ndarray]:
        """Chunked prefill of every prompt of a static batch, then the first generated token of each request."""
        b = len(prompts)
        lens = np.array([len(p) for p in prompts])
        longest = int(lens.max())
        c = chunk_width(longest, self.chunk_limit(b))
        padded = np.zeros((b, -(-longest // c) * c), np.int32)
        for i, p in enumerate(prompts):
            padded[i, :len(p)] = p
        last = jnp.zeros((b, self.model.config.vocab_size), jnp.float32)
        self._shapes.update({("static_prefill", b, bs.cache.max_len, c), ("static_first", b, bs.cache.max_len)})
        for s in range(0, padded.shape[1], c):
            n_valid = np.clip(lens - s, 0, c).astype(np.int32)
            is_last = (lens > s) & (lens <= s + c)
            bs, last = self._prefill(self.params, bs, padded[:, s:s + c], n_valid, last, is_last)
        bs, first = self._first(self.params, bs, last, jnp.ones((b,), bool))
        return bs, np.asarray(first)

    def chunk_limit(self, rows: int) -> int:
        """The widest prefill chunk for ``rows`` rows: ``prefill_chunk``, narrowed to a power of 2 so
        that rows x width stays within ``prefill_tokens`` (at least MIN_PREFILL_CHUNK). On a 4-layer
        Flash slice (H200) one 2048-token chunk prefills 1.8x faster than 256-token chunks, for
        8.8 GB of temporaries (docs/benchmarks.md); the token budget keeps a pool of many slots from
        multiplying that."""
        fit = max(1, self.prefill_tokens // max(rows, 1))
        return max(MIN_PREFILL_CHUNK, min(self.prefill_chunk, 1 << (fit.bit_length() - 1)))

    def round(self, bs: BatchState, *, sampled: bool, top_k: bool, top_p: bool,
              verify_lens: np.ndarray | None = None, buckets: Sequence[int] | None = None
              ) -> tuple[BatchState, RoundOutput]:
        """One decoding round over the pool. verify_lens None: every slot verifies γ + 1 tokens
        (one program, the per-request layout). verify_lens [slots] in [0, γ + 1]: ragged verify,
        slot r verifying its anchor and first verify_lens[r] - 1 drafts (0: the slot commits
        nothing this round; slots without a running request verify nothing whatever they are
        given), packed on ``verify_bucket(sum)`` rows, or on the smallest of ``buckets`` that holds
        them (an SPS table's token counts: ``table_bucket``; see ``_ragged_round``)."""
        b, max_len = bs.anchor.shape[0], bs.cache.max_len
        flags = dict(sampled=sampled, top_k=top_k, top_p=top_p)
        if verify_lens is None:
            self._shapes.add(("round", b, max_len, sampled, top_k, top_p))
            return self._round(self.params, bs, **flags)
        lens = np.asarray(verify_lens)
        if lens.shape != (b,) or not np.issubdtype(lens.dtype, np.integer):
            raise ValueError(f"verify_lens must be integers of shape ({b},) (one per slot), got {lens.dtype} "
                             f"{lens.shape}")
        if lens.min() < 0 or lens.max() > self.gamma + 1:
            raise ValueError(f"verify_lens must lie in [0, gamma + 1 = {self.gamma + 1}], got {lens.tolist()}")
        drafted, _ = self._draft_program(bs, top_k, top_p, None)
        return self._ragged_round(bs, drafted, np.asarray(lens, np.int32), -1, int(lens.sum()), buckets=buckets,
                                  **flags)

    def rounds(self, bs: BatchState, count: int, *, sampled: bool, top_k: bool, top_p: bool
               ) -> tuple[BatchState, RoundOutput]:
        """``count`` static rounds in one call (one program per count: ``_rounds_impl``): the same
        tokens as ``count`` calls of ``round``, each output stacked on a leading axis [count, ...]."""
        count = check_int("count", count, lo=1)
        b, max_len = bs.anchor.shape[0], bs.cache.max_len
        self._shapes.add(("rounds", b, max_len, sampled, top_k, top_p, count))
        return self._rounds(self.params, bs, count=count, sampled=sampled, top_k=top_k, top_p=top_p)

    def round_lagged(self, bs: BatchState, capacity: int, busy: int, *, sampled: bool, top_k: bool,
                     top_p: bool, buckets: Sequence[int] | None = None) -> tuple[BatchState, RoundOutput]:
        """A ragged round of the lagged scheduler: ``capacity`` drafts in total (decided on the
        host, ``scheduler.lagged_capacity``), given on the device to the best by the round's own
        survivals (``scheduler.allocate_topk``). ``busy`` (slots that may hold a running request)
        + capacity bounds the tokens, so the bucket is known before the round: no host sync.
        ``buckets``: as in ``round`` (the SPS table's token counts)."""
        b = bs.anchor.shape[0]
        if not 0 <= busy <= b or capacity < 0:
            raise ValueError(f"need 0 <= busy <= {b} slots and capacity >= 0, got busy={busy}, capacity={capacity}")
        capacity = min(int(capacity), busy * self.gamma)
        drafted, _ = self._draft_program(bs, top_k, top_p, None)
        return self._ragged_round(bs, drafted, np.zeros((b,), np.int32), capacity, busy + capacity,
                                  sampled=sampled, top_k=top_k, top_p=top_p, buckets=buckets)

    def round_confidence(self, bs: BatchState, table: SPSTable, *, sampled: bool, top_k: bool,
                         top_p: bool) -> tuple[BatchState, RoundOutput]:
        """A ragged round of the confidence scheduler: the draft program also runs bucket-aware
        early stopping on its confidences (``scheduler.confidence_lengths``); the host waits for
        the lengths, the only host sync of any round, to pick the verify bucket of their sum, and
        hands them back as host lengths are (``round``): the verify program of a bucket is then one
        program whoever chose the lengths (the device's output would be a committed input)."""
        if not table.initialised:
            raise ValueError("the confidence scheduler needs an initialised SPS table")
        table.check_covers(bs.anchor.shape[0] * (self.gamma + 1))
        drafted, lens = self._draft_program(bs, top_k, top_p, table)
        lens = np.asarray(lens)
        return self._ragged_round(bs, drafted, np.asarray(lens, np.int32), -1, int(lens.sum()), sampled=sampled,
                                  top_k=top_k, top_p=top_p, buckets=table.tokens)

    def _draft_program(self, bs: BatchState, top_k: bool, top_p: bool, table: SPSTable | None):
        self._shapes.add(("draft", bs.anchor.shape[0], bs.cache.max_len, top_k, top_p, table is not None))
        tokens, steps = ((1,), (1.0,)) if table is None else (table.tokens, table.steps_per_s)
        return self._draft_step(self.params, bs, np.asarray(tokens, np.int32),
                                np.asarray(steps, np.float32), top_k=top_k, top_p=top_p, schedule=table is not None)

    def _ragged_round(self, bs: BatchState, drafted, verify_lens, capacity: int, tokens: int, *, sampled: bool,
                      top_k: bool, top_p: bool, buckets: Sequence[int] | None = None
                      ) -> tuple[BatchState, RoundOutput]:
        """Ragged rounds run as two programs: the draft (one per pool and flags) and the verify /
        accept / commit of one token bucket (``verify_bucket``, or ``table_bucket`` of the given
        ``buckets``: a scheduler's round runs in the bucket its SPS table timed), whatever decides
        the lengths, so the drafter compiles once for all buckets; without the confidence
        scheduler's sync the host dispatches both at once."""
        b = bs.anchor.shape[0]
        bucket = self.last_bucket = (verify_bucket(tokens, b, self.gamma, self.fine_buckets) if buckets is None
                                     else table_bucket(tokens, b, self.gamma, buckets))
        self._shapes.add(("verify", b, bs.cache.max_len, sampled, top_k, top_p, bucket))
        return self._verify_step(self.params, bs, drafted, verify_lens, np.int32(capacity), sampled=sampled,
                                 top_k=top_k, top_p=top_p, tokens=bucket)

    def round_flags(self, slots: int, max_len: int, *, sampled: bool, top_k: bool, top_p: bool) -> dict[str, bool]:
        """The round variant to run for requests that need these flags: a compiled variant for
        this pool (slots x max_len) that does at least as much if there is one (it gives the same
        tokens: greedy rows ignore the sampled path, top-k 0 and top-p 1 filter nothing), the
        narrowest such; else exactly the flags needed (compiled on first use)."""
        need = (sampled, top_k, top_p)
        have = [k[3:6] for k in self._shapes if k[0] in ("round", "rounds", "verify") and k[1:3] == (slots, max_len)
                and all(h >= n for h, n in zip(k[3:6], need))]
        pick = min(have, key=sum) if have else need
        return dict(zip(("sampled", "top_k", "top_p"), pick))

    def compilations(self) -> int:
        """Number of distinct compiled round functions so far, ragged rounds' draft and verify
        programs included (for recompilation checks)."""
        return sum(f._cache_size() for f in (self._round, self._rounds, self._draft_step, self._verify_step))

    def compiled_programs(self) -> int:
        """Number of distinct compiled programs of every kind (prefill steps, admit, round, the
        draft and verify programs of ragged rounds, and a static batch's prefill and first token)."""
        return sum(self.compiled_by_program().values())

    def compiled_by_program(self) -> dict[str, int]:
        """Compiled programs per kind of ``compiled_shapes`` ("prefill", "admit", "round", "rounds",
        "draft", "verify", "static_prefill", "static_first"): one per shape called when nothing
        compiles twice (``place``)."""
        fns = dict(prefill=self._prefill_rows, admit=self._admit, round=self._round, rounds=self._rounds,
                   draft=self._draft_step, verify=self._verify_step, static_prefill=self._prefill,
                   static_first=self._first)
        return {k: f._cache_size() for k, f in fns.items()}

    def compiled_shapes(self) -> frozenset[tuple]:
        """The shapes called so far, each (program, slots, cache length, ...): ("prefill", S, L,
        rows, chunk) (``prefill_step``), ("admit", S, L), ("round", S, L, sampled, top_k, top_p),
        ("rounds", S, L, sampled, top_k, top_p, count) (``rounds``), the two programs of ragged
        rounds: ("draft", S, L, top_k, top_p, with the confidence schedule) and ("verify", S, L,
        sampled, top_k, top_p, token bucket), and a static batch's ("static_prefill", b, L, chunk)
        and ("static_first", b, L) (``prefill``)."""
        return frozenset(self._shapes)


def chunk_width(tokens: int, limit: int = PREFILL_CHUNK) -> int:
    """Prefill chunk width for ``tokens`` prompt tokens: the smallest power of 2 >= tokens (at
    least MIN_PREFILL_CHUNK), at most ``limit`` (longer prompts take several chunks)."""
    return min(limit, max(MIN_PREFILL_CHUNK, 1 << (tokens - 1).bit_length()))


def prefill_rows(reading: int, slots: int) -> int:
    """Rows of a prefill call for ``reading`` slots reading a prompt in a pool of ``slots``: the
    smallest power of 2 >= reading while that is at most an eighth of the pool (at least 1 row):
    those rows are gathered, a temporary copy of their caches; more readers take the whole pool
    (``slots`` rows, prefilled in place). A pool compiles about log2(slots) - 1 sizes."""
    if not 1 <= reading <= slots:
        raise ValueError(f"a pool of {slots} slots prefills 1 to {slots} of them, got {reading}")
    p = 1 << (reading - 1).bit_length()
    return p if p <= max(1, slots // 8) else slots


def check_scheduler(scheduler: str, gamma: int) -> None:
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
    if scheduler != "static" and gamma == 0:
        raise ValueError(f"the {scheduler!r} scheduler needs speculative decoding (gamma > 0)")


def verify_bucket(tokens: int, slots: int, gamma: int, fine: int = 0) -> int:
    """Rows of a packed verify holding ``tokens`` verify tokens of a pool of ``slots`` slots: the
    smallest power of 2 >= tokens (at least MIN_VERIFY_BUCKET), at most slots x (γ + 1) (every
    slot verifying everything). A pool compiles at most log2(slots x (γ + 1) / 8) + 2 buckets.
    ``fine`` = k > 0 (``Engine(fine_buckets=k)``): up to ``slots`` tokens at most ``slots``, above
    them the smallest multiple of ceil(slots / k) (k γ + 1 more buckets): at full depth a verify's
    cost grows with its tokens, and with power-of-2 buckets even a clairvoyant allocation of a
    64-128-slot Flash pool would gain at most 1.06x, 1.16-1.18x with multiples of the slots, 1.24x
    with multiples of half of them (``scheduler.clairvoyant_bound``, docs/benchmarks.md)."""
    top = slots * (gamma + 1)
    if not 0 <= tokens <= top:
        raise ValueError(f"a round of {slots} slots verifies 0 to {top} tokens, got {tokens}")
    rows = 1 << max(tokens - 1, 0).bit_length()
    if fine:
        step = -(-slots // fine)
        rows = -(-tokens // step) * step if tokens > slots else min(rows, slots)
    return min(top, max(MIN_VERIFY_BUCKET, rows))


def table_bucket(tokens: int, slots: int, gamma: int, buckets: Sequence[int]) -> int:
    """Rows of a packed verify holding ``tokens`` verify tokens in one of ``buckets`` (an SPS
    table's token counts, ascending): the smallest that holds them, at most slots x (γ + 1)."""
    top = slots * (gamma + 1)
    if not 0 <= tokens <= top:
        raise ValueError(f"a round of {slots} slots verifies 0 to {top} tokens, got {tokens}")
    fit = [int(k) for k in buckets if k >= tokens]
    if not fit:
        raise ValueError(f"no verify bucket holds {tokens} tokens: the buckets (SPS table token counts) stop at "
                         f"{max(buckets, default=0)}")
    return min(top, min(fit))


def verify_buckets(slots: int, gamma: int, fine: int = 0) -> tuple[int, ...]:
    """Every bucket ``verify_bucket`` can give a pool of ``slots`` slots, ascending."""
    return tuple(sorted({verify_bucket(t, slots, gamma, fine) for t in range(slots * (gamma + 1) + 1)}))
