"""Shared building blocks: run-time numerics options, linear layers in the official
``[out, in]`` weight layout, the embedding, and a variable type for non-trained buffers."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from dspark_jax.model.quant import fp8_sim
from dspark_jax.sharding import batch_axes
from pallas_kernels import gemv
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.attention_metadata import cu_from_lens, token_request


MOE_IMPLS = ("auto", "dense", "grouped")
WEIGHT_FORMATS = ("dense", "official", "fp8")


@dataclass(frozen=True)
class Numerics:
    """How a model computes (not what it is).

    dtype: activation / residual dtype (bf16 like the reference, or fp32 for tests).
    param_dtype: storage dtype of matrices (norms, mHC, sinks, ape and router bias stay fp32).
    quant_sim: simulate the reference's fp8 activation / KV and fp4 indexer fake-quantisation.
    moe_impl: "dense" (every expert on every token: small models and training), "grouped"
        (tokens sorted by expert, a grouped matmul reading each selected expert once: the Pallas
        kernel or its loop-over-tiles reference, by ``kernels``) or "auto" (grouped above 16 experts).
    weight_format: "dense" (every matrix in ``param_dtype``), "official" (FP8 linears and FP4
        routed experts kept as the official checkpoints store them, dequantised inside the matmuls
        to exactly the checkpoint's values: 2-4x fewer bytes to hold and to read) or "fp8" (the
        same, with the FP4 experts widened to one e4m3 code per value and one scale per row and
        128 inputs (``fp8_k128``): the same values, twice FP4's bytes, faster on GPUs without FP4
        arithmetic, and multiplied as fp8 x fp8 codes at decode / verify).
    kernels: attention / fp8-cache-write implementation for decode and verify chunks: "pallas"
        (the Pallas kernels: Triton on a GPU, interpret mode on CPU), "xla" (their pure-JAX
        references) or "auto" (pallas on a GPU, xla elsewhere).
    sinkhorn: how mHC's units run: "loop" (plain JAX, the Sinkhorn iterations as a loop: fast to
        compile; training uses it), "unrolled" (no per-iteration loop overhead, but tens of small
        fusions per mHC unit on a GPU and a long compile), "kernel" (plain JAX with the gates and
        Sinkhorn in ``pallas_kernels.hc_weights``: one launch for them), "fused" (mHC's steps
        between sub-blocks in ``pallas_kernels.hc_fused``, each with the sub-block's RMSNorm:
        hc_pre + attn_norm and hc_post + hc_pre + ffn_norm in two launches each, the last hc_post
        in one, hc_head + norm in two: 5 launches per layer instead of 18-20) or "auto" (fused on a
        GPU, where it measured faster, docs/benchmarks.md; the loop elsewhere). The kernels are for
        inference only (no gradient).
    matmul_precision: float32 matmuls (the lm_head, router and compressor of every model; all of
        an fp32 model) in true float32 like the PyTorch reference ("highest"), or at the backend's
        default ("default": TF32 on NVIDIA GPUs). Set by ``precision_scope`` in inference entry
        points; bf16 matmuls are unaffected.
    """

    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.bfloat16
    quant_sim: bool = False
    moe_impl: str = "auto"
    weight_format: str = "dense"
    kernels: str = "auto"
    sinkhorn: str = "auto"
    matmul_precision: str = "highest"

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.kernels not in ("auto", "pallas", "xla"):
            raise ValueError(f"kernels must be 'auto', 'pallas' or 'xla', got {self.kernels!r}")
        if self.sinkhorn not in ("auto", "loop", "unrolled", "kernel", "fused"):
            raise ValueError(f"sinkhorn must be 'auto', 'loop', 'unrolled', 'kernel' or 'fused', got {self.sinkhorn!r}")
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

    def sinkhorn_impl(self) -> str:
        """``sinkhorn_impl`` for ``hyper.hc_pre`` ("auto" resolved when tracing)."""
        if self.sinkhorn == "auto":  # the fused kernels on a GPU, or lowering for one
            from pallas_kernels.backend import gpu_platform

            return "fused" if gpu_platform() is not None else "loop"
        return self.sinkhorn

    def mhc_fused(self) -> bool:
        """Whether mHC's units run as the fused kernels (``sinkhorn_impl() == "fused"``)."""
        return self.sinkhorn_impl() == "fused"

    def kernel_impl(self) -> str:
        """The implementation the kernel dispatchers get (resolved when tracing)."""
        if self.kernels == "auto":  # the kernels on a GPU, or lowering for one (``pallas_kernels.lowering``)
            from pallas_kernels.backend import gpu_platform

            return "pallas" if gpu_platform() is not None else "xla"
        return self.kernels


