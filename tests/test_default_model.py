"""The shipped DeepSeek-V4 + DSpark pair: loads through the official-layout loader, is the default
model, and decodes losslessly on held-out text; fp8 KV pools track bf16 pools."""

import numpy as np
import pytest

import dspark_jax
from dspark_jax import SamplingParams
from dspark_jax.decoding.generate import DEFAULT_MODEL_DIR, default_model
from dspark_jax.train.corpus import CorpusConfig, build_corpus


@pytest.fixture(scope="module")
def heldout_prompts():
    """Code from files of the held-out split (never trained on), cut at line boundaries."""
    corpus = build_corpus(CorpusConfig())
    prompts = []
    for _, text in corpus.heldout[:4]:
        lines = text.splitlines(keepends=True)
        start = len(lines) // 3
        prompts.append("".join(lines[start:start + 12]))
    return prompts


def test_shipped_checkpoint_is_the_default(heldout_prompts):
    m = default_model()
    assert m.path == DEFAULT_MODEL_DIR and m.config.dspark is not None and m.tokenizer is not None
    assert m.sts_temperatures is not None and len(m.sts_temperatures) == m.config.dspark.block_size
    sp = SamplingParams(max_new_tokens=8)
    assert dspark_jax.generate(heldout_prompts[0], sampling=sp)[0].tokens == \
        dspark_jax.generate(heldout_prompts[0], model=m, sampling=sp)[0].tokens


def test_greedy_speculative_equals_target_only_on_heldout(heldout_prompts):
    sp = SamplingParams(max_new_tokens=64)
    spec = dspark_jax.generate(heldout_prompts, sampling=sp)
    base = dspark_jax.generate(heldout_prompts, sampling=sp, speculative=False)
    for s, b in zip(spec, base):
        assert s.tokens == b.tokens and s.text == b.text
    assert np.mean([r.stats["mean_accept_length"] for r in spec]) > 1.5  # the drafter is trained


def test_fp8_kv_pools_track_bf16_pools(heldout_prompts):
    """Greedy decoding with fp8 target KV pools against bf16 pools over a long run: tokens agree
    position by position (the report prints the agreement and the first divergence)."""
    sp = SamplingParams(max_new_tokens=192)
    a = dspark_jax.generate(heldout_prompts, sampling=sp, kv_cache="bf16")
    b = dspark_jax.generate(heldout_prompts, sampling=sp, kv_cache="fp8")
    same = [np.mean(np.asarray(x.tokens) == np.asarray(y.tokens)) for x, y in zip(a, b)]
    first = [next((i for i, (u, v) in enumerate(zip(x.tokens, y.tokens)) if u != v), len(x.tokens))
             for x, y in zip(a, b)]
    print(f"fp8 vs bf16 KV: token agreement {np.mean(same):.3f} per request {np.round(same, 3).tolist()}, "
          f"first divergence {first}")
    assert np.mean(same) >= 0.95
