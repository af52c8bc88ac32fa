"""Mixture of experts: sqrtsoftplus router (learned top-k with a selection-only bias, or hash
routing by token id in the first layers), SwiGLU experts with clamps, one shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from dspark_jax.config import ModelConfig
from dspark_jax.model.common import Buffer, Linear, Numerics, normal_init
from dspark_jax.model.quant import fp8_sim


def route_scores(logits: Float[Array, "n e"], func: str) -> Float[Array, "n e"]:
    if func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


class Gate(nnx.Module):
    def __init__(self, cfg: ModelConfig, hash_routing: bool, num: Numerics, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (cfg.n_routed_experts, cfg.hidden_size), num.param_dtype))
        if hash_routing:
            ids = jax.random.randint(rngs.params(), (cfg.vocab_size, cfg.num_experts_per_tok), 0, cfg.n_routed_experts)
            self.tid2eid = Buffer(ids.astype(jnp.int32))
        else:
            self.bias = Buffer(jnp.zeros((cfg.n_routed_experts,), jnp.float32))
        self.hash_routing, self.cfg = hash_routing, cfg

    def __call__(self, x: Float[Array, "n d"], ids: Int[Array, " n"]) -> tuple[Array, Int[Array, "n k"]]:
        """Routing weights [n, k] (fp32) and expert indices [n, k]."""
        cfg = self.cfg
        logits = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        scores = route_scores(logits, cfg.scoring_func)
        if self.hash_routing:
            idx = self.tid2eid[...][ids]
        else:
            _, idx = jax.lax.top_k(scores + self.bias[...], cfg.num_experts_per_tok)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        if cfg.scoring_func != "softmax" and cfg.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def swiglu(g: Array, u: Array, limit: float) -> Array:
    """silu(min(g, limit)) * clamp(u, -limit, limit) in fp32."""
    g, u = g.astype(jnp.float32), u.astype(jnp.float32)
    if limit > 0:
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return jax.nn.silu(g) * u


class SharedExpert(nnx.Module):
    def __init__(self, cfg: ModelConfig, num: Numerics, *, rngs: nnx.Rngs):
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = Linear(d, i, num, rngs=rngs)
        self.w2 = Linear(i, d, num, rngs=rngs)
        self.w3 = Linear(d, i, num, rngs=rngs)
        self.limit = cfg.swiglu_limit

    def __call__(self, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
        h = swiglu(self.w1(x), self.w3(x), self.limit)  # GEMM outputs in the activation dtype, then fp32
        return self.w2(h.astype(x.dtype))


class Experts(nnx.Module):
    """Routed experts stacked on a leading axis: w1, w3 [E, I, D] and w2 [E, D, I]
    (official ``experts.{e}.w{1,2,3}.weight`` tensors)."""

    def __init__(self, cfg: ModelConfig, num: Numerics, *, rngs: nnx.Rngs):
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = nnx.Param(normal_init(rngs, (e, i, d), num.param_dtype))
        self.w2 = nnx.Param(normal_init(rngs, (e, d, i), num.param_dtype))
        self.w3 = nnx.Param(normal_init(rngs, (e, i, d), num.param_dtype))
        self.cfg, self.num = cfg, num

    def _act_in(self, x):
        return fp8_sim(x, 128) if self.num.quant_sim else x

    def dense(self, x: Float[Array, "n d"], w: Array, idx: Array) -> Float[Array, "n d"]:
        """Every expert on every token, weighted by the (mostly zero) routing weights."""
        cfg, dt = self.cfg, x.dtype
        gate_w = jnp.zeros((x.shape[0], cfg.n_routed_experts), jnp.float32)
        gate_w = gate_w.at[jnp.arange(x.shape[0])[:, None], idx].add(w)
        xq = self._act_in(x)
        g = jnp.einsum("nd,eid->nei", xq, self.w1[...].astype(dt), preferred_element_type=jnp.float32).astype(dt)
        u = jnp.einsum("nd,eid->nei", xq, self.w3[...].astype(dt), preferred_element_type=jnp.float32).astype(dt)
        # The routing weight multiplies before w2 (rounded to the activation dtype as in the reference).
        h = swiglu(g, u, cfg.swiglu_limit) * gate_w.astype(dt).astype(jnp.float32)[..., None]
        y = jnp.einsum("nei,edi->ned", self._act_in(h.astype(dt)), self.w2[...].astype(dt),
                       preferred_element_type=jnp.float32)
        return jnp.sum(y.astype(dt).astype(jnp.float32), axis=1)

    def ragged(self, x: Float[Array, "n d"], w: Array, idx: Array) -> Float[Array, "n d"]:
        """Sort (token, expert) pairs by expert and run grouped GEMMs: each expert's weights are
        read once however many tokens chose it."""
        cfg, dt = self.cfg, x.dtype
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=cfg.n_routed_experts).astype(jnp.int32)
        xs = self._act_in(x)[token]
        dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                                 lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        mm = lambda a, b: jax.lax.ragged_dot_general(a, b.astype(dt), sizes, dims,
                                                     preferred_element_type=jnp.float32).astype(dt)
        h = swiglu(mm(xs, self.w1[...]), mm(xs, self.w3[...]), cfg.swiglu_limit)
        h = h * w.reshape(-1)[order].astype(dt).astype(jnp.float32)[:, None]
        y = mm(self._act_in(h.astype(dt)), self.w2[...]).astype(jnp.float32)
        return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, hash_routing: bool, num: Numerics, *, rngs: nnx.Rngs):
        self.gate = Gate(cfg, hash_routing, num, rngs=rngs)
        self.experts = Experts(cfg, num, rngs=rngs)
        self.shared_experts = SharedExpert(cfg, num, rngs=rngs)
        impl = num.moe_impl
        if impl == "auto":
            impl = "dense" if cfg.n_routed_experts <= 16 else "ragged"
        self.impl = impl

    def __call__(self, x: Float[Array, "b t d"], ids: Int[Array, "b t"]) -> Float[Array, "b t d"]:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        w, idx = self.gate(xf, ids.reshape(-1))
        routed = getattr(self.experts, self.impl)(xf, w, idx)
        y = routed + self.shared_experts(xf).astype(jnp.float32)
        return y.astype(x.dtype).reshape(shape)
