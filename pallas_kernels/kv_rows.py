"""New KV rows at decode and verify: RMSNorm, RoPE, the reference's rounding and the write into a
pool in one launch, beside its pure-JAX reference.

A row c [w] (float32, or the float32 partial sums of a split linear, ``gemv.Partials``) becomes
the pool row ``slot``:

    e = rms_norm(c.astype(dtype), weight, eps)          # norms_rope.rms_norm
    e = apply_rope(e, position, inv_freq)                # its last rope_dim dims
    quant "kv":   e = kv_sim(e, rope_dim)                # fp8 per 64 nope dims, the rope dims exact
    quant "keys": e = fp4_sim(hadamard(e), 32)           # the indexer's keys: e2m1 per 32 dims
    pool[b, slot] = e                                    # slots outside the pool: not written

Three users (``dspark_jax.model``): a compressor's entries (c: a window's pooled row,
``compressor_pool``; position: the window's start; the attention's compressor "kv", the
indexer's "keys"; ``write_window_rows``, the windows' slots and positions worked out in the
kernel) and the attention's own window row (c: wkv's partial sums at one token, the weight
kv_norm's; "kv"). In XLA each is a reduction launch, one or two elementwise launches (three
for the keys: the Hadamard product, the fp4 scales, the rounding) and a dynamic-slice / update
pair for the scatter: four to six launches of ~1-2 us for 1 KiB per row. ``rows_kernel`` does
it in one, grid (requests, rows), writing the pool rows in place (``input_output_aliases``; pool
rows not written keep their bytes). Plain pools (an array [b, n, w]) only; the fp8 layouts
(``cache.Fp8Keys``, ``kv_fp8.Fp8Rows``) take the reference.

Numerics: the reference's up to float32 rounding of the mean's sum, of cos / sin (the kernel's
functions, not XLA's; as ``rope.q_norm_rope``) and of the Hadamard product's sum (float32 here;
a dot in XLA): a row may differ from the reference's by one rounding step of its dtype in a few
elements, and where that moves a value across an fp8 / e2m1 rounding boundary, by one such step
there. Inference only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels import backend, horizontal
from pallas_kernels.gemv import Partials, total
from pallas_kernels.grouped_matmul import ACT_FP8_MAX, act_scale, act_scale_inverse
from pallas_kernels.rms_norms import normalise_row, rms_norms
from pallas_kernels.rope import partner_columns, rotate_pairs

QUANTS = (None, "kv", "keys")
KV_BLOCK = 64  # nope dims per fp8 scale of the reference's KV rounding (``quant.kv_sim``)
KEY_BLOCK = 32  # dims per e2m1 scale of the indexer keys' rounding (``quant.fp4_sim``)


def row_values(c: Float[Array, "b k w"] | Partials, positions: Int[Array, "b k"], weight: Float[Array, " w"],
               inv_freq, *, eps: float, quant: str | None, dtype) -> Float[Array, "b k w"]:
    """Pure JAX: the rows of c (norm, RoPE at ``positions``, the ``quant`` rounding) in ``dtype``."""
    from dspark_jax.model.norms_rope import apply_rope, rms_norm
    from dspark_jax.model.quant import fp4_sim, hadamard, kv_sim

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    e = apply_rope(rms_norm(total(c, dtype), weight, eps), positions, np.asarray(inv_freq), heads=False)
    if quant == "kv":
        return kv_sim(e, 2 * np.asarray(inv_freq).shape[0])
    return fp4_sim(hadamard(e), KEY_BLOCK) if quant == "keys" else e


def rows_reference(pool: Array, slots: Int[Array, "b k"], positions: Int[Array, "b k"],
                      c: Float[Array, "b k w"] | Partials, weight: Float[Array, " w"], inv_freq, *, eps: float,
                      quant: str | None, dtype, impl: str | None = None, mesh=None):
    """``row_values`` written into ``pool`` (any ``cache.KVPool``) at rows ``slots`` (slots
    outside [0, n): not written), through ``cache.write_kv`` (``impl``, ``mesh``: its)."""
    from dspark_jax.cache import write_kv

    rows = row_values(c, positions, weight, inv_freq, eps=eps, quant=quant, dtype=dtype)
    return write_kv(pool, slots, rows, impl=impl or "xla", mesh=mesh)


def _e2m1(v: Array) -> Array:
    """float32 values in [-6, 6] rounded to the nearest e2m1 value (ties to an even code), as
    ``astype(float4_e2m1fn)``: grid steps 0.5 below 2, 1 below 4, then 2; the quotient by the
    step rounded half to even with integer arithmetic (exact)."""
    a = jnp.abs(v)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0))
    y = a / step  # exact: a power of two
    n = y.astype(jnp.int32)  # floor (y >= 0)
    frac = y - n.astype(jnp.float32)
    up = (frac > 0.5) | ((frac == 0.5) & (n % 2 == 1))
    return jnp.where(v < 0, -1.0, 1.0) * ((n + up.astype(jnp.int32)).astype(jnp.float32) * step)


def _fp4_scale(amax: Array) -> Array:
    """``2 ** ceil(log2(max(amax, FP4_AMAX_FLOOR) / 6))`` from the exponent bits (``quant.fp4_sim``'s
    scale): with amax = m 2**E (1 <= m < 2) and 6 = 1.5 * 2**2, 2**(E - 2), doubled when m > 1.5
    (the correctly rounded quotient never crosses the power of two, as in ``act_scale``)."""
    from dspark_jax.model.quant import FP4_AMAX_FLOOR

    bits = jax.lax.bitcast_convert_type(jnp.maximum(amax, FP4_AMAX_FLOOR), jnp.int32)
    up = ((bits & 0x7FFFFF) > 0x400000).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(((bits >> 23) - 2 + up) << 23, jnp.float32)


def rows_loader(c_ref, row0, count: int, parts: int):
    """The loader of ``finished_row`` (count 1) or ``query_tile`` (count = heads): rows row0 ..
    row0 + count - 1 of c [parts * rows, w] at columns ``at`` [1, w], each row's parts added in
    order: [count, w] float32."""
    rows = jnp.arange(count, dtype=jnp.int32)[:, None] + row0

    def load(at: Array) -> Array:
        x = pltriton.load(c_ref.at[rows, at])
        for s in range(1, parts):
            x = x + pltriton.load(c_ref.at[s * c_ref.shape[0] // parts + rows, at])
        return x
    return load


def finished_row(load, w_ref, freq_ref, h_ref, position, *, w: int, eps: float, rope_dim: int, quant: str | None,
                 dt) -> Array:
    """A row c [w] (``load(cols)``: its float32 values at columns cols [1, w]) rounded to ``dt``,
    normalised (with a weight ref), rotated at ``position`` and rounded by ``quant``: [1, w] in
    ``dt``. (``compressor_pool.pool_write_kernel`` loads its pooled rows this way.)"""
    cols = jnp.arange(w, dtype=jnp.int32)[None, :]  # [1, w]
    partner = jnp.where(cols >= w - rope_dim, partner_columns(cols), cols)

    def rounded(at: Array) -> Array:  # c at columns ``at``, rounded to dtype, float32
        return load(at).astype(dt).astype(jnp.float32)

    x = rounded(cols)
    if w_ref is None:  # no norm
        values, partner_values = x.astype(dt), rounded(partner).astype(dt)
    else:
        inv = 1.0 / jnp.sqrt(jnp.sum(x * x, axis=1, keepdims=True) / w + eps)  # as norms_rope.rms_norm

        def normed(at: Array, v: Array) -> Array:
            return (pltriton.load(w_ref.at[at]).astype(jnp.float32) * (v * inv)).astype(dt)

        values, partner_values = normed(cols, x), normed(partner, rounded(partner))
    e = rotate_pairs(values, partner_values, cols, w, rope_dim, position, freq_ref, inverse=False)
    if quant == "kv":  # fp8 per 64 nope dims with power-of-two scales (quant.kv_sim); the rope dims exact
        blocks = e.astype(jnp.float32).reshape(w // KV_BLOCK, KV_BLOCK)
        amax = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)
        codes = jnp.clip(blocks * act_scale_inverse(amax), -ACT_FP8_MAX, ACT_FP8_MAX).astype(jnp.float8_e4m3fn)
        nope = jnp.arange(w // KV_BLOCK, dtype=jnp.int32)[:, None] < (w - rope_dim) // KV_BLOCK
        e = jnp.where(nope, codes.astype(jnp.float32) * act_scale(amax), blocks).reshape(1, w).astype(dt)
    elif quant == "keys":  # the Hadamard rotation (rounded to dtype), then e2m1 per 32 dims (quant.fp4_sim)
        h = pltriton.load(h_ref.at[cols.reshape(w, 1), cols])  # [w, w]: h[j, i]
        z = jnp.sum(h * e.astype(jnp.float32), axis=1).reshape(1, w).astype(dt)
        e = _fp4_blocks(z).astype(dt)
    return e


def _fp4_blocks(z: Array) -> Array:
    """Values z [r, w] (of any float dtype) rounded to e2m1 per 32 columns with power-of-two scales,
    as ``quant.fp4_sim``: float32."""
    r, w = z.shape
    blocks = z.astype(jnp.float32).reshape(r * w // KEY_BLOCK, KEY_BLOCK)
    scale = _fp4_scale(jnp.max(jnp.abs(blocks), axis=1, keepdims=True))
    return (_e2m1(jnp.clip(blocks / scale, -6.0, 6.0)) * scale).reshape(r, w)


def query_tile(load, freq_ref, sign_ref, position, *, heads: int, w: int, rope_dim: int, quant: str | None,
               dt) -> Array:
    """A token's ``heads`` queries [heads, w] (``load(cols)``: their float32 values at columns cols
    [1, w]) rounded to ``dt``, rotated at ``position`` and with "keys" the Hadamard rotation and
    e2m1 per 32 dims: [heads, w] in ``dt``. The rotation is one dot of the rounded rows with the
    Sylvester matrix of signs (``sign_ref`` [w, w] in ``dt``: exact products, float32 sums)
    scaled by w**-0.5, the reference's ``quant.hadamard`` up to the float32 rounding of its sums.
    (``query_rows`` runs it per token; ``index_scores`` finishes the indexer's queries with it
    inside its own kernel.)"""
    cols = jnp.arange(w, dtype=jnp.int32)[None, :]
    partner = jnp.where(cols >= w - rope_dim, partner_columns(cols), cols)
    values, partner_values = load(cols).astype(dt), load(partner).astype(dt)
    e = rotate_pairs(values, partner_values, cols, w, rope_dim, position, freq_ref, inverse=False)  # [heads, w]
    if quant != "keys":
        return e
    signs = pltriton.load(sign_ref.at[cols.reshape(w, 1), cols])  # [w, w]: s[i, j] (symmetric)
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(dt) == jnp.float32 else None  # (Triton's default: TF32)
    z = jax.lax.dot_general(e, signs, (((1,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    z = (z * np.float32(w ** -0.5)).astype(dt)
    return _fp4_blocks(z).astype(dt)


def sign_operands(quant: str | None, w: int, dtype) -> tuple:
    """``query_tile``'s Sylvester matrix of signs [w, w] in ``dtype`` for "keys" (else nothing)."""
    from dspark_jax.model.quant import hadamard_matrix

    return (jnp.asarray(np.sign(hadamard_matrix(w)), dtype),) if quant == "keys" else ()


