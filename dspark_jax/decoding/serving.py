"""Continuous batching: any number of requests streamed through a fixed pool of slots.

The engine's state is a pool of S slots, each with its own rows of every cache (target pools,
compressor rings, draft rings). A request takes a free slot; its slot's length goes back to 0
(the caches rewind by length, nothing is cleared). Each step of the host loop

  1 admits waiting requests into free slots (and stops on the device the slots of requests the
    host finished, e.g. on a stop string),
  2 prefills one chunk of every prompt still being read, on those slots' rows only (p rows, a
    power of 2 up to an eighth of the pool, else the whole pool: ``engine.prefill_rows``; at
    most ``Engine.chunk_limit(p)`` tokens per row, so a long prompt never holds up running
    requests for more than one chunk) and draws the first token of every prompt that chunk
    completes,
  3 runs one decoding round over the pool (slots without a running request compute but commit
    nothing),
  4 reads the previous step's tokens (so the host never waits for the device in between) and
    frees the slots of requests that finished.

Every call has one of a fixed set of shapes: p rows (a power of 2 up to S / 8, or all S) x a
power-of-2 prefill chunk, or S slots x the round's γ + 1 tokens (for ragged rounds one draft program and a
verify program per token bucket: 8, 16, ... S x (γ + 1)), with the cache length fixed for the
pool; nothing recompiles as requests come and go. The lagged scheduler keeps the survivals of past rounds per slot
(``scheduler.SurvivalHistory``): when it schedules round t the host has read round t - 2.
Randomness is keyed by (request seed, position), so a request's tokens do not depend on its
slot, its neighbours or when it entered (for sampled requests under the confidence and lagged
schedulers, whose verify lengths depend on the other requests, in distribution only).
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import MAX_VERIFY_TOKENS
from dspark_jax.decoding.engine import (Engine, check_scheduler, chunk_width, prefill_rows, unpack_round,
                                       verify_buckets)
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.decoding.scheduler import (UNINITIALISED_WARNING, RoundTimes, SPSTable, SurvivalHistory, lagged_plan,
                                           profile, table_key)
from dspark_jax.train.sts import survival


@dataclasses.dataclass
class Outputs:
    """What the loop returns per request (times in seconds on the perf_counter clock)."""

    tokens: list[list[int]]
    accepts: list[list[int]]  # accepted drafts per round
    verified: list[list[int]]  # tokens verified per round (anchor + drafts)
    confidences: list[list[np.ndarray]]  # raw draft confidences per round
    reason: list[str]  # "stop" or "length"
    admitted: list[float]  # when the request took a slot
    first: list[float]  # when its first token was read
    finished: list[float]


def finish_request(tokens: list[int], params: SamplingParams, tokenizer) -> tuple[list[int], str | None]:
    """The tokens truncated at the first stop (token id or string) or at max_new_tokens, and the
    finish reason; (tokens, None) while the request goes on."""
    for j, t in enumerate(tokens):
        if t in params.stop:
            return tokens[:j], "stop"
    text_stops = [s for s in params.stop if isinstance(s, str)]
    if text_stops and tokenizer is not None:
        text = tokenizer.decode(tokens)
        for s in text_stops:
            if s in text:
                while tokens and s in tokenizer.decode(tokens):
                    tokens = tokens[:-1]
                return tokens, "stop"
    if len(tokens) >= params.max_new_tokens:
        return tokens[:params.max_new_tokens], "length"
    return tokens, None


class RoundDispatcher:
    """The host half of the verify schedulers over a pool of ``slots`` slots: ``dispatch`` runs
    one round under ``scheduler`` ("static", "confidence" or "lagged", by ``table``; without an
    initialised table every scheduler verifies everything, as "static", with a warning) and
    ``read`` takes a round's outputs once the host has them, for the survival history
    (``scheduler.SurvivalHistory``: when round t is scheduled the host has read round t - 2).

    Both confidence schedulers run the static round's one program instead of their own rounds
    when the table's static rate says it is worth it: always, if no ragged bucket is faster
    (``SPSTable.static_dominates``); else for a round whose lagged survivals give the static round
    at least the throughput of the lagged capacity (``scheduler.lagged_plan``), or whose
    lagged capacity covers every draft of a pool whose slots all decode. The choice reads rounds
    t - 2 and older only, so it does not depend on the round's own drafts (lossless).

    With ``adapt`` (and a table with a static rate) the table's ragged rates are corrected by
    the round times measured here (``scheduler.RoundTimes``): the wall time between two round
    dispatches of a decode-only loop step is that of a round (the loop reads each round one
    round late, so in steady state it waits for one round per step), counted for a round kind
    when the two rounds before were of that kind and ran programs already compiled, and no
    prefill step came between them."""

    def __init__(self, engine: Engine, scheduler: str, table: SPSTable | None, slots: int, *,
                 adapt: bool = True, clock=time.perf_counter):
        check_scheduler(scheduler, engine.gamma)
        if scheduler != "static" and (table is None or not table.initialised):
            warnings.warn(UNINITIALISED_WARNING, stacklevel=3)
            scheduler = "static"
        if scheduler != "static":
            table.check_covers(slots * (engine.gamma + 1))
        self.engine, self.scheduler, self.table = engine, scheduler, table
        self.history = SurvivalHistory(slots, engine.gamma) if scheduler != "static" else None
        self.always_static = scheduler == "static" or table.static_dominates
        self.rounds = 0  # rounds dispatched
        self.times = None  # kept by the engine per pool, scheduler and table: a later call starts from them
        if adapt and not self.always_static and table.static_steps_per_s is not None:
            key = (slots, scheduler, table.tokens, table.steps_per_s, table.static_steps_per_s)
            self.times = engine.round_times.setdefault(key, RoundTimes())
        self.clock, self._recent = clock, []
        self.last_program = None  # ("static", None) or ("ragged", verify bucket): the last round's programs

    def dispatch(self, bs, running: list[int], flags: dict[str, bool], *, clean: bool = True):
        """One round over the pool; running[s] = the request slot s decodes (-1: none). Returns
        the state, the round's (device) outputs and the round's index. ``clean``: no prefill since
        the previous round (the time between the two is a round's)."""
        eng = self.engine
        if self.always_static:  # (rounds_per_call > 1: several rounds in one call, outputs stacked)
            bs, res = (eng.round(bs, **flags) if eng.rounds_per_call == 1
                       else eng.rounds(bs, eng.rounds_per_call, **flags))
            program = ("static", None)
        else:  # the lagged capacity from survivals of round t - 2, the newest the host has read
            table, now = self.table, None
            if self.times is not None:
                now = self.clock()
                self._count(now, clean)
                table = self.times.corrected(table)
            busy = np.asarray(running) >= 0
            capacity, static_wins = lagged_plan(self.history.lagged(self.rounds, running), busy, table)
            if static_wins or (busy.all() and capacity >= busy.size * eng.gamma):  # (every draft of every slot)
                bs, res = eng.round(bs, **flags)
                program = ("static", None)
            elif self.scheduler == "confidence":
                bs, res = eng.round_confidence(bs, table, **flags)
                program = ("ragged", eng.last_bucket)
            else:
                bs, res = eng.round_lagged(bs, capacity, int(busy.sum()), buckets=self.table.tokens, **flags)
                program = ("ragged", eng.last_bucket)
            if self.times is not None:
                self._recent = self._recent[-1:] + [dict(program=program, t=now, clean=clean,
                                                         warm=program in self.times.programs)]
                self.times.programs.add(program)
        self.last_program = program
        self.rounds += 1
        return bs, res, self.rounds - 1

    def _count(self, now: float, clean: bool) -> None:
        """Record the time since the previous dispatch for the previous round when it and the
        round before it ran one kind of round ((kind, verify bucket) programs run before), with no
        prefill since the round before it."""
        if not (len(self._recent) == 2 and clean and all(r["clean"] and r["warm"] for r in self._recent)):
            return
        (kind, bucket), (kind_before, _) = self._recent[1]["program"], self._recent[0]["program"]
        if kind == kind_before:
            rate = self.table.static_steps_per_s if kind == "static" else self.table.steps_per_second([bucket])[0]
            self.times.record(kind, 1.0 / float(rate), now - self._recent[1]["t"])

    def read(self, index: int, running: list[int], n_new: np.ndarray, confidence: np.ndarray) -> None:
        """Round ``index``'s emitted-token counts and raw confidences [slots, γ], on the host."""
        if self.history is not None:
            temps = self.engine.temperatures or np.ones(self.engine.gamma)
            self.history.record(index, running, n_new > 0, survival(confidence, temps))


def serve(engine: Engine, ids: list[np.ndarray], params: list[SamplingParams], seeds: list[int], *, slots: int,
          max_len: int, tokenizer=None, on_progress=None, track_confidence: bool = True, scheduler: str | None = None,
          sps_table: SPSTable | None = None) -> Outputs:
    """Run every request through a pool of ``slots`` slots of ``max_len`` cache tokens each.

    scheduler / sps_table: the verify lengths of the rounds (see ``Engine``; None: the engine's).
    on_progress(phase, kept, done): called after each step with the tokens each request holds.
    """
    n = len(ids)
    out = Outputs(tokens=[[] for _ in range(n)], accepts=[[] for _ in range(n)], verified=[[] for _ in range(n)],
                  confidences=[[] for _ in range(n)], reason=["length"] * n, admitted=[0.0] * n, first=[0.0] * n,
                  finished=[0.0] * n)
    rounds = RoundDispatcher(engine, engine.scheduler if scheduler is None else scheduler,
                             engine.sps_table if sps_table is None else sps_table, slots, adapt=engine.adapt_sps)
    done = [False] * n
    flags = engine.round_flags(slots, max_len, sampled=any(p.temperature > 0 for p in params),
                               top_k=any(p.top_k > 0 for p in params),
                               top_p=any(p.top_p < 1.0 for p in params))

    bs = engine.init_slots(slots, max_len)
    waiting = collections.deque(range(n))
    owner = [-1] * slots  # request held by each slot, -1 = free
    fed = [0] * slots  # prompt tokens of the slot's request prefilled so far
    decoding = [False] * slots  # the slot's request has its first token
    release = np.zeros(slots, bool)  # slots the host freed since the last admit call
    pending: list[tuple] = []  # the previous step's device outputs, read one step late

    def take(i: int, new: list[int]) -> None:
        """Append tokens of request i; finish it (and free its slot) on a stop or its length."""
        out.tokens[i], reason = finish_request(out.tokens[i] + new, params[i], tokenizer)
        if reason is not None:
            done[i], out.reason[i], out.finished[i] = True, reason, time.perf_counter()
            s = owner.index(i)
            owner[s], release[s] = -1, True

    while waiting or any(o >= 0 for o in owner) or pending:
        # 1 admit: free slots take waiting requests
        entering = {}
        for s in range(slots):
            if owner[s] < 0 and waiting:
                i = waiting.popleft()
                owner[s], fed[s], decoding[s] = i, 0, False
                entering[s] = (params[i], seeds[i])
                out.admitted[i] = time.perf_counter()
        if entering or release.any():
            bs = engine.admit(bs, entering, release)
            release[:] = False

        # 2 one prefill chunk for the prompts still being read
        step: list[tuple] = []
        reading = [s for s in range(slots) if owner[s] >= 0 and not decoding[s]]
        clean = not (entering or reading)  # this step runs no prefill before its round (freeing slots is cheap)
        if reading:  # on the reading slots' rows (padded with other slots to a power of 2), or the whole pool
            p = prefill_rows(len(reading), slots)
            rows = (reading + [s for s in range(slots) if s not in reading][:p - len(reading)] if p < slots
                    else list(range(slots)))  # the whole pool, in slot order (in place)
            c = chunk_width(max(len(ids[owner[s]]) - fed[s] for s in reading), engine.chunk_limit(p))
            chunk = np.zeros((p, c), np.int32)
            n_valid = np.zeros(p, np.int32)
            is_last = np.zeros(p, bool)
            for j, s in enumerate(rows):
                if s not in reading:
                    continue
                part = ids[owner[s]][fed[s]:fed[s] + c]
                chunk[j, :len(part)], n_valid[j] = part, len(part)
                fed[s] += len(part)
                is_last[j] = decoding[s] = fed[s] == len(ids[owner[s]])
            bs, first = engine.prefill_step(bs, np.asarray(rows), chunk, n_valid, is_last)
            if is_last.any():
                step.append(("first", first, [owner[s] for s in rows], is_last))

        # 3 one decoding round over the pool
        running = [owner[s] if decoding[s] else -1 for s in range(slots)]
        if any(o >= 0 for o in running):
            bs, res, index = rounds.dispatch(bs, running, flags, clean=clean)
            step.append(("round", res.host, list(owner), index, running))

        # 4 the previous step's tokens (the device works on this step meanwhile)
        for kind, arrays, owners, *rest in pending:
            if kind == "first":  # owners and is_last per prefill row
                first = np.asarray(arrays)
                for j in np.flatnonzero(rest[0]):
                    i = owners[j]
                    out.first[i] = time.perf_counter()
                    take(i, [int(first[j])])
                continue
            host = np.asarray(arrays)  # one copy from the device: a round [slots, w] or a call's rounds [k, slots, w]
            for packed in (host if host.ndim == 3 else host[None]):
                toks, n_new, acc, conf, verified = unpack_round(packed, engine.gamma)
                rounds.read(rest[0], rest[1], n_new, conf)
                for s, i in enumerate(owners):
                    if i < 0 or done[i] or n_new[s] == 0:
                        continue
                    out.accepts[i].append(int(acc[s]))
                    out.verified[i].append(int(verified[s]))
                    if engine.gamma and track_confidence:
                        out.confidences[i].append(conf[s])
                    take(i, [int(t) for t in toks[s, :n_new[s]]])
        pending = step
        if on_progress is not None:
            phase = "decode" if any(out.first) else "prefill"
            on_progress(phase, [len(t) for t in out.tokens], done)
    return out


def decoding_pool(engine: Engine, slots: int, max_len: int, *, prompt_len: int = 32, seed: int = 0):
    """A pool of ``slots`` x ``max_len`` with every slot decoding after a ``prompt_len``-token
    random prompt (greedy, no stops): a state to time rounds on."""
    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_new_tokens=max_len - prompt_len - MAX_VERIFY_TOKENS, ignore_eos=True)
    bs = engine.admit(engine.init_slots(slots, max_len), {s: (sp, s) for s in range(slots)}, np.zeros(slots, bool))
    c = chunk_width(prompt_len, engine.chunk_limit(slots))
    for start in range(0, prompt_len, c):
        n = min(c, prompt_len - start)
        ids = np.zeros((slots, c), np.int32)
        ids[:, :n] = rng.integers(3, engine.model.config.vocab_size, (slots, n))
        bs, _ = engine.prefill_step(bs, np.arange(slots), ids, np.full(slots, n, np.int32),
                                    np.full(slots, start + n == prompt_len))
    return bs


