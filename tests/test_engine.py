"""The speculative engine: lossless greedy decoding, batching, stops, errors, compilation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax
from dspark_jax import InputError, SamplingParams
from dspark_jax.decoding.engine import (Engine, pack_round, table_bucket, unpack_round, verify_bucket,
                                       verify_buckets)
from dspark_jax.decoding.generate import _engine, sps_table
from dspark_jax.decoding.scheduler import SPSTable
from tests.helpers import OracleDrafter

GAMMA = 5


@pytest.fixture(scope="module")
def greedy_truth(tiny_f32):
    """Target-only greedy continuations of two prompts of different lengths (shared by tests)."""
    rng = np.random.default_rng(10)
    prompts = [rng.integers(2, 500, 23).tolist(), rng.integers(2, 500, 70).tolist()]
    sp = SamplingParams(max_new_tokens=320, ignore_eos=True)
    res = dspark_jax.generate(prompts, model=tiny_f32, sampling=sp, speculative=False)
    return prompts, [r.tokens for r in res]


def test_greedy_speculative_equals_target_only(tiny_f32, greedy_truth):
    prompts, truth = greedy_truth
    res = dspark_jax.generate(prompts, model=tiny_f32, sampling=SamplingParams(max_new_tokens=60, ignore_eos=True))
    for r, t in zip(res, truth):
        assert r.tokens == t[:60]
        assert r.stats["rounds"] >= 1 and r.stats["gamma"] == GAMMA


@pytest.fixture(scope="module")
def oracle(tiny_f32, greedy_truth):
    """Drafts of the greedy truth, wrong at 25% of random positions (so every accept length
    happens), confidence logit +2 for right drafts and -2 for wrong ones; shared by the tests that
    decode these prompts through ``generate``'s pool of 2 slots x 512 tokens, which compiles once."""
    prompts, truth = greedy_truth
    rng = np.random.default_rng(11)
    full = [np.asarray(p + t) for p, t in zip(prompts, truth)]
    table = np.zeros((2, max(len(f) for f in full)), np.int32)
    for i, f in enumerate(full):
        table[i, :len(f)] = f
    return OracleDrafter(table, rng.random(table.shape) < 0.25, GAMMA, tiny_f32.config.vocab_size, signal=2.0)


def test_oracle_drafter_exercises_every_accept_length(tiny_f32, greedy_truth, oracle):
    """Drafts are right except at chosen positions: accept lengths 0..γ all occur, over 300+ tokens
    crossing window-ring wrap-around and C4 / C128 window boundaries; the output must not change."""
    prompts, truth = greedy_truth
    res = dspark_jax.generate(prompts, model=tiny_f32, sampling=SamplingParams(max_new_tokens=320, ignore_eos=True),
                              drafter=oracle)
    for r, t in zip(res, truth):
        assert r.tokens == t
        hist = r.stats["accept_length_histogram"]
        assert all(h > 0 for h in hist), hist  # accept lengths 1..γ+1 all happened
        assert r.stats["mean_accept_length"] > 2.0
    assert len(prompts[1]) + 320 > 2 * 128 + 16  # crossed two C128 windows


@pytest.mark.parametrize("gamma", [0, 5])
def test_packed_round_reads_back_every_field(gamma):
    """The serving loop's one read of a round (``pack_round`` on the device, ``unpack_round`` on
    the host) gives every field back bit for bit: -1 tokens, and confidences of any value."""
    rng = np.random.default_rng(gamma)
    b = 3
    fields = (rng.integers(-1, 50_000, (b, gamma + 1)), rng.integers(0, gamma + 2, b), rng.integers(0, gamma + 1, b),
              rng.normal(0, 30, (b, gamma)).astype(np.float32), rng.integers(0, gamma + 2, b))
    if gamma:
        fields[3][0, :3] = [np.inf, -np.inf, -0.0]
    host = np.asarray(jax.jit(pack_round)(*[jnp.asarray(f) for f in fields]))
    assert host.dtype == np.int32 and host.shape == (b, 2 * gamma + 4)
    for got, want in zip(unpack_round(host, gamma), fields):
        assert got.dtype == want.dtype or got.dtype == np.int32
        np.testing.assert_array_equal(got.view(np.int32), want.astype(got.dtype).view(np.int32))
    with pytest.raises(ValueError, match="columns"):
        unpack_round(host, gamma + 1)


