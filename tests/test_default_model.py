"""The shipped DeepSeek-V4 + DSpark pair: loads through the official-layout loader, is the default
model, and decodes losslessly on held-out text; fp8 KV pools track bf16 pools."""

import re

import numpy as np
import pytest

import dspark_jax
from dspark_jax import SamplingParams
from dspark_jax.decoding.generate import DEFAULT_MODEL_DIR, default_model, prompt_ids
from dspark_jax.train.corpus import CorpusConfig, build_corpus


# Every generate call of this module runs in one pool of 4 slots x 512 tokens (the fp8 test's 128
# new tokens need 512), so the DSpark engine compiles its programs once for all of them.
POOL = dict(slots=4, context=512)


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
    assert dspark_jax.generate(heldout_prompts[0], sampling=sp, **POOL)[0].tokens == \
        dspark_jax.generate(heldout_prompts[0], model=m, sampling=sp, **POOL)[0].tokens


def test_greedy_speculative_equals_target_only_on_heldout(heldout_prompts, capsys):
    sp = SamplingParams(max_new_tokens=64)
    spec = dspark_jax.generate(heldout_prompts, sampling=sp, progress=True, **POOL)
    base = dspark_jax.generate(heldout_prompts, sampling=sp, speculative=False, **POOL)
    for s, b in zip(spec, base):
        assert s.tokens == b.tokens and s.text == b.text
        assert s.stats["greedy_exact"] and b.stats["greedy_exact"]  # float32 on the CPU: the flag says so
    # the drafter is trained: tokens per round over every round (a request that stops at its first
    # token, as the shipped target does after one of these prompts, has no rounds and a NaN mean)
    rounds = np.array([r.stats["rounds"] for r in spec])
    taus = np.array([r.stats["mean_accept_length"] if n else 0.0 for r, n in zip(spec, rounds)])
    assert rounds.sum() > 0 and (taus * rounds).sum() / rounds.sum() > 1.5
    # rounds emit up to γ + 1 tokens, past a request's budget: the bar counts the tokens kept
    shown = [(int(n), int(t)) for n, t in re.findall(r"\| (\d+)/(\d+) \[", capsys.readouterr().err)]
    kept = sum(len(r.tokens) for r in spec)
    assert shown[-1] == (kept, kept) and all(n <= t for n, t in shown), shown


def test_fp8_kv_pools_track_bf16_pools(heldout_prompts):
    """fp8 target KV pools against bf16 pools over a long greedy run (128 tokens per request: the
    window rings wrap).

    Per-token agreement is measured teacher-forced: both layouts score the same bf16-pool
    generation in verify-sized chunks, and their greedy next tokens are compared at every
    generated position (a free-running comparison stops meaning anything after the first
    divergence; it is printed too)."""
    m = default_model()
    sp = SamplingParams(max_new_tokens=128, ignore_eos=True)
    a = dspark_jax.generate(heldout_prompts, sampling=sp, kv_cache="bf16", **POOL)
    b = dspark_jax.generate(heldout_prompts, sampling=sp, kv_cache="fp8", **POOL)
    first = [next((i for i, (u, v) in enumerate(zip(x.tokens, y.tokens)) if u != v), len(x.tokens))
             for x, y in zip(a, b)]
    chunk = m.config.dspark.block_size + 1
    prompts = [prompt_ids(m, p).tolist() for p in heldout_prompts]
    seqs = [p + r.tokens for p, r in zip(prompts, a)]
    width = -(-max(map(len, seqs)) // chunk) * chunk  # whole chunks: one program per layout
    batch = np.asarray([s + [m.config.eos_token_id] * (width - len(s)) for s in seqs], np.int32)  # causal: tail padding is inert
    bf16 = np.argmax(np.asarray(m.logits(batch, chunk_size=chunk, kv_cache="bf16")), -1)
    fp8 = np.argmax(np.asarray(m.logits(batch, chunk_size=chunk, kv_cache="fp8")), -1)
    agree, n = 0, 0
    for i, (p, r) in enumerate(zip(prompts, a)):
        gen = slice(len(p) - 1, len(p) - 1 + len(r.tokens))  # positions whose next token was generated
        assert np.array_equal(bf16[i, gen], r.tokens)  # teacher forcing reproduces the generation
        agree, n = agree + int(np.sum(fp8[i, gen] == bf16[i, gen])), n + len(r.tokens)
    print(f"fp8 vs bf16 KV over {n} tokens: teacher-forced agreement {agree / n:.4f}; free-running "
          f"first divergence per request {first} of {[len(r.tokens) for r in a]}")
    assert agree / n >= 0.95
