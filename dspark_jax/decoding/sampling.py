"""Sampling parameters, the processed distributions, and lossless acceptance of drafts.

The same processing (temperature, then top-k, then top-p) is applied to the draft logits that
tokens are drawn from (q) and to the target logits they are verified against (p). Greedy requests
(temperature 0) accept the longest prefix that matches the target argmax; sampled requests use
chain rejection sampling: accept d_k iff u_k * q_k(d_k) < p_{k-1}(d_k); at the first rejection
the bonus token is drawn from normalize(max(p - q, 0)); if all drafts pass, from p_γ. The emitted
tokens then follow the target distribution exactly.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

# Random streams: the randomness deciding the token at absolute position x of a request comes from
# key(seed, x, stream), one stream per purpose. A round starting at committed length L uses
# positions L+1 .. L+a+1 only for what reaches the output, and the next round starts at L+a+1, so
# no randomness is ever reused for a decision that shows in the emitted tokens. Draft draws are
# also keyed by the round (its L): the drafts past the accepted ones are not emitted but set the
# round's confidences, which the lagged scheduler reads two rounds later; a later round drafting
# the same positions must not draw them again, or its verify lengths could depend on its drafts.
STREAM_DRAFT, STREAM_ACCEPT, STREAM_BONUS = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature: 0 = greedy, else a finite positive number; top_k: 0 = off; top_p: in (0, 1],
    1.0 = off; max_new_tokens: a positive integer; stop: a token id, a string, or a list of them,
    that end the request (the stop itself is not returned; None = none); the model's EOS token
    also ends it unless ignore_eos; seed: an integer in [0, 2**32), None = derived from
    generate()'s seed. Bad values raise ``dspark_jax.InputError`` naming the field.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: Sequence[int | str] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        from dspark_jax.api import InputError, check_float, check_int

        def put(name, value):
            object.__setattr__(self, name, value)

        put("temperature", check_float("temperature", self.temperature))
        if self.temperature < 0.0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        put("top_p", check_float("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must lie in (0, 1], got {self.top_p}")
        put("top_k", check_int("top_k", self.top_k, lo=0))
        put("max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, lo=1))
        if self.seed is not None:  # request_keys takes uint32 seeds
            put("seed", check_int("seed", self.seed, lo=0, hi=2**32))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise InputError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        put("ignore_eos", bool(self.ignore_eos))
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, (str, numbers.Integral)):
            stop = (stop,)
        elif not isinstance(stop, (list, tuple, np.ndarray)):
            raise InputError(f"stop must be a token id, a string, or a list of them; got {type(stop).__name__}")
        out = []
        for s in stop:
            if isinstance(s, str) and not s:
                raise InputError("stop strings must not be empty")
            out.append(s if isinstance(s, str) else check_int("a stop token id", s, lo=0))
        put("stop", tuple(out))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-request sampling parameters as device arrays [B]."""

    temperature: Float[Array, " b"]
    top_k: Int[Array, " b"]
    top_p: Float[Array, " b"]
    seed: Int[Array, " b"]

    @property
    def greedy(self) -> Bool[Array, " b"]:
        return self.temperature <= 0.0


def request_keys(seed: Int[Array, " b"], position: Int[Array, " b"], stream: int,
                 round_start: Int[Array, " b"] | None = None) -> Array:
    """Keys per request for the token at ``position``, derived from (seed, position, stream) and, if
    given, the committed length ``round_start`` of the round drawing it, only, so results do not
    depend on which other requests share the batch."""
    def one(s, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), stream)
    keys = jax.vmap(one)(seed.astype(jnp.uint32), position)
    return keys if round_start is None else jax.vmap(jax.random.fold_in)(keys, round_start)


# Top-k / top-p read the largest CANDIDATES logits of a row (lax.top_k) instead of sorting the
# vocabulary: exact when every row's top-k is at most that many and its top-p nucleus lies within
# them; otherwise the whole batch sorts its rows (one lax.cond, same result).
CANDIDATES = 256