def _kernel(ids, a_ref, b_ref, c_ref, w_ref, freq_ref, *refs, eps: float, rope_dim: int, quant: str | None,
            parts: int, rows_per_request: int, ratio: int, dt, norm_eps: float | None = None):
    """Refs a, b: slots and positions [b k]; or with ``ratio`` (a compressor's candidate windows,
    ``write_window_rows``) the requests' start and n_valid [b]. With ``norm_eps`` (``write_rows_and_norm``)
    the programs of grid axis 2 = 1 normalise the row of the same index of another input instead."""
    h_ref = refs[:1] if quant == "keys" else ()  # the Hadamard matrix
    refs = refs[len(h_ref):]
    norm_refs, (_, pool_ref, *norm_out) = (refs[:2], refs[2:]) if norm_eps is not None else ((), refs)
    b, k, task = ids if norm_eps is not None else (*ids, 0)
    n, w = pool_ref.shape[1], pool_ref.shape[2]
    row = b * rows_per_request + k  # of c [parts * rows, w]
    if ratio:  # window start // m + k, written iff the chunk's real rows closed it
        start = a_ref[b]
        win = start // ratio + k
        slot = jnp.where(win < (start + b_ref[b]) // ratio, win, n)
        position = win * ratio
    else:
        slot, position = a_ref[row], b_ref[row]

    def write():
        e = finished_row(rows_loader(c_ref, row, 1, parts), w_ref, freq_ref, h_ref[0] if h_ref else None, position, w=w,
                         eps=eps, rope_dim=rope_dim, quant=quant, dt=dt)
        ok = (slot >= 0) & (slot < n)
        cols = jnp.arange(w, dtype=jnp.int32)[None, :]
        dest = jnp.where(ok, slot, n)  # a window not closed: one past the pool, masked (never accessed)
        pltriton.store(pool_ref.at[b, dest, cols], e.astype(pool_ref.dtype), mask=jnp.broadcast_to(ok, cols.shape))

    if norm_eps is None:
        write()
    else:
        pl.when(task == 0)(write)
        pl.when(task == 1)(lambda: normalise_row(*norm_refs, norm_out[0], norm_out[1] if len(norm_out) > 1 else None,
                                                 row, norm_eps))


def _queries_kernel(pos_ref, c_ref, freq_ref, *refs, rope_dim: int, quant: str | None, parts: int, heads: int, dt):
    """Token t's heads (rows t * heads .. of c) in one tile, rotated at the token's position."""
    *sign_ref, o_ref = refs
    t = pl.program_id(0)
    w = o_ref.shape[1]
    e = query_tile(rows_loader(c_ref, t * heads, heads, parts), freq_ref, sign_ref[0] if sign_ref else None,
                   pos_ref[t], heads=heads, w=w, rope_dim=rope_dim, quant=quant, dt=dt)
    rows = t * heads + jnp.arange(heads, dtype=jnp.int32)[:, None]
    pltriton.store(o_ref.at[rows, jnp.arange(w, dtype=jnp.int32)[None, :]], e)


def hadamard_operands(quant: str | None, w: int) -> tuple:
    from dspark_jax.model.quant import hadamard_matrix

    return (jnp.asarray(hadamard_matrix(w)),) if quant == "keys" else ()


def rows_part(pool, a, b_, c, weight, inv_freq, norm_x: Partials | None = None, norm_weight=None, *, eps: float,
              quant: str | None, ratio: int, dtype, norm_eps: float | None = None,
              norm_rounded: bool = False) -> horizontal.Part:
    """The rows kernel as a launch's part (``horizontal``): outputs the pool, then with ``norm_eps``
    the normed rows of ``norm_x`` (and their quantised values when ``norm_rounded``). a, b_: slots
    and positions [b k], or with ``ratio`` the requests' start and n_valid [b]."""
    parts = c.parts if isinstance(c, Partials) else c[None]
    s, b, k, w = parts.shape
    body = functools.partial(_kernel, eps=eps, rope_dim=2 * inv_freq.shape[0], quant=quant, parts=s,
                             rows_per_request=k, ratio=ratio, dt=dtype, norm_eps=norm_eps)
    hadamard = hadamard_operands(quant, w)
    norm_in, norm_out = (), ()
    if norm_eps is not None:  # (``write_rows_and_norm``)
        norm_in = (norm_x.parts.astype(jnp.float32), norm_weight.astype(jnp.float32))
        normed = jax.ShapeDtypeStruct(norm_x.parts.shape[1:], dtype)
        norm_out = (normed, normed) if norm_rounded else (normed,)
    inputs = (a.reshape(-1).astype(jnp.int32), b_.reshape(-1).astype(jnp.int32),
              parts.astype(jnp.float32).reshape(s * b * k, w), weight.astype(jnp.float32), inv_freq, *hadamard,
              *norm_in, pool)
    return horizontal.Part(body, (b, k) if norm_eps is None else (b, k, 2), inputs,
                           (jax.ShapeDtypeStruct(pool.shape, pool.dtype), *norm_out), {len(inputs) - 1: 0},
                           ("kv_rows" if quant != "keys" else "key_rows") + ("_norm" if norm_eps is not None else ""))


@functools.partial(jax.jit, static_argnames=("eps", "quant", "ratio", "dtype", "norm_eps", "norm_rounded",
                                             "interpret"))
def _pallas(pool, a, b_, c, weight, inv_freq, norm_x=None, norm_weight=None, *, eps: float, quant: str | None,
            ratio: int, dtype, norm_eps: float | None = None, norm_rounded: bool = False, interpret: bool):
    part = rows_part(pool, a, b_, c, weight, inv_freq, norm_x, norm_weight, eps=eps, quant=quant, ratio=ratio,
                     dtype=dtype, norm_eps=norm_eps, norm_rounded=norm_rounded)
    (out,) = horizontal.launch([part], interpret=interpret)
    return out if norm_eps is not None else out[0]


@functools.partial(jax.jit, static_argnames=("quant", "dtype", "interpret"))
def _queries_pallas(c, positions, inv_freq, *, quant: str | None, dtype, interpret: bool):
    parts = c.parts if isinstance(c, Partials) else c[None]
    s, b, t, h, w = parts.shape
    kernel = functools.partial(_queries_kernel, rope_dim=2 * inv_freq.shape[0], quant=quant, parts=s, heads=h,
                               dt=dtype)
    with backend.quiet_triton_deprecation():
        out = pl.pallas_call(
            kernel,
            grid=(b * t,),
            out_shape=jax.ShapeDtypeStruct((b * t * h, w), dtype),
            compiler_params=backend.compiler_params(4, 1),
            interpret=interpret,
            name="query_rows",
        )(positions.reshape(-1).astype(jnp.int32), parts.astype(jnp.float32).reshape(s * b * t * h, w), inv_freq,
          *sign_operands(quant, w, dtype))
    return out.reshape(b, t, h, w)


def _shape(c) -> tuple[int, ...]:
    return tuple(c.parts.shape[1:]) if isinstance(c, Partials) else tuple(c.shape)


def kernel_takes(pool, c, rope_dim: int, quant: str | None) -> bool:
    """Whether ``rows_kernel`` takes this pool and these rows: a plain pool [b, n, w] of a float
    dtype, w a power of two (at most 128 for "keys"), the rope dims (and for "kv" the nope dims)
    whole 64-dim blocks."""
    if not isinstance(pool, jax.Array) or pool.ndim != 3 or not jnp.issubdtype(pool.dtype, jnp.floating):
        return False
    w, shape = pool.shape[2], _shape(c)
    quant_ok = {None: True, "kv": rope_dim % KV_BLOCK == 0 and w % KV_BLOCK == 0,
                "keys": KEY_BLOCK <= w <= 128}.get(quant, False)
    return (len(shape) == 3 and shape[0] == pool.shape[0] and shape[2] == w and backend.is_power_of_2(w)
            and 0 < rope_dim <= w and rope_dim % 2 == 0 and quant_ok)


def rows_kernel(pool: Array, slots: Int[Array, "b k"], positions: Int[Array, "b k"],
                   c: Float[Array, "b k w"] | Partials, weight: Float[Array, " w"], inv_freq, *, eps: float,
                   quant: str | None, dtype, interpret: bool | None = None) -> Array:
    """The Pallas kernel (``rows_reference``'s contract for plain pools): the pool is updated in
    place (jit the caller with it donated to avoid a copy)."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    rope_dim = 2 * inv_freq.shape[0]
    if not kernel_takes(pool, c, rope_dim, quant):
        limit = ", at most 128" if quant == "keys" else ""
        nope = " and nope dims" if quant == "kv" else ""
        raise ValueError(f"the rows kernel needs a plain float pool [b, n, w] (w a power of two{limit}) and rows "
                         f"[b, k, w] with rope dims{nope} in {KV_BLOCK}-dim blocks; got pool "
                         f"{getattr(pool, 'dtype', type(pool).__name__)} {getattr(pool, 'shape', None)}, rows "
                         f"{_shape(c)}, rope_dim {rope_dim}")
    shape = _shape(c)
    if slots.shape != shape[:2] or positions.shape != shape[:2] or weight.shape != shape[2:]:
        raise ValueError(f"slots and positions must be {shape[:2]} and the weight [{shape[2]}], got "
                         f"{slots.shape}, {positions.shape} and {weight.shape}")
    return _pallas(pool, slots, positions, c, weight.astype(jnp.float32), inv_freq, eps=float(eps), quant=quant,
                   ratio=0, dtype=jnp.dtype(dtype), interpret=backend.interpret_mode(interpret))


def write_rows(pool, slots: Int[Array, "b k"], positions: Int[Array, "b k"], c: Float[Array, "b k w"] | Partials,
                  weight: Float[Array, " w"], inv_freq, *, eps: float, quant: str | None, dtype,
                  impl: str | None = None, mesh=None):
    """The backend switch: the kernel when ``impl`` resolves to "pallas", there is no ``mesh`` (the
    pool's, ``sharding.attach_mesh``) and it takes the pool; else the reference."""
    rope_dim = 2 * np.asarray(inv_freq).shape[0]
    if backend.resolve(impl) == "pallas" and mesh is None and kernel_takes(pool, c, rope_dim, quant):
        return rows_kernel(pool, slots, positions, c, weight, inv_freq, eps=eps, quant=quant, dtype=dtype)
    return rows_reference(pool, slots, positions, c, weight, inv_freq, eps=eps, quant=quant, dtype=dtype,
                             impl=impl, mesh=mesh)


def rows_and_norm_part(pool, slots: Int[Array, "b k"], positions: Int[Array, "b k"],
                       c: Float[Array, "b k w"] | Partials, weight: Float[Array, " w"], inv_freq, *, eps: float,
                       quant: str | None, dtype, norm_x: Partials, norm_weight: Float[Array, " n"], norm_eps: float,
                       rounded: bool = False, impl: str | None = None, mesh=None, with_norm: bool = True
                       ) -> horizontal.Part | None:
    """``write_rows_and_norm``'s kernel as a launch's part (grid (b, k, 2), the programs of axis 2
    = 1 normalising), or None where it does not take it: ``write_rows`` would not take the kernel,
    or norm_x's parts [S, R, n] do not have a row per written row (R = b k; n a power of two, a
    multiple of 128 when ``rounded``). ``with_norm`` False: the rows' write alone (grid (b, k);
    outputs the pool), where the same kernels take the norm."""
    rope_dim = 2 * np.asarray(inv_freq).shape[0]
    n = norm_x.parts.shape[-1]
    fits = (norm_x.parts.ndim == 3 and norm_x.parts.shape[1] == int(np.prod(_shape(c)[:2]))
            and norm_weight.shape == (n,) and backend.is_power_of_2(n) and not (rounded and n % 128))
    if not (backend.resolve(impl) == "pallas" and mesh is None and kernel_takes(pool, c, rope_dim, quant) and fits):
        return None
    shape = _shape(c)
    if slots.shape != shape[:2] or positions.shape != shape[:2] or weight.shape != shape[2:]:
        raise ValueError(f"slots and positions must be {shape[:2]} and the weight [{shape[2]}], got "
                         f"{slots.shape}, {positions.shape} and {weight.shape}")
    if not with_norm:
        return rows_part(pool, slots, positions, c, weight, jnp.asarray(inv_freq, jnp.float32), eps=float(eps),
                         quant=quant, ratio=0, dtype=jnp.dtype(dtype))
    return rows_part(pool, slots, positions, c, weight, jnp.asarray(inv_freq, jnp.float32), norm_x, norm_weight,
                     eps=float(eps), quant=quant, ratio=0, dtype=jnp.dtype(dtype), norm_eps=float(norm_eps),
                     norm_rounded=bool(rounded))


def write_rows_and_norm(pool, slots: Int[Array, "b k"], positions: Int[Array, "b k"],
                        c: Float[Array, "b k w"] | Partials, weight: Float[Array, " w"], inv_freq, *, eps: float,
                        quant: str | None, dtype, norm_x: Partials, norm_weight: Float[Array, " n"], norm_eps: float,
                        rounded: bool = False, impl: str | None = None, mesh=None) -> tuple[Array, ...]:
    """``write_rows`` and ``rms_norms((norm_x,), (norm_weight,), norm_eps, dtype, rounded=(rounded,))``
    (a one-token step's window row and q_norm, both from the attention's shared launch): (pool,
    normed rows [R, n][, their quantised values]). In one launch where ``rows_and_norm_part``
    takes them, else each on its own."""
    kw = dict(eps=eps, quant=quant, dtype=dtype)
    norm = dict(norm_x=norm_x, norm_weight=norm_weight, norm_eps=norm_eps, rounded=rounded)
    part = rows_and_norm_part(pool, slots, positions, c, weight, inv_freq, **kw, **norm, impl=impl, mesh=mesh)
    if part is not None:
        (out,) = horizontal.launch([part], interpret=backend.interpret_mode(None))
        return out
    pool = write_rows(pool, slots, positions, c, weight, inv_freq, **kw, impl=impl, mesh=mesh)
    return (pool, *rms_norms((norm_x,), (norm_weight,), norm_eps, dtype, rounded=(rounded,), impl=impl))


def window_slots(start: Int[Array, " b"], n_valid: Int[Array, " b"], windows: int, ratio: int, n: int
                 ) -> tuple[Int[Array, "b k"], Int[Array, "b k"]]:
    """The pool rows (n: not written) and start positions of a chunk's ``windows`` candidate windows
    ``start // ratio + k``: written iff the chunk's real rows closed the window."""
    win = start[:, None] // ratio + jnp.arange(windows, dtype=jnp.int32)[None]  # [b, k]
    return jnp.where(win < (start + n_valid)[:, None] // ratio, win, n), win * ratio


def write_window_rows(pool, start: Int[Array, " b"], n_valid: Int[Array, " b"], ratio: int,
                      c: Float[Array, "b k w"], weight: Float[Array, " w"], inv_freq, *, eps: float,
                      quant: str | None, dtype, impl: str | None = None):
    """``write_rows`` for a compressor's pooled rows of its candidate windows (``window_slots``):
    on the kernel the slots and positions come from start and n_valid inside it (no launches to
    make them)."""
    rope_dim = 2 * np.asarray(inv_freq).shape[0]
    if backend.resolve(impl) == "pallas" and kernel_takes(pool, c, rope_dim, quant):
        return _pallas(pool, start, n_valid, c, weight.astype(jnp.float32), jnp.asarray(inv_freq, jnp.float32),
                       eps=float(eps), quant=quant, ratio=int(ratio), dtype=jnp.dtype(dtype),
                       interpret=backend.interpret_mode(None))
    slots, positions = window_slots(start, n_valid, c.shape[1], ratio, pool.shape[1])
    return rows_reference(pool, slots, positions, c, weight, inv_freq, eps=eps, quant=quant, dtype=dtype, impl=impl)


def queries_reference(c: Float[Array, "b t h w"] | Partials, positions: Int[Array, "b t"], inv_freq, *,
                      quant: str | None, dtype) -> Float[Array, "b t h w"]:
    """Pure JAX: heads of c (its parts added, rounded to ``dtype``) rotated at their token's position
    (``apply_rope``), then rounded by ``quant`` (the indexer's queries: "keys")."""
    from dspark_jax.model.norms_rope import apply_rope
    from dspark_jax.model.quant import fp4_sim, hadamard

    if quant not in (None, "keys"):
        raise ValueError(f"query rows take quant None or 'keys', got {quant!r}")
    q = apply_rope(total(c, dtype), positions, jnp.asarray(inv_freq))
    return fp4_sim(hadamard(q), KEY_BLOCK) if quant == "keys" else q


# The most tokens ``query_rows`` takes the kernel for, as measured on an H200 at a decode step and a
# batch-1 verify with a program per head (each read the 64 KiB Hadamard matrix: a verify of 32 x 6
# tokens would have streamed ~0.8 GB through the L2); a program per token now reads its signs once,
# not yet measured beyond; XLA's GEMM beyond.
QUERY_KERNEL_MAX_TOKENS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QueryRows:
    """Queries before ``query_rows`` (the indexer's: wq_b's output or its split's partial sums, c
    [b, t, h, w], their tokens' positions [b, t], the layer's inv_freq, the rounding), for a
    consumer kernel that finishes them as it loads them (``index_scores``: ``query_tile``)
    instead of a launch of their own; ``finish`` gives the queries."""

    c: Array | Partials
    positions: Array
    inv_freq: Array
    quant: str | None = dataclasses.field(metadata=dict(static=True), default=None)
    dtype: object = dataclasses.field(metadata=dict(static=True), default=jnp.bfloat16)

    @property
    def shape(self) -> tuple[int, ...]:
        return _shape(self.c)

    def fit(self) -> bool:
        """Whether ``query_tile`` takes them (``queries_fit``)."""
        rope_dim = 2 * self.inv_freq.shape[0]
        return queries_fit(self.shape, rope_dim, self.quant) and self.positions.shape == self.shape[:2]

    def finish(self, impl: str | None = None) -> Float[Array, "b t h w"]:
        return query_rows(self.c, self.positions, self.inv_freq, quant=self.quant, dtype=self.dtype, impl=impl)


def queries_fit(shape: tuple[int, ...], rope_dim: int, quant: str | None) -> bool:
    """Whether ``query_tile`` takes a token's queries of ``shape`` [b, t, h, w] (up to
    ``QUERY_KERNEL_MAX_TOKENS`` tokens): h and w powers of two, w at most 128 and h at least 16
    (the rotation's dot) with "keys"."""
    return (len(shape) == 4 and backend.is_power_of_2(shape[3]) and backend.is_power_of_2(shape[2])
            and rope_dim <= shape[3] and shape[0] * shape[1] <= QUERY_KERNEL_MAX_TOKENS
            and (quant is None or (quant == "keys" and KEY_BLOCK <= shape[3] <= 128 and shape[2] >= 16)))


def query_rows(c: Float[Array, "b t h w"] | Partials, positions: Int[Array, "b t"], inv_freq, *, quant: str | None,
               dtype, impl: str | None = None) -> Float[Array, "b t h w"]:
    """Queries (the indexer's: wq_b's output, at one token its split's partial sums) rotated and
    rounded as ``queries_reference``, in one launch on the Pallas path (grid (tokens,): a token's
    heads in one tile, ``query_tile``; where ``queries_fit``)."""
    shape = _shape(c)
    rope_dim = 2 * jnp.asarray(inv_freq).shape[0]
    if backend.resolve(impl) == "pallas" and queries_fit(shape, rope_dim, quant) and positions.shape == shape[:2]:
        return _queries_pallas(c, positions, jnp.asarray(inv_freq, jnp.float32), quant=quant, dtype=jnp.dtype(dtype),
                               interpret=backend.interpret_mode(None))
    return queries_reference(c, positions, inv_freq, quant=quant, dtype=dtype)


kernel = rows_kernel
reference = rows_reference
