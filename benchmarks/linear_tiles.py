"""Row tiles of the FP8 linears at verify sizes: device time per linear for each row tile.

A plain linear's rows come in tiles of ``block_m`` rows (``grouped_matmul.block_m_for``), and
every row tile reads the whole weight (from the L2 cache when it is still there) and runs its
tensor-core dots on ``block_m`` rows. This script times the FP8 linears of one DeepSeek-V4-Flash
layer (and the drafter's input projection) at R rows (a batch-32 verify: 192) with each row tile:
16 (and ``--code-tiles``) with the rows as fp8 codes (e4m3 x e4m3 dots, what decode / verify tiles
take) and ``--tiles`` with the rows' rounded values; ``wo_a``, whose rows the model keeps in bf16
(as the reference), with values only. Device time per call from a profiler trace (one jitted
program calls the linear on distinct weight copies, together >= 256 MiB, so no call reads
another's weights from the L2); every variant is checked against the 16-row result.
``--configs`` also times each row tile with other kernel tiles (column tile, step width, warps,
stages, scales folded into the weight tiles); ``--xla`` adds three XLA baselines: the rows'
quantised values times weights dequantised to bf16 beforehand (a cuBLAS GEMM reading twice the
weight bytes: what ``dspark_jax.with_dense_copies`` runs), the same with the dequantisation inside
the program (on an H200 XLA does not fuse it into the GEMM), and the rows' e4m3 codes times the
weights' e4m3 codes with no scales (a ceiling for an fp8 GEMM of the shape; its values differ
from the model's).

    PYTHONPATH=. OUT=out python benchmarks/linear_tiles.py --rows 32,192,384
    PYTHONPATH=. OUT=out python benchmarks/linear_tiles.py --rows 192 --code-tiles 32,64 \
        --configs 128x128w4s3,128x64w8s3f --xla
    PYTHONPATH=. python benchmarks/linear_tiles.py --smoke    # small shapes, interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, write_json
from benchmarks.gemm_decode import Shape, random_weights
from benchmarks.hc_fused import compile_highest, device_times
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.group_metadata import dense_tiles


def flash_linears() -> list[tuple[Shape, bool]]:
    """(shape, whether the model quantises its rows). ``wo_a``: 8 groups, each of the R rows times
    each group's weights; the reference multiplies it by the bf16 rows (no activation quant)."""
    d, h, hd, q, og, orank = 4096, 64, 512, 1024, 8, 1024
    return [(Shape("attn.wo_a (8 groups)", "fp8", orank, h * hd // og, og, og), False),
            (Shape("attn.wq_b", "fp8", h * hd, q, 1, 1), True),
            (Shape("attn.wo_b", "fp8", d, og * orank, 1, 1), True),
            (Shape("attn.wq_a", "fp8", q, d, 1, 1), True),
            (Shape("shared w2", "fp8", d, 2048, 1, 1), True),
            (Shape("indexer.wq_b", "fp8", 64 * 128, q, 1, 1), True),
            (Shape("drafter main_proj", "fp8", d, 3 * d, 1, 1), True)]


def parse_config(text: str) -> gm.GemmConfig:
    """"BNxBKwWsS[f]" (e.g. 128x128w4s3f) -> GemmConfig(block_n=BN, block_k=BK, num_warps=W,
    num_stages=S, fold_scales=True if it ends in f)."""
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(f?)", text)
    if m is None:
        raise ValueError(f"a config is BNxBKwWsS[f], e.g. 128x128w4s3f, got {text!r}")
    bn, bk, warps, stages = map(int, m.groups()[:4])
    return gm.GemmConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, fold_scales=bool(m.group(5)))


def call(x, w: gm.Weights, block_m: int, codes: bool, interpret: bool, config: gm.GemmConfig | None = None):
    """x [R, K] @ w[g]^T for every group g through the kernel with ``block_m``-row tiles (rows
    padded to the tile) and ``config`` (None: the library's): [G, R, N]."""
    r, g = x.shape[0], w.shape[0]
    rp = -(-r // block_m) * block_m
    xp = jnp.tile(jnp.pad(x, ((0, rp - r), (0, 0))), (g, 1))
    rows = gm.ActQuant.of(xp) if codes else gm.ActQuant.of(xp).values()
    tile_group, num_tiles = dense_tiles(rp, g, block_m)
    y = gm.kernel(rows, w, tile_group, num_tiles, block_m=block_m, interpret=interpret, config=config)
    return y.reshape(g, rp, -1)[:, :r]


def xla_call(x, w, kind: str):
    """The XLA baselines (``--xla``): "xla bf16" (x's quantised values times the dequantised
    weights ``w`` [G, N, K] bf16), "xla fp8" (x's e4m3 codes times the weights' codes ``w``, no
    scales) or "xla dequant" (x's quantised values times ``w`` (``gm.Weights``) dequantised to
    bf16 inside the program, which XLA may fuse into its GEMM): [G, R, N]."""
    q = gm.ActQuant.of(x)
    rows = q.codes if kind == "xla fp8" else q.values()
    if kind == "xla dequant":
        w = gm.dequantize(w, jnp.bfloat16)
    return jnp.einsum("rk,gnk->grn", rows, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def variant_label(v: dict) -> str:
    if v["rows_as"].startswith("xla"):
        return v["rows_as"]
    c = v.get("config")
    tiles = "" if c is None else (f" {c['block_n']}x{c['block_k']}w{c['num_warps']}s{c['num_stages']}"
                                  + ("f" if c["fold_scales"] else ""))
    return f"bm {v['block_m']:3d} {'codes' if v['rows_as'] == 'fp8 codes' else 'vals '}{tiles}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="192")
    ap.add_argument("--tiles", default="16,32,64,128")
    ap.add_argument("--code-tiles", default="16",
                    help="row tiles also timed with the rows as fp8 codes (lifts grouped_matmul.CODE_DOTS_MAX_BLOCK_M)")
    ap.add_argument("--configs", default="",
                    help="comma list of kernel tiles BNxBKwWsS[f] also timed at every row tile (f: fold_scales)")
    ap.add_argument("--xla", action="store_true", help="add the XLA baselines (see the module docstring)")
    ap.add_argument("--only", default="", help="comma list: time only the linears whose names contain one of these")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    out = {"env": environment(), "method": __doc__.split("\n\n")[1], "results": []}
    shapes = ([(Shape("linear", "fp8", 256, 512, 1, 1), True), (Shape("grouped", "fp8", 128, 256, 2, 2), False)]
              if args.smoke else flash_linears())
    if args.only:
        shapes = [(s, q) for s, q in shapes if any(part in s.name for part in args.only.split(","))]
    rows_list = [int(r) for r in args.rows.split(",")]
    code_tiles = [int(b) for b in args.code_tiles.split(",")]
    gm.CODE_DOTS_MAX_BLOCK_M = max(code_tiles + [gm.CODE_DOTS_MAX_BLOCK_M])
    configs = [None] + [parse_config(c) for c in args.configs.split(",") if c]
    variants = ([(16, True, None)] + [(b, True, c) for b in code_tiles for c in configs
                                      if (b, c) != (16, None) and not (c and c.fold_scales)]  # codes: no folding
                + [(int(b), False, c) for b in args.tiles.split(",") for c in configs])
    variants += [(0, kind, None) for kind in ("xla bf16", "xla fp8", "xla dequant")] if args.xla else []
    trace_root = tempfile.mkdtemp(prefix="dspark_linear_tiles_")
    for si, (shape, quantised) in enumerate(shapes):
        if time.time() - t0 > args.budget_s:
            print("budget exhausted", flush=True)
            break
        weight_bytes = shape.weight_bytes_per_tile * shape.groups
        copies = 2 if args.smoke else min(32, max(2, -(-(256 << 20) // weight_bytes)))
        keys = jax.random.split(jax.random.key(si), copies + 1)
        ws = [random_weights(keys[c], shape) for c in range(copies)]
        mine = [v for v in variants if quantised or v[1] is not True]  # bf16 rows in the model: no codes
        xla_weights = {"xla bf16": [gm.dequantize(w, jnp.bfloat16) for w in ws],
                       "xla fp8": [w.values for w in ws], "xla dequant": ws} if args.xla else {}
        for rows in rows_list:
            x = jax.random.normal(keys[-1], (rows, shape.k), jnp.bfloat16)
            ref = np.asarray(call(x, ws[0], *mine[0][:2], args.smoke), np.float32)
            compiled, row = {}, {"name": shape.name, "n": shape.n, "k": shape.k, "groups": shape.groups, "rows": rows,
                                 "rows_quantised_in_the_model": quantised, "variants": []}
            for vi, (bm, codes, cfg) in enumerate(mine):
                if isinstance(codes, str):  # an XLA baseline
                    operands = xla_weights[codes]
                    got = xla_call(x, operands[0], codes)
                    fn = functools.partial(lambda kind, x, ws: [xla_call(x, w, kind) for w in ws], codes)
                    label = {"block_m": 0, "rows_as": codes}
                else:
                    operands = ws
                    try:
                        got = call(x, ws[0], bm, codes, args.smoke, cfg)
                    except Exception as e:  # a tile the kernel cannot take: say so, go on
                        print(f"  bm {bm} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    fn = functools.partial(lambda bm, codes, cfg, x, ws: [call(x, w, bm, codes, args.smoke, cfg)
                                                                          for w in ws], bm, codes, cfg)
                    label = {"block_m": bm, "rows_as": "fp8 codes" if codes else "values",
                             "config": None if cfg is None else dataclasses.asdict(cfg)}
                got = np.asarray(got, np.float32)
                err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
                c, module, _, _ = compile_highest(fn, f"linear_tiles_{si}_{rows}_{vi}", x, operands)
                compiled[len(row["variants"])] = (c, module, (x, operands))
                row["variants"].append(label | {"max_rel_diff_vs_first": err})
            for vi, t in device_times(compiled, args.calls, trace_root).items():
                v = row["variants"][vi]
                if "device_us" in t:
                    v["us"] = t["device_us"] / copies
                    v["launches"] = t["launches"] / copies
                    v["GBps"] = (weight_bytes + shape.groups * x.size * 2) / v["us"] / 1e3
                else:
                    v.update(t)
            out["results"].append(row)
            print(f"{shape.name:18s} rows {rows:4d} | " + " | ".join(
                f"{variant_label(v)} {v.get('us', float('nan')):7.1f} us ({v.get('launches', 0):.0f})"
                for v in row["variants"]), flush=True)
            write_json("linear_tiles.json", out)
    write_json("linear_tiles.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