def process_logits(logits: Float[Array, "b ... v"], sp: SamplingArrays, *, use_top_k: bool = True,
                   use_top_p: bool = True, candidates: int = CANDIDATES) -> Float[Array, "b ... v"]:
    """Tempered logits with tokens outside top-k / top-p set to -inf (greedy rows: temperature 1).

    Top-k keeps the values >= the k-th largest; top-p keeps the largest values whose probability
    mass before them (after top-k) is below p. Both read the ``candidates`` largest values of a
    row; rows that need more (top-k above it, or a nucleus reaching past it) make the batch read
    fully sorted rows instead."""
    extra = logits.ndim - 2
    expand = lambda a: a.reshape(a.shape + (1,) * (extra + 1))
    t = jnp.where(sp.greedy, 1.0, sp.temperature)
    x = logits.astype(jnp.float32) / expand(t)
    if not (use_top_k or use_top_p):
        return x
    v = x.shape[-1]
    top_k = expand(sp.top_k)
    top_p = expand(sp.top_p)

    def keep(srt: Float[Array, "b ... c"]):
        """The filtered logits from the c largest values of each row, descending; and whether they
        were enough for every row."""
        out, c = x, srt.shape[-1]
        ok = jnp.ones(x.shape[:-1] + (1,), bool)
        if use_top_k:  # rows without top-k cut nothing
            k = jnp.clip(top_k, 1, c) * jnp.ones(srt.shape[:-1] + (1,), jnp.int32)
            kth = jnp.where(top_k > 0, jnp.take_along_axis(srt, k - 1, axis=-1), -jnp.inf)
            out = jnp.where(out < kth, -jnp.inf, out)
            srt = jnp.where(srt < kth, -jnp.inf, srt)
            ok &= top_k <= c
        if use_top_p:
            probs = jnp.exp(srt - jax.nn.logsumexp(out, axis=-1, keepdims=True))
            before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly larger tokens
            kept = before < top_p
            cutoff = jnp.min(jnp.where(kept, srt, jnp.inf), axis=-1, keepdims=True)
            cutoff = jnp.where(top_p >= 1.0, -jnp.inf, cutoff)  # 1.0: all, despite rounding
            out = jnp.where(out < cutoff, -jnp.inf, out)
            # the nucleus ends within the candidates if their mass reaches p (every later token then
            # has at least p before it), or if the row is cut at one of them by top-k
            cut_by_top_k = (top_k > 0) & (top_k <= c) if use_top_k else False
            ok &= (top_p >= 1.0) | (jnp.sum(probs, axis=-1, keepdims=True) >= top_p) | cut_by_top_k
        return out, jnp.all(ok)

    sort_all = lambda: keep(jnp.sort(x, axis=-1)[..., ::-1])[0]  # noqa: E731
    if candidates >= v:
        return sort_all()
    out, enough = keep(jax.lax.top_k(x, candidates)[0])
    return jax.lax.cond(enough, lambda: out, sort_all)


def pick_tokens(keys: Array, processed: Float[Array, "b v"], greedy: Bool[Array, " b"]) -> Int[Array, " b"]:
    """argmax for greedy requests, a categorical draw from the processed logits otherwise."""
    drawn = jax.vmap(jax.random.categorical)(keys, processed)
    return jnp.where(greedy, jnp.argmax(processed, axis=-1), drawn).astype(jnp.int32)


def _verified(drafts: Int[Array, "b g"], limit: Int[Array, " b"] | None) -> Int[Array, " b"]:
    g = drafts.shape[1]
    return jnp.full(drafts.shape[:1], g, jnp.int32) if limit is None else jnp.clip(limit, 0, g).astype(jnp.int32)


def accept_greedy(drafts: Int[Array, "b g"], target_logits: Float[Array, "b g1 v"],
                  limit: Int[Array, " b"] | None = None) -> tuple[Int[Array, " b"], Int[Array, " b"]]:
    """Longest prefix with d_k == argmax of target row k-1, at most ``limit`` drafts (the drafts
    verified: rows 0..limit of the target are real; default all); bonus = argmax of row a."""
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [b, γ+1]
    ok = drafts == best[:, :-1]
    a = jnp.minimum(jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1), _verified(drafts, limit))
    return a, jnp.take_along_axis(best, a[:, None], axis=1)[:, 0]


def accept_sampled(drafts: Int[Array, "b g"], q_logits: Float[Array, "b g v"], p_logits: Float[Array, "b g1 v"],
                   uniforms: Float[Array, "b g"], limit: Int[Array, " b"] | None = None
                   ) -> tuple[Int[Array, " b"], Float[Array, "b v"]]:
    """Chain rejection sampling on processed logits (draft q for d_1..d_γ, target p rows 0..γ) over
    the first ``limit`` drafts (the drafts verified; default all: target rows past limit are
    not used).

    Returns the number of accepted drafts a and the log-distribution of the bonus token: the
    residual max(p_a - q_{a+1}, 0) after a rejection, p_a when every verified draft passed.
    """
    q = jax.nn.softmax(q_logits, axis=-1)
    p = jax.nn.softmax(p_logits, axis=-1)
    g = drafts.shape[1]
    verified = _verified(drafts, limit)
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    p_d = jnp.take_along_axis(p[:, :g], drafts[..., None], axis=-1)[..., 0]
    ok = uniforms * q_d < p_d
    a = jnp.minimum(jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1), verified)
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # [b, v]
    q_a = jnp.take_along_axis(jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1), a[:, None, None], axis=1)[:, 0]
    q_a = jnp.where((a < verified)[:, None], q_a, 0.0)
    resid = jnp.maximum(p_a - q_a, 0.0)  # q_a = 0 when all verified drafts passed: plain p_a
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(mass > 1e-12, resid / jnp.maximum(mass, 1e-30), p_a)
    return a, jnp.log(resid)
