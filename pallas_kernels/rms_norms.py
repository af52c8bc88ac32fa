"""RMSNorms of several rows in one launch, each row given as the float32 partial sums of a split
matrix-vector product, beside its pure-JAX reference.

At a batch-1 decode step an attention layer's wq_a output comes from one ``gemv`` launch as K-split
partial sums (``gemv.Partials``) and is RMS-normalised next (q_norm; kv_norm runs with the window's
write, ``kv_rows``). In XLA each norm is two launches (a reduction: the parts' sum and its sum of
squares; then the elementwise scaling, which sums the parts again) of ~1.2 us for a few KiB.
``rms_norms`` normalises any number of such rows in one launch: program i adds up input i's
parts, rounds the sum to the output dtype (the linear's output, as the reference stores it), and
normalises it as ``norms_rope.rms_norm`` does: ``(w * (y * 1 / sqrt(mean(y^2) + eps)))`` in
float32, rounded.

An input flagged ``rounded`` also comes back quantised as the reference quantises an FP8 GEMM's
input (``quant.fp8_sim(y, 128)``: e4m3 values times a power of two per 128 columns, exact in the
output dtype): its consumer (wq_b at one row, ``gemv``) then multiplies the values as they are
instead of quantising every 128-input block in each of its programs, which cost 1.4-1.6 us per
33 MB linear on an H200 (docs/benchmarks.md).

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
from pallas_kernels.grouped_matmul import FP8_BLOCK, _quantise_block


def _flags(rounded: tuple[bool, ...], count: int) -> tuple[bool, ...]:
    flags = tuple(bool(r) for r in rounded) or (False,) * count
    if len(flags) != count:
        raise ValueError(f"rms_norms needs one rounded flag per input ({count}), got {rounded}")
    return flags


def rms_norms_reference(xs: tuple[Partials, ...], weights: tuple[Array, ...], eps: float, dtype,
                        rounded: tuple[bool, ...] = ()) -> tuple[Array, ...]:
    """Pure JAX: each input's parts added (``gemv.total``), rounded to ``dtype``, then
    ``norms_rope.rms_norm``; after the norms, those flagged ``rounded`` quantised
    (``quant.fp8_sim(y, 128)``)."""
    from dspark_jax.model.norms_rope import rms_norm
    from dspark_jax.model.quant import fp8_sim

    ys = tuple(rms_norm(total(x, dtype), w, eps) for x, w in zip(xs, weights))
    return ys + tuple(fp8_sim(y, FP8_BLOCK) for y, r in zip(ys, _flags(rounded, len(xs))) if r)


def normalise_row(in_ref, w_ref, o_ref, q_ref, r, eps: float) -> None:
    """Row r of the parts [S, R, N] in ``in_ref`` added in order, rounded to o_ref's dtype and
    normalised into o_ref [R, N]; with a ``q_ref``, also its quantised values (per 128 columns).
    (``kv_rows`` runs it beside the window's new KV row: q_norm and the row in one launch.)"""
    parts, n = in_ref.shape[0], in_ref.shape[2]
    y = in_ref[0, pl.ds(r, 1), :]
    for s in range(1, parts):  # the parts added in order
        y = y + in_ref[s, pl.ds(r, 1), :]
    y = y.astype(o_ref.dtype).astype(jnp.float32)
    inv = 1.0 / jnp.sqrt(jnp.sum(y * y, axis=1, keepdims=True) / n + eps)
    w = w_ref[...].astype(jnp.float32)[None, :]
    out = (w * (y * inv)).astype(o_ref.dtype)
    o_ref[pl.ds(r, 1), :] = out
    if q_ref is not None:  # the quantised values, per 128 columns
        codes, scale = _quantise_block(out.reshape(n // FP8_BLOCK, FP8_BLOCK))
        q = (codes.astype(jnp.float32) * scale).reshape(1, n)
        q_ref[pl.ds(r, 1), :] = q.astype(q_ref.dtype)


def _kernel(*refs, count: int, eps: float, rounded: tuple[bool, ...]):
    in_refs, w_refs, o_refs = refs[:count], refs[count:2 * count], refs[2 * count:]
    q_refs = dict(zip([j for j in range(count) if rounded[j]], o_refs[count:]))
    r, i = pl.program_id(0), pl.program_id(1)
    for j in range(count):
        @pl.when(i == j)
        def _norm(j=j):
            normalise_row(in_refs[j], w_refs[j], o_refs[j], q_refs.get(j), r, eps)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "rounded", "interpret"))
def _pallas(parts: tuple[Array, ...], weights: tuple[Array, ...], *, eps: float, dtype, rounded: tuple[bool, ...],
            interpret: bool):
    rows = parts[0].shape[1]
    shapes = [jax.ShapeDtypeStruct((rows, p.shape[2]), dtype) for p in parts]
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            functools.partial(_kernel, count=len(parts), eps=eps, rounded=rounded),
            grid=(rows, len(parts)),
            out_shape=tuple(shapes + [s for s, r in zip(shapes, rounded) if r]),
            compiler_params=backend.compiler_params(4, 1),
            interpret=interpret,
            name=f"rms_norms_x{len(parts)}",
        )(*parts, *weights)


def rms_norms_kernel(xs: tuple[Partials, ...], weights: tuple[Array, ...], eps: float, dtype, *,
                     rounded: tuple[bool, ...] = (), interpret: bool | None = None) -> tuple[Float[Array, "r n"], ...]:
    """The Pallas kernel: inputs ``Partials`` with parts [S_i, R, N_i] (the same R; N_i a power of
    two), weights [N_i]; outputs [R, N_i] in ``dtype``, then the quantised values of those flagged
    ``rounded`` (N_i a multiple of 128)."""
    flags = _flags(rounded, len(xs))
    if not xs or len(xs) != len(weights):
        raise ValueError(f"rms_norms needs one weight per input, got {len(xs)} inputs and {len(weights)} weights")
    rows = {x.parts.shape[1] for x in xs}
    for x, w in zip(xs, weights):
        if x.parts.ndim != 3 or len(rows) != 1 or w.shape != x.parts.shape[2:]:
            raise ValueError(f"rms_norms needs parts [S, R, N] of one R and weights [N], got "
                             f"{[x.parts.shape for x in xs]} and {[w.shape for w in weights]}")
        if not backend.is_power_of_2(x.parts.shape[2]):
            raise ValueError(f"rms_norms needs power-of-two widths, got {x.parts.shape[2]}")
    for x, r in zip(xs, flags):
        if r and x.parts.shape[2] % FP8_BLOCK:
            raise ValueError(f"rms_norms quantises widths that are multiples of {FP8_BLOCK}, got {x.parts.shape[2]}")
    return _pallas(tuple(x.parts.astype(jnp.float32) for x in xs), tuple(weights), eps=float(eps),
                   dtype=jnp.dtype(dtype), rounded=flags, interpret=backend.interpret_mode(interpret))


def rms_norms(xs: tuple[Partials, ...], weights: tuple[Array, ...], eps: float, dtype, *,
              rounded: tuple[bool, ...] = (), impl: str | None = None) -> tuple[Float[Array, "r n"], ...]:
    """The backend switch: the kernel when ``impl`` resolves to "pallas", else the reference.
    Returns the normalised inputs, then the quantised values of those flagged ``rounded``."""
    if backend.resolve(impl) == "pallas":
        return rms_norms_kernel(xs, weights, eps, dtype, rounded=rounded)
    return rms_norms_reference(xs, weights, eps, dtype, rounded)


kernel = rms_norms_kernel
reference = rms_norms_reference
