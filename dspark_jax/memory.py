"""Memory planner for the KV caches: bytes per token and how many tokens / requests fit.

Costs that grow with the context (per token of a request, summed over target layers):
- C4 layers: one compressed KV row per 4 tokens + one indexer key (index_head_dim, in the compute
  dtype or, in the fp8 layout, fp8 with a scale per 32 dims: 132 B) per 4 tokens;
- Cm layers: one compressed KV row per m tokens.
Fixed costs per request (independent of its length):
- a window ring per target layer (``window_ring_size`` rows, in the pool's layout);
- compressor input rings (fp32 kv and gate scores) of every compressed layer and C4 indexer;
- the drafter's context rings (``window_ring_size`` rows per stage, in the compute dtype), unless gamma = 0;
- the committed length (4 B).

A KV row is ``head_dim`` latents: 1024 B in bf16, 640 B in the fp8 layout (``pallas_kernels.kv_fp8``).
Sizes follow ``dspark_jax.cache`` (entries sized by ceil(length / m) per request) byte for byte.
``plan_slots`` sizes generate's slot pool: requests of a given context in the free device memory.

    python -m dspark_jax.memory            # DeepSeek-V4-Flash figures for both layouts
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import jax.numpy as jnp

from dspark_jax import config as config_lib
from dspark_jax.config import ModelConfig
from dspark_jax.cache import KEY_BLOCK
from pallas_kernels.kv_fp8 import row_bytes

LAYOUTS = ("bf16", "fp8")
LENGTH_BYTES = 4  # the committed length of a request (int32)
FREE_FRACTION = 0.9  # share of the free device memory the slot pool may take by default
_GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    layout: str
    budget_bytes: int
    seq_len: int
    bytes_per_token: float  # context-proportional cost, averaged per token
    bytes_per_request_fixed: int  # rings and compressor states of one request
    bytes_per_request: int  # fixed + entries for a request of seq_len tokens
    max_requests: int  # requests of seq_len tokens that fit in the budget
    max_tokens: int  # max_requests * seq_len
    breakdown: dict[str, float]  # named parts (per token or per request, see keys)

    def summary(self) -> str:
        b = self.breakdown
        lines = [
            f"layout {self.layout}: {self.bytes_per_token:,.1f} B/token of context "
            f"(C4 entries {b['c4_entries_per_token']:,.1f} + indexer keys {b['indexer_keys_per_token']:,.1f} "
            f"+ Cm entries {b['cm_entries_per_token']:,.1f}); fixed {self.bytes_per_request_fixed / 2**20:,.2f} MiB "
            f"per request (window rings {b['window_rings_per_request'] / 2**20:,.2f}, compressor states "
            f"{b['compressor_states_per_request'] / 2**20:,.2f}, "
            f"draft rings {b['draft_rings_per_request'] / 2**20:,.2f})",
            f"  budget {self.budget_bytes / _GiB:,.1f} GiB, requests of {self.seq_len:,} tokens: "
            f"{self.bytes_per_request / 2**20:,.1f} MiB each -> {self.max_requests:,} requests = "
            f"{self.max_tokens:,} tokens",
        ]
        return "\n".join(lines)


def plan(cfg: ModelConfig, budget_bytes: int, layout: str = "bf16", *, seq_len: int = 32768,
         gamma: int | None = None, dtype="bfloat16") -> MemoryPlan:
    """How many requests of ``seq_len`` cache tokens fit into ``budget_bytes`` of cache memory.

    layout: 'bf16' or 'fp8' for the target's KV pools (window rings and compressed entries).
    gamma: speculative block size; 0 = target-only decoding (no draft rings); None = the
        config's drafter if it has one.
    dtype: the compute dtype, which the 'bf16' layout's rows, the indexer keys and the draft
        rings are stored in (bfloat16 for served checkpoints, float32 for the CPU tests).
    seq_len: ``init_cache``'s ``max_len`` (prompt + new tokens + one verify block), so that
        ``bytes_per_request`` is exactly the bytes of one slot's caches (``cache.cache_bytes`` of
        the target caches plus the draft rings).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if gamma is not None and gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    item = jnp.dtype(dtype).itemsize
    row = item * cfg.head_dim if layout == "bf16" else row_bytes(cfg.head_dim, cfg.qk_rope_head_dim, layout)
    # indexer keys: in the compute dtype, or fp8 codes + one scale byte per 32 dims (cache.Fp8Keys)
    index_key = item * cfg.index_head_dim if layout == "bf16" else cfg.index_head_dim + cfg.index_head_dim // KEY_BLOCK
    ring = cfg.window_ring_size

    c4 = [r for r in cfg.compress_ratios if r == 4]
    cm = [r for r in cfg.compress_ratios if r and r != 4]
    per_tok = dict(c4_entries_per_token=len(c4) * row / 4, indexer_keys_per_token=len(c4) * index_key / 4,
                   cm_entries_per_token=sum(row / m for m in cm))
    entries_for_len = sum(math.ceil(seq_len / r) * (row + (index_key if r == 4 else 0))
                          for r in cfg.compress_ratios if r)

    window_rings = cfg.num_hidden_layers * ring * row
    states = 0
    for r in cfg.compress_ratios:
        if not r:
            continue
        coff = 2 if r == 4 else 1
        rows = cfg.compressor_ring_size(r)
        states += 2 * rows * coff * cfg.head_dim * 4  # kv + score, fp32
        if r == 4:
            states += 2 * rows * coff * cfg.index_head_dim * 4
    draft_stages = 0
    if cfg.dspark is not None and gamma != 0:
        draft_stages = cfg.dspark.num_stages
    draft_rings = draft_stages * ring * item * cfg.head_dim
    fixed = window_rings + states + draft_rings + LENGTH_BYTES
    per_request = fixed + entries_for_len
    n_req = int(budget_bytes // per_request)
    return MemoryPlan(layout=layout, budget_bytes=int(budget_bytes), seq_len=seq_len,
                      bytes_per_token=sum(per_tok.values()), bytes_per_request_fixed=fixed,
                      bytes_per_request=per_request, max_requests=n_req, max_tokens=n_req * seq_len,
                      breakdown=dict(per_tok, window_rings_per_request=window_rings,
                                     compressor_states_per_request=states, draft_rings_per_request=draft_rings))


def free_device_bytes(device=None) -> int:
    """Memory not yet in use on ``device`` (default: the first device): the allocator's limit
    minus its bytes in use on accelerators, the available host memory on the CPU."""
    import jax

    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_slots(cfg: ModelConfig, context: int, *, layout: str = "bf16", gamma: int | None = None,
               dtype="bfloat16", budget_bytes: int | None = None, fraction: float = FREE_FRACTION) -> MemoryPlan:
    """The slot pool that fits: requests of ``context`` cache tokens in ``budget_bytes`` (None:
    ``fraction`` of the free device memory); ``max_requests`` is the number of slots."""
    if budget_bytes is None:
        budget_bytes = int(fraction * free_device_bytes())
    return plan(cfg, budget_bytes, layout, seq_len=context, gamma=gamma, dtype=dtype)


def weight_bytes(cfg: ModelConfig, weight_format: str = "official", param_dtype="bfloat16", *,
                 dense_copies: bool = False) -> dict[str, int]:
    """Bytes of the model's weights by part ("routed_experts", "other"), counted from the abstract
    model (no memory allocated): ``weight_format`` "official" keeps FP4 experts and FP8 linears as
    the checkpoints store them, "dense" holds every matrix in ``param_dtype``. ``dense_copies``
    adds "dense_copies": the FP8 linears also held dequantised in ``param_dtype``
    (``dspark_jax.with_dense_copies``)."""
    import jax
    from flax import nnx

    from dspark_jax.model.common import Linear, Numerics
    from dspark_jax.model.deepseek_v4 import DeepSeekV4

    num = Numerics(dtype=param_dtype, param_dtype=param_dtype, weight_format=weight_format)
    module = nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0)))
    out = {"routed_experts": 0, "other": 0}
    for key, var in nnx.to_flat_state(nnx.state(module)):
        part = "routed_experts" if "experts" in map(str, key) and "shared_experts" not in map(str, key) else "other"
        out[part] += math.prod(var.shape) * jax.numpy.dtype(var.dtype).itemsize
    if dense_copies:
        out["dense_copies"] = sum(math.prod(m.weight.shape) * jnp.dtype(param_dtype).itemsize
                                  for _, m in nnx.iter_modules(module) if isinstance(m, Linear) and m.quantized)
    return out


