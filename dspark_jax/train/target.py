"""Target pretraining: next-token cross-entropy of ``DeepSeekV4.forward`` over whole windows.

One chunk holding the whole window, from an empty cache, is an exact causal forward (every V4
mechanism included: window attention, C4 + indexer, C128, hash / learned MoE, mHC). The cache it
returns is unused, so XLA drops those writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from dspark_jax.cache import init_cache
from dspark_jax.model.deepseek_v4 import DeepSeekV4
from dspark_jax.train.optim import TrainState, apply_gradients, cast_like


def init_hash_routes(model: DeepSeekV4, key: Array) -> None:
    """Give every token ``num_experts_per_tok`` distinct experts in each hash-routed layer (a random
    table drawn with replacement can send a token twice to one expert). The table is fixed, not trained."""
    cfg = model.cfg
    for i, layer in enumerate(model.layers):
        if cfg.is_hash_layer(i):
            u = jax.random.uniform(jax.random.fold_in(key, i), (cfg.vocab_size, cfg.n_routed_experts))
            routes = jnp.argsort(u, axis=-1)[:, :cfg.num_experts_per_tok].astype(jnp.int32)
            layer.ffn.gate.tid2eid.set_value(routes)


def causal_logits(model: DeepSeekV4, ids: Int[Array, "b t"]) -> Float[Array, "b t v"]:
    """fp32 logits of every position of full windows."""
    b, t = ids.shape
    cache = init_cache(model.cfg, b, t, model.num.dtype)
    logits, _, _ = model.forward(ids, jnp.full((b,), t, jnp.int32), cache, logits="all")
    return logits


def next_token_metrics(logits: Float[Array, "b t v"], ids: Int[Array, "b t"]) -> dict[str, Array]:
    """Mean cross-entropy (nats / token) and greedy accuracy of predicting ids[:, 1:]."""
    pred, labels = logits[:, :-1], ids[:, 1:]
    ce = optax.softmax_cross_entropy_with_integer_labels(pred, labels)
    acc = (jnp.argmax(pred, axis=-1) == labels).astype(jnp.float32)
    return dict(loss=jnp.mean(ce), accuracy=jnp.mean(acc))


def make_target_step(graphdef: nnx.GraphDef, dtypes, tx: optax.GradientTransformation):
    """Jitted ``(state, rest, ids, lr) -> (state, metrics)``; ``state`` is donated.

    graphdef / dtypes come from ``nnx.split(model, nnx.Param, ...)`` (dtypes: the storage dtype of
    every parameter); ``rest`` is the non-trained state (hash tables, router bias)."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state: TrainState, rest: nnx.State, ids: Int[Array, "b t"], lr):
        def loss_fn(master):
            model = nnx.merge(graphdef, cast_like(master, dtypes), rest)
            m = next_token_metrics(causal_logits(model, ids), ids)
            return m["loss"], m

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.master)
        state, gnorm = apply_gradients(state, grads, tx, lr)
        return state, dict(metrics, grad_norm=gnorm)

    return step


def make_target_eval(graphdef: nnx.GraphDef):
    """Jitted ``(params, rest, ids) -> metrics`` on parameters in their storage dtypes."""

    @jax.jit
    def evaluate(params: nnx.State, rest: nnx.State, ids: Int[Array, "b t"]):
        return next_token_metrics(causal_logits(nnx.merge(graphdef, params, rest), ids), ids)

    return evaluate
