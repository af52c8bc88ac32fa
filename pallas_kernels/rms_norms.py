"""RMSNorms of several rows in one launch, each row given as the float32 partial sums of a split
matrix-vector product, beside its pure-JAX reference.

At a batch-1 decode step an attention layer's wq_a and wkv outputs come from one ``gemv`` launch
as K-split partial sums (``gemv.Partials``), and each is RMS-normalised next (q_norm, kv_norm). In
XLA each norm is two launches (a reduction: the parts' sum and its sum of squares; then the
elementwise scaling, which sums the parts again): four launches of ~1.2 us for 6 KiB of values.
``rms_norms`` does both in one launch: program i adds up input i's parts, rounds the sum to the
output dtype (the linear's output, as the reference stores it), and normalises it as
``norms_rope.rms_norm`` does: ``(w * (y * 1 / sqrt(mean(y^2) + eps)))`` in float32, rounded.

Numerics: the reference's but for the order of the parts' float32 additions (in order here) and of
the mean's sum. Inference only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from pallas_kernels import backend
from pallas_kernels.gemv import Partials, total


def rms_norms_reference(xs: tuple[Partials, ...], weights: tuple[Array, ...], eps: float, dtype
                        ) -> tuple[Array, ...]:
    """Pure JAX: each input's parts added (``gemv.total``), rounded to ``dtype``, then
    ``norms_rope.rms_norm``."""
    from dspark_jax.model.norms_rope import rms_norm

    return tuple(rms_norm(total(x, dtype), w, eps) for x, w in zip(xs, weights))


def _kernel(*refs, count: int, eps: float):
    in_refs, w_refs, o_refs = refs[:count], refs[count:2 * count], refs[2 * count:]
    r, i = pl.program_id(0), pl.program_id(1)
    for j in range(count):
        @pl.when(i == j)
        def _norm(j=j):
            parts, n = in_refs[j].shape[0], in_refs[j].shape[2]
            y = in_refs[j][0, pl.ds(r, 1), :]
            for s in range(1, parts):  # the parts added in order
                y = y + in_refs[j][s, pl.ds(r, 1), :]
            y = y.astype(o_refs[j].dtype).astype(jnp.float32)
            inv = 1.0 / jnp.sqrt(jnp.sum(y * y, axis=1, keepdims=True) / n + eps)
            w = w_refs[j][...].astype(jnp.float32)[None, :]
            o_refs[j][pl.ds(r, 1), :] = (w * (y * inv)).astype(o_refs[j].dtype)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "interpret"))
def _pallas(parts: tuple[Array, ...], weights: tuple[Array, ...], *, eps: float, dtype, interpret: bool):
    rows = parts[0].shape[1]
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            functools.partial(_kernel, count=len(parts), eps=eps),
            grid=(rows, len(parts)),
            out_shape=tuple(jax.ShapeDtypeStruct((rows, p.shape[2]), dtype) for p in parts),
            compiler_params=backend.compiler_params(4, 1),
            interpret=interpret,
            name=f"rms_norms_x{len(parts)}",
        )(*parts, *weights)


def rms_norms_kernel(xs: tuple[Partials, ...], weights: tuple[Array, ...], eps: float, dtype, *,
                     interpret: bool | None = None) -> tuple[Float[Array, "r n"], ...]:
    """The Pallas kernel: inputs ``Partials`` with parts [S_i, R, N_i] (the same R; N_i a power of
    two), weights [N_i]; outputs [R, N_i] in ``dtype``."""
    if not xs or len(xs) != len(weights):
        raise ValueError(f"rms_norms needs one weight per input, got {len(xs)} inputs and {len(weights)} weights")
    rows = {x.parts.shape[1] for x in xs}
    for x, w in zip(xs, weights):
        if x.parts.ndim != 3 or len(rows) != 1 or w.shape != x.parts.shape[2:]:
            raise ValueError(f"rms_norms needs parts [S, R, N] of one R and weights [N], got "
                             f"{[x.parts.shape for x in xs]} and {[w.shape for w in weights]}")
        if not backend.is_power_of_2(x.parts.shape[2]):
            raise ValueError(f"rms_norms needs power-of-two widths, got {x.parts.shape[2]}")
    return _pallas(tuple(x.parts.astype(jnp.float32) for x in xs), tuple(weights), eps=float(eps),
                   dtype=jnp.dtype(dtype), interpret=backend.interpret_mode(interpret))


def rms_norms(xs: tuple[Partials, ...], weights: tuple[Array, ...], eps: float, dtype, *,
              impl: str | None = None) -> tuple[Float[Array, "r n"], ...]:
    """The backend switch: the kernel when ``impl`` resolves to "pallas", else the reference."""
    if backend.resolve(impl) == "pallas":
        return rms_norms_kernel(xs, weights, eps, dtype)
    return rms_norms_reference(xs, weights, eps, dtype)


kernel = rms_norms_kernel
reference = rms_norms_reference
