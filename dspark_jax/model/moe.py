"""Mixture of experts: sqrtsoftplus router (learned top-k with a selection-only bias, or hash
routing by token id in the first layers), SwiGLU experts with clamps, one shared expert."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from dspark_jax.config import ModelConfig
from dspark_jax.model.common import Buffer, Linear, Numerics, matmul_f32, normal_init, one_row_dense, random_fp4
from dspark_jax.model.quant import fp8_sim
from dspark_jax.sharding import batch_axes, mesh_axes, per_request
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import gemv, pair_experts, routing
from pallas_kernels.grouped_matmul import swiglu
from pallas_kernels.group_metadata import group_tiles, pair_tiles
from pallas_kernels.routing import gate_weights, route_scores

# (token, expert) pairs up to which every pair gets its own tile (batch <= 2 at top-6); on the
# Pallas path the layer then runs as the router kernels + the pair kernels (``MoE.decode_path``)
PAIR_TILES_MAX = 16
ONE_ROW = ("xla", "select", "shared", "apart", "experts", "tile")  # MoE.one_row
# The K split of the shared expert's one-row launches under ``MoE.one_row`` "apart" (w1 + w3, then
# w2; 0: ``gemv``'s automatic tiles, 512 programs each at Flash widths). They run beside the
# router, its selection and the routed experts, off the layer's chain: with 512 programs they held
# the SMs, and the selection waited for them (5-6 us after the router on an H100). In 2 (128
# programs of 64 columns at Flash widths) the 6-layer Flash slice's batch-1 step took 26 us less
# on an H100 (docs/benchmarks.md, 2026-12-06 (last)). A switch for benchmarks
# (``benchmarks/decode.py --shared-split``).
SHARED_SPLIT = 2


def shared_config() -> gemv.GemvConfig | None:
    """The shared expert's one-row ``gemv`` tiles (``SHARED_SPLIT``; None: automatic)."""
    return gemv.GemvConfig(split_k=SHARED_SPLIT) if SHARED_SPLIT else None


class Gate(nnx.Module):
    def __init__(self, cfg: ModelConfig, hash_routing: bool, num: Numerics, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (cfg.n_routed_experts, cfg.hidden_size), num.param_dtype))
        if hash_routing:
            ids = jax.random.randint(rngs.params(), (cfg.vocab_size, cfg.num_experts_per_tok), 0, cfg.n_routed_experts)
            self.tid2eid = Buffer(ids.astype(jnp.int32))
        else:
            self.bias = Buffer(jnp.zeros((cfg.n_routed_experts,), jnp.float32))
        self.hash_routing, self.cfg, self.num = hash_routing, cfg, num
        self.mesh = None  # set by ``dspark_jax.sharding.attach_mesh``: the top-k then runs per device

    def _opts(self) -> dict:
        cfg = self.cfg
        return dict(func=cfg.scoring_func, norm=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)

    def _selection(self, ids: Int[Array, " n"]) -> tuple[Array | None, Array | None]:
        """(selection bias, hashed expert indices): one of them is None."""
        if self.hash_routing:
            return None, self.tid2eid[...][ids]
        return self.bias[...], None

    def weights(self) -> gm.Weights:
        """The router's weight [E, D] as one group of the kernels' dense weights."""
        return gm.Weights(self.weight[...][None], None, "dense")

    def one_row(self, x: Float[Array, "n d"]) -> bool:
        """Whether the product at x runs as ``gemv`` (one row, a bf16 weight, the Pallas path, no
        mesh): its partial sums can then go to ``select``."""
        return self.mesh is None and one_row_dense(x, self.weight[...], self.num.kernel_impl())

    def select(self, logits: gemv.Partials, ids: Int[Array, " n"]) -> tuple[Array, Int[Array, "n k"]]:
        """Routing weights and experts from the product's float32 partial sums (``gemv`` with
        ``partials``) in one launch (``routing.select``), where XLA takes two fusions."""
        bias, idx = self._selection(ids)
        return routing.select(logits, bias, idx, top_k=self.cfg.num_experts_per_tok, **self._opts())

    def route(self, logits: gemv.Partials, ids: Int[Array, " n"]) -> gm.Route:
        """The selection left to the routed experts' SwiGLU programs (``grouped_matmul.Route``), from
        the product's float32 partial sums: no launch of its own."""
        bias, idx = self._selection(ids)
        parts, sel = routing.selection_operands(logits, bias, idx, top_k=self.cfg.num_experts_per_tok,
                                                func=self.cfg.scoring_func)
        return gm.Route(parts.reshape(-1, parts.shape[-1]), sel, n=parts.shape[1], k=self.cfg.num_experts_per_tok,
                        **self._opts())

    def __call__(self, x: Float[Array, "n d"], ids: Int[Array, " n"], *, kernel: bool = False
                 ) -> tuple[Array, Int[Array, "n k"]]:
        """Routing weights [n, k] (fp32) and expert indices [n, k]. ``kernel``: through the Pallas
        router kernels (``pallas_kernels.routing``; no mesh); else XLA after the product (one row
        on the Pallas path: ``gemv``)."""
        cfg, opts = self.cfg, self._opts()
        bias, idx = self._selection(ids)
        if kernel:
            return routing.kernel(x, self.weight[...], bias, idx, top_k=cfg.num_experts_per_tok, **opts)
        impl = self.num.kernel_impl() if self.mesh is None else "xla"
        scores = route_scores(matmul_f32(x, self.weight[...], impl), cfg.scoring_func)
        if idx is None:
            idx = per_request(lambda sc: jax.lax.top_k(sc, cfg.num_experts_per_tok)[1], self.mesh, scores + bias)
        return gate_weights(scores, idx, **opts), idx.astype(jnp.int32)