def test_draft_rings_after_rounds_equal_fresh_prefill(tiny_f32, greedy_truth, oracle):
    """Context keys written round by round (only committed columns) equal a fresh prefill's (static
    rounds; the programs of ``generate``'s pool for these prompts, compiled by the tests above)."""
    prompts, truth = greedy_truth
    eng = _engine(tiny_f32, GAMMA, oracle)
    sp = SamplingParams(max_new_tokens=100, ignore_eos=True)
    bs, _ = _prefill_pool(eng, [np.asarray(p) for p in prompts], sp)
    for _ in range(12):
        bs, _ = eng.round(bs, sampled=False, top_k=False, top_p=False)
    lengths = np.asarray(bs.cache.lengths)
    assert np.all(lengths > np.array([len(p) for p in prompts]) + 12)
    fresh, _ = _prefill_pool(eng, [np.asarray(p + t)[:n] for p, t, n in zip(prompts, truth, lengths)], sp)
    for ring, ref in zip(bs.draft.rings, fresh.draft.rings):
        np.testing.assert_allclose(np.asarray(ring), np.asarray(ref), rtol=0, atol=1e-5)


def test_batch_mixing_equals_alone(tiny_f32):
    """Prompt lengths, greedy and sampled requests, early stops: each request as if alone. Four
    requests stream through the 2 x 256 pool of ``test_greedy_speculative_equals_target_only``
    (greedy and sampled ones share rounds, a slot is reused after an early stop), and every run
    alone uses the same pool, so all calls share the pool's compiled programs."""
    rng = np.random.default_rng(13)
    prompts = [rng.integers(2, 500, n).tolist() for n in (5, 16, 9, 13)]  # one prefill chunk size

    def run(prompts, sampling):
        return dspark_jax.generate(prompts, model=tiny_f32, sampling=sampling, slots=2, context=256)

    alone_greedy = run(prompts[0], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]  # the greedy round
    stop_tok = alone_greedy.tokens[7]
    params = [
        SamplingParams(max_new_tokens=30, stop=[stop_tok], ignore_eos=True),  # stops early on a token
        SamplingParams(max_new_tokens=25, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=9, ignore_eos=True),  # stops early on length
        SamplingParams(max_new_tokens=28, temperature=0.8, top_k=50, top_p=0.9, seed=3, ignore_eos=True),
    ]
    batch = run(prompts, params)  # the round with sampling, top-k and top-p, which the runs alone reuse
    for p, sp, r in zip(prompts, params, batch):
        alone = run(p, sp)[0]
        assert r.tokens == alone.tokens and r.finish_reason == alone.finish_reason
    # greedy rows of the sampling round give the greedy round's tokens
    assert batch[0].finish_reason == "stop" and stop_tok not in batch[0].tokens
    assert batch[0].tokens == alone_greedy.tokens[:alone_greedy.tokens.index(stop_tok)]
    assert batch[2].finish_reason == "length" and len(batch[2].tokens) == 9
    # seeded sampling is reproducible and depends on the seed
    again = run(prompts[1], params[1])[0]
    other = run(prompts[1], dataclasses.replace(params[1], seed=8))[0]
    assert again.tokens == batch[1].tokens and other.tokens != batch[1].tokens