class DenseCopy(nnx.Variable):
    """A dequantised copy of an FP8 weight (``Linear.weight_copy``, made by
    ``dspark_jax.with_dense_copies``): held in device memory beside the weight, never saved."""


# Rows from which an FP8 linear with a dense copy multiplies by the copy in XLA's GEMM instead of
# running the grouped-matmul kernel on the FP8 weight. On an H200 (Flash linears,
# ``benchmarks/linear_tiles.py --xla``, docs/benchmarks.md) XLA's bf16 GEMM ties the kernel at 64
# rows and is 1.2-2.8x faster at 192 and 384 (e.g. wo_b 63.5 -> 27.3 us at 192 rows), while the
# kernel is faster at 32 rows (decode steps: wq_b 13.6 against 19.2 us).
DENSE_COPY_MIN_ROWS = 65


class Buffer(nnx.Variable):
    """A non-trained array stored in checkpoints (hash routing table, router correction bias)."""


# Random weights larger than this many values are made in blocks of leading rows (e.g. a routed
# expert of a stack at a time): made whole, a Flash layer's experts passed through float32 /
# int32 temporaries of 8 GiB each, which an 80 GB GPU holding a few layers could not always
# allocate. Smaller ones (every tiny model's) are made whole, as before.
RANDOM_SLICE_VALUES = 1 << 26


