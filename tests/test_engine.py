"""The speculative engine: lossless greedy decoding, batching, stops, errors, compilation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax
from dspark_jax import InputError, SamplingParams
from dspark_jax.decoding.engine import Engine
from dspark_jax.decoding.generate import _engine
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


def test_oracle_drafter_exercises_every_accept_length(tiny_f32, greedy_truth):
    """Drafts are right except at chosen positions: accept lengths 0..γ all occur, over 300+ tokens
    crossing window-ring wrap-around and C4 / C128 window boundaries; the output must not change."""
    prompts, truth = greedy_truth
    rng = np.random.default_rng(11)
    full = [np.asarray(p + t) for p, t in zip(prompts, truth)]
    n = max(len(f) for f in full)
    table = np.zeros((2, n), np.int32)
    wrong = rng.random((2, n)) < 0.25  # mistakes at random positions -> all accept lengths
    for i, f in enumerate(full):
        table[i, :len(f)] = f
    oracle = OracleDrafter(table, wrong, GAMMA, tiny_f32.config.vocab_size)
    res = dspark_jax.generate(prompts, model=tiny_f32, sampling=SamplingParams(max_new_tokens=320, ignore_eos=True),
                              drafter=oracle)
    for r, t in zip(res, truth):
        assert r.tokens == t
        hist = r.stats["accept_length_histogram"]
        assert all(h > 0 for h in hist), hist  # accept lengths 1..γ+1 all happened
        assert r.stats["mean_accept_length"] > 2.0
    assert len(prompts[1]) + 320 > 2 * 128 + 16  # crossed two C128 windows


def test_draft_rings_after_rounds_equal_fresh_prefill(tiny_f32, greedy_truth):
    """Context keys written round by round (only committed columns) equal a fresh prefill's."""
    prompts, truth = greedy_truth
    full = np.asarray(prompts[0] + truth[0])
    wrong = np.random.default_rng(12).random((1, len(full))) < 0.3
    oracle = OracleDrafter(full[None], wrong, GAMMA, tiny_f32.config.vocab_size)
    eng = Engine(tiny_f32, gamma=GAMMA, drafter=oracle)
    sp = [SamplingParams(max_new_tokens=100, ignore_eos=True)]
    bs = eng.init_state([np.asarray(prompts[0])], sp, [0], 256)
    bs, _ = eng.prefill(bs, [np.asarray(prompts[0])])
    for _ in range(12):
        bs, _ = eng.round(bs, sampled=False, top_k=False, top_p=False)
    length = int(bs.cache.lengths[0])
    assert length > len(prompts[0]) + 12
    fresh = eng.init_state([full[:length]], sp, [0], 256)
    fresh, _ = eng.prefill(fresh, [full[:length]])
    for ring, ref in zip(bs.draft.rings, fresh.draft.rings):
        np.testing.assert_allclose(np.asarray(ring), np.asarray(ref), rtol=0, atol=1e-5)


def test_batch_mixing_equals_alone(tiny_f32):
    """Prompt lengths, greedy and sampled requests, early stops: each request as if alone."""
    rng = np.random.default_rng(13)
    prompts = [rng.integers(2, 500, n).tolist() for n in (5, 16, 9, 13)]  # one prefill chunk size
    alone_greedy = dspark_jax.generate(prompts[0], model=tiny_f32,
                                       sampling=SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    stop_tok = alone_greedy.tokens[7]
    params = [
        SamplingParams(max_new_tokens=30, stop=[stop_tok], ignore_eos=True),  # stops early on a token
        SamplingParams(max_new_tokens=25, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=9, ignore_eos=True),  # stops early on length
        SamplingParams(max_new_tokens=28, temperature=0.8, top_k=50, top_p=0.9, seed=3, ignore_eos=True),
    ]
    batch = dspark_jax.generate(prompts, model=tiny_f32, sampling=params)
    for p, sp, r in zip(prompts, params, batch):
        alone = dspark_jax.generate(p, model=tiny_f32, sampling=sp)[0]
        assert r.tokens == alone.tokens and r.finish_reason == alone.finish_reason
    assert batch[0].finish_reason == "stop" and stop_tok not in batch[0].tokens
    assert batch[0].tokens == alone_greedy.tokens[:alone_greedy.tokens.index(stop_tok)]
    assert batch[2].finish_reason == "length" and len(batch[2].tokens) == 9
    # seeded sampling is reproducible and depends on the seed
    again = dspark_jax.generate(prompts[1], model=tiny_f32, sampling=params[1])[0]
    other = dspark_jax.generate(prompts[1], model=tiny_f32, sampling=dataclasses.replace(params[1], seed=8))[0]
    assert again.tokens == batch[1].tokens and other.tokens != batch[1].tokens


def test_no_recompilation_across_rounds(tiny_f32, greedy_truth):
    prompts, truth = greedy_truth
    full = [np.asarray(p + t) for p, t in zip(prompts, truth)]
    n = max(len(f) for f in full)
    table = np.zeros((2, n), np.int32)
    for i, f in enumerate(full):
        table[i, :len(f)] = f
    rng = np.random.default_rng(14)
    oracle = OracleDrafter(table, rng.random((2, n)) < 0.3, GAMMA, tiny_f32.config.vocab_size)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    dspark_jax.generate(prompts, model=tiny_f32, sampling=sp, drafter=oracle)  # warm-up
    eng = _engine(tiny_f32, GAMMA, oracle)
    before = (eng.compilations(), eng._prefill._cache_size())
    res = dspark_jax.generate([p[::-1] for p in prompts], model=tiny_f32, sampling=sp, drafter=oracle)
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
    """Parameters and per-request state spread over 8 devices: the same tokens."""
    from dspark_jax.sharding import make_mesh

    prompts, truth = greedy_truth
    assert len(jax.devices()) == 8
    mesh = make_mesh(data=2)  # 2 x 4: requests over data, heads / vocab over model, experts over both
    res = dspark_jax.generate(prompts, model=tiny_f32, sampling=SamplingParams(max_new_tokens=12, ignore_eos=True),
                              mesh=mesh)
    for r, t in zip(res, truth):
        assert r.tokens == t[:12]


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
    cfg = dspark_jax.config.tiny().replace(max_position_embeddings=256)
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
