"""mHC's per-token mixing weights in one kernel: the gates and the Sinkhorn projection.

For every token, ``hc_pre`` turns (2 + n) * n pre-activations z (the streams' mixes, already
scaled and shifted by the unit's scale and base) into

    pre  = sigmoid(z[:n]) + eps                      [n]
    post = 2 * sigmoid(z[n:2n])                      [n]
    comb = Sinkhorn(z[2n:].reshape(n, n))            [n, n]   (``model.hyper.sinkhorn``)

On a GPU, XLA turns the reference's 20 Sinkhorn iterations into a chain of small fusions (tens of
launches per mHC unit, and a long compile) or into a while loop (a host round trip per
iteration). This kernel computes all of it for a tile of tokens in registers: one launch per unit.

Layout: z is passed transposed and padded, [M, T] with M = next power of two >= (2 + n) * n, so a
tile [M, BT] holds whole tokens along the lanes; the output has the same layout (pre in rows
[0, n), post in [n, 2n), comb row-major in [2n, 2n + n * n)). The reference is
``weights_reference``, the same math as ``model.hyper`` in plain JAX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from pallas_kernels import backend


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def sinkhorn_lists(c: list[list], iters: int, eps: float) -> list[list]:
    """Sinkhorn on an n x n matrix held as lists of same-shaped arrays c[i][j] (one per entry):
    softmax over j plus eps, column-normalise, then (iters - 1) x (row-, column-normalise)."""
    n = len(c)
    rng = range(n)

    def col_norm(c):
        s = [functools.reduce(jnp.add, [c[i][j] for i in rng]) + eps for j in rng]
        return [[c[i][j] / s[j] for j in rng] for i in rng]

    def row_norm(c):
        s = [functools.reduce(jnp.add, c[i]) + eps for i in rng]
        return [[c[i][j] / s[i] for j in rng] for i in rng]

    m = [functools.reduce(jnp.maximum, c[i]) for i in rng]
    e = [[jnp.exp(c[i][j] - m[i]) for j in rng] for i in rng]
    c = [[e[i][j] / functools.reduce(jnp.add, e[i]) + eps for j in rng] for i in rng]
    c = col_norm(c)
    flat = tuple(x for row in c for x in row)

    def body(_, flat):
        c = [list(flat[i * n:(i + 1) * n]) for i in rng]
        return tuple(x for row in col_norm(row_norm(c)) for x in row)

    flat = jax.lax.fori_loop(0, iters - 1, body, flat)
    return [list(flat[i * n:(i + 1) * n]) for i in rng]


def _weights_kernel(z_ref, o_ref, *, n: int, iters: int, eps: float):
    k = (2 + n) * n
    # row r of the tile as a [BT] vector: one row load each (no cross-lane work)
    row = [z_ref[r, :].astype(jnp.float32) for r in range(k)]
    pre = [_sigmoid(x) + eps for x in row[:n]]
    post = [2.0 * _sigmoid(x) for x in row[n:2 * n]]
    comb = sinkhorn_lists([row[2 * n + i * n:2 * n + (i + 1) * n] for i in range(n)], iters, eps)
    for r, v in enumerate(pre + post + [x for c_i in comb for x in c_i]):
        o_ref[r, :] = v
    for r in range(k, o_ref.shape[0]):  # the padding rows
        o_ref[r, :] = jnp.zeros_like(row[0])


def padded_rows(n: int) -> int:
    return backend.next_power_of_2((2 + n) * n)


@functools.partial(jax.jit, static_argnames=("n", "iters", "eps", "block_t", "interpret"))
def _weights_pallas(z_t: Float[Array, "m t"], *, n: int, iters: int, eps: float, block_t: int, interpret: bool):
    m, t = z_t.shape
    kernel = functools.partial(_weights_kernel, n=n, iters=iters, eps=eps)
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=(t // block_t,),
            in_specs=[pl.BlockSpec((m, block_t), lambda i: (0, i))],
            out_specs=pl.BlockSpec((m, block_t), lambda i: (0, i)),
            out_shape=jax.ShapeDtypeStruct((m, t), jnp.float32),
            compiler_params=backend.compiler_params(1 if block_t <= 32 else 4, 1),
            interpret=interpret,
            name="hc_weights",
        )(z_t)


def _split(z: Float[Array, "... k"], n: int):
    return z[..., :n], z[..., n:2 * n], z[..., 2 * n:].reshape(*z.shape[:-1], n, n)


def weights_kernel(z: Float[Array, "... k"], *, n: int, iters: int, eps: float, block_t: int = 128,
                   interpret: bool | None = None):
    """The Pallas kernel. z [..., (2 + n) * n] float32 pre-activations -> (pre [..., n],
    post [..., n], comb [..., n, n])."""
    k = (2 + n) * n
    if z.shape[-1] != k:
        raise ValueError(f"z must end in (2 + n) * n = {k} values for n = {n}, got shape {z.shape}")
    if iters < 1:
        raise ValueError(f"Sinkhorn needs iters >= 1, got {iters}")
    if not backend.is_power_of_2(block_t):
        raise ValueError(f"block_t must be a power of two, got {block_t}")
    lead = z.shape[:-1]
    flat = z.reshape(-1, k).astype(jnp.float32)
    t = flat.shape[0]
    bt = min(block_t, max(16, backend.next_power_of_2(max(t, 1))))
    t_pad = -(-max(t, 1) // bt) * bt
    z_t = jnp.pad(flat.T, ((0, padded_rows(n) - k), (0, t_pad - t)))
    out = _weights_pallas(z_t, n=n, iters=iters, eps=eps, block_t=bt, interpret=backend.interpret_mode(interpret))
    return _split(out[:k, :t].T.reshape(*lead, k), n)


def weights_reference(z: Float[Array, "... k"], *, n: int, iters: int, eps: float, unroll: bool = False):
    """Pure JAX: ``model.hyper.mix_weights`` (``jax.nn.sigmoid``, ``hyper.sinkhorn``)."""
    from dspark_jax.model.hyper import mix_weights

    return mix_weights(z, n=n, iters=iters, eps=eps, unroll=unroll)
