"""Bad arguments of the public API raise InputError naming the argument, before any computation."""

import numpy as np
import pytest

import dspark_jax
from dspark_jax import InputError, SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed=-5), r"seed must be in \[0, 4294967296\), got -5"),
    (dict(seed=2**40), r"seed must be in \[0, 4294967296\)"),
    (dict(seed=1.5), r"seed must be an integer, got 1.5"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(temperature=float("nan")), "temperature must be finite"),
    (dict(temperature="0.7"), "temperature must be a number, got '0.7'"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=None), "top_p must be a number, got None"),
    (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(max_new_tokens="10"), "max_new_tokens must be an integer, got '10'"),
    (dict(max_new_tokens=10.0), "max_new_tokens must be an integer, got 10.0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(stop={1, 2}), "stop must be a token id, a string, or a list of them; got set"),
    (dict(stop=[None]), "stop token id must be an integer, got None"),
    (dict(stop=[""]), "stop strings must not be empty"),
    (dict(stop=[-3]), "stop token id must be >= 0"),
    (dict(ignore_eos="no"), "ignore_eos must be a bool"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InputError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise():
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=7).stop == (7,) and SamplingParams(stop="\n\n").stop == ("\n\n",)
    sp = SamplingParams(max_new_tokens=np.int64(5), stop=np.array([3, 4]), seed=2**32 - 1, temperature=1)
    assert (sp.max_new_tokens, sp.stop, sp.seed, sp.temperature) == (5, (3, 4), 2**32 - 1, 1.0)
    assert type(sp.max_new_tokens) is int and all(type(s) is int for s in sp.stop)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=None), "prompts must be a string, a list of token ids, or a list of those; got NoneType"),
    (dict(prompts=5), "prompts must be .* got int"),
    (dict(prompts=[]), "no prompts given"),
    (dict(prompts="x", sampling="greedy"), "sampling must be a SamplingParams, a dict of its fields, or a list"),
    (dict(prompts="x", sampling=[None]), "sampling entries must be SamplingParams or dicts, got NoneType"),
    (dict(prompts="x", sampling={"temp": 1.0}), "sampling: .*unexpected keyword argument 'temp'"),
    (dict(prompts=["a", "b"], sampling=[SamplingParams()]), "got 1 SamplingParams for 2 prompts"),
    (dict(prompts="x", seed="1"), "seed must be an integer, got '1'"),
    (dict(prompts="x", kv_cache="int4"), "kv_cache must be one of"),
])
def test_bad_generate_arguments_fail_before_loading(kwargs, message, monkeypatch):
    from dspark_jax.decoding import generate as gen

    def no_model(*a, **k):
        raise AssertionError("the arguments should have been rejected before the model")
    monkeypatch.setattr(gen, "resolve_model", no_model)
    prompts = kwargs.pop("prompts")
    with pytest.raises(InputError, match=message):
        dspark_jax.generate(prompts, **kwargs)


def test_bad_token_ids(small_checkpoint):
    m = dspark_jax.load(small_checkpoint, progress=False)
    with pytest.raises(InputError, match="token_ids must form a rectangular array of integers"):
        m.logits([[1, 2], [3]])
    with pytest.raises(InputError, match="token_ids must be integers"):
        m.logits([1.0, 2.0])
    with pytest.raises(InputError, match="a prompt must be a string or a list of token ids, got NoneType"):
        dspark_jax.generate([None], model=m)
    with pytest.raises(InputError, match="prompt token ids must form a rectangular array"):
        dspark_jax.generate([[[1, 2], [3]]], model=m)
