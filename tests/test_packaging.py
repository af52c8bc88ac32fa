"""The package metadata and the examples a new user runs first."""

import importlib.util
import os
import tomllib

import dspark_jax
from dspark_jax.checkpoint.tokenizer import encode_chat
from dspark_jax.decoding.generate import prompt_ids
from tests.test_tokenizer import make_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_license_is_an_spdx_expression():
    """A TOML-table license makes setuptools print a deprecation block on every install (PEP 639)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert meta["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", []))
    assert "setuptools>=77" in meta["build-system"]["requires"]  # the first to read SPDX strings


def test_load_example_prompts_without_a_chat_format(small_checkpoint):
    """examples/load_deepseek_v4.py on the shipped kind of tokenizer (no chat tokens): plain text."""
    spec = importlib.util.spec_from_file_location("load_example", os.path.join(ROOT, "examples", "load_deepseek_v4.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    plain = dspark_jax.load(small_checkpoint, progress=False)  # the shipped tokenizer
    assert example.encode_prompt(plain, "def f(x):", thinking=False) == prompt_ids(plain, "def f(x):").tolist()
    chat = dspark_jax.Model(plain.module, tokenizer=make_tokenizer())
    messages = [{"role": "user", "content": "hello"}]
    assert example.encode_prompt(chat, "hello", thinking=True) == encode_chat(messages, True, tokenizer=chat.tokenizer)
