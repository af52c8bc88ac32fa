"""Linears at one row: the multiply-add kernel (``pallas_kernels.gemv``) against what it replaced,
at DeepSeek-V4-Flash shapes: for FP8 weights the tensor-core dots (``grouped_matmul.
batched_matmul`` / ``batched_swiglu`` with ``one_row_gemv=False``: the row padded to a 16-row
tile, then the grouped-matmul kernel); for bf16 weights applied in float32 (router, compressors,
lm_head) XLA's ``matmul_f32``.

For each shape: the dots, ``gemv`` at the library's default tiles and a sweep of tilings
(``--sweep``), and XLA's bf16 matrix-vector product over a weight of the same bytes (cuBLAS: what
this device reads at this size). Device time per call: one program runs R calls on distinct
weight copies (together >= 256 MiB, more than the L2), traced ``--calls`` times; every kernel
of the program counted (the row padding and a split's partial-product sum included). Each
gemv result is checked against the dots on the device (``max_rel``; the products are exact in
both, only float32 summation order differs). ``gemv_l2``: the R calls on the first copy alone
(other rows each), so that after the first call its weights come from the L2 (a linear's time
had its weights been read into the L2 ahead of it; the 33 MB linears fit in an H200's 50 MB).

    PYTHONPATH=. OUT=out python benchmarks/gemv.py --sweep
    PYTHONPATH=. python benchmarks/gemv.py --smoke    # small shapes, interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import ceilings, environment, write_json
from benchmarks.gemm_decode import Shape, random_weights
from benchmarks.hc_fused import compile_highest, device_times
from dspark_jax.model.common import matmul_f32
from pallas_kernels import grouped_matmul as gm
from dspark_jax.model.quant import fp8_sim
from pallas_kernels.gemv import GemvConfig, gemv_many, gemv_swiglu
from pallas_kernels.grouped_matmul import FP8_BLOCK

LIMIT = 10.0


@dataclasses.dataclass(frozen=True)
class Case:
    shape: Shape  # groups = weight groups; tiles = rows (one per group for linears)
    quantised: bool  # rows quantised as the reference's FP8 GEMM input (wo_a: bf16 rows)
    also: int = 0  # N of a second FP8 weight of the same K in the same launch (``gemv_many``)


def flash_cases() -> list[Case]:
    d, i, h, hd, q, og, orank = 4096, 2048, 64, 512, 1024, 8, 1024
    return [
        Case(Shape("attn.wq_b", "fp8", h * hd, q, 1, 1), True),
        Case(Shape("attn.wo_b", "fp8", d, og * orank, 1, 1), True),
        Case(Shape("attn.wo_a (8 groups)", "fp8", orank, h * hd // og, og, og), False),
        Case(Shape("shared w1 + w3 swiglu", "fp8", i, d, 1, 1, swiglu=True), True),
        Case(Shape("shared w2", "fp8", d, i, 1, 1), True),
        Case(Shape("attn.wq_a", "fp8", q, d, 1, 1), True),
        Case(Shape("attn.wkv", "fp8", hd, d, 1, 1), True),
        Case(Shape("indexer.wq_b", "fp8", 64 * 128, q, 1, 1), True),
        # a C4 layer's wq_b and its indexer's wq_b in one launch (``attention.WQ_B_TOGETHER``)
        Case(Shape("C4 wq_b + indexer.wq_b", "fp8", h * hd, q, 1, 1), True, also=64 * 128),
        Case(Shape("drafter main_proj", "fp8", d, 3 * d, 1, 1), True),
        # bf16 weights the reference applies in float32 (dots: XLA's matmul_f32)
        Case(Shape("router (bf16)", "dense", 256, d, 1, 1), False),
        Case(Shape("C4 compressor wkv (bf16)", "dense", 2 * hd, d, 1, 1), False),
        Case(Shape("indexer weights_proj (bf16)", "dense", 64, d, 1, 1), False),
        Case(Shape("lm_head (bf16)", "dense", 129280, d, 1, 1), False),
    ]


def smoke_cases() -> list[Case]:
    return [Case(Shape("linear", "fp8", 256, 512, 1, 1), True),
            Case(Shape("grouped", "fp8", 128, 256, 4, 4), False),
            Case(Shape("swiglu", "fp8", 128, 512, 1, 1, swiglu=True), True),
            Case(Shape("two weights", "fp8", 256, 512, 1, 1), True, also=128),
            Case(Shape("bf16", "dense", 128, 512, 1, 1), False)]


def dots(case: Case, x, ws):
    """The tensor-core dots for one row per group: batched_matmul / batched_swiglu without
    ``one_row_gemv`` (the row padded to 16 rows, the grouped-matmul kernel)."""
    s = case.shape
    if s.fmt == "dense":  # what the model ran before gemv took bf16 weights: XLA's exact-product GEMM
        return matmul_f32(x, ws[0].values[0])
    if s.swiglu:
        return gm.batched_swiglu(x, ws[0], ws[1], limit=LIMIT, act_quant=case.quantised, impl="pallas",
                                 one_row_gemv=False)
    return tuple(gm.batched_matmul(x[:, None, :], w, act_quant=case.quantised, out_dtype=jnp.float32,
                                   impl="pallas", one_row_gemv=False)[:, 0] for w in ws)


def multiply_adds(case: Case, x, ws, cfg: GemvConfig | None, rounded: bool = False):
    """``gemv`` on the case's rows; ``rounded``: quantised rows handed over as their quantised
    values (bf16, exact: what a producer kernel that rounds its output gives), the kernel's
    quantisation skipped."""
    s = case.shape
    group = jnp.arange(x.shape[0], dtype=jnp.int32) % s.groups
    if rounded:
        xin = fp8_sim(x, FP8_BLOCK)
    else:
        xin = gm.QuantRows(x) if case.quantised else x
    if s.swiglu:
        return gemv_swiglu(xin, ws[0], ws[1], group, limit=LIMIT, config=cfg)
    return gemv_many(xin, tuple(ws), group, out_dtype=jnp.float32, config=cfg)


def as_row(y) -> np.ndarray:
    """A call's output (one array, or one per weight) as one float32 array, the weights' side by side."""
    return np.concatenate([np.asarray(a, np.float32) for a in jax.tree_util.tree_leaves(y)], axis=-1)


def sweep_configs(smoke: bool) -> list[GemvConfig]:
    if smoke:
        return [GemvConfig(32, 128, 2)]
    out = []
    for bn, bk, warps in itertools.product((32, 64, 128), (128, 256, 512), (2, 4, 8)):
        out.append(GemvConfig(bn, bk, 0, warps))
    for split in (1, 2, 4, 8, 16):  # the split around the default tiles
        out.append(GemvConfig(64, 256, split))
        out.append(GemvConfig(32, 256, split))
    for bn, bk, stages in itertools.product((32, 64), (256, 512), (2, 4, 5)):  # the pipeline's depth
        out.append(GemvConfig(bn, bk, 0, 4, stages))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also tilings of the multiply-add kernel")
    ap.add_argument("--sweep-only", default="", help="comma-separated substrings of the shapes to sweep")
    ap.add_argument("--only", default="", help="comma-separated substrings of the shape names to run")
    ap.add_argument("--sweep-configs", default="",
                    help="comma-separated indices into the sweep's tilings (default: all; printed with --list-sweep)")
    ap.add_argument("--list-sweep", action="store_true", help="print the sweep's tilings with their indices, then stop")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    configs = sweep_configs(args.smoke)
    if args.list_sweep:
        for i, c in enumerate(configs):
            print(i, c)
        return 0
    if args.sweep_configs:
        configs = [configs[int(i)] for i in args.sweep_configs.split(",")]
    t0 = time.time()
    env = environment()
    ceil = ceilings(0.0625, 512) if args.smoke else ceilings()
    print(env, ceil, flush=True)
    out = {"env": env, "ceilings": ceil, "method": __doc__.split("\n\n")[1], "shapes": []}
    cases = smoke_cases() if args.smoke else flash_cases()
    if args.only:
        cases = [c for c in cases if any(o in c.shape.name for o in args.only.split(","))]
    trace_root = tempfile.mkdtemp(prefix="dspark_gemv_")
    for ci, case in enumerate(cases):
        if time.time() - t0 > args.budget_s:
            print("budget exhausted", flush=True)
            break
        s = case.shape
        second = dataclasses.replace(s, n=case.also) if case.also else None
        call_bytes = (s.weight_bytes_per_tile + (second.weight_bytes_per_tile if second else 0)) * s.groups
        copies = 2 if args.smoke else min(32, max(2, -(-(256 << 20) // call_bytes)))
        keys = jax.random.split(jax.random.key(ci), copies * 2 + 1)
        sets = [tuple(random_weights(keys[2 * c + j], shape)
                      for j, shape in enumerate([s, s] if s.swiglu else [s, second] if second else [s]))
                for c in range(copies)]
        x = jax.random.normal(keys[-1], (s.tiles, s.k), jnp.bfloat16)
        want = as_row(dots(case, x, sets[0]))
        sweep = args.sweep and (not args.sweep_only or any(o in s.name for o in args.sweep_only.split(",")))
        variants = [("dots", None), ("gemv", None)]  # gemv None: the library's default tiles
        if case.quantised:  # the rows quantised before the kernel (by their producer)
            variants.append(("gemv_rounded", None))
        variants.append(("gemv_l2", None))  # every call on the first copy: its weights found in L2
        variants += [("gemv", c) for c in (configs if sweep else [])]
        row = {"name": s.name, "fmt": s.fmt, "n": s.n, "k": s.k, "groups": s.groups, "rows": s.tiles,
               "quantised": case.quantised, "bytes_per_call": call_bytes, "copies": copies, "variants": []}
        out["shapes"].append(row)
        compiled = {}
        for vi, (kind, cfg) in enumerate(variants):
            rec = {"kind": kind, "config": dataclasses.asdict(cfg) if cfg else None}
            row["variants"].append(rec)
            args_in = (x, sets)
            if kind == "dots":
                fn = lambda x, sets: [dots(case, x, ws) for ws in sets]  # noqa: E731
            elif kind == "gemv_l2":  # other rows per call (identical calls would be computed once)
                fn = lambda xs, sets: [multiply_adds(case, xi, sets[0], None) for xi in xs]  # noqa: E731
                args_in = ([x] + [jax.random.normal(jax.random.fold_in(keys[-1], c), x.shape, x.dtype)
                                  for c in range(1, copies)], sets)
                got = as_row(fn(*args_in)[0])  # the first call: x on the first copy
                rec["max_rel"] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
            else:
                rounded = kind == "gemv_rounded"
                fn = functools.partial(lambda cfg, r, x, sets: [multiply_adds(case, x, ws, cfg, r) for ws in sets],
                                       cfg, rounded)
                try:
                    got = as_row(multiply_adds(case, x, sets[0], cfg, rounded))
                    rec["max_rel"] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                except Exception as e:  # noqa: BLE001 (a config the compiler rejects is a result too)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    continue
            if args.smoke:
                continue
            c, module, _, _ = compile_highest(fn, f"gemv_{ci}_{vi}", *args_in)
            compiled[vi] = (c, module, args_in)
        if not args.smoke:
            # cuBLAS's bf16 matrix-vector product over the same bytes: [1, K] x [K, bytes / 2K]
            nb = max(16, call_bytes // 2 // s.k // 16 * 16)
            wb = [jax.random.normal(keys[c], (s.k, nb), jnp.bfloat16) for c in range(copies)]
            xb = x[:1]
            c, module, _, _ = compile_highest(lambda xb, wb: [xb @ w for w in wb], f"gemv_{ci}_xla", xb, wb)
            compiled["xla"] = (c, module, (xb, wb))
            for key, t in device_times(compiled, args.calls, trace_root).items():
                if "device_us" not in t:
                    continue
                us = t["device_us"] / copies
                rec = row.setdefault("xla_bf16", {}) if key == "xla" else row["variants"][key]
                rec.update(us=us, GBps=call_bytes / us / 1e3, launches=t["launches"] / copies)
            del compiled, wb
        timed = [v for v in row["variants"] if "us" in v]
        lib = row["variants"][0]
        best = min((v for v in timed if v["kind"] == "gemv"), key=lambda v: v["us"], default=None)
        dflt = row["variants"][1]
        fmt_us = lambda v: f"{v['us']:6.1f} us {v['GBps']:5.0f} GB/s" if v and "us" in v else "   -"  # noqa: E731
        rnd = next((v for v in row["variants"] if v["kind"] == "gemv_rounded"), None)
        l2 = next((v for v in row["variants"] if v["kind"] == "gemv_l2"), None)
        print(f"{s.name:24s} N {s.n:5d} K {s.k:5d} | dots {fmt_us(lib)} | gemv default {fmt_us(dflt)} "
              f"| rows rounded before {fmt_us(rnd)} | weights in L2 {fmt_us(l2)} "
              f"rel {dflt.get('max_rel', float('nan')):.1e} | best {fmt_us(best)} {best['config'] if best else ''} "
              f"| cuBLAS bf16 {fmt_us(row.get('xla_bf16'))}", flush=True)
        write_json("gemv.json", out)
        del sets, x
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