def compare(cfg: ModelConfig, budget_bytes: int, *, seq_len: int = 32768, gamma: int | None = None) -> str:
    """Both layouts side by side with the capacity ratio."""
    bf16 = plan(cfg, budget_bytes, "bf16", seq_len=seq_len, gamma=gamma)
    fp8 = plan(cfg, budget_bytes, "fp8", seq_len=seq_len, gamma=gamma)
    ratio_tok = bf16.bytes_per_token / fp8.bytes_per_token
    ratio_fit = fp8.max_tokens / max(bf16.max_tokens, 1)
    return "\n".join([bf16.summary(), fp8.summary(),
                      f"fp8 / bf16: {ratio_tok:.3f}x tokens per byte of context; "
                      f"{ratio_fit:.3f}x tokens that fit at {seq_len:,} tokens per request"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash", choices=sorted(config_lib.PRESETS))
    ap.add_argument("--budget-gib", type=float, default=64.0)
    ap.add_argument("--seq-len", type=int, nargs="+", default=[8192, 32768, 65536])
    ap.add_argument("--gamma", type=int, default=None)
    args = ap.parse_args(argv)
    cfg = config_lib.PRESETS[args.preset]()
    for fmt in ("official", "dense"):
        w = weight_bytes(cfg, fmt, dense_copies=fmt == "official")
        copies = w.pop("dense_copies", 0)
        print(f"== {args.preset} weights ({fmt}): {sum(w.values()) / _GiB:,.1f} GiB "
              f"(routed experts {w['routed_experts'] / _GiB:,.1f}, other {w['other'] / _GiB:,.1f})"
              + (f"; dense copies of its FP8 linears (with_dense_copies): {copies / _GiB:,.1f} GiB more"
                 if copies else ""))
    for n in args.seq_len:
        print(f"== {args.preset}, {n:,}-token requests")
        print(compare(cfg, int(args.budget_gib * _GiB), seq_len=n, gamma=args.gamma))


if __name__ == "__main__":
    main()
