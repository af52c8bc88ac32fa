"""Test helpers shared by several test modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax
from dspark_jax import config
from dspark_jax.api import forward_step
from dspark_jax.cache import commit
from pallas_kernels.lowering import pallas_calls, subjaxprs  # noqa: F401 (shared by the tests)


MATMULS = ("dot_general", "ragged_dot_general", "ragged_dot")


def equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (kernels of pallas_calls included), in
    program order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in subjaxprs(v):
                yield from equations(sub)


def matmul_precisions(jaxpr) -> list:
    """The precision parameter of every matmul in ``jaxpr`` and its sub-programs."""
    return [eqn.params.get("precision") for eqn in equations(jaxpr) if eqn.primitive.name in MATMULS]


def perturb(model: dspark_jax.Model, seed: int = 0, scale: float = 0.3) -> dspark_jax.Model:
    """Add noise to every float parameter (init leaves sinks, ape, hc bases and biases at 0 / 1,
    which would hide mistakes in how they are applied)."""
    key = jax.random.key(seed)
    state = nnx.state(model.module)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    out = []
    for i, x in enumerate(leaves):
        if jnp.issubdtype(x.dtype, jnp.floating):
            std = jnp.maximum(jnp.std(x.astype(jnp.float32)), 0.05) * scale
            noise = std * jax.random.normal(jax.random.fold_in(key, i), x.shape)
            x = (x.astype(jnp.float32) + noise).astype(x.dtype)
        out.append(x)
    nnx.update(model.module, jax.tree_util.tree_unflatten(treedef, out))
    return dspark_jax.Model(model.module, tokenizer=model.tokenizer)


def perturbed_tiny(dtype=jnp.float32, *, quant_sim: bool = False, seed: int = 0, dspark: bool = True):
    m = dspark_jax.init(config.tiny(dspark=dspark), seed, dtype=dtype, quant_sim=quant_sim)
    return perturb(m, seed)


def run_chunks(model: dspark_jax.Model, ids: np.ndarray, sizes, cache, *, commit_all: bool = True):
    """Feed ``ids`` [b, t] in chunks of the given sizes; returns concatenated logits and the cache."""
    out, pos = [], 0
    b = ids.shape[0]
    for sz in sizes:
        n = jnp.full((b,), sz, jnp.int32)
        lg, _, cache = forward_step(model.graphdef, model.state, jnp.asarray(ids[:, pos:pos + sz]), n, cache)
        cache = commit(cache, n)
        out.append(np.asarray(lg))
        pos += sz
    return np.concatenate(out, axis=1), cache


class OracleDrafter:
    """A test-only drafter proposing the target's own greedy continuation ``truth`` [b, n] (prompt +
    target-only output, per request), except at positions where ``wrong`` [b, n] is set, where it
    proposes a different token. This makes every accept length 0..γ happen on purpose.
    Confidence logits: ``signal`` for right drafts, ``-signal`` for wrong ones (0: none)."""

    def __init__(self, truth: np.ndarray, wrong: np.ndarray, gamma: int, vocab: int, signal: float = 0.0):
        self.truth, self.wrong = jnp.asarray(truth, jnp.int32), jnp.asarray(wrong, bool)
        self.gamma, self.vocab, self.signal = gamma, vocab, signal

    def __call__(self, model, draft_cache, anchor, lengths, pick):
        from dspark_jax.model.dspark import DraftOutput

        n = self.truth.shape[1]
        pos = jnp.clip(lengths[:, None] + jnp.arange(1, self.gamma + 1)[None], 0, n - 1)
        true = jnp.take_along_axis(self.truth, pos, axis=1)
        bad = jnp.take_along_axis(self.wrong, pos, axis=1)
        tokens = jnp.where(bad, (true + 1) % self.vocab, true)
        logits = jax.nn.one_hot(tokens, self.vocab) * 30.0
        return DraftOutput(tokens=tokens, logits=logits, confidence=jnp.where(bad, -self.signal, self.signal))
