"""Shared building blocks: run-time numerics options, linear layers in the official
``[out, in]`` weight layout, the embedding, and a variable type for non-trained buffers."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from dspark_jax.model.quant import fp8_sim


@dataclass(frozen=True)
class Numerics:
    """How a model computes (not what it is).

    dtype: activation / residual dtype (bf16 like the reference, or fp32 for tests).
    param_dtype: storage dtype of matrices (norms, mHC, sinks, ape and router bias stay fp32).
    quant_sim: simulate the reference's fp8 activation / KV and fp4 indexer fake-quantisation.
    moe_impl: "dense" (every expert, small models and training), "ragged" (sorted tokens +
        ragged_dot, each selected expert read once) or "auto".
    kernels: attention / fp8-cache-write implementation for decode and verify chunks: "pallas"
        (the Pallas kernels: Triton on a GPU, interpret mode on CPU), "xla" (their pure-JAX
        references) or "auto" (pallas on a GPU, xla elsewhere).
    sinkhorn: mHC's Sinkhorn iterations as a "loop" (fast to compile; training uses it) or
        "unrolled" (no per-iteration loop overhead), or "auto" (unrolled on accelerators).
    matmul_precision: float32 matmuls (the lm_head, router and compressor of every model; all of
        an fp32 model) in true float32 like the PyTorch reference ("highest"), or at the backend's
        default ("default": TF32 on NVIDIA GPUs). Set by ``precision_scope`` in inference entry
        points; bf16 matmuls are unaffected.
    """

    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.bfloat16
    quant_sim: bool = False
    moe_impl: str = "auto"
    kernels: str = "auto"
    sinkhorn: str = "auto"
    matmul_precision: str = "highest"

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
        if self.moe_impl not in ("auto", "dense", "ragged"):
            raise ValueError(f"moe_impl must be 'auto', 'dense' or 'ragged', got {self.moe_impl!r}")
        if self.kernels not in ("auto", "pallas", "xla"):
            raise ValueError(f"kernels must be 'auto', 'pallas' or 'xla', got {self.kernels!r}")
        if self.sinkhorn not in ("auto", "loop", "unrolled"):
            raise ValueError(f"sinkhorn must be 'auto', 'loop' or 'unrolled', got {self.sinkhorn!r}")
        if self.matmul_precision not in ("highest", "default"):
            raise ValueError(f"matmul_precision must be 'highest' or 'default', got {self.matmul_precision!r}")

    def precision_scope(self):
        """Context for tracing a computation with this model (see ``matmul_precision``)."""
        if self.matmul_precision == "default":
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)

    def scoped(self, fn):
        """``fn`` traced inside ``precision_scope``."""
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self.precision_scope():
                return fn(*args, **kwargs)
        return wrapped

    def sinkhorn_unroll(self) -> bool | None:
        """``unroll`` for ``hyper.sinkhorn`` (None: chosen by backend when tracing)."""
        return None if self.sinkhorn == "auto" else self.sinkhorn == "unrolled"

    def kernel_impl(self) -> str:
        """The implementation the kernel dispatchers get (resolved when tracing)."""
        if self.kernels == "auto":
            from pallas_kernels.backend import on_gpu

            return "pallas" if on_gpu() else "xla"
        return self.kernels


class Buffer(nnx.Variable):
    """A non-trained array stored in checkpoints (hash routing table, router correction bias)."""


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ W.T with W stored as ``weight [out, in]`` (the official layout and name).

    fp8_act: this is an FP8 / FP4 GEMM in the reference, whose input is fake-quantised per 128
        elements when ``quant_sim`` is on.
    compute_dtype: cast the input (and weight) to this dtype first (fp32 for the compressor,
        router and lm_head, which the reference runs in fp32); default: the input dtype.
    """

    def __init__(self, in_features: int, out_features: int, num: Numerics, *, rngs: nnx.Rngs,
                 fp8_act: bool = True, compute_dtype=None, param_dtype=None, std: float = 0.02):
        self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), param_dtype or num.param_dtype, std))
        self.fp8_act = fp8_act and num.quant_sim
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)

    def __call__(self, x: Float[Array, "... i"], out_dtype=None) -> Float[Array, "... o"]:
        if self.compute_dtype is not None:
            x = x.astype(self.compute_dtype)
        if self.fp8_act:
            x = fp8_sim(x, 128)
        w = self.weight[...].astype(x.dtype)
        y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
        return y.astype(out_dtype or x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, num: Numerics, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (vocab_size, dim), num.param_dtype))

    def __call__(self, ids: Int[Array, "..."], dtype) -> Float[Array, "... d"]:
        return jnp.take(self.weight[...], ids, axis=0).astype(dtype)


@jax.tree_util.register_dataclass
@dataclass
class Chunk:
    """Where a chunk of new tokens sits: row t of request b is at position ``start[b] + t`` and is
    real iff ``t < n_valid[b]`` (padding rows are computed but never written to any cache)."""

    ids: Int[Array, "b t"]
    start: Int[Array, " b"]
    n_valid: Int[Array, " b"]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def positions(self) -> Int[Array, "b t"]:
        return self.start[:, None] + jnp.arange(self.width, dtype=jnp.int32)[None]

    @property
    def row_valid(self) -> Array:
        return jnp.arange(self.width, dtype=jnp.int32)[None] < self.n_valid[:, None]
