"""Mixed-precision optimisation: an fp32 master copy of the trained parameters with AdamW moments
in fp32; the forward runs on the master cast to each parameter's storage dtype (bf16 matrices,
fp32 norms / mHC / sinks). The learning rate is an argument of the step so that the schedule can
follow the wall clock (runs stop by time, not by a step count known in advance)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclass(frozen=True)
class OptimConfig:
    peak_lr: float
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    warmup_fraction: float = 0.05  # of the phase's progress
    min_lr_ratio: float = 0.1  # cosine decay floor

    def __post_init__(self):
        if not self.peak_lr > 0:
            raise ValueError(f"peak_lr must be positive, got {self.peak_lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must lie in [0, 1), got {self.warmup_fraction}")

    def lr(self, progress: float) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_ratio * peak_lr`` at progress 1."""
        p = min(max(progress, 0.0), 1.0)
        if self.warmup_fraction > 0 and p < self.warmup_fraction:
            return self.peak_lr * max(p / self.warmup_fraction, 0.01)
        q = (p - self.warmup_fraction) / (1 - self.warmup_fraction)
        return self.peak_lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * q)))


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in path
                    if not (hasattr(k, "name") and k.name == "value"))


def decay_mask(params) -> object:
    """Weight decay on matrices only: not on embeddings (the DSpark noise row must keep its norm),
    vectors (norms, sinks, biases) or the mHC mixing projections."""
    def keep(path, x):
        name = _path_name(path)
        excluded = name.startswith("embed") or "markov_w1" in name or name.rsplit(".", 1)[-1].startswith("hc_")
        return x.ndim >= 2 and not excluded
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimConfig, params) -> optax.GradientTransformation:
    """Clipped AdamW direction without the learning rate (the step multiplies by -lr)."""
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    if cfg.weight_decay > 0:
        parts.append(optax.add_decayed_weights(cfg.weight_decay, decay_mask(params)))
    return optax.chain(*parts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """What a training phase updates (and checkpoints): fp32 master parameters and optimizer state."""

    master: nnx.State
    opt_state: optax.OptState
    step: jax.Array


def init_state(params: nnx.State, tx: optax.GradientTransformation) -> TrainState:
    master = jax.tree.map(lambda x: jnp.array(x, jnp.float32), params)  # a copy: the state is donated
    return TrainState(master=master, opt_state=tx.init(master), step=jnp.zeros((), jnp.int32))


def cast_like(master: nnx.State, dtypes) -> nnx.State:
    """The master copy in the storage dtypes of the model parameters (a tree of dtypes)."""
    return jax.tree.map(lambda x, dt: x.astype(dt), master, dtypes)


def apply_gradients(state: TrainState, grads, tx: optax.GradientTransformation, lr) -> tuple[TrainState, jax.Array]:
    """One AdamW update of the master copy; returns the new state and the gradient norm."""
    updates, opt_state = tx.update(grads, state.opt_state, state.master)
    updates = jax.tree.map(lambda u: -lr * u, updates)
    master = optax.apply_updates(state.master, updates)
    gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
    return TrainState(master=master, opt_state=opt_state, step=state.step + 1), gnorm
