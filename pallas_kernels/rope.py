"""RoPE inside kernels: the pair rotation of a row's last dims (``rotate_pairs``, also the
attention's split merge's inverse rotation), and the queries' per-head RMS norm + RoPE in one
launch (``q_norm_rope``), beside its pure-JAX reference.

``norms_rope.apply_rope`` rotates the pairs (2i, 2i + 1) of a row's last 2r dims by the angle
position * inv_freq[i], in float32 from the row's values, rounded back to its dtype. A kernel
holding a row as a vector over its columns gets each column's pair partner by loading the row
again at the partner columns (``c ^ 1``): no shuffle across lanes.

The attention's queries (``Attention.project_q``): q = wq_b(qr) [t, h, d] in bf16, then per head
``q * rsqrt(mean(q^2) + eps)`` (the scale rounded to q's dtype and multiplied in it), then RoPE at
the token's position. In XLA: a reduction launch and a concatenation launch (the norm, the cos /
sin and the rotation). ``q_norm_rope``: one launch, grid (tokens, head blocks). Numerics: the
reference's up to float32 rounding of the mean's sum, the reciprocal square root and cos / sin
(the kernel's functions, not XLA's). Inference only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels import backend


def rotate_pairs(x: Array, partner: Array, cols: Array, d: int, rope_dim: int, pos: Array, freq_ref, *,
                 inverse: bool) -> Array:
    """A row's values ``x`` (any leading dims, columns ``cols`` last; the row's dtype) with its last
    ``rope_dim`` of d columns rotated as ``apply_rope`` does; ``partner``: the values at each
    column's pair partner (c + 1 for even c, c - 1 for odd), ``pos`` the row's position
    (broadcastable to x's leading dims + 1), ``freq_ref`` inv_freq [rope_dim / 2]."""
    rope = (cols >= d - rope_dim) & (cols < d)
    even = (cols % 2) == 0
    fi = jnp.where(rope, (cols - (d - rope_dim)) // 2, 0)
    angle = pos.astype(jnp.float32) * pltriton.load(freq_ref.at[fi], mask=rope, other=0.0)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    xf, pf = x.astype(jnp.float32), partner.astype(jnp.float32)
    rot = jnp.where(even, xf * cos - pf * sin, pf * sin + xf * cos)  # re*cos - im*sin | re*sin + im*cos
    return jnp.where(rope, rot.astype(x.dtype), x)


def partner_columns(cols: Array) -> Array:
    return jnp.where(cols % 2 == 0, cols + 1, cols - 1)


def q_norm_rope_reference(q: Float[Array, "t h d"], positions: Int[Array, " t"], inv_freq, eps: float
                          ) -> Float[Array, "t h d"]:
    """Pure JAX: ``Attention.project_q``'s head norm, then ``norms_rope.apply_rope``."""
    from dspark_jax.model.norms_rope import apply_rope

    qf = q.astype(jnp.float32)
    q = q * lax.rsqrt(jnp.mean(qf * qf, axis=-1, keepdims=True) + eps).astype(q.dtype)
    return apply_rope(q, positions, inv_freq)


def _kernel(pos_ref, freq_ref, q_ref, o_ref, *, bh: int, heads: int, rope_dim: int, eps: float):
    t, blk = pl.program_id(0), pl.program_id(1)
    d = q_ref.shape[1]
    rows = t * heads + blk * bh + jnp.arange(bh, dtype=jnp.int32)[:, None]  # [bh, 1]: rows of q [t * h, d]
    cols = jnp.arange(d, dtype=jnp.int32)[None, :]
    q = pltriton.load(q_ref.at[rows, cols]).astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) / d + eps).astype(q_ref.dtype).astype(jnp.float32)
    y = (q * r).astype(q_ref.dtype)
    rope = cols >= d - rope_dim
    partner_cols = jnp.where(rope, partner_columns(cols), cols)
    partner = (pltriton.load(q_ref.at[rows, partner_cols]).astype(jnp.float32) * r).astype(q_ref.dtype)
    out = rotate_pairs(y, partner, cols, d, rope_dim, pos_ref[t], freq_ref, inverse=False)
    pltriton.store(o_ref.at[rows, cols], out)


@functools.partial(jax.jit, static_argnames=("eps", "bh", "interpret"))
def _pallas(q, positions, inv_freq, *, eps: float, bh: int, interpret: bool):
    t, h, d = q.shape
    with backend.quiet_triton_deprecation():
        out = pl.pallas_call(
            functools.partial(_kernel, bh=bh, heads=h, rope_dim=2 * inv_freq.shape[0], eps=eps),
            grid=(t, h // bh),
            out_shape=jax.ShapeDtypeStruct((t * h, d), q.dtype),
            compiler_params=backend.compiler_params(4, 1),
            interpret=interpret,
            name="q_norm_rope",
        )(positions, inv_freq, q.reshape(t * h, d))
    return out.reshape(t, h, d)


def q_norm_rope_kernel(q: Float[Array, "t h d"], positions: Int[Array, " t"], inv_freq, eps: float, *,
                       block_h: int = 8, interpret: bool | None = None) -> Float[Array, "t h d"]:
    """The Pallas kernel: ``block_h`` heads per program (at most h; powers of two; d a power of
    two, 2 len(inv_freq) <= d)."""
    t, h, d = q.shape
    inv_freq = np.asarray(inv_freq, np.float32) if not isinstance(inv_freq, jax.Array) else inv_freq
    if positions.shape != (t,) or inv_freq.ndim != 1 or 2 * inv_freq.shape[0] > d:
        raise ValueError(f"q_norm_rope needs positions [{t}] and inv_freq [r] with 2r <= {d}, got "
                         f"{positions.shape} / {inv_freq.shape}")
    bh = min(block_h, h)
    if not (backend.is_power_of_2(d) and backend.is_power_of_2(bh) and h % bh == 0):
        raise ValueError(f"q_norm_rope needs a power-of-two head_dim and heads a multiple of {bh}, got {q.shape}")
    return _pallas(q, jnp.asarray(positions, jnp.int32), jnp.asarray(inv_freq, jnp.float32), eps=float(eps), bh=bh,
                   interpret=backend.interpret_mode(interpret))


def q_norm_rope(q: Float[Array, "t h d"], positions: Int[Array, " t"], inv_freq, eps: float, *,
                impl: str | None = None) -> Float[Array, "t h d"]:
    """The backend switch: the kernel when ``impl`` resolves to "pallas", else the reference."""
    if backend.resolve(impl) == "pallas":
        return q_norm_rope_kernel(q, positions, inv_freq, eps)
    return q_norm_rope_reference(q, positions, inv_freq, eps)


kernel = q_norm_rope_kernel
reference = q_norm_rope_reference
