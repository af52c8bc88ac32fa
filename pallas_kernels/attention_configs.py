"""Tile configurations of the ragged attention kernel, chosen by shape from a tuned table.

``attention_configs.json`` (beside this module) holds configurations for a few shapes, per GPU
platform (``cuda`` / ``rocm``): layer kind (``window``: ring keys only, ``prefix``: + every
visible compressed entry (Cm layers), ``topk``: + the indexer's picks (C4 layers)), pool layout
(bf16 / fp8), number of heads, verify tokens per request and number of requests. Each entry says
where it comes from (``source``): measured best by ``benchmarks/kernels.py --device-time`` (a
small sweep timed inside one jitted loop on a GPU, which rewrites the entries of its platform),
or provisional, chosen by reasoning and an offline compilation of the kernel (registers, spills).

``select`` takes the entry of the same platform, kind, layout and head count whose batch is
nearest (on a log scale; ties go to the larger batch, whose tiles are the efficient ones) and
rescales its key splits so that the call launches about as many programs as the tuned shape did:
fewer requests or tokens spread each program's keys over more splits. Shapes without an entry
(other head counts, e.g. the tiny test model) get ``default_config``. Off GPU (interpret mode)
the ``cuda`` entries apply.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

from pallas_kernels import backend

KINDS = ("window", "prefix", "topk")
POOLS = ("bf16", "fp8")
PLATFORMS = ("cuda", "rocm")
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_configs.json")
MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes of one kernel call (powers of two).

    A program holds ``block_t`` tokens x ``block_h`` heads of one request as the rows of its tiles
    (>= 16 rows) and walks their keys ``block_k`` (>= 16) at a time. ``kv_splits`` > 1 shares each
    program's key tiles among that many programs (partial results merged afterwards). With
    ``fp8_fold`` an fp8 pool is never dequantised: its per-64-dim scales multiply the logits and
    the probabilities of 64-column dots instead (else each key tile is dequantised once per
    program). ``block_d`` (>= 64) splits q, the key tiles and the accumulator into column blocks
    of that width (dots summed over the blocks; fewer live registers while a tile is converted);
    ``fp8_fold`` implies 64. Top-k entries need ``block_t = 1`` (each token has its own key list).
    """

    block_t: int = 1
    block_h: int = 64
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2
    kv_splits: int = 1
    fp8_fold: bool = False
    block_d: int = 512

    @property
    def rows(self) -> int:
        return self.block_t * self.block_h

    def check(self) -> None:
        if self.kv_splits < 1:
            raise ValueError(f"kv_splits must be >= 1, got {self.kv_splits}")
        for name in ("block_t", "block_h", "block_k"):
            if not backend.is_power_of_2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        if not backend.is_power_of_2(self.block_d) or self.block_d < 64:
            raise ValueError(f"block_d must be a power of two >= 64, got {self.block_d}")
        if self.rows < 16 or self.block_k < 16:
            raise ValueError(f"tiles need >= 16 rows and >= 16 keys, got block_t * block_h = {self.rows}, "
                             f"block_k = {self.block_k}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BlockConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown BlockConfig fields {sorted(unknown)}")
        return cls(**d)