def _by_slices(make):
    """``make(key, shape, *args)``; where the array holds more than ``RANDOM_SLICE_VALUES`` values,
    one jitted program making it as blocks of its leading rows in turn (the most rows dividing the
    leading axis within that many values, a key per block)."""
    @functools.partial(jax.jit, static_argnums=tuple(range(1, 4)))
    def blocked(key: Array, shape: tuple[int, ...], *args) -> Array:
        row = math.prod(shape[1:])
        rows = max((d for d in range(1, shape[0] + 1) if shape[0] % d == 0 and d * row <= RANDOM_SLICE_VALUES),
                   default=1)
        blocks = jax.lax.map(lambda k: make(k, (rows, *shape[1:]), *args), jax.random.split(key, shape[0] // rows))
        return blocks.reshape(shape)

    @functools.wraps(make)
    def made(key: Array, shape: tuple[int, ...], *args) -> Array:
        if len(shape) < 2 or math.prod(shape) <= RANDOM_SLICE_VALUES:
            return make(key, shape, *args)
        return blocked(key, shape, *args)

    return made


@_by_slices
def _scaled_normal(key: Array, shape: tuple[int, ...], scale: float, dtype) -> Array:
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@_by_slices
def _widened_fp4_codes(key: Array, shape: tuple[int, ...]) -> Array:
    """Uniformly random e2m1 values times 64 as e4m3 codes."""
    codes = jax.random.randint(key, shape, 0, 16)
    return (jnp.asarray(gm.FP4_VALUES, jnp.float32)[codes] * 64).astype(jnp.float8_e4m3fn)


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> Array:
    return _scaled_normal(rngs.params(), tuple(shape), std, dtype)


_FP4_RMS = math.sqrt(sum(v * v for v in gm.FP4_VALUES[:8]) / 8)  # of uniformly random e2m1 codes


def random_fp8(rngs: nnx.Rngs, shape: tuple[int, int], std: float = 0.02) -> tuple[Array, Array]:
    """Random fp8 weights [out, in] of about ``std``: (e4m3 codes, e8m0 scale bytes per 128 x 128 block)."""
    e = round(math.log2(std))
    codes = _scaled_normal(rngs.params(), tuple(shape), std * 2.0**-e, jnp.float8_e4m3fn)
    blocks = tuple(-(-n // gm.FP8_BLOCK) for n in shape)
    return codes, jnp.full(blocks, 127 + e, jnp.uint8)


def random_fp4(rngs: nnx.Rngs, shape: tuple[int, ...], std: float = 0.02, *, widened: bool = False
               ) -> tuple[Array, Array]:
    """Random fp4 weights [..., out, in] of about ``std``: (packed e2m1 code pairs [..., out, in / 2],
    e8m0 scale bytes per 32 inputs [..., out, in / 32]); ``widened``: the same kind of values as
    ``fp8_k128`` weights, e4m3 codes [..., out, in] (e2m1 values times 64) and one scale byte per
    128 inputs [..., out, in / 128]."""
    e = round(math.log2(std / _FP4_RMS))
    if widened:
        scales = jnp.full((*shape[:-1], shape[-1] // gm.FP8_BLOCK), 127 + e - 6, jnp.uint8)
        return _widened_fp4_codes(rngs.params(), tuple(shape)), scales
    scales = jnp.full((*shape[:-1], shape[-1] // gm.FP4_BLOCK), 127 + e, jnp.uint8)
    return jax.random.bits(rngs.params(), (*shape[:-1], shape[-1] // 2), jnp.uint8), scales


def matmul_f32(x: Float[Array, "... i"], w: Float[Array, "o i"], impl: str = "xla") -> Float[Array, "... o"]:
    """x @ w.T in float32 for fp32 activations. With bf16 weights, x is split exactly into three
    bf16 parts (hi + mid + lo hold all 24 significand bits) that go through one bf16 GEMM with fp32
    accumulation: every product is exact, as in an fp32 GEMM of the upcast weight, but the weight
    is read once as stored instead of being copied to fp32 first (the lm_head and Markov head are
    the largest matrices of the model). One row on the Pallas path (``impl``, no mesh: the router
    of a batch-1 step): ``gemv``'s multiply-adds, the same exact products in one launch. Other
    weight dtypes: a plain fp32 matmul."""
    if one_row_dense(x, w, impl):
        y = gemv.gemv(x.reshape(1, -1), gm.Weights(w[None], None, "dense"), gemv.ONE_GROUP, out_dtype=jnp.float32)
        return y.reshape(*x.shape[:-1], -1)
    x = x.astype(jnp.float32)
    if w.dtype != jnp.bfloat16:
        return jnp.einsum("...i,oi->...o", x, w.astype(jnp.float32), preferred_element_type=jnp.float32)
    y = jnp.einsum("p...i,oi->p...o", jnp.stack(bf16_parts(x)), w, preferred_element_type=jnp.float32)
    return y[0] + (y[1] + y[2])


def one_row_dense(x: Array, w: Array, impl: str) -> bool:
    """Whether x (one bf16 / fp32 row) times the bf16 weight w [o, i] runs as ``gemv`` (``impl``
    "pallas")."""
    return (math.prod(x.shape[:-1]) == 1 and x.dtype in (jnp.bfloat16, jnp.float32) and w.dtype == jnp.bfloat16
            and gemv.takes(1, gm.Weights(w[None], None, "dense"), impl))


def bf16_parts(x: Float[Array, "..."]) -> tuple[Array, Array, Array]:
    """fp32 x as three bf16 numbers hi + mid + lo (exactly: together they hold its 24 significand bits)."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    return hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)


class Linear(nnx.Module):
    """y = x @ W.T with W stored as ``weight [out, in]`` (the official layout and name).

    fp8_act: this is an FP8 / FP4 GEMM in the reference, whose input is fake-quantised per 128
        elements when ``quant_sim`` is on.
    fp8_weight: the official checkpoints store this weight in FP8 (default: ``fp8_act``). With
        ``Numerics.weight_format == "official"`` it is kept so: ``weight`` holds e4m3 codes and
        ``scale`` one e8m0 byte per 128 x 128 block, and the product runs through the grouped
        matmul (the Pallas kernel on GPUs, dequantise-then-matmul elsewhere: same values).
    compute_dtype: cast the input (and weight) to this dtype first (fp32 for the compressor,
        router and lm_head, which the reference runs in fp32); default: the input dtype.

    ``weight_copy`` (None, or a ``DenseCopy`` from ``dspark_jax.with_dense_copies``): the FP8
    weight dequantised once, in the activation dtype. Calls of at least ``DENSE_COPY_MIN_ROWS``
    rows (verify, prefill) then multiply by it in XLA's GEMM, as the reference path does: the same
    values as the kernel's (exact products; only the fp32 summation order differs), twice the
    weight's bytes in memory.
    """

    def __init__(self, in_features: int, out_features: int, num: Numerics, *, rngs: nnx.Rngs,
                 fp8_act: bool = True, fp8_weight: bool | None = None, compute_dtype=None, param_dtype=None,
                 std: float = 0.02):
        fp8_weight = fp8_act if fp8_weight is None else fp8_weight
        self.quantized = fp8_weight and num.weight_format != "dense"
        if self.quantized:
            codes, scale = random_fp8(rngs, (out_features, in_features), std)
            self.weight, self.scale = nnx.Param(codes), Buffer(scale)
        else:
            self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), param_dtype or num.param_dtype, std))
        self.fp8_act = fp8_act and num.quant_sim
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        self.num = num
        self.weight_copy = nnx.data(None)  # a DenseCopy once ``keep_dense_copy`` runs
        # set by ``dspark_jax.sharding.attach_mesh`` for an FP8 weight: its mesh and PartitionSpec
        # (``[out, in]`` dims over ``model`` as the rules say); the GEMM then runs per device
        self.mesh, self.spec = None, None

    def grouped_weights(self, groups: int = 1) -> gm.Weights:
        """The weight as ``groups`` stacked [out / groups, in] matrices for the grouped matmul."""
        w = self.weight[...]
        out, inp = w.shape
        if not self.quantized:
            return gm.Weights(w.reshape(groups, out // groups, inp), None, "dense")
        s = self.scale[...]
        return gm.Weights(w.reshape(groups, out // groups, inp), s.reshape(groups, s.shape[0] // groups, -1), "fp8")

    def dense_weight(self, dtype) -> Float[Array, "o i"]:
        """The weight as a plain matrix (FP8 dequantised; the dense copy when there is one)."""
        if not self.quantized:
            return self.weight[...].astype(dtype)
        if self.weight_copy is not None:
            return self.weight_copy[...].astype(dtype)
        return gm.dequantize(self.grouped_weights(), dtype)[0]

    def keep_dense_copy(self) -> None:
        """Hold the FP8 weight dequantised in the activation dtype (``weight_copy``); no-op for
        a weight not kept in FP8."""
        if self.quantized:
            dense = gm.dequantize(self.grouped_weights(), self.num.dtype)[0]
            self.weight_copy = DenseCopy(jax.device_put(dense, self.weight[...].sharding))

    def runs_kernel(self, x: Array) -> bool:
        """Whether a call on x runs the grouped-matmul kernel on the FP8 weight (else XLA's GEMM
        on the dequantised weight: the dense copy from ``DENSE_COPY_MIN_ROWS`` rows)."""
        if not (self.quantized and self.num.kernel_impl() == "pallas"):
            return False
        return self.weight_copy is None or math.prod(x.shape[:-1]) < DENSE_COPY_MIN_ROWS

    def groups_fit(self, groups: int) -> bool:
        """Whether the weight splits into ``groups`` row blocks along its scale blocks."""
        return not self.quantized or (self.weight.shape[0] // groups) % gm.FP8_BLOCK == 0

    def takes_gemv(self, x: Float[Array, "... i"]) -> bool:
        """Whether x, one row, could run through ``gemv`` as it is (the rows of ``shared_input``):
        on the Pallas path an FP8 weight without a mesh that ``runs_kernel``, or a bf16 weight whose
        input is not quantised; x in bf16 or fp32, cast to ``compute_dtype`` exactly (None, x's
        dtype or fp32)."""
        if math.prod(x.shape[:-1]) != 1 or x.dtype not in (jnp.bfloat16, jnp.float32):
            return False
        if self.compute_dtype not in (None, jnp.dtype(x.dtype), jnp.dtype(jnp.float32)):
            return False
        if self.quantized:
            ok = self.mesh is None and self.runs_kernel(x)
        else:
            ok = not self.fp8_act and self.weight.dtype == jnp.bfloat16
        return ok and gemv.takes(1, self.grouped_weights(), self.num.kernel_impl(), self.fp8_act)

    def __call__(self, x: Float[Array, "... i"], out_dtype=None, *, rounded: bool = False, partials: bool = False,
                 gemv_config: gemv.GemvConfig | None = None) -> Float[Array, "... o"] | gemv.Partials:
        """x @ W.T. On a mesh (an FP8 weight, ``sharding.attach_mesh``) every device runs the GEMM
        in a ``shard_map`` on its own shard: its requests (x's leading dim, over ``data``) and the
        weight's block of rows (column-parallel: its share of the outputs) or of columns (row-
        parallel: x split likewise, the fp32 partial products psum'ed over the split axes). x may be
        its producer's float32 partial sums (``gemv.Partials``, e.g. wo_a's for wo_b; or
        ``gemv.SwiGLUPartials``, the shared expert's w1 and w3 for w2): at one row on ``gemv`` its
        programs add them (rounded to the activations' dtype; the SwiGLU after), else they are
        added first.
        ``rounded``: x holds the quantised input values already (``quant.fp8_sim(x, 128)``, e.g.
        from ``pallas_kernels.rms_norms``), so an ``fp8_act`` linear does not quantise it again
        (quantising them again would give the same values). ``partials``: where x is one row that
        ``takes_gemv``, the result as the float32 partial sums of the kernel's K split
        (``gemv.Partials``, for a consumer that adds them as it loads them); else as usual.
        ``gemv_config``: that launch's tiles (None: ``gemv``'s automatic ones)."""
        sums = (gemv.Partials, gemv.SwiGLUPartials)
        if isinstance(x, sums):  # a producer's partial sums (or their SwiGLU): added by gemv's programs (at one row)
            dtype = jnp.dtype(self.num.dtype)
            if not self.takes_gemv(jax.ShapeDtypeStruct(x.shape, dtype)):
                x = gemv.total(x, dtype)
        if isinstance(x, sums) or (partials and self.takes_gemv(x)):
            parts = isinstance(x, sums)
            rows = x.reshape(1, -1) if parts else x.reshape(1, -1).astype(self.compute_dtype or x.dtype)
            (y,) = gemv.gemv_many(rows, (self.grouped_weights(),), gemv.ONE_GROUP,
                                  quantise=(self.fp8_act and not rounded,), partials=(partials,),
                                  out_dtype=out_dtype or (self.num.dtype if parts else x.dtype),
                                  rows_dtype=self.num.dtype if parts else None, config=gemv_config)
            return y.reshape(*x.shape[:-1], -1)
        if self.mesh is None:
            return self._apply(x, out_dtype, rounded)
        out_axes, in_axes = (*self.spec, None, None)[:2]
        lead = (batch_axes(x.shape[0], self.mesh) or None,) + (None,) * (x.ndim - 2)
        dtype = out_dtype or self.compute_dtype or x.dtype

        def local(lin, x):
            if in_axes is None:
                return lin._apply(x, dtype, rounded)
            return jax.lax.psum(lin._apply(x, jnp.float32, rounded), in_axes).astype(dtype)

        return self._per_device(local, x, PartitionSpec(*lead, in_axes), PartitionSpec(*lead, out_axes))

    def grouped(self, x: Float[Array, "b t g i"], *, partials: bool = False) -> Float[Array, "b t g r"] | gemv.Partials:
        """The weight's g row blocks applied to x's g groups (``wo_a``'s grouped low-rank
        projection: block j to x[:, :, j]), in x's dtype. On a mesh every device runs it on its
        requests and its groups (the weight's rows split over ``model`` whole groups at a time).
        ``partials``: at one token on ``gemv``, the K split's partial sums (``gemv.Partials``) for a
        consumer that adds them (wo_b: ``__call__`` takes them)."""
        if self.mesh is None:
            b, t, g, _ = x.shape
            if partials and b * t == 1 and self.runs_kernel(x[..., 0, :]) and self.groups_fit(g):
                w = self.grouped_weights(g)
                if gemv.takes(1, w, self.num.kernel_impl()):
                    (y,) = gemv.gemv_many(x.reshape(g, -1), (w,), np.arange(g, dtype=np.int32), partials=(True,))
                    return y.reshape(b, t, g, -1)
            return self._grouped(x)
        spec = PartitionSpec(batch_axes(x.shape[0], self.mesh) or None, None, (*self.spec, None)[0])
        return self._per_device(lambda lin, x: lin._grouped(x), x, spec, spec)

    def _per_device(self, fn, x, x_spec: PartitionSpec, y_spec: PartitionSpec):
        """``fn(this layer, x)`` in a ``shard_map``: the weight (and scale) split by ``spec``, x and
        the result by ``x_spec`` / ``y_spec`` (the weights are passed in: a shard_map body may not
        close over them)."""
        graphdef, weights = nnx.split(self)
        return jax.shard_map(lambda w, x: fn(nnx.merge(graphdef, w), x), mesh=self.mesh,
                             in_specs=(self.spec, x_spec), out_specs=y_spec, check_vma=False)(weights, x)

    def _apply(self, x: Float[Array, "... i"], out_dtype=None, rounded: bool = False) -> Float[Array, "... o"]:
        if self.compute_dtype is not None:
            x = x.astype(self.compute_dtype)
        quantise = self.fp8_act and not rounded
        if self.runs_kernel(x):
            # the kernel rounds its float32 sums to the output dtype itself (no convert launch after it)
            y = gm.batched_matmul(x.reshape(1, -1, x.shape[-1]), self.grouped_weights(), act_quant=quantise,
                                  out_dtype=out_dtype or x.dtype, impl="pallas")
            return y.reshape(*x.shape[:-1], -1)
        if quantise:
            x = fp8_sim(x, 128)
        if x.dtype == jnp.float32 and not self.quantized:
            y = matmul_f32(x, self.weight[...])
        else:
            y = jnp.einsum("...i,oi->...o", x, self.dense_weight(x.dtype), preferred_element_type=jnp.float32)
        return y.astype(out_dtype or x.dtype)

    def _grouped(self, x: Float[Array, "b t g i"]) -> Float[Array, "b t g r"]:
        b, t, g, _ = x.shape
        if self.runs_kernel(x[..., 0, :]) and self.groups_fit(g):
            xg = x.reshape(b * t, g, -1).transpose(1, 0, 2)  # [g, bt, i]
            return gm.batched_matmul(xg, self.grouped_weights(g), impl="pallas").transpose(1, 0, 2).reshape(b, t, g, -1)
        w = self.dense_weight(x.dtype).reshape(g, self.weight.shape[0] // g, -1)
        return jnp.einsum("btgi,gri->btgr", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def shared_input(linears: tuple[Linear, ...], x: Float[Array, "... i"], mesh=None,
                 partials: tuple[bool, ...] = (), rounded: bool = False, config: gemv.GemvConfig | None = None
                 ) -> tuple[Float[Array, "... o"] | gemv.Partials, ...]:
    """``lin(x)`` for each of several linears of one input (e.g. an attention layer's wq_a and wkv
    and its compressors' wkv and wgate). At one row without a ``mesh`` (the caller's), those that
    would take ``gemv`` (``Linear.takes_gemv``, at least two) run in one launch (``gemv.gemv_many``:
    the row read once per program instead of once per linear's launch, quantised for the linears
    that quantise it); the others, and every linear otherwise, one call each. ``partials[i]``:
    linear i's result comes back as ``gemv.Partials`` (float32) when it ran in the shared launch,
    for a consumer that adds the K split's partial sums itself (``gemv.total`` gives the array).
    ``rounded``: x holds the quantised values already (``Linear(rounded=True)``). ``config``: the
    shared launch's tiles (None: ``gemv``'s automatic ones)."""
    takers = [i for i, lin in enumerate(linears) if lin.takes_gemv(x)] if mesh is None else []
    if len(takers) < 2:
        return tuple(lin(x, rounded=rounded) for lin in linears)
    picked = tuple(linears[i] for i in takers)
    keep = tuple(bool((partials + (False,) * len(linears))[i]) for i in takers)
    # each result not kept as partial sums rounded to its linear's dtype in the launch (a rounding of
    # the float32 sum after it would take an XLA launch of its own)
    out_dtypes = tuple(jnp.dtype(jnp.float32 if k else (lin.compute_dtype or x.dtype)) for k, lin in zip(keep, picked))
    ys = gemv.gemv_many(x.reshape(1, -1), tuple(lin.grouped_weights() for lin in picked), gemv.ONE_GROUP,
                        quantise=tuple(lin.fp8_act and not rounded for lin in picked), out_dtype=out_dtypes,
                        partials=keep, config=config)
    lead = x.shape[:-1]
    shared = {i: y.reshape(*lead, -1) for i, y in zip(takers, ys)}
    return tuple(shared[i] if i in shared else lin(x, rounded=rounded) for i, lin in enumerate(linears))


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, num: Numerics, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (vocab_size, dim), num.param_dtype))

    def __call__(self, ids: Int[Array, "..."], dtype) -> Float[Array, "... d"]:
        return jnp.take(self.weight[...], ids, axis=0).astype(dtype)


@jax.tree_util.register_dataclass
@dataclass
class Packing:
    """The ragged layout of a verify chunk: the tokens of b requests front-packed on one axis of
    ``tokens`` rows (a static bucket). Request r owns rows cu[r] .. cu[r+1] - 1 (its first
    cu[r+1] - cu[r] <= ``width`` tokens, in order); rows from cu[b] on are padding.

    ``unpack`` / ``pack`` move arrays between this layout [1, T, ...] and the per-request layout
    [b, width, ...] (rows a layout does not hold become 0)."""

    cu: Int[Array, " b1"]
    width: int = field(metadata=dict(static=True), default=1)
    tokens: int = field(metadata=dict(static=True), default=1)

    @classmethod
    def from_lens(cls, lens: Int[Array, " b"], *, width: int, tokens: int) -> "Packing":
        return cls(cu=cu_from_lens(lens), width=width, tokens=tokens)

    @property
    def lens(self) -> Int[Array, " b"]:
        return self.cu[1:] - self.cu[:-1]

    def _dense_rows(self) -> tuple[Int[Array, "b w"], Array]:
        """Packed row of every (request, t) of the per-request layout and whether it exists."""
        row = self.cu[:-1, None] + jnp.arange(self.width, dtype=jnp.int32)[None]
        return row, row < self.cu[1:, None]

    def _packed_rows(self) -> tuple[Int[Array, " T"], Int[Array, " T"], Array]:
        """Request and index within it of every packed row, and whether the row is a real token."""
        b = self.cu.shape[0] - 1
        req = token_request(self.cu, self.tokens)
        ok = req < b
        req = jnp.minimum(req, b - 1)
        return req, jnp.clip(jnp.arange(self.tokens, dtype=jnp.int32) - self.cu[req], 0, self.width - 1), ok

    def unpack(self, x: Float[Array, "1 T ..."]) -> Float[Array, "b w ..."]:
        row, ok = self._dense_rows()
        y = x[0][jnp.where(ok, row, 0)]
        return jnp.where(ok.reshape(ok.shape + (1,) * (y.ndim - 2)), y, jnp.zeros((), y.dtype))

    def pack(self, x: Float[Array, "b w ..."]) -> Float[Array, "1 T ..."]:
        req, t, ok = self._packed_rows()
        y = x[req, t]
        return jnp.where(ok.reshape(ok.shape + (1,) * (y.ndim - 1)), y, jnp.zeros((), y.dtype))[None]


@jax.tree_util.register_dataclass
@dataclass
class Chunk:
    """Where a chunk of new tokens sits: row t of request b is at position ``start[b] + t`` and is
    real iff ``t < n_valid[b]`` (padding rows are computed but never written to any cache).

    Per-request layout (``packing`` None): ids [b, width], one row of the arrays per request.
    Packed layout (ragged verify): ids [1, T] holding the n_valid[b] tokens of every request on
    one axis as ``packing`` says; token-wise layers run on it unchanged, the caches' writes and
    reads go through ``unpack`` / ``pack`` and the per-request view ``dense``."""

    ids: Int[Array, "b t"]
    start: Int[Array, " b"]
    n_valid: Int[Array, " b"]
    packing: Packing | None = None

    @property
    def width(self) -> int:
        """Rows per request in the per-request layout."""
        return self.ids.shape[1] if self.packing is None else self.packing.width

    @property
    def dense(self) -> "Chunk":
        """This chunk in the per-request layout (itself when it is in it)."""
        if self.packing is None:
            return self
        return Chunk(ids=self.unpack(self.ids), start=self.start, n_valid=self.n_valid)

    def unpack(self, x: Array) -> Array:
        """An array of the chunk's layout [1, T, ...] or [b, t, ...] in the per-request layout."""
        return x if self.packing is None else self.packing.unpack(x)

    def pack(self, x: Array) -> Array:
        """An array of the per-request layout [b, width, ...] in the chunk's layout."""
        return x if self.packing is None else self.packing.pack(x)

    @property
    def positions(self) -> Int[Array, "b t"]:
        """Positions of the chunk's rows, in its layout (packed padding rows: 0)."""
        return self.pack(self.start[:, None] + jnp.arange(self.width, dtype=jnp.int32)[None])

    @property
    def row_valid(self) -> Array:
        return self.pack(jnp.arange(self.width, dtype=jnp.int32)[None] < self.n_valid[:, None])
