"""MQA latent attention of DeepSeek-V4 (one 512-d latent per token is both key and value).

Queries: q = wq_b(q_norm(wq_a(x))), a weightless per-head RMS norm, RoPE at the token position
(``pallas_kernels.rope.q_norm_rope``).
Keys = values: kv = kv_norm(wkv(x)) with RoPE (and fp8 nope dims under ``quant_sim``).
Key set of a query at position i: the ``sliding_window`` latest tokens up to and including i,
plus compressed entries (C4: the indexer's top-k, Cm: all visible entries). A learned per-head
sink logit enters only the softmax denominator. The output is rotated back (inverse RoPE at i)
and projected by the grouped low-rank wo_a / wo_b.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from dspark_jax.cache import LayerCache, read_kv, ring_positions, ring_write_slots, write_kv
from dspark_jax.config import ModelConfig
from dspark_jax.model.common import Chunk, Linear, Numerics, shared_input
from dspark_jax.model.compressor import Compressor
from dspark_jax.model.indexer import Indexer, visible_entries
from dspark_jax.model.norms_rope import RMSNorm, apply_rope, layer_inv_freq
from dspark_jax.model.quant import kv_sim
from dspark_jax.sharding import activation_spec, batch_axes
from pallas_kernels import attention_metadata, backend, gemv, horizontal, kv_rows
from pallas_kernels.gemv import Partials, total
from pallas_kernels.ragged_attention import ragged_attention, sink_attention  # noqa: F401 (re-exported)
from pallas_kernels.rms_norms import rms_norms
from pallas_kernels.rope import q_norm_rope

# How a one-token step launches its new rows (``Attention._new_rows``): "apart" (q_norm in a
# launch of its own, so that wq_b waits for it alone, and the window's row with the compressors'
# pooling in one launch beside it), "one" (q_norm in that launch too: wq_b then waits for the
# pooling, ~20 us in a C4 layer on an H200; the 43-layer batch-1 step 8.57 / 8.74 ms against
# 8.02 / 8.32 for "apart", docs/benchmarks.md), "separate" (one launch per kernel). A switch for
# benchmarks (``benchmarks/decode.py --new-rows``), as ``compressor_pool.WRITE_IN_POOL``; a
# compressed layer merges its new rows only with that on (off by default: then its window row and
# q_norm share a launch and each compressor's step takes two).
NEW_ROWS = "apart"
NEW_ROWS_MODES = ("one", "apart", "separate")
# Whether a C4 layer's one-token step launches wq_b and its indexer's wq_b together (one read of
# qr, one launch) or each on its own (the indexer's scores and top-k may then run beside the
# larger wq_b; on an H100 the 6-layer Flash slice's batch-1 step took 16 us longer so,
# docs/benchmarks.md). A switch for benchmarks (``benchmarks/decode.py --wq-b-apart``).
WQ_B_TOGETHER = True
# Whether a compressed layer's one-token step multiplies x by wq_a, wkv and its compressors' linears
# in one launch (x read once; 27 MB in a C4 layer, 12.2 us on an H200) or (off, the default) by
# wq_a + wkv in one (5.8 us) and the compressors' linears (bf16, 21 MB in a C4 layer; 7.9 us) in
# another beside it: the queries' chain (q_norm, wq_b, the indexer's scores, the attention) then
# waits for the 6 MB of wq_a + wkv only. Apart, the 6-layer Flash slice's batch-1 step took 19-38 us
# less on an H200 (the median of 21-31 paired passes; faster in 76-84 % of them; docs/benchmarks.md).
# A switch for benchmarks (``benchmarks/decode.py --x-linears together``).
X_LINEARS_TOGETHER = False
# With ``X_LINEARS_TOGETHER`` off, whether a C4 layer's one-token step multiplies x by its indexer's
# linears (weights_proj and its compressor's wkv and wgate, bf16, 4.7 MB at Flash widths) in a launch
# of their own instead of with the attention compressor's (16.8 MB): the indexer's pooling and new key
# row, which its scores wait for, then need the smaller launch only. A switch for benchmarks
# (``benchmarks/decode.py --indexer-linears apart``).
INDEXER_LINEARS_APART = False
# The K split of a compressed layer's one-token launch of its compressors' linears (with
# ``X_LINEARS_TOGETHER`` off; 0: ``gemv``'s automatic tiles). That launch runs beside wq_a + wkv,
# which the queries' chain waits for. A switch for benchmarks (``benchmarks/decode.py
# --compressor-split``).
COMPRESSOR_SPLIT = 0

def window_mask(key_pos: Array, key_ok: Array, q_pos: Array, window: int) -> Bool[Array, "b t k"]:
    """Causal sliding window of ``window`` tokens including the query itself."""
    kp, qp = key_pos[:, None, :], q_pos[:, :, None]
    return key_ok[:, None, :] & (kp <= qp) & (kp > qp - window)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, num: Numerics, *, rngs: nnx.Rngs):
        h, d, g = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, num, rngs=rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, h * d, num, rngs=rngs)
        self.wkv = Linear(cfg.hidden_size, d, num, rngs=rngs)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        # fp8 in the checkpoint but applied dequantised in bf16 without activation quantisation.
        self.wo_a = Linear(h * d // g, g * cfg.o_lora_rank, num, rngs=rngs, fp8_act=False, fp8_weight=True)
        self.wo_b = Linear(g * cfg.o_lora_rank, cfg.hidden_size, num, rngs=rngs)
        self.attn_sink = nnx.Param(jnp.zeros((h,), jnp.float32))
        if ratio:
            self.compressor = Compressor(cfg, ratio, d, num, rotate=False, rngs=rngs)
        if ratio == 4:
            self.indexer = Indexer(cfg, num, rngs=rngs)
        self.cfg, self.num, self.ratio = cfg, num, ratio
        self.mesh = None  # set by ``dspark_jax.sharding.attach_mesh``: the kernels then run per device

    @property
    def inv_freq(self):
        return layer_inv_freq(self.cfg, self.ratio)

    def project_q(self, x: Float[Array, "b t D"], pos: Array, a: Array | None = None, qr: Array | None = None,
                  rounded: bool = False, rope: bool = True, q_b: Array | None = None
                  ) -> tuple[Float[Array, "b t h d"], Array]:
        """Queries and qr = q_norm(wq_a(x)) (``a``: wq_a(x), or ``qr`` itself, when already computed;
        ``rounded``: that qr holds the quantised values wq_b takes, ``Linear(rounded=True)``;
        ``q_b``: wq_b(qr) itself). ``rope`` False: the queries before their head norm and RoPE, for
        the ragged attention to apply (``q_rope``: ``ragged_q_rope``)."""
        cfg = self.cfg
        if qr is None:
            qr = self.q_norm(self.wq_a(x) if a is None else a)
        q = self.wq_b(qr, rounded=rounded) if q_b is None else q_b
        b, t = x.shape[:2]
        if not rope:
            return q.reshape(b, t, cfg.num_attention_heads, cfg.head_dim), qr
        # a weightless per-head RMS norm, then RoPE (one launch on the Pallas path without a mesh)
        impl = self.num.kernel_impl() if self.mesh is None else "xla"
        q = q_norm_rope(q.reshape(b * t, cfg.num_attention_heads, cfg.head_dim), pos.reshape(-1), self.inv_freq,
                        cfg.rms_norm_eps, impl=impl)
        return q.reshape(b, t, cfg.num_attention_heads, cfg.head_dim), qr

    def ragged_q_rope(self, positions: Int[Array, " t"]) -> tuple[Array, Array, float]:
        """``ragged_attention``'s ``q_rope`` for queries of ``project_q(rope=False)`` at ``positions``."""
        return positions, self.inv_freq, self.cfg.rms_norm_eps

    def project_kv(self, x: Float[Array, "b t D"], pos: Array, a: Array | None = None) -> Float[Array, "b t d"]:
        """Keys = values (``a``: wkv(x), when already computed; at one token the kernel path does
        all of it with the window's write: ``kv_rows``)."""
        kv = apply_rope(self.kv_norm(self.wkv(x) if a is None else a), pos, self.inv_freq, heads=False)
        return kv_sim(kv, self.cfg.qk_rope_head_dim) if self.num.quant_sim else kv

    def project_out(self, o: Float[Array, "b t h d"], pos: Array | None, partials: bool = False
                    ) -> Float[Array, "b t D"] | Partials:
        """Inverse RoPE (``pos`` None: ``o`` is rotated back already), then wo_a per output group
        and wo_b (on a mesh both per device: the groups' rows of wo_a and wo_b's matching columns,
        summed over ``model`` by wo_b). ``partials``: at one row, wo_b's split partial sums
        (``Linear(partials=True)``: mHC's expansion adds them, ``hyper.hc_post_pre_norm``)."""
        b, t = o.shape[:2]
        if pos is not None:
            o = apply_rope(o, pos, self.inv_freq, inverse=True)
        o = o.reshape(b, t, self.cfg.o_groups, -1)
        # (at one token wo_a's split partial sums go to wo_b's programs, which add them)
        return self.wo_b(self.wo_a.grouped(o, partials=partials).reshape(b, t, -1), partials=partials)

    def __call__(self, x: Float[Array, "b t D"], chunk: Chunk, cache: LayerCache
                 ) -> tuple[Float[Array, "b t D"] | Partials, LayerCache]:
        """The attention's output (at a one-token step: wo_b's partial sums, ``project_out``) and
        the updated cache."""
        cfg = self.cfg
        pos = chunk.positions
        # every linear of x in one launch at one row: wq_a, wkv, the compressor's, the indexer's
        # (``X_LINEARS_TOGETHER`` off: wq_a + wkv in one, the compressors' in another), as the split's
        # partial sums (their consumers add them)
        cmp = (self.compressor.wkv, self.compressor.wgate) if self.ratio else ()
        idx = self.indexer.x_linears() if self.ratio == 4 else ()
        if X_LINEARS_TOGETHER:
            a_q, a_kv, *projected = shared_input((self.wq_a, self.wkv, *cmp, *idx), x, self.mesh,
                                                 partials=(True,) * (2 + len(cmp) + len(idx)))
        else:
            a_q, a_kv = shared_input((self.wq_a, self.wkv), x, self.mesh, partials=(True, True))
            groups = ((*cmp,), (*idx,)) if INDEXER_LINEARS_APART and idx else ((*cmp, *idx),)
            split = gemv.GemvConfig(split_k=COMPRESSOR_SPLIT) if COMPRESSOR_SPLIT else None
            projected = [y for g in groups
                         for y in shared_input(g, x, self.mesh, partials=(True,) * len(g), config=split)]
        b, t = x.shape[:2]
        ring = cache.window.shape[1]
        impl = self.num.kernel_impl()
        slots = ring_write_slots(chunk.start, chunk.n_valid, chunk.width, ring)  # per request
        decode = chunk.width <= ring - cfg.sliding_window + 1  # (else a prefill chunk)

        new = {}
        qr = kv = None
        rounded = False  # qr: the quantised values wq_b (and the indexer's wq_b) take
        pooled = (None, None)  # the compressor's and the indexer's pooling, when launched here
        q_b = index_q = None  # wq_b(qr) and the indexer's, when launched here
        one_row = isinstance(a_q, Partials) and isinstance(a_kv, Partials)
        if decode and chunk.packing is None and (one_row or (impl == "pallas" and self.mesh is None)):
            # a decode step or verify chunk (per request) from the split sums (at one token) or the
            # products: the window's new rows (kv_norm, RoPE, kv_sim and the write), q_norm (with the
            # values wq_b takes) and the compressors' pooling and entries in one launch
            a_q, a_kv = (a if isinstance(a, Partials) else Partials(a.astype(jnp.float32)[None]) for a in (a_q, a_kv))
            rounded = self.wq_b.fp8_act and (self.ratio != 4 or self.indexer.wq_b.fp8_act)
            (new["window"], *normed), pooled = self._new_rows(a_q, a_kv, chunk, cache, slots, rounded, projected,
                                                              x.dtype)
            qr = normed[-1].reshape(*x.shape[:-1], -1)
            if self.ratio == 4 and one_row and WQ_B_TOGETHER:  # wq_b and the indexer's (partial sums) in one launch
                q_b, index_q = shared_input((self.wq_b, self.indexer.wq_b), qr, self.mesh, partials=(False, True),
                                            rounded=rounded)
        else:
            a_q, a_kv = total(a_q, x.dtype), total(a_kv, x.dtype)
            kv = self.project_kv(x, pos, a_kv)
        # (a decode step's queries get their head norm and RoPE inside the ragged attention)
        q, qr = self.project_q(x, pos, a_q, qr, rounded, rope=not decode, q_b=q_b)

        entries = top = None
        if self.ratio:
            entries, new["compressor"] = self.compressor(x, chunk, cache.compressor, tuple(projected[:2]),
                                                         pooled=pooled[0])
            if self.ratio == 4:
                top, new["indexer"] = self.indexer(x, qr, chunk, cache.indexer, tuple(projected[2:]),  # -1: none
                                                   rounded=rounded, pooled=pooled[1], q=index_q)

        if decode:
            # Decode / verify: write the rows first; the ring then holds every key of the chunk.
            if kv is not None:
                new["window"] = write_kv(cache.window, slots, chunk.unpack(kv), impl=impl, mesh=self.mesh)
            o = self._ragged(q, new["window"], entries, top, chunk, impl)  # rotated back already
            return self.project_out(o, None, partials=True), dataclasses.replace(cache, **new)
        else:
            # Prefill chunk: keys = the ring before the chunk + the chunk's own rows.
            rpos = ring_positions(chunk.start, ring)
            keys = jnp.concatenate([read_kv(cache.window, q.dtype), kv.astype(q.dtype)], axis=1)
            key_pos = jnp.concatenate([rpos, pos], axis=1)
            key_ok = jnp.concatenate([rpos >= 0, chunk.row_valid], axis=1)
            parts = [(keys, window_mask(key_pos, key_ok, pos, cfg.sliding_window))]
            if self.ratio:
                ent = read_kv(entries, q.dtype)
                if self.ratio == 4:
                    picked = ent[jnp.arange(b)[:, None, None], jnp.maximum(top, 0)]  # [b, t, k, d]
                    parts.append((picked, top >= 0))
                else:
                    n = ent.shape[1]
                    parts.append((ent, jnp.arange(n)[None, None] < visible_entries(pos, self.ratio)[..., None]))
            o = sink_attention(q, parts, self.attn_sink[...], cfg.head_dim**-0.5)
            new["window"] = write_kv(cache.window, slots, kv, impl=impl, mesh=self.mesh)
        return self.project_out(o, pos), dataclasses.replace(cache, **new)

    def _new_rows(self, a_q: Partials, a_kv: Partials, chunk: Chunk, cache: LayerCache, slots: Array, rounded: bool,
                  projected: list, dtype) -> tuple[tuple[Array, ...], tuple]:
        """A one-token step's new rows from the shared launch's partial sums: (the window's pool with
        its new row, q_norm's rows[, their quantised values]) and the compressor's and indexer's
        pooling outputs (``Compressor.pool_part``; None: not pooled here). On the Pallas path the
        window's row and the compressors' parts in one launch (``horizontal.launch``) and q_norm in
        one of its own beside it (``NEW_ROWS`` "apart"; "one": q_norm in the first launch too,
        ``kv_rows.rows_and_norm_part``), else the window's row and q_norm in one
        (``kv_rows.write_rows_and_norm``) and the compressors' on their own."""
        impl = self.num.kernel_impl()
        rows = dict(eps=self.kv_norm.eps, quant="kv" if self.num.quant_sim else None, dtype=dtype,
                    norm_x=a_q.reshape(-1, a_q.parts.shape[-1]), norm_weight=self.q_norm.weight[...],
                    norm_eps=self.q_norm.eps, rounded=rounded, impl=impl, mesh=self.mesh)
        args = (cache.window, slots, chunk.positions, a_kv, self.kv_norm.weight[...], self.inv_freq)
        if NEW_ROWS not in NEW_ROWS_MODES:
            raise ValueError(f"attention.NEW_ROWS must be one of {NEW_ROWS_MODES}, got {NEW_ROWS!r}")
        apart = NEW_ROWS == "apart"
        window = kv_rows.rows_and_norm_part(*args, **rows, with_norm=not apart)
        pools = []
        if self.ratio:
            pools.append(self.compressor.pool_part(chunk, cache.compressor, tuple(projected[:2])))
        if self.ratio == 4:
            # (projected[2:]: the indexer's ``x_linears``, weights_proj then its compressor's wkv and wgate)
            pools.append(self.indexer.compressor.pool_part(chunk, cache.indexer, tuple(projected[3:5])))
        if window is None or any(p is None for p in pools) or NEW_ROWS == "separate":
            return kv_rows.write_rows_and_norm(*args, **rows), (None, None)
        name = f"new_rows_x{1 + len(pools)}" if pools else None  # (the window's alone: kv_rows_norm)
        outs = horizontal.launch([window, *pools], name=name, interpret=backend.interpret_mode(None))
        pooled = tuple(outs[1:]) + (None,) * (3 - len(outs))
        if apart:
            normed = rms_norms((rows["norm_x"],), (rows["norm_weight"],), rows["norm_eps"], dtype,
                               rounded=(rounded,), impl=impl)
            return (outs[0][0], *normed), pooled
        return outs[0], pooled

    def per_device(self, fn, q: Float[Array, "b t h d"], requests: dict) -> Float[Array, "b t h d"]:
        """``fn(q, sink, requests)`` for the queries, this layer's sinks [h] and a dict of
        per-request arrays (pools, lengths: the request is their leading dim). On a mesh
        (``sharding.attach_mesh``) every device runs ``fn`` in a ``shard_map`` on its own requests
        (``data``, with their pools) and heads (``model``): the attention kernels are
        ``pallas_call``s, which have no partitioning rule, so left to the partitioner they would
        run whole on gathered inputs."""
        sink = self.attn_sink[...]
        if self.mesh is None:
            return fn(q, sink, requests)
        q_spec = activation_spec(("batch", None, "heads"), q.shape, self.mesh, self.cfg)
        req = activation_spec(("batch",), q.shape[:1], self.mesh, self.cfg)
        heads = activation_spec(("heads",), sink.shape, self.mesh, self.cfg)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(q_spec, heads, req), out_specs=q_spec,
                             check_vma=False)(q, sink, requests)

    def per_device_packed(self, fn, q: Float[Array, "1 T h d"], tokens: dict, requests: dict,
                          cu: Int[Array, " b1"]) -> Float[Array, "1 T h d"]:
        """``per_device`` for a packed chunk (ragged verify): ``fn(q, sink, tokens | requests)``
        with q and ``tokens`` (per-token arrays) in the packed layout, request r owning rows
        cu[r] .. cu[r+1] - 1, its ``cu_q_lens`` made by ``fn`` from ``requests["n_valid"]``. On a
        mesh the packed rows are whole on every device (replicated over ``data``, heads over
        ``model``): each device rolls its requests' rows to the front, so that their ``cu_q_lens``
        start at 0, runs ``fn`` on its requests' pools, rolls the rows back and zeroes the others'
        rows; a psum over ``data`` then gives every device every row."""
        sink = self.attn_sink[...]
        if self.mesh is None:
            return fn(q, sink, tokens | requests)
        data = batch_axes(cu.shape[0] - 1, self.mesh)
        q_spec = activation_spec((None, None, "heads"), q.shape, self.mesh, self.cfg)
        heads = activation_spec(("heads",), sink.shape, self.mesh, self.cfg)

        def local(q, sink, tokens, cu, r):
            if not data:
                return fn(q, sink, tokens | r)
            first = jax.lax.axis_index(data) * r["n_valid"].shape[0]
            lo, hi = cu[first], cu[first + r["n_valid"].shape[0]]
            o = fn(jnp.roll(q, -lo, axis=1), sink, {k: jnp.roll(v, -lo, axis=1) for k, v in tokens.items()} | r)
            row = jnp.arange(q.shape[1])[None, :, None, None]
            return jax.lax.psum(jnp.where((row >= lo) & (row < hi), jnp.roll(o, lo, axis=1), 0), data)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(q_spec, heads, P(), P(), P(data or None)),
                             out_specs=q_spec, check_vma=False)(q, sink, tokens, cu, requests)

    def _ragged(self, q, window, entries, top, chunk: Chunk, impl: str) -> Float[Array, "b t h d"]:
        """Ragged attention over the pools (the Pallas kernel or its reference, by ``impl``), its
        output rotated back (inverse RoPE: in the kernel's split merge when it has one), per
        device on a mesh (``per_device``). A packed chunk's tokens (ragged verify) go to it as they
        are, ``cu_q_lens`` from the packing (``per_device_packed``)."""
        requests = dict(window=window, entries=entries, start=chunk.start, n_valid=chunk.n_valid)
        requests = {k: v for k, v in requests.items() if v is not None}
        tokens = {} if top is None else dict(top=top)
        if chunk.packing is None:
            return self.per_device(functools.partial(self._ragged_local, impl=impl), q, tokens | requests)
        return self.per_device_packed(functools.partial(self._ragged_local, impl=impl, packed_width=chunk.width),
                                      q, tokens, requests, chunk.packing.cu)

    def _ragged_local(self, q: Float[Array, "b t h d"], sink: Float[Array, " h"], r: dict, *, impl: str,
                      packed_width: int | None = None) -> Float[Array, "b t h d"]:
        cfg = self.cfg
        b, t, h, d = q.shape
        if packed_width is None:
            meta, pos_flat = attention_metadata.verify_dense(r["n_valid"], r["start"], width=t,
                                                            window=cfg.sliding_window)
        else:
            meta, pos_flat = attention_metadata.verify(r["n_valid"], r["start"], window=cfg.sliding_window,
                                                       num_tokens=t, max_q_len=packed_width)
        if self.ratio == 4:
            meta = attention_metadata.with_topk_entries(meta, r["top"].reshape(b * t, -1), pos_flat)
        elif self.ratio:
            meta = attention_metadata.with_prefix_entries(meta, pos_flat, ratio=self.ratio,
                                                          num_slots=r["entries"].shape[1])
        o = ragged_attention(q.reshape(b * t, h, d), r["window"], r.get("entries"), sink, meta, scale=d**-0.5,
                             impl=impl, out_rope=(pos_flat, self.inv_freq), q_rope=self.ragged_q_rope(pos_flat))
        return o.reshape(b, t, h, d)
