"""Attention call shapes at DeepSeek-V4-Flash sizes for the kernel benchmarks
(``benchmarks/kernels.py``, ``benchmarks/attention_tiles.py``): a layer kind's inputs
(queries, window ring, compressed entries, sink, metadata) for a batch, context and verify
length, with the bytes and FLOPs the call must move."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import baseline_attention as before
from pallas_kernels import attention_metadata as am
from pallas_kernels import kv_fp8

FLASH = dict(heads=64, head_dim=512, window=128, ring=144, topk=512, rope=64, ctx=32768)
SMOKE = dict(heads=4, head_dim=128, window=8, ring=24, topk=8, rope=64, ctx=512)
TABLE_KIND = {"swa": "window", "c128": "prefix", "c4": "topk"}


def _pools(key, batch, rows, dims, layout):
    x = jax.random.normal(key, (batch, rows, dims["head_dim"]), jnp.float32).astype(jnp.bfloat16)
    return kv_fp8.quantize(x, dims["rope"]) if layout == "fp8" else x


def _topk(rng, vis_counts, q_lens, k, shift):
    """Per request a sliding window over a random candidate list: adjacent tokens share k - shift picks."""
    rows = []
    for vis, q in zip(vis_counts, q_lens):
        n_cand = min(vis, k + (q - 1) * shift)
        cand = rng.choice(vis, n_cand, replace=False)
        for i in range(q):
            pick = cand[i * shift: i * shift + k] if n_cand >= k + (q - 1) * shift else cand[:k]
            row = np.full(k, -1, np.int32)
            row[:len(pick)] = pick
            rows.append(row)
    return np.stack(rows)


@dataclasses.dataclass
class Case:
    kind: str  # swa | c128 | c4
    batch: int
    ctx: int
    q_len: int
    layout: str  # bf16 | fp8

    @property
    def key(self) -> str:
        return f"{self.kind}-{self.layout}-b{self.batch}-{self.ctx // 1024}k-q{self.q_len}"


def build_case(case: Case, dims, seed=0):
    """Inputs (q, window, entries, sink, meta), the old kernel's metadata and the byte / FLOP
    counts of one case (all requests end near ``ctx``)."""
    rng = np.random.default_rng(seed)
    h, d, w, ring, k = dims["heads"], dims["head_dim"], dims["window"], dims["ring"], dims["topk"]
    batch, q_len = case.batch, case.q_len
    q_lens = np.full(batch, q_len, np.int32)
    lengths = np.maximum(case.ctx - q_len - rng.integers(0, 64, batch), 0).astype(np.int32)
    ends = lengths + q_lens
    t = int(q_lens.sum())
    meta, pos = am.verify(q_lens, lengths, window=w, num_tokens=t, max_q_len=q_len)
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (t, h, d), jnp.float32).astype(jnp.bfloat16)
    window = _pools(keys[1], batch, ring, dims, case.layout)
    sink = jax.random.normal(keys[2], (h,), jnp.float32)
    pos_np = np.asarray(pos)
    win_keys = np.minimum(pos_np + 1, w)  # per token
    win_unique = np.minimum(w + q_lens - 1, ends)  # per request
    entries, n_entries, comp_keys, comp_unique = None, 0, np.zeros(t), np.zeros(batch)
    if case.kind == "c128":
        n_entries = max(case.ctx // 128, 1)
        meta = am.with_prefix_entries(meta, pos, ratio=128, num_slots=n_entries)
        entries = _pools(keys[3], batch, n_entries, dims, case.layout)
        comp_keys, comp_unique = (pos_np + 1) // 128, ends // 128
    elif case.kind == "c4":
        n_entries = max(case.ctx // 4, 1)
        topk = _topk(rng, (lengths + 1) // 4, q_lens, k, max(k // 10, 1))  # entries every token may see
        meta = am.with_topk_entries(meta, jnp.asarray(topk))
        entries = _pools(keys[3], batch, n_entries, dims, case.layout)
        comp_keys = (topk >= 0).sum(1)
        comp_unique = np.array([len(np.unique(r[r >= 0])) for r in np.split(topk, np.cumsum(q_lens)[:-1])])
    row = kv_fp8.row_bytes(d, dims["rope"], case.layout)
    bytes_req = 2 * q_lens * h * d * 2 + (win_unique + comp_unique) * row
    flops = float(4 * h * d * (win_keys + comp_keys).sum())
    info = dict(case=case.key, kind=case.kind, batch=batch, ctx=case.ctx, q_len=q_len, layout=case.layout,
                tokens=t, unique_bytes_per_request=float(bytes_req.mean()), bytes=float(bytes_req.sum()),
                useful_flops=flops, keys_per_token=float((win_keys + comp_keys).mean()),
                entries_per_request=float(comp_unique.mean()))
    old_meta = before.union_meta(meta, n_entries)
    return (q, window, entries, sink, meta), old_meta, info