def row_programs(cfg: BlockConfig, num_heads: int, max_q_len: int, num_requests: int) -> int:
    """Programs of one key split: requests x token blocks x head blocks."""
    return num_requests * -(-max_q_len // cfg.block_t) * -(-num_heads // cfg.block_h)


def _with_splits(cfg: BlockConfig, programs: float, num_heads: int, max_q_len: int, num_requests: int,
                 n_keys: int | None) -> BlockConfig:
    """``cfg`` with as many key splits as make about ``programs`` programs in all, and no more
    splits than a program has key tiles (``n_keys``: most keys one token may have)."""
    splits = programs / row_programs(cfg, num_heads, max_q_len, num_requests)
    most = MAX_SPLITS if n_keys is None else max(1, min(MAX_SPLITS, -(-n_keys // cfg.block_k)))
    return dataclasses.replace(cfg, kv_splits=int(min(most, max(1, round(splits)))))


def default_config(num_heads: int, max_q_len: int, num_requests: int = 64, *, kind: str = "window",
                   fp8: bool = False, platform: str | None = None, n_keys: int | None = None,
                   target_programs: int = 128) -> BlockConfig:
    """The fallback for shapes without a table entry: one token's heads per program (several
    tokens when there are fewer than 16 heads, except for top-k entries), 16 to 64 rows, 32-key
    tiles, and key splits when the grid has fewer than ``target_programs`` programs. A 64-row
    fp32 accumulator of 512 columns needs 8 warps of 32 lanes (NVIDIA) or 4 wavefronts of 64
    (AMD) to stay in registers."""
    block_h = min(backend.next_power_of_2(num_heads), 64)
    block_t = 1
    if block_h < 16:
        if kind == "topk":
            block_h = 16  # a top-k key list serves one token: pad the rows with masked heads
        else:
            block_t = min(backend.next_power_of_2(max_q_len), 16 // block_h)
            block_h = max(block_h, 16 // block_t)
    rows = block_t * block_h
    rocm = platform == "rocm"
    cfg = BlockConfig(block_t=block_t, block_h=block_h, block_k=32,
                      num_warps=8 if rows >= 64 and not rocm else 4, num_stages=1 if rocm else 2,
                      block_d=256 if fp8 else 512)
    programs = row_programs(cfg, num_heads, max_q_len, num_requests)
    return cfg if programs >= target_programs else _with_splits(cfg, target_programs, num_heads, max_q_len,
                                                                 num_requests, n_keys)


# ------------------------------------------------------------------------------ the tuned table
@functools.cache
def _read(path: str) -> tuple[dict, ...]:
    with open(path) as f:
        table = json.load(f)
    entries = []
    for e in table["entries"]:
        if e["kind"] not in KINDS or e["pool"] not in POOLS or e["platform"] not in PLATFORMS:
            raise ValueError(f"{path}: bad platform / kind / pool in entry {e}")
        cfg = BlockConfig.from_dict(e["config"])
        cfg.check()
        if e["kind"] == "topk" and cfg.block_t != 1:
            raise ValueError(f"{path}: top-k entries need block_t = 1, got {e}")
        entries.append(dict(e, config=cfg))
    return tuple(entries)


def table_entries(path: str = TABLE_PATH) -> tuple[dict, ...]:
    """The table's entries (``config`` as a ``BlockConfig``), validated."""
    return _read(os.path.abspath(path))


def table_configs(path: str = TABLE_PATH) -> list[BlockConfig]:
    """The distinct configurations of the table, in table order."""
    return list(dict.fromkeys(e["config"] for e in table_entries(path)))


def select(num_heads: int, max_q_len: int, num_requests: int, kind: str, fp8: bool, *,
           platform: str | None = None, n_keys: int | None = None, path: str = TABLE_PATH) -> BlockConfig:
    """The configuration for one call shape on ``platform`` (see the module docstring); ``n_keys``
    (the most keys one token may have: ring rows + entry slots) bounds the key splits."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    platform = platform or "cuda"
    pool = "fp8" if fp8 else "bf16"
    same = [e for e in table_entries(path)
            if e["platform"] == platform and e["heads"] == num_heads and e["pool"] == pool]
    cands = [e for e in same if e["kind"] == kind] or same
    if not cands:
        return default_config(num_heads, max_q_len, num_requests, kind=kind, fp8=fp8, platform=platform,
                              n_keys=n_keys)
    b = math.log2(max(num_requests, 1))
    best = min(cands, key=lambda e: (abs(math.log2(e["batch"]) - b), -e["batch"], abs(e["q_len"] - max_q_len)))
    cfg = best["config"]
    if kind == "topk" and cfg.block_t != 1:
        cfg = dataclasses.replace(cfg, block_t=1, block_h=max(cfg.block_h, 16))
    tuned_programs = cfg.kv_splits * row_programs(cfg, num_heads, best["q_len"], best["batch"])
    return _with_splits(cfg, tuned_programs, num_heads, max_q_len, num_requests, n_keys)