def test_no_recompilation_across_rounds(tiny_f32, greedy_truth, oracle):
    """Other prompts with other acceptance through the same pool compile nothing (the first call
    compiles whatever an earlier test has not)."""
    prompts, truth = greedy_truth
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    dspark_jax.generate(prompts, model=tiny_f32, sampling=sp, drafter=oracle, context=POOL[1])  # warm-up
    eng = _engine(tiny_f32, GAMMA, oracle)
    before = (eng.compilations(), eng._prefill._cache_size())
    res = dspark_jax.generate([p[::-1] for p in prompts], model=tiny_f32, sampling=sp, drafter=oracle,
                              context=POOL[1])
    assert len(set(a for r in res for a in r.stats["accept_length_histogram"])) > 1  # varied acceptance
    assert (eng.compilations(), eng._prefill._cache_size()) == before


def test_bad_inputs(tiny_f32):
    m = tiny_f32
    with pytest.raises(InputError, match="empty"):
        dspark_jax.generate([[]], model=m)
    with pytest.raises(InputError, match="outside"):
        dspark_jax.generate([[1, 2, 9999]], model=m)
    with pytest.raises(InputError, match="exceeds the model context"):
        dspark_jax.generate([[1, 2, 3]], model=m, sampling=SamplingParams(max_new_tokens=m.config.max_position_embeddings))
    with pytest.raises(InputError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(InputError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InputError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InputError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(InputError, match="unknown model"):
        dspark_jax.generate([[1, 2]], model="/no/such/checkpoint")
    with pytest.raises(InputError, match="tokenizer"):
        dspark_jax.generate("hello", model=m)
    with pytest.raises(InputError, match="kv_cache"):
        dspark_jax.generate([[1, 2]], model=m, kv_cache="int4")
    no_draft = dspark_jax.init(dspark_jax.config.tiny(dspark=False), 0, dtype=jnp.float32)
    with pytest.raises(InputError, match="no DSpark drafter"):
        dspark_jax.generate([[1, 2]], model=no_draft)


def test_sharded_generation_equals_unsharded(tiny_f32, greedy_truth):
    """Parameters and per-request state spread over 8 devices: the same tokens, with one round per
    call and with four."""
    from dspark_jax.sharding import make_mesh

    prompts, truth = greedy_truth
    assert len(jax.devices()) == 8
    mesh = make_mesh(data=2)  # 2 x 4: requests over data, heads / vocab over model, experts over both
    res = dspark_jax.generate(prompts, model=tiny_f32, sampling=SamplingParams(max_new_tokens=12, ignore_eos=True),
                              mesh=mesh)
    for r, t in zip(res, truth):
        assert r.tokens == t[:12]
    several = dspark_jax.generate(prompts, model=tiny_f32, sampling=SamplingParams(max_new_tokens=12, ignore_eos=True),
                                  mesh=mesh, rounds_per_call=4)  # four rounds per call on the mesh
    assert [r.tokens for r in several] == [r.tokens for r in res]
    # a pool's state is built by one program straight into its layout on the mesh
    from dspark_jax.decoding.generate import _sharded
    from dspark_jax.sharding import state_shardings

    eng = _engine(_sharded(tiny_f32, mesh), GAMMA, None)
    pool = eng.init_slots(4, 64)
    for leaf, want in zip(jax.tree_util.tree_leaves(pool), jax.tree_util.tree_leaves(state_shardings(pool, mesh))):
        assert leaf.sharding == want
    assert pool.cache.lengths.sharding.spec == jax.sharding.PartitionSpec("data")  # 4 slots split over 2


def test_stops_default_to_eos(tiny_f32):
    from dspark_jax.decoding.generate import _with_stops

    eos = tiny_f32.config.eos_token_id
    assert _with_stops(tiny_f32, SamplingParams(stop=[7])).stop == (7, eos)
    assert _with_stops(tiny_f32, SamplingParams(stop=[7], ignore_eos=True)).stop == (7,)
    with pytest.raises(InputError, match="outside the vocabulary"):
        _with_stops(tiny_f32, SamplingParams(stop=[10**6]))


def test_request_filling_the_whole_context():
    """prompt + max_new_tokens = the model context: the last verify blocks write rows past the
    context (the cache's verify slack) while whole drafts are accepted; output = target-only."""
    # the oracle drafts; the target's three kinds of layers (window-only, C4 + indexer, C128) once each
    cfg = dspark_jax.config.tiny(dspark=False).replace(max_position_embeddings=256, num_hidden_layers=3,
                                                       compress_ratios=(0, 4, 128))
    m = dspark_jax.init(cfg, 1, dtype=jnp.float32)
    new = 23
    prompt = (np.arange(cfg.max_position_embeddings - new) * 7 % 300 + 3).tolist()
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    truth = dspark_jax.generate([prompt], model=m, sampling=sp, speculative=False)[0]
    assert len(truth.tokens) == new
    table = np.asarray([prompt + truth.tokens])
    oracle = OracleDrafter(table, np.zeros(table.shape, bool), GAMMA, cfg.vocab_size)
    spec = dspark_jax.generate([prompt], model=m, sampling=sp, drafter=oracle)[0]
    assert spec.tokens == truth.tokens
    assert spec.stats["accept_length_histogram"][-1] >= 3  # rounds that accepted all γ drafts



POOL = (2, 512)  # generate's pool for the two prompts of greedy_truth with 320 new tokens
SPS = SPSTable(tokens=(8, 12), steps_per_s=(10.0, 6.0))  # rounds past 8 verify tokens are much slower


def _prefill_pool(eng: Engine, seqs: list[np.ndarray], sp: SamplingParams):
    """Slots 0 and 1 of a fresh pool take ``seqs``, prefilled in 128-token chunks (the programs
    ``generate`` compiles for this pool); returns the state and the first tokens."""
    bs = eng.admit(eng.init_slots(*POOL), {0: (sp, 0), 1: (sp, 1)}, np.zeros(2, bool))
    lens = np.array([len(x) for x in seqs])
    for start in range(0, lens.max(), 128):
        chunk = np.zeros((2, 128), np.int32)
        for i, x in enumerate(seqs):
            part = x[start:start + 128]
            chunk[i, :len(part)] = part
        bs, first = eng.prefill_step(bs, np.arange(2), chunk, np.clip(lens - start, 0, 128),
                                     (lens > start) & (lens <= start + 128))
    return bs, np.asarray(first)


def test_ragged_verify_equals_target_only(tiny_f32, greedy_truth, oracle):
    """Ragged verify with random lengths per slot and round (0: the slot sits the round out; 1:
    the anchor alone; up to γ + 1): the output is the target-only greedy output over 150+ tokens
    per request (window rings wrap, C4 and C128 windows close during rounds), the draft rings
    equal a fresh prefill's; 100 rounds in the 8-token bucket, then 12 in the top bucket (the
    per-request layout, some slots verifying fewer than γ + 1)."""
    prompts, truth = greedy_truth
    eng = _engine(tiny_f32, GAMMA, oracle)
    sp = SamplingParams(max_new_tokens=320, ignore_eos=True)
    bs, first = _prefill_pool(eng, [np.asarray(p) for p in prompts], sp)
    out = [[int(t)] for t in first]
    rng = np.random.default_rng(15)
    n_new_seen = []
    for _ in range(100):
        lens = np.array([rng.integers(0, GAMMA + 2), 0])
        lens[1] = rng.integers(0, min(GAMMA + 1, 8 - lens[0]) + 1)  # at most 8 tokens: one bucket
        lens = lens[::-1] if rng.random() < 0.5 else lens
        bs, res = eng.round(bs, sampled=False, top_k=False, top_p=False, verify_lens=lens)
        n_new, tokens = np.asarray(res.n_new), np.asarray(res.tokens)
        assert np.asarray(res.verify_lens).tolist() == lens.tolist() and np.all(n_new <= lens)
        for i in range(2):
            out[i] += tokens[i, :n_new[i]].tolist()
        n_new_seen += n_new.tolist()
    assert {k[-1] for k in eng.compiled_shapes() if k[0] == "verify"} == {8}
    for k in range(12):  # more than 8 tokens: the top bucket (12), in the per-request layout, capped per slot
        lens = np.array([GAMMA + 1, 3 + k % 4])[::1 if k % 2 else -1]
        bs, res = eng.round(bs, sampled=False, top_k=False, top_p=False, verify_lens=lens)
        n_new, tokens = np.asarray(res.n_new), np.asarray(res.tokens)
        assert np.asarray(res.verify_lens).tolist() == lens.tolist() and np.all(n_new <= lens)
        for i in range(2):
            out[i] += tokens[i, :n_new[i]].tolist()
    for o, p, t in zip(out, prompts, truth):
        assert len(p) + len(o) > 128 + 8 and o == t[:len(o)]
    assert set(n_new_seen) == set(range(GAMMA + 2))  # 0 (sat out) .. γ + 1 (every draft accepted)
    assert {k[-1] for k in eng.compiled_shapes() if k[0] == "verify"} == {8, 12}

    lengths = np.asarray(bs.cache.lengths)
    fresh, _ = _prefill_pool(eng, [np.asarray(p + t)[:n] for p, t, n in zip(prompts, truth, lengths)], sp)
    for ring, ref in zip(bs.draft.rings, fresh.draft.rings):
        np.testing.assert_allclose(np.asarray(ring), np.asarray(ref), rtol=0, atol=1e-5)


def test_fine_buckets_verify_packed_rounds_of_any_multiple_of_the_slots(tiny_f32, greedy_truth, oracle):
    """With ``fine_buckets`` a round of 9-10 tokens of a 2-slot pool verifies packed in the
    10-token bucket (not the 12-token per-request layout), and the output is still the
    target-only greedy output."""
    prompts, truth = greedy_truth
    eng = Engine(tiny_f32, gamma=GAMMA, drafter=oracle, fine_buckets=True)
    sp = SamplingParams(max_new_tokens=320, ignore_eos=True)
    bs, first = _prefill_pool(eng, [np.asarray(p) for p in prompts], sp)
    out = [[int(t)] for t in first]
    for k in range(10):
        lens = np.array([GAMMA + 1, 3 + k % 2])[::1 if k % 3 else -1]
        bs, res = eng.round(bs, sampled=False, top_k=False, top_p=False, verify_lens=lens)
        assert eng.last_bucket == 10
        n_new, tokens = np.asarray(res.n_new), np.asarray(res.tokens)
        assert np.all(n_new <= lens)
        for i in range(2):
            out[i] += tokens[i, :n_new[i]].tolist()
    for o, t in zip(out, truth):
        assert len(o) > 20 and o == t[:len(o)]
    assert {k[-1] for k in eng.compiled_shapes() if k[0] == "verify"} == {10}


def test_schedulers_run_in_the_buckets_of_their_table(tiny_f32, greedy_truth, oracle):
    """Given a table timed at 8, 10 and 12 verify tokens (the buckets of ``sps_table(...,
    fine_buckets=1)`` for a 2-slot pool), ``generate``'s schedulers pack their ragged rounds in those buckets:
    rounds of 9-10 tokens in the 10-token bucket, not the 12 of the engine's power-of-2 rule (the
    verify programs compiled are the table's), and the output is the target-only greedy output."""
    prompts, truth = greedy_truth
    eng = _engine(tiny_f32, GAMMA, oracle)
    earlier, eng._shapes = eng._shapes, set()  # the shapes of this test's calls alone (the engine is shared)
    table = SPSTable(tokens=(8, 10, 12), steps_per_s=(10.0, 8.5, 6.0))
    try:
        for scheduler in ("lagged", "confidence"):
            res = dspark_jax.generate(prompts, model=tiny_f32, drafter=oracle, scheduler=scheduler, sps_table=table,
                                      sampling=SamplingParams(max_new_tokens=320, ignore_eos=True))
            for r, t in zip(res, truth):
                assert r.tokens == t
            verify = {k[-1] for k in eng.compiled_shapes() if k[0] == "verify"}
            assert 10 in verify and verify <= set(table.tokens), (scheduler, verify)
    finally:
        eng._shapes |= earlier


def test_schedulers_equal_target_only(tiny_f32, greedy_truth, oracle):
    """The lagged and confidence schedulers (confidence high where drafts are right, a steep SPS
    table) verify fewer tokens than γ + 1 per round, accept several drafts per round, and give
    the target-only greedy output; a second call compiles nothing."""
    prompts, truth = greedy_truth
    eng = _engine(tiny_f32, GAMMA, oracle)
    earlier, eng._shapes = eng._shapes, set()  # the shapes of this test's calls alone (the engine is shared)
    for scheduler in ("lagged", "confidence"):
        res = dspark_jax.generate(prompts, model=tiny_f32, sampling=SamplingParams(max_new_tokens=320, ignore_eos=True),
                                  drafter=oracle, scheduler=scheduler, sps_table=SPS)
        for r, t in zip(res, truth):
            assert r.tokens == t
            assert 2.0 < r.stats["mean_verify_tokens"] < GAMMA + 1 and r.stats["mean_accept_length"] > 2.0
    programs = eng.compiled_programs()
    assert {k[-1] for k in eng.compiled_shapes() if k[0] == "verify"} == {8}
    eng._shapes |= earlier
    for scheduler in ("lagged", "confidence"):
        res = dspark_jax.generate([p[::-1] for p in prompts], model=tiny_f32, drafter=oracle, context=POOL[1],
                                  sampling=SamplingParams(max_new_tokens=30, ignore_eos=True), scheduler=scheduler,
                                  sps_table=SPS)
    assert eng.compiled_programs() == programs


def test_verify_buckets_and_bad_ragged_inputs(tiny_f32):
    """Token buckets: powers of 2 from 8, the pool's slots x (γ + 1) at the top; bad verify
    lengths and schedulers raise before anything runs."""
    assert [verify_bucket(t, 2, GAMMA) for t in (0, 1, 8, 9, 12)] == [8, 8, 8, 12, 12]
    assert [verify_bucket(t, 64, GAMMA) for t in (1, 9, 64, 65, 257, 384)] == [8, 16, 64, 128, 384, 384]
    with pytest.raises(ValueError, match="verifies 0 to 12 tokens"):
        verify_bucket(13, 2, GAMMA)
    # fine buckets: every multiple of the slots above them
    assert [verify_bucket(t, 64, GAMMA, fine=True) for t in (1, 64, 65, 129, 200, 384)] == [8, 64, 128, 192, 256, 384]
    assert verify_buckets(64, GAMMA, fine=True) == (8, 16, 32, 64, 128, 192, 256, 320, 384)
    assert verify_buckets(2, GAMMA, fine=True) == (8, 10, 12) and verify_buckets(2, GAMMA) == (8, 12)
    assert verify_buckets(48, GAMMA, fine=True) == (8, 16, 32, 48, 96, 144, 192, 240, 288)
    # and of half the slots with fine=2
    assert [verify_bucket(t, 64, GAMMA, fine=2) for t in (1, 64, 65, 97, 200, 384)] == [8, 64, 96, 128, 224, 384]
    assert verify_buckets(6, GAMMA, fine=2) == (8, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36)
    with pytest.raises(ValueError, match="fine_buckets"):
        Engine(tiny_f32, gamma=GAMMA, fine_buckets=-1)
    with pytest.raises(InputError, match="fine_buckets must be >= 0"):
        sps_table(tiny_f32, slots=2, context=256, fine_buckets=-1)
    # a table's buckets: the smallest holding the tokens, at most the pool's slots x (γ + 1)
    assert [table_bucket(t, 2, GAMMA, (8, 10, 12)) for t in (0, 8, 9, 10, 11, 12)] == [8, 8, 10, 10, 12, 12]
    assert table_bucket(20, 4, GAMMA, (16, 32)) == 24 and table_bucket(3, 4, GAMMA, (2, 4, 8)) == 4
    with pytest.raises(ValueError, match="buckets .* stop at 10"):
        table_bucket(11, 2, GAMMA, (8, 10))
    with pytest.raises(ValueError, match="verifies 0 to 12 tokens"):
        table_bucket(13, 2, GAMMA, (8, 16))
    eng = Engine(tiny_f32, gamma=GAMMA)
    bs = eng.init_slots(2, 256)
    flags = dict(sampled=False, top_k=False, top_p=False)
    with pytest.raises(ValueError, match=r"verify_lens must lie in \[0, gamma \+ 1 = 6\]"):
        eng.round(bs, verify_lens=np.array([7, 0]), **flags)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        eng.round(bs, verify_lens=np.array([1]), **flags)
    with pytest.raises(ValueError, match="needs an initialised SPS table"):
        eng.round_confidence(bs, SPSTable.uninitialised(), **flags)
    with pytest.raises(ValueError, match="scheduler must be one of"):
        Engine(tiny_f32, gamma=GAMMA, scheduler="fast")
    with pytest.raises(InputError, match="scheduler must be one of"):
        dspark_jax.generate([[1, 2]], model=tiny_f32, scheduler="fast")
    with pytest.raises(InputError, match="needs speculative decoding"):
        dspark_jax.generate([[1, 2]], model=tiny_f32, speculative=False, scheduler="lagged")


def test_compiler_options_reach_the_programs(tiny_f32):
    """The engine's programs compile with its XLA options: a value XLA rejects fails the prefill's
    and the round's compile (the option is not dropped on the way); the default is
    ``COMPILER_OPTIONS``, ``{}`` passes none."""
    from dspark_jax.compile_cache import COMPILER_OPTIONS

    assert Engine(tiny_f32, gamma=GAMMA).compiler_options == COMPILER_OPTIONS
    assert Engine(tiny_f32, gamma=0, compiler_options={}).compiler_options == {}
    bad = Engine(tiny_f32, gamma=GAMMA, compiler_options={"xla_gpu_command_buffer_scheduling_mode": "SOMETIMES"})
    prompts = [np.arange(3, 9), np.arange(5, 20)]
    bs = bad.init_state(prompts, [SamplingParams(max_new_tokens=8)] * 2, [1, 2], 64)
    with pytest.raises(Exception, match="xla_gpu_command_buffer_scheduling_mode"):
        bad.prefill(bs, prompts)
    with pytest.raises(Exception, match="xla_gpu_command_buffer_scheduling_mode"):
        bad.round(bad.init_slots(2, 64), sampled=False, top_k=False, top_p=False)
    with pytest.raises(ValueError, match="compiler_options must be a dict"):
        Engine(tiny_f32, gamma=GAMMA, compiler_options="CONCURRENT")


def test_several_rounds_per_call_carry_the_state_in_place_at_flash_dims():
    """A 4-layer DeepSeek-V4-Flash slice (window, C4 and C128 layers; FP8 weights, fp8 KV pools),
    8 slots of 8,192 tokens, compiled from abstract arrays (XLA's CPU reference path): the program
    looping over 3 rounds returns the whole donated state in its input buffers like the one-round
    program, copies no large array the one-round program does not (no cache or weight copied per
    round), and its temporaries stay within 2 % of the one-round program's."""
    from benchmarks.rounds_memory import measure

    rows = measure(4, 8, 8192, (1, 3))
    for mode in ("target", "dspark"):
        one, three = (next(r for r in rows if r["mode"] == mode and r["rounds_per_call"] == k) for k in (1, 3))
        assert one["state_mb"] > 20  # the caches are in the state
        assert three["alias_mb"] == one["alias_mb"] == one["state_mb"]
        assert one["large_copies"]  # (the listing finds copies: activations of the reference path)
        assert all(n <= one["large_copies"].get(shape, 0) for shape, n in three["large_copies"].items()), (
            three["large_copies"], one["large_copies"])
        assert abs(three["temp_mb"] - one["temp_mb"]) <= 0.02 * one["temp_mb"]
