"""Manifold-constrained hyper-connections (mHC): hc_pre with Sinkhorn, hc_post, hc_head.

The residual is ``n = hc_mult`` parallel streams X [b, t, n, d]. Each sub-block reads one
mixture of the streams and writes back through a doubly-stochastic mixing matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from dspark_jax.model.common import normal_init
from dspark_jax.model.norms_rope import rms_norm
from pallas_kernels.gemv import ExpertRows, Partials, total


def sinkhorn(logits: Float[Array, "... n n"], iters: int, eps: float, *, unroll: bool | None = None
             ) -> Float[Array, "... n n"]:
    """Reference Sinkhorn: softmax over j plus eps, column-normalise, then (iters - 1) x
    (row-normalise, column-normalise). Columns (sums over i) end at exactly 1.

    unroll: write the iterations out (GPU: no per-iteration loop overhead) or use a loop (CPU:
    much faster to compile); None picks by backend.
    """
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def row_col(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    if unroll is None:
        unroll = jax.default_backend() != "cpu"
    if unroll:
        for i in range(iters - 1):
            c = row_col(i, c)
        return c
    return jax.lax.fori_loop(0, iters - 1, row_col, c)


def mix_weights(z: Float[Array, "... k"], *, n: int, iters: int, eps: float, unroll: bool = False
                ) -> tuple[Float[Array, "... n"], Float[Array, "... n"], Float[Array, "... n n"]]:
    """The (2 + n) * n pre-activations z -> (pre = sigmoid + eps, post = 2 sigmoid, C = Sinkhorn)."""
    z = z.astype(jnp.float32)
    comb = sinkhorn(z[..., 2 * n:].reshape(*z.shape[:-1], n, n), iters, eps, unroll=unroll)
    return jax.nn.sigmoid(z[..., :n]) + eps, 2.0 * jax.nn.sigmoid(z[..., n:2 * n]), comb


def _mixes(x: Float[Array, "b t n d"], fn: Array, eps: float) -> Float[Array, "b t m"]:
    """(x_flat @ fn^T) * rsqrt(mean(x_flat^2) + eps), one RMS statistic over all n*d values."""
    xf = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return jnp.einsum("...k,mk->...m", xf, fn.astype(jnp.float32)) * r


def hc_pre(x: Float[Array, "b t n d"], fn: Array, base: Array, scale: Array, *, iters: int, hc_eps: float,
           norm_eps: float, sinkhorn_impl: str = "loop"
           ) -> tuple[Float[Array, "b t d"], Float[Array, "b t n"], Float[Array, "b t n n"]]:
    """Collapse the streams for a sub-block; returns (block input, post weights, mixing matrix C).

    sinkhorn_impl: how the unit runs: "loop" / "unrolled" (plain JAX, see ``sinkhorn``), "kernel"
    (plain JAX with the gates and Sinkhorn in ``pallas_kernels.hc_weights``: one launch for them on
    a GPU) or "fused" (all of it in ``pallas_kernels.hc_fused``: two launches on a GPU).
    """
    if sinkhorn_impl == "fused":
        from pallas_kernels.hc_fused import pre_kernel

        return pre_kernel(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    n = x.shape[-2]
    mix = _mixes(x, fn, norm_eps)
    z = jnp.concatenate([mix[..., :n] * scale[0], mix[..., n:2 * n] * scale[1], mix[..., 2 * n:] * scale[2]],
                        axis=-1) + base  # the gates' and C's pre-activations
    if sinkhorn_impl == "kernel":
        from pallas_kernels.hc_weights import weights_kernel

        pre, post, comb = weights_kernel(z, n=n, iters=iters, eps=hc_eps)
    elif sinkhorn_impl in ("loop", "unrolled"):
        pre, post, comb = mix_weights(z, n=n, iters=iters, eps=hc_eps, unroll=sinkhorn_impl == "unrolled")
    else:
        raise ValueError(f"sinkhorn_impl must be 'loop', 'unrolled', 'kernel' or 'fused', got {sinkhorn_impl!r}")
    y = jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2)
    return y.astype(x.dtype), post, comb


def hc_post(f: Float[Array, "b t d"], x: Float[Array, "b t n d"], post: Float[Array, "b t n"],
            comb: Float[Array, "b t n n"], *, fused: bool = False) -> Float[Array, "b t n d"]:
    """X'_j = post_j * f + sum_i C[i, j] X_i (note the sum over the FIRST index of C). f may come as
    a linear's partial sums or a MoE's terms (``gemv.Partials`` / ``gemv.ExpertRows``: added first).
    fused: in one Pallas kernel (``pallas_kernels.hc_fused``)."""
    if fused:
        from pallas_kernels.hc_fused import post_kernel

        return post_kernel(f, x, post, comb)
    if isinstance(f, (Partials, ExpertRows)):
        f = total(f, x.dtype)
    mixed = jnp.einsum("btij,btid->btjd", comb, x.astype(jnp.float32))
    y = post[..., None] * f.astype(jnp.float32)[..., None, :] + mixed
    return y.astype(x.dtype)


def hc_head(x: Float[Array, "b t n d"], fn: Array, base: Array, scale: Array, *, hc_eps: float,
            norm_eps: float, fused: bool = False, norm_weight: Array | None = None, out_eps: float | None = None
            ) -> Float[Array, "b t d"]:
    """Final collapse: sigmoid-gated sum of the streams (no Sinkhorn, no post); with
    ``norm_weight`` (and ``out_eps``) followed by that RMSNorm.
    fused: in Pallas kernels (``pallas_kernels.hc_fused``: two launches, the norm included)."""
    if fused:
        from pallas_kernels.hc_fused import head_kernel

        return head_kernel(x, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps, norm_weight=norm_weight,
                           out_eps=out_eps)
    pre = jax.nn.sigmoid(_mixes(x, fn, norm_eps) * scale[0] + base) + hc_eps
    y = jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)
    return y if norm_weight is None else rms_norm(y, norm_weight, out_eps)


def hc_pre_norm(x: Float[Array, "b t n d"], fn: Array, base: Array, scale: Array, norm_weight: Array, *, iters: int,
                hc_eps: float, norm_eps: float, out_eps: float, sinkhorn_impl: str = "loop"
                ) -> tuple[Float[Array, "b t d"], Float[Array, "b t n"], Float[Array, "b t n n"]]:
    """``hc_pre``, then the sub-block's RMSNorm (weight ``norm_weight``, epsilon ``out_eps``) of its
    input: (normalised block input, post, comb). "fused": both in ``pallas_kernels.hc_fused``'s two
    launches."""
    if sinkhorn_impl == "fused":
        from pallas_kernels.hc_fused import pre_kernel

        return pre_kernel(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, norm_weight=norm_weight,
                          out_eps=out_eps)
    y, post, comb = hc_pre(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                           sinkhorn_impl=sinkhorn_impl)
    return rms_norm(y, norm_weight, out_eps), post, comb


def hc_post_pre_norm(f: Float[Array, "b t d"] | Partials, x: Float[Array, "b t n d"], post: Float[Array, "b t n"],
                     comb: Float[Array, "b t n n"], fn: Array, base: Array, scale: Array, norm_weight: Array, *,
                     iters: int, hc_eps: float, norm_eps: float, out_eps: float, sinkhorn_impl: str = "loop"):
    """One sub-block's ``hc_post``, then the next one's ``hc_pre_norm``: (X', normalised input of the
    next sub-block, its post, its comb). "fused": all of it in two launches
    (``pallas_kernels.hc_fused.post_pre_kernel``). f may come as a linear's float32 partial sums
    (``gemv.Partials``): f is their sum rounded to x's dtype (the linear's output); or as a MoE's
    terms (``gemv.ExpertRows``), added as the MoE would."""
    kw = dict(iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, out_eps=out_eps)
    if sinkhorn_impl == "fused":
        from pallas_kernels.hc_fused import post_pre_kernel

        return post_pre_kernel(f, x, post, comb, fn, base, scale, norm_weight=norm_weight, **kw)
    x = hc_post(total(f, x.dtype), x, post, comb)
    return (x, *hc_pre_norm(x, fn, base, scale, norm_weight, sinkhorn_impl=sinkhorn_impl, **kw))


def hc_unit_params(rngs: nnx.Rngs, n: int, dim: int, rows: int) -> tuple[nnx.Param, nnx.Param, nnx.Param]:
    """(fn [rows, n*dim], base [rows], scale) initialised like the reference: N(0, 0.02), 0, 1."""
    n_scale = 3 if rows == (2 + n) * n else 1
    return (nnx.Param(normal_init(rngs, (rows, n * dim), jnp.float32)),
            nnx.Param(jnp.zeros((rows,), jnp.float32)),
            nnx.Param(jnp.ones((n_scale,), jnp.float32)))
