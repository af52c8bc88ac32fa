"""Serving: continuous batching over a slot pool equals each request alone, nothing recompiles
across calls, prompts are prefilled in chunks between rounds, and the memory plan is the caches'
real size."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax
from dspark_jax import SamplingParams, config
from dspark_jax.cache import init_cache
from dspark_jax.decoding import generate as gen
from dspark_jax.decoding.scheduler import SPSTable
from dspark_jax.memory import plan, plan_slots
from dspark_jax.model.dspark import init_draft_cache

SLOTS, CONTEXT, CHUNK = 2, 256, 16


def test_continuous_batching_equals_each_request_alone(monkeypatch):
    """Six requests through two slots: prompts up to 40 tokens (prefilled in 16-token chunks),
    greedy and sampled, stops on a token id and on a string, lengths 3 to 24. Each request's
    tokens and finish reason equal the request run alone; each program compiles once per shape
    called, and a second call and the runs alone compile nothing."""
    shipped = gen.default_model()  # a Model of its own: engines of its own, whichever tests ran before
    model = dspark_jax.Model(shipped.module, tokenizer=shipped.tokenizer, sts_temperatures=shipped.sts_temperatures)
    eng = gen._engine(model, model.config.dspark.block_size, None, "bf16", 1)  # one round per call: logged below
    monkeypatch.setattr(eng, "prefill_chunk", CHUNK)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (9, 40, 5, 14, 12, 7)]

    def run(prompts, params):
        return dspark_jax.generate(prompts, model=model, sampling=params, slots=SLOTS, context=CONTEXT,
                                   rounds_per_call=1)

    # a first call without stops: it compiles the pool's programs and shows what the requests say
    first_params = [SamplingParams(max_new_tokens=24, ignore_eos=True),
                    SamplingParams(max_new_tokens=20, ignore_eos=True),
                    SamplingParams(max_new_tokens=20, temperature=1.0, seed=11, ignore_eos=True),
                    SamplingParams(max_new_tokens=20, ignore_eos=True),
                    SamplingParams(max_new_tokens=16, temperature=0.8, top_k=40, top_p=0.9, seed=5, ignore_eos=True),
                    SamplingParams(max_new_tokens=3, ignore_eos=True)]
    warm = run(prompts, first_params)
    assert [len(r.tokens) for r in warm] == [p.max_new_tokens for p in first_params]
    shapes, programs = eng.compiled_shapes(), eng.compiled_programs()
    assert {k[0] for k in shapes} == {"admit", "prefill", "round"}
    def one_per_shape():  # the programs each kind would have if each of its shapes compiled once
        return {p: sum(k[0] == p for k in eng.compiled_shapes()) for p in eng.compiled_by_program()}

    assert eng.compiled_by_program() == one_per_shape()  # the calls on the empty pool compiled no extra variant
    assert all(k[1:3] == (SLOTS, CONTEXT) for k in shapes)
    assert {k[3:5] for k in shapes if k[0] == "prefill"} == {(1, CHUNK), (2, CHUNK)}  # 1 or 2 slots reading

    # the same requests with stops and other lengths
    stop_tok = warm[1].tokens[6]
    greedy3 = warm[3].tokens
    stop_text = model.tokenizer.decode(greedy3[7:9]).strip()
    assert stop_text and stop_text not in model.tokenizer.decode(greedy3[:5])
    params = [dataclasses.replace(first_params[0], max_new_tokens=22),
              dataclasses.replace(first_params[1], stop=(stop_tok,)),  # a stop token id
              first_params[2],
              dataclasses.replace(first_params[3], stop=(stop_text,)),  # a stop string
              dataclasses.replace(first_params[4], max_new_tokens=9),
              dataclasses.replace(first_params[5], max_new_tokens=5)]
    log = []
    prefill_step, round_ = eng.prefill_step, eng.round
    def logged_prefill(bs, rows, ids, n, last):  # tokens read per slot (the call computes only its rows)
        per_slot = np.zeros(SLOTS, int)
        per_slot[rows] = n
        log.append(("prefill", per_slot.tolist(), len(rows)))
        return prefill_step(bs, rows, ids, n, last)
    monkeypatch.setattr(eng, "prefill_step", logged_prefill)
    monkeypatch.setattr(eng, "round", lambda bs, **kw: log.append(("round",)) or round_(bs, **kw))
    batch = run(prompts, params)
    monkeypatch.setattr(eng, "prefill_step", prefill_step)
    monkeypatch.setattr(eng, "round", round_)

    assert batch[1].finish_reason == "stop" and batch[1].tokens == warm[1].tokens[:warm[1].tokens.index(stop_tok)]
    assert batch[3].finish_reason == "stop" and stop_text not in batch[3].text
    assert batch[3].tokens == greedy3[:len(batch[3].tokens)] and len(batch[3].tokens) <= 8
    assert [r.finish_reason for r in batch] == ["length", "stop", "length", "stop", "length", "length"]
    assert batch[2].tokens == warm[2].tokens and batch[4].tokens == warm[4].tokens[:9]  # seeded: position-keyed
    for p, sp, r in zip(prompts, params, batch):
        alone = run([p], [sp])[0]
        assert r.tokens == alone.tokens and r.finish_reason == alone.finish_reason
    # one program per shape (a fresh pool is placed as the programs return it), none compiled since
    assert eng.compiled_shapes() == shapes and eng.compiled_programs() == programs == len(shapes)

    # the 40-token prompt (slot 1) was read in three chunks with decoding rounds in between
    long_steps = [i for i, e in enumerate(log) if e[0] == "prefill" and e[1][1] > 0][:3]
    assert [log[i][1][1] for i in long_steps] == [16, 16, 8]
    assert any(e[0] == "prefill" and e[2] == 1 for e in log)  # one slot reading: a one-row call
    assert all(("round",) in log[a:b] for a, b in zip(long_steps, long_steps[1:]))

    # the lagged scheduler (ragged verify; capacity from survivals two rounds old, history kept
    # per slot across requests; the static round where those survivals give it the higher
    # throughput: 7 rounds/s makes it win for confident slots and lose for unsure ones): greedy
    # requests as above, sampled ones end as above
    gamma = model.config.dspark.block_size
    table = SPSTable(tokens=(8, SLOTS * (gamma + 1)), steps_per_s=(10.0, 6.0), static_steps_per_s=7.0)
    lagged = dspark_jax.generate(prompts, model=model, sampling=params, slots=SLOTS, context=CONTEXT,
                                 scheduler="lagged", sps_table=table, rounds_per_call=1)
    for sp, r, ref in zip(params, lagged, batch):
        assert r.finish_reason == ref.finish_reason and (r.tokens == ref.tokens if sp.temperature == 0 else
                                                         len(r.tokens) == len(ref.tokens))
    assert np.mean([r.stats["mean_verify_tokens"] for r in lagged]) < gamma + 1  # some rounds verified less
    verify = {k for k in eng.compiled_shapes() if k[0] == "verify"}
    assert {k[-1] for k in verify} == {8} and {k[0] for k in eng.compiled_shapes()} - {k[0] for k in shapes} == {
        "draft", "verify"}
    assert eng.compiled_by_program() == one_per_shape()


@pytest.mark.parametrize("preset", ["tiny", "flash"])
def test_memory_plan_is_the_real_cache_bytes(preset):
    """plan().bytes_per_request x slots == the bytes of the target caches + draft rings that
    ``init_cache`` / ``init_draft_cache`` build (shapes only: nothing is allocated)."""
    cfg = config.tiny() if preset == "tiny" else config.flash()
    slots, context = 3, 1040 if preset == "tiny" else 8192 + 16
    for dtype in (jnp.float32, jnp.bfloat16):
        for layout in ("bf16", "fp8"):
            for gamma in (0, cfg.dspark.block_size):
                def pools():
                    cache = init_cache(cfg, slots, context, dtype, kv_layout=layout)
                    return cache, init_draft_cache(cfg, slots, dtype) if gamma else None
                real = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(jax.eval_shape(pools)))
                p = plan(cfg, 1 << 40, layout, seq_len=context, gamma=gamma, dtype=dtype)
                assert p.bytes_per_request * slots == real, (dtype, layout, gamma)
    # the pool generate would build: as many slots as the budget holds
    p = plan_slots(cfg, context, layout="fp8", dtype=jnp.bfloat16, budget_bytes=10**9)
    assert p.max_requests == 10**9 // p.bytes_per_request


def test_slot_count_follows_the_memory_budget():
    model = gen.default_model()
    per_slot = plan(model.config, 1 << 40, "bf16", seq_len=CONTEXT, gamma=5, dtype=jnp.float32).bytes_per_request
    count = lambda n, budget: gen.slot_count(model, n, CONTEXT, 5, "bf16", budget)  # noqa: E731
    assert count(100, 5 * per_slot + 1) == 5  # memory-bound
    assert count(3, 100 * per_slot) == 4  # the requests, rounded up to a power of 2
    assert count(1000, 1000 * per_slot) == gen.MAX_SLOTS
    assert count(1, None) == 1  # from the free memory
    with pytest.raises(dspark_jax.InputError, match="do not fit"):
        count(4, per_slot - 1)
    sp = SamplingParams(max_new_tokens=200)
    with pytest.raises(dspark_jax.InputError, match="context of 256 tokens per slot"):
        dspark_jax.generate([[5] * 50], model=model, sampling=sp, context=CONTEXT)
    with pytest.raises(dspark_jax.InputError, match="slots"):
        dspark_jax.generate([[5] * 5], model=model, sampling=sp, slots=0)
    with pytest.raises(dspark_jax.InputError, match="do not fit"):
        dspark_jax.generate([[5] * 5], model=model, sampling=sp, memory_budget=1000)
    fp8 = plan(model.config, 1 << 40, "fp8", seq_len=CONTEXT, gamma=5, dtype=jnp.float32).bytes_per_request
    assert gen.slot_count(model, 100, CONTEXT, 5, "fp8", 5 * per_slot) == 5 * per_slot // fp8 > 5


def test_fp8_indexer_keys_hold_the_reference_keys_exactly():
    """The reference rounds indexer keys to e2m1 with a power-of-two scale per 32 dims; the fp8
    key layout (132 B per 128-d key) stores those values bit for bit, other values to e4m3."""
    from dspark_jax.cache import Fp8Keys, dequantize_keys, quantize_keys
    from dspark_jax.model.quant import fp4_sim, hadamard

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 50, 128)) * np.exp(rng.uniform(-8, 8, (3, 50, 1)))
    ref = fp4_sim(hadamard(jnp.asarray(x, jnp.float32)), 32).astype(jnp.bfloat16)
    keys = quantize_keys(ref)
    assert isinstance(keys, Fp8Keys) and keys.codes.dtype == keys.scales.dtype == jnp.uint8
    assert keys.codes.shape == (3, 50, 128) and keys.scales.shape == (3, 50, 4)
    np.testing.assert_array_equal(np.asarray(dequantize_keys(keys, jnp.float32)), np.asarray(ref, np.float32))
    back = np.asarray(dequantize_keys(quantize_keys(jnp.asarray(x, jnp.float32)), jnp.float32))
    amax = np.abs(x.reshape(3, 50, 4, 32)).max(-1, keepdims=True)
    assert np.all(np.abs(back - x).reshape(3, 50, 4, 32) <= amax / 16) and not np.array_equal(back, x)


def test_prefill_chunks_keep_within_the_token_budget():
    """One prefill program holds at most ``prefill_tokens`` rows x width (powers of 2, at least
    16, at most ``prefill_chunk``): one request reads 2048-token chunks, a pool of 64 slots 32."""
    from dspark_jax.decoding.engine import MIN_PREFILL_CHUNK, Engine

    eng = Engine(gen.default_model(), gamma=0)
    assert [eng.chunk_limit(r) for r in (1, 2, 8, 64, 1000)] == [2048, 1024, 256, 32, MIN_PREFILL_CHUNK]
    small = Engine(gen.default_model(), gamma=0, prefill_chunk=512, prefill_tokens=3000)
    assert [small.chunk_limit(r) for r in (1, 3, 7)] == [512, 512, 256]
    for rows in range(1, 200):
        c = eng.chunk_limit(rows)
        assert c & (c - 1) == 0 and (rows * c <= eng.prefill_tokens or c == MIN_PREFILL_CHUNK)


class _RecordingEngine:
    """The parts of an Engine a RoundDispatcher calls; records which round program ran."""

    gamma, temperatures, rounds_per_call = 5, None, 1

    def __init__(self):
        self.calls, self.round_times = [], {}

    def round(self, bs, **flags):
        self.calls.append("static")
        return bs, None

    def round_confidence(self, bs, table, **flags):
        self.calls.append("confidence")
        self.last_bucket = 24
        return bs, None

    def round_lagged(self, bs, capacity, busy, **flags):
        self.calls.append(("lagged", capacity, busy))
        self.last_bucket = 24  # the bucket of busy + capacity <= 3 + 15 verify tokens
        return bs, None


@pytest.mark.parametrize("scheduler", ["confidence", "lagged"])
def test_schedulers_run_the_static_round_when_the_table_says_it_dominates(scheduler):
    """A static round at least as fast as every ragged bucket (a launch-bound pool: measured on
    the H200 for the shipped model at 16 slots) is the schedulers' choice whatever the
    confidences, in its one program; slower, where the lagged survivals say it wins; else they
    run their own rounds."""
    from dspark_jax.decoding.serving import RoundDispatcher

    slots, flags = 4, dict(sampled=False, top_k=False, top_p=False)
    running = [0, 1, -1, 3]  # one slot idle: the lagged rule alone would not run the static round
    buckets = dict(tokens=(8, 16, 24), steps_per_s=(250.0, 245.0, 240.0))
    # 245/s: slower than the 8-token bucket, but with no history yet (survival 1: every draft is
    # worth verifying) the static round's Θ = 18 x 245 beats the lagged capacity's 18 x 240
    for static_sps, want in [(380.0, "static"), (250.0, "static"), (245.0, "static"), (200.0, None)]:
        eng = _RecordingEngine()
        disp = RoundDispatcher(eng, scheduler, SPSTable(**buckets, static_steps_per_s=static_sps), slots)
        for _ in range(3):
            disp.dispatch("state", running, flags)
        if want == "static":
            assert eng.calls == ["static"] * 3
        else:
            assert "static" not in eng.calls and len(eng.calls) == 3


@pytest.mark.parametrize("scheduler", ["confidence", "lagged"])
def test_schedulers_fall_back_to_the_static_round_when_ragged_rounds_run_slower_than_the_table(scheduler):
    """Round times measured while serving correct the table: ragged rounds three times slower
    than their entry make the static round the better choice after a few rounds (the first
    calls of a program compile and are not counted); as fast as the table says, or with
    adaptation off, the scheduler keeps its own rounds."""
    from dspark_jax.decoding.serving import RoundDispatcher

    slots, flags, running = 4, dict(sampled=False, top_k=False, top_p=False), [0, 1, -1, 3]
    table = SPSTable(tokens=(8, 16, 24), steps_per_s=(250.0, 245.0, 240.0), static_steps_per_s=200.0)
    for slow, adapt, want_static in [(3.0, True, True), (1.0, True, False), (3.0, False, False)]:
        eng, now = _RecordingEngine(), [0.0]
        disp = RoundDispatcher(eng, scheduler, table, slots, adapt=adapt, clock=lambda: now[0])
        for _ in range(10):
            disp.dispatch("state", running, flags)
            now[0] += 1 / 200.0 if eng.calls[-1] == "static" else slow / 240.0  # the round just dispatched
        ragged = [c != "static" for c in eng.calls]
        if want_static:  # rounds 0-2 ragged; round 2's time, the first counted, is read at round 3's dispatch
            assert ragged == [True] * 3 + [False] * 7
            assert disp.times.slowdown() == pytest.approx(3.0)
        else:
            assert all(ragged)
    # a later call on the same engine, pool and table starts from the round times measured
    eng, now = _RecordingEngine(), [0.0]
    for _ in range(2):  # the first call explores as above
        disp = RoundDispatcher(eng, scheduler, table, slots, clock=lambda: now[0])
        eng.calls.clear()
        for _ in range(10):
            disp.dispatch("state", running, flags)
            now[0] += 1 / 200.0 if eng.calls[-1] == "static" else 3.0 / 240.0
    assert eng.calls == ["static"] * 10


def test_several_rounds_per_call_give_the_same_tokens():
    """``generate``'s default ``rounds_per_call`` (4): the host hands the device four static rounds
    per call. Three requests through two slots (greedy with a stop token id, sampled with top-p,
    greedy with 150 new tokens: its window ring wraps) give the tokens and finish reasons of one
    round per call; requests that finish inside a call keep nothing of its later rounds; the
    engine compiled the four-round program and no one-round program."""
    shipped = gen.default_model()
    model = dspark_jax.Model(shipped.module, tokenizer=shipped.tokenizer, sts_temperatures=shipped.sts_temperatures)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (11, 20, 6)]
    params = [SamplingParams(max_new_tokens=17, ignore_eos=True),
              SamplingParams(max_new_tokens=150, ignore_eos=True),
              SamplingParams(max_new_tokens=13, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)]

    def run(params, k=None):  # None: generate's default
        kw = {} if k is None else dict(rounds_per_call=k)
        return dspark_jax.generate(prompts, model=model, sampling=params, slots=2, context=CONTEXT, **kw)

    one = run(params, 1)
    stop_tok = one[0].tokens[9]
    params[0] = dataclasses.replace(params[0], stop=(stop_tok,))
    one, four = run(params, 1), run(params)
    assert one[0].finish_reason == "stop" and len(one[0].tokens) <= 9
    assert len(prompts[1]) + len(one[1].tokens) > model.config.sliding_window  # the window ring wrapped
    for a, b in zip(one, four):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason
        assert b.stats["rounds"] == a.stats["rounds"]
        assert b.stats["accept_length_histogram"] == a.stats["accept_length_histogram"]
    assert sum(one[1].stats["accept_length_histogram"][2:]) > 0  # rounds that accepted two drafts or more
    assert gen.ROUNDS_PER_CALL == 4
    eng = gen._engine(model, model.config.dspark.block_size, None, "bf16", 4)
    kinds = {k[0] for k in eng.compiled_shapes()}
    assert "rounds" in kinds and "round" not in kinds
    assert {k[-1] for k in eng.compiled_shapes() if k[0] == "rounds"} == {4}


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3"])
def test_rounds_per_call_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="rounds_per_call"):
        dspark_jax.generate(["x"], sampling=SamplingParams(max_new_tokens=2), rounds_per_call=bad)