def round_seconds(engine: Engine, pool, buckets: Sequence[int] | None = None):
    """``seconds(tokens)``: the wall time of one ragged greedy round on a copy of the state
    ``pool`` (``decoding_pool``; the copy is not timed, and the context does not grow from call to
    call) verifying ``tokens`` tokens in total, spread evenly over the slots, in their bucket (of
    ``buckets`` if given, else the engine's ``verify_bucket``); ``seconds(None)``: the static round
    (every slot verifies γ + 1 tokens, one program); for ``scheduler.profile``."""
    slots, g1 = pool.anchor.shape[0], engine.gamma + 1

    def seconds(tokens: int | None) -> float:
        if tokens is not None and not 1 <= tokens <= slots * g1:
            raise ValueError(f"a pool of {slots} slots verifies 1 to {slots * g1} tokens, got {tokens}")
        lens = None if tokens is None else np.full(slots, tokens // slots) + (np.arange(slots) < tokens % slots)
        state = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, pool))
        t0 = time.perf_counter()
        state, res = engine.round(state, sampled=False, top_k=False, top_p=False, verify_lens=lens, buckets=buckets)
        jax.block_until_ready(res.tokens)
        return time.perf_counter() - t0

    return seconds


def profile_sps(engine: Engine, slots: int, max_len: int, *, prompt_len: int = 32, repeats: int = 5,
                fine_buckets: int | None = None) -> SPSTable:
    """The SPS table of ``engine`` for a pool of ``slots`` x ``max_len``: ragged rounds timed at
    every token bucket of the pool and the static round (``round_seconds``), keyed by the device,
    model, γ and KV layout. The buckets: ``verify_buckets`` with ``fine_buckets`` (None: the
    engine's); the schedulers' rounds then run in them (``Engine.round_lagged``,
    ``round_confidence``)."""
    fine = engine.fine_buckets if fine_buckets is None else int(fine_buckets)
    key = table_key(engine.model, gamma=engine.gamma, kv_layout=engine.kv_layout)
    buckets = verify_buckets(slots, engine.gamma, fine)
    seconds = round_seconds(engine, decoding_pool(engine, slots, max_len, prompt_len=prompt_len), buckets)
    return profile(seconds, buckets, key, repeats=repeats,
                   meta=dict(slots=slots, max_len=max_len, prompt_len=prompt_len, fine_buckets=fine),
                   static_seconds=lambda: seconds(None))