class SharedExpert(nnx.Module):
    def __init__(self, cfg: ModelConfig, num: Numerics, *, rngs: nnx.Rngs):
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = Linear(d, i, num, rngs=rngs)
        self.w2 = Linear(i, d, num, rngs=rngs)
        self.w3 = Linear(d, i, num, rngs=rngs)
        self.limit = cfg.swiglu_limit

    def fused(self, x: Float[Array, "n d"]) -> bool:
        """Whether w1 and w3 run on x as one fused SwiGLU kernel (FP8 weights on the Pallas path,
        no mesh, not the dense copies): one launch and no separate activation, the same roundings
        as two GEMMs."""
        w1, w3 = self.w1, self.w3  # (built alike: the same activation rounding, no compute dtype)
        return w1.runs_kernel(x) and w3.runs_kernel(x) and w1.mesh is None and w3.mesh is None

    def __call__(self, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
        if self.fused(x):
            h = gm.batched_swiglu(x, self.w1.grouped_weights(), self.w3.grouped_weights(), limit=self.limit,
                                  act_quant=self.w1.fp8_act, impl="pallas")
        else:
            h = swiglu(self.w1(x), self.w3(x), self.limit)  # GEMM outputs in the activation dtype, then fp32
        return self.w2(h.astype(x.dtype))

    def down(self, g: gemv.Partials, u: gemv.Partials) -> Float[Array, "n d"] | gemv.Partials:
        """w2 of the SwiGLU of w1's and w3's float32 partial sums (``gemv`` with ``partials``):
        the products rounded to the activations' dtype (``Numerics.dtype``), then the SwiGLU as the
        fused kernel's, rounded likewise: in w2's programs as they load their inputs where it runs as
        ``gemv`` (``gemv.SwiGLUPartials``: no launch of its own), w2's own partial sums out
        (``Linear(partials=True)``)."""
        return self.w2(gemv.SwiGLUPartials(g, u, float(self.limit)), partials=True, gemv_config=shared_config())

    def weights(self) -> tuple[gm.Weights, gm.Weights, gm.Weights]:
        """w1, w2, w3 as one-group weights of the grouped matmul's formats."""
        return self.w1.grouped_weights(), self.w2.grouped_weights(), self.w3.grouped_weights()


class Experts(nnx.Module):
    """Routed experts stacked on a leading axis: w1, w3 [E, I, D] and w2 [E, D, I]
    (official ``experts.{e}.w{1,2,3}.weight`` tensors). With ``Numerics.weight_format ==
    "official"`` they stay FP4 as in the checkpoint: ``w{1,2,3}`` hold packed e2m1 code pairs
    [E, out, in / 2] (uint8) and ``w{1,2,3}_scale`` one e8m0 byte per 32 inputs [E, out, in / 32]
    (official ``experts.{e}.w{1,2,3}.scale``); with "fp8" the codes are widened to e4m3
    [E, out, in] with one scale byte per row and 128 inputs [E, out, in / 128] (``fp8_k128``:
    the same values, ``dspark_jax.checkpoint.codecs.fp4_to_e4m3_k128``)."""

    def __init__(self, cfg: ModelConfig, num: Numerics, *, rngs: nnx.Rngs):
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.fmt = {"official": "fp4", "fp8": "fp8_k128"}.get(num.weight_format, "dense")
        for name, shape in (("w1", (e, i, d)), ("w2", (e, d, i)), ("w3", (e, i, d))):
            if self.fmt != "dense":
                packed, scale = random_fp4(rngs, shape, widened=self.fmt == "fp8_k128")
                setattr(self, name, nnx.Param(packed))
                setattr(self, f"{name}_scale", Buffer(scale))
            else:
                setattr(self, name, nnx.Param(normal_init(rngs, shape, num.param_dtype)))
        self.cfg, self.num = cfg, num
        self.mesh = None  # set by ``dspark_jax.sharding`` when the experts are split over a mesh

    def weights(self, name: str) -> gm.Weights:
        """``w1`` / ``w2`` / ``w3`` in the grouped matmul's format."""
        scale = getattr(self, f"{name}_scale")[...] if self.fmt != "dense" else None
        return gm.Weights(getattr(self, name)[...], scale, self.fmt)

    def _act_in(self, x):
        return fp8_sim(x, 128) if self.num.quant_sim else x

    def dense(self, x: Float[Array, "n d"], w: Array, idx: Array) -> Float[Array, "n d"]:
        """Every expert on every token, weighted by the (mostly zero) routing weights."""
        cfg, dt = self.cfg, x.dtype
        w1, w2, w3 = (gm.dequantize(self.weights(n), dt) for n in ("w1", "w2", "w3"))
        gate_w = jnp.zeros((x.shape[0], cfg.n_routed_experts), jnp.float32)
        gate_w = gate_w.at[jnp.arange(x.shape[0])[:, None], idx].add(w)
        xq = self._act_in(x)
        g = jnp.einsum("nd,eid->nei", xq, w1, preferred_element_type=jnp.float32).astype(dt)
        u = jnp.einsum("nd,eid->nei", xq, w3, preferred_element_type=jnp.float32).astype(dt)
        # The routing weight multiplies before w2 (rounded to the activation dtype as in the reference).
        h = swiglu(g, u, cfg.swiglu_limit) * gate_w.astype(dt).astype(jnp.float32)[..., None]
        y = jnp.einsum("nei,edi->ned", self._act_in(h.astype(dt)), w2, preferred_element_type=jnp.float32)
        return jnp.sum(y.astype(dt).astype(jnp.float32), axis=1)

    def grouped(self, x: Float[Array, "n d"], w: Array, idx: Array, *, token_axes: tuple[str, ...] = (),
                shared: tuple[gm.Weights, gm.Weights, gm.Weights] | None = None, **kernel_options
                ) -> Float[Array, "n d"] | tuple[Array, int]:
        """(token, expert) pairs sorted by expert into row tiles and two grouped matmuls (the Pallas
        kernel on GPUs, its loop-over-tiles reference elsewhere): each chosen expert's weights are
        read once per tile, unchosen experts never; memory grows with tokens x top-k only. With the
        experts split over a mesh: ``expert_parallel`` (tokens split over ``token_axes``). ``shared``:
        the shared expert's (w1, w2, w3), one more pair per token (``grouped_experts``)."""
        weights = tuple(self.weights(n) for n in ("w1", "w2", "w3"))
        options = dict(limit=self.cfg.swiglu_limit, quant_sim=self.num.quant_sim, impl=self.num.kernel_impl(),
                       **kernel_options)
        if self.mesh is not None:
            options.pop("as_rows", None)  # (the expert-parallel sum crosses devices)
            return expert_parallel(x, w, idx, *weights, mesh=self.mesh, token_axes=token_axes, **options)
        return grouped_experts(x, w, idx, *weights, shared=shared, **options)

    def pairs(self, x: Float[Array, "n d"], w: Array, idx: Array, *, shared=None, out_dtype=jnp.float32,
              **kernel_options) -> Float[Array, "n d"]:
        """The pair kernels (``pallas_kernels.pair_experts``): each (token, expert) pair reads its
        expert's weights, no tiles or sorting; for a decode step's few pairs. ``shared``: the shared
        expert's (w1, w2, w3), computed as one more pair per token and added."""
        weights = tuple(self.weights(n) for n in ("w1", "w2", "w3"))
        return pair_experts.kernel(x, w, idx, *weights, limit=self.cfg.swiglu_limit, quant_sim=self.num.quant_sim,
                                   shared=shared, out_dtype=out_dtype, **kernel_options)


def grouped_experts(x: Float[Array, "n d"], w: Float[Array, "n k"], idx: Int[Array, "n k"], w1: gm.Weights,
                    w2: gm.Weights, w3: gm.Weights, *, limit: float, quant_sim: bool, impl: str,
                    block_m: int | None = None, dropped: bool = False, as_rows: bool = False,
                    shared: tuple[gm.Weights, gm.Weights, gm.Weights] | None = None,
                    **kernel_options) -> Float[Array, "n d"] | tuple[Array, int]:
    """sum_j w[n, j] * expert_{idx[n, j]}(x[n]) in fp32 through the grouped matmul (``kernel_options``,
    e.g. a ``config``, go to both kernels; ``block_m`` overrides the row tile). Up to ``PAIR_TILES_MAX``
    pairs each pair gets its own tile (``pair_tiles``), otherwise pairs are sorted by expert (``group_tiles``).
    ``dropped``: pairs with ``idx`` = the number of experts contribute nothing and are not computed
    (sorted tiles: ``group_tiles(dropped=True)``). ``as_rows``: where the pairs got their own tiles,
    (w2's output rows [pairs x row tile, d], the row tile) instead of the sum, for a consumer that
    adds them (``gemv.ExpertRows``). ``w`` a ``grouped_matmul.Route`` (``idx`` None): the routing
    decided inside the SwiGLU's programs (pairs in their own tiles, rows taken as fp8 codes, the
    Pallas path). ``shared``: the shared expert's (w1, w2, w3), computed as one more pair of each
    token (expert index E, weight 1, last of its k + 1 pairs) in the same two launches as the
    routed pairs (the kernels' ``extra`` weights); the pairs then take their own tiles, and
    ``as_rows`` gives k + 1 rows per token, the shared expert's last."""
    route = w if isinstance(w, gm.Route) else None
    if shared is not None:
        if route is not None or dropped or idx.size + idx.shape[0] > PAIR_TILES_MAX:
            raise ValueError(f"the shared expert as one more pair needs the experts given and at most "
                             f"{PAIR_TILES_MAX} pairs in their own tiles, got {idx.shape} routed pairs")
        w = jnp.concatenate([w, jnp.ones((w.shape[0], 1), w.dtype)], axis=1)
        idx = jnp.concatenate([idx, jnp.full((idx.shape[0], 1), w1.shape[0], idx.dtype)], axis=1)
    n, k = (route.n, route.k) if route is not None else idx.shape
    bm = block_m or gm.block_m_for(n * k, w1.shape[0])
    own_tiles = n * k <= PAIR_TILES_MAX and not dropped
    if route is not None and not (own_tiles and quant_sim and gm.takes_codes(w1.fmt, bm) and impl != "xla"):
        raise ValueError("a Route needs pairs in their own tiles, quantised rows taken as fp8 codes and the "
                         "Pallas path")
    if route is not None:  # (the tiles' layout only: their experts come from the SwiGLU's programs)
        tiles = pair_tiles(jnp.zeros((n, k), jnp.int32), bm)
    elif own_tiles:
        tiles = pair_tiles(idx, bm)
    else:
        tiles = group_tiles(idx, w1.shape[0], bm, dropped=dropped, impl=impl)
    pair = tiles.pair_of_row
    real = pair >= 0
    gathered = lambda a: jnp.where(real[:, None], a[jnp.maximum(pair, 0) // k], 0)  # noqa: E731
    # The reference quantises each expert GEMM's input (act_quant, block 128). Where the weights and
    # the row tile take fp8 x fp8 dots the rows go in quantised (after the gather), elsewhere as
    # their rounded values (before it): the same values either way.
    codes = quant_sim and gm.takes_codes(w1.fmt, bm)
    if codes:
        act_in = lambda a: gm.quantised_rows(a, bm)  # noqa: E731
        rows = act_in(gathered(x))
    else:
        act_in = (lambda a: fp8_sim(a, 128)) if quant_sim else (lambda a: a)
        rows = gathered(act_in(x))
    meta = dict(tile_group=tiles.tile_group, num_tiles=tiles.num_tiles, block_m=bm, impl=impl, **kernel_options)
    if route is not None:  # each program decides its pair's expert and weight; w2 takes the experts decided
        h, group = gm.grouped_swiglu(rows, w1, w3, None, limit=limit, quantised_out=True,
                                     **{**meta, "tile_group": route})
        y = gm.grouped_matmul(h, w2, **{**meta, "tile_group": group})
        return (y, bm) if as_rows else jnp.sum(y[tiles.row_of_pair].reshape(n, k, -1).astype(jnp.float32), axis=1)
    row_w = jnp.where(real, w.reshape(-1)[jnp.maximum(pair, 0)], 0.0)
    up_extra, down_extra = (None, None) if shared is None else ((shared[0], shared[2]), shared[1])
    if codes and tiles.pair_of_row.shape[0] > bm:  # w2's input quantised by XLA: with the SwiGLU instead
        y = gm.grouped_matmul(gm.grouped_swiglu(rows, w1, w3, row_w, limit=limit, quantised_out=True, extra=up_extra,
                                                **meta), w2, extra=down_extra, **meta)
    else:
        y = gm.grouped_matmul(act_in(gm.grouped_swiglu(rows, w1, w3, row_w, limit=limit, extra=up_extra, **meta)),
                              w2, extra=down_extra, **meta)
    if as_rows and own_tiles:
        return y, bm
    return jnp.sum(y[tiles.row_of_pair].reshape(n, k, -1).astype(jnp.float32), axis=1)


def expert_parallel(x: Float[Array, "n d"], w: Float[Array, "n k"], idx: Int[Array, "n k"], w1: gm.Weights,
                    w2: gm.Weights, w3: gm.Weights, *, mesh, token_axes: tuple[str, ...] = (),
                    **options) -> Float[Array, "n d"]:
    """``grouped_experts`` with the experts split over the mesh (``dspark_jax.sharding`` rules:
    dim 0 over the expert mesh axes), in a ``shard_map``; expert weights never move, tokens do:

    1 the tokens (with their routing) enter split over ``token_axes`` (the data-parallel axes of
      the activations, or none: replicated) and are all-gathered over them: every device holds
      the step's tokens;
    2 every device runs the (token, expert) pairs routed to its own experts (other pairs are
      dropped from its tiles: computed by no one else's program);
    3 the partial outputs are summed: reduce-scattered over ``token_axes`` (each device gets back
      the sum for its own tokens) and all-reduced over the other expert axes.

    On a (1, 8) mesh that is one all-reduce of the outputs; on (8, 1) with data-split tokens an
    all-gather of the inputs and a reduce-scatter of the outputs (no all-reduce); on (2, 4) both
    over data and an all-reduce of the data shard's outputs over model."""
    axes = mesh_axes("experts", mesh)
    if not set(token_axes) <= set(axes):
        raise ValueError(f"tokens split over {token_axes} must be split over expert axes {axes}")
    rest = tuple(a for a in axes if a not in token_axes)
    spec = P(axes if len(axes) > 1 else axes[0])
    tok = P(token_axes) if token_axes else P()
    # The row tile for one device's share of the pairs: its experts get about 1 / shards of them.
    shards = math.prod(mesh.shape[a] for a in axes)
    options["block_m"] = options.get("block_m") or gm.block_m_for(-(-idx.size // shards), w1.shape[0] // shards)

    def local(x, w, idx, w1, w2, w3):
        if token_axes:
            x, w, idx = (jax.lax.all_gather(a, token_axes, axis=0, tiled=True) for a in (x, w, idx))
        n_local = w1.shape[0]
        first = jax.lax.axis_index(axes) * n_local
        mine = (idx >= first) & (idx < first + n_local)
        y = grouped_experts(x, jnp.where(mine, w, 0.0), jnp.where(mine, idx - first, n_local), w1, w2, w3,
                            dropped=True, **options)
        if token_axes:
            y = jax.lax.psum_scatter(y, token_axes, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, rest) if rest else y

    weight_spec = lambda wt: gm.Weights(spec, None if wt.scales is None else spec, wt.fmt)  # noqa: E731
    return jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, weight_spec(w1), weight_spec(w2), weight_spec(w3)),
                         out_specs=tok, check_vma=False)(x, w, idx, w1, w2, w3)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, hash_routing: bool, num: Numerics, *, rngs: nnx.Rngs):
        self.gate = Gate(cfg, hash_routing, num, rngs=rngs)
        self.experts = Experts(cfg, num, rngs=rngs)
        self.shared_experts = SharedExpert(cfg, num, rngs=rngs)
        impl = num.moe_impl
        if impl == "auto":
            impl = "dense" if cfg.n_routed_experts <= 16 else "grouped"
        self.impl = impl
        # How a one-token step on the Pallas path (no mesh) starts (``ONE_ROW``): "xla" (the router's
        # product as ``gemv``, the selection in XLA's fusions; the shared expert's w1 / w3 as
        # ``gemv_swiglu``), "select" (the selection from the product's partial sums in one launch,
        # ``Gate.select``), "shared" (the router's product and the shared expert's w1 / w3 in one
        # ``gemv_many`` launch, their partial sums to ``Gate.select`` and ``SharedExpert.down``, the
        # layer's sum left to mHC's next launch): three launches fewer per layer than "xla"; on an
        # H200 a 4-layer batch-1 step ran 125 kernels against 136 and a 0.2-0.3 ms shorter device
        # span, its 43-layer wall-time estimate within the runs' spread (docs/benchmarks.md, 2026-12-05);
        # "apart" (the default: as "shared", but the router's product in a launch of its own and the
        # shared expert's w1 / w3 in another: the routing waits for the router's 2 MB only, the shared
        # expert's 17 MB read runs beside the selection and the routed experts; on an H100 the 6-layer
        # Flash slice's batch-1 step took 11 us less than with "shared", 34 us less with the
        # compressors' two launches too, docs/benchmarks.md, 2026-12-05, last);
        # "experts" (as "shared", the selection decided in the routed SwiGLU's programs,
        # ``Gate.route``, where the pairs take their own tiles as fp8 codes: one launch fewer; with the
        # one-token SwiGLU unsplit the layer's kernels took 4 us more on an H200, docs/benchmarks.md);
        # "tile" (the router's product alone as "apart", and the shared expert as one more pair of
        # the routed experts' two launches, ``shared_tile``: two launches fewer than "apart", but its
        # 25 MB join the routed chain where "apart"'s launches ran beside it: on an H100 the batch-1
        # step took 7.7 us more at 2 layers and 36 us more at 6, docs/benchmarks.md, 2026-12-05, evening).
        self.one_row = "apart"
        # (token, expert) pairs up to which a step takes the decode kernels (0: never). Opt-in
        # (PAIR_TILES_MAX to use them): on the H200 they measured slower than the grouped path
        # (one Flash layer at 1 token: 283 us against 189 us, docs/benchmarks.md).
        self.decode_max_pairs = 0

    def decode_path(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens runs as the decode kernels: the router kernels, then
        the pair kernels with the shared expert as one more pair (4 launches with learned routing).
        For grouped experts on the Pallas path without a mesh, up to ``decode_max_pairs`` pairs."""
        return (self.impl == "grouped" and self.experts.mesh is None and self.gate.mesh is None
                and tokens * self.gate.cfg.num_experts_per_tok <= self.decode_max_pairs
                and self.experts.num.kernel_impl() == "pallas")

    def token_axes(self, batch: int) -> tuple[str, ...]:
        """The mesh axes the step's tokens are split over on entering the routed experts: those
        of the requests (``sharding.batch_axes``), when the experts are split over a mesh."""
        mesh = self.experts.mesh
        return () if mesh is None else batch_axes(batch, mesh)

    def __call__(self, x: Float[Array, "b t d"], ids: Int[Array, "b t"]) -> Float[Array, "b t d"] | gemv.ExpertRows:
        """The layer's output in x's dtype; a one-token step that took ``one_row``'s kernels with
        the routed pairs in their own tiles returns it as its terms (``gemv.ExpertRows``: the
        routed rows and the shared expert's w2 partial sums), for mHC's next launch to add."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        if self.decode_path(xf.shape[0]):
            w, idx = self.gate(xf, ids.reshape(-1), kernel=True)
            y = self.experts.pairs(xf, w, idx, shared=self.shared_experts.weights(), out_dtype=x.dtype)
            return y.reshape(shape)
        w, idx, shared = self._route(xf, ids.reshape(-1))
        tile = self.shared_tile(xf) if shared is None else None
        if self.impl == "grouped":  # (one-row path: the pairs' rows left to the consumer where they can be)
            routed = self.experts.grouped(xf, w, idx, token_axes=self.token_axes(shape[0]),
                                          as_rows=shared is not None or tile is not None, shared=tile)
        else:
            routed = self.experts.dense(xf, w, idx)
        k = self.gate.cfg.num_experts_per_tok
        if tile is not None:  # the shared expert's row is each token's last (mHC's next launch adds them)
            rows, stride = routed
            return gemv.ExpertRows(rows, None, k=k + 1, stride=stride, shape=shape)
        if shared is None:
            shared = self.shared_experts(xf)
        if isinstance(routed, tuple):  # mHC's next launch adds the terms (``gemv.ExpertRows``)
            rows, stride = routed
            return gemv.ExpertRows(rows, shared, k=k, stride=stride, shape=shape)
        y = routed + gemv.total(shared, x.dtype).astype(jnp.float32)
        return y.astype(x.dtype).reshape(shape)

    def shared_tile(self, xf: Float[Array, "n d"]) -> tuple[gm.Weights, gm.Weights, gm.Weights] | None:
        """The shared expert's (w1, w2, w3) where a one-row step under ``one_row`` "tile" computes it as
        one more pair of the routed experts' launches (``grouped_experts(shared=...)``): grouped
        experts without a mesh on the Pallas path, the shared expert's linears running the kernel
        (or bf16) on rows quantised as the routed ones, its weights taking the routed rows
        (``grouped_matmul.extra_fits``), the pairs in their own tiles; else None."""
        ex, se, cfg = self.experts, self.shared_experts, self.gate.cfg
        if self.one_row != "tile" or self.impl != "grouped" or ex.mesh is not None or not self.gate.one_row(xf):
            return None
        linears = (se.w1, se.w2, se.w3)
        if any(lin.mesh is not None or (lin.quantized and not lin.runs_kernel(xf)) for lin in linears):
            return None
        weights = se.weights()
        fits = all(gm.extra_fits(ex.weights(name), w) for name, w in zip(("w1", "w2", "w3"), weights))
        # (the routed rows are quantised as their GEMM input iff quant_sim: the shared expert's must be too)
        same_rows = se.w1.fp8_act == se.w2.fp8_act == ex.num.quant_sim
        if not fits or not same_rows or xf.shape[0] * (cfg.num_experts_per_tok + 1) > PAIR_TILES_MAX:
            return None
        return weights

    def _routes_in_experts(self, tokens: int) -> bool:
        """Whether the routed SwiGLU can decide the routing (``grouped_experts`` with a Route): grouped
        experts without a mesh on the Pallas path, the pairs in their own tiles, taken as fp8 codes."""
        ex, cfg = self.experts, self.gate.cfg
        pairs = tokens * cfg.num_experts_per_tok
        return (self.impl == "grouped" and ex.mesh is None and ex.num.kernel_impl() == "pallas" and ex.num.quant_sim
                and pairs <= PAIR_TILES_MAX and gm.takes_codes(ex.fmt, gm.block_m_for(pairs, cfg.n_routed_experts)))

    def _route(self, xf: Float[Array, "n d"], ids: Int[Array, " n"]
               ) -> tuple[Array, Array, Array | gemv.Partials | None]:
        """(routing weights, experts, the shared expert's output (w2's partial sums where it runs as
        ``gemv``) or None: not computed yet), as ``one_row`` says at one token."""
        gate, se = self.gate, self.shared_experts
        if self.one_row not in ONE_ROW:
            raise ValueError(f"MoE.one_row must be one of {ONE_ROW}, got {self.one_row!r}")
        if self.one_row == "xla" or not gate.one_row(xf):
            return *gate(xf, ids), None
        shared_gemv = se.w1.takes_gemv(xf) and se.w3.takes_gemv(xf)
        if self.one_row in ("shared", "experts") and shared_gemv:
            logits, g, u = gemv.gemv_many(xf, (gate.weights(), se.w1.grouped_weights(), se.w3.grouped_weights()),
                                          gemv.ONE_GROUP, quantise=(False, se.w1.fp8_act, se.w3.fp8_act),
                                          out_dtype=jnp.float32, partials=(True, True, True))
            if self.one_row == "experts" and self._routes_in_experts(xf.shape[0]):
                return gate.route(logits, ids), None, se.down(g, u)
            return *gate.select(logits, ids), se.down(g, u)
        logits = gemv.gemv_many(xf, (gate.weights(),), gemv.ONE_GROUP, out_dtype=jnp.float32, partials=(True,))[0]
        gu = None
        if self.one_row == "apart" and shared_gemv:  # the shared expert's w1 / w3 in a launch of their own
            gu = gemv.gemv_many(xf, (se.w1.grouped_weights(), se.w3.grouped_weights()), gemv.ONE_GROUP,
                                quantise=(se.w1.fp8_act, se.w3.fp8_act), out_dtype=jnp.float32, partials=(True, True),
                                config=shared_config())
        w, idx = gate.select(logits, ids)
        return w, idx, None if gu is None else se.down(*gu)
