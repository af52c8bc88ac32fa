"""The grouped-matmul kernel at a decode step's shapes: column tiles, stages and K splits.

At one token a DeepSeek-V4-Flash linear is a matrix-vector product: its few output tiles (e.g.
32 column tiles for the shared expert's 2048 outputs) leave most of the GPU's cores idle while
each program walks all of K. This script times every FP8 / FP4 linear and expert kernel of one
Flash layer (and the drafter's input projection) at one token (rows padded to the 16-row tile),
and the routed experts at a 6-token verify and a batch-32 verify (192 tokens: every expert one
row tile), for the configuration the library picks
(``grouped_matmul.default_config``, which splits K), the same tiles without the split, and a
sweep of column tiles x step widths x splits (``--pipelines``: then the three fastest of the
sweep again with each warps x stages pair given).

Device time per call: one jitted program runs the kernel on R distinct copies of the weights
(together >= 256 MiB, more than the H200's 50 MiB L2, so no call reads another's weights from the
cache; experts: a different random choice of experts per call); the program runs ``--calls``
times under the profiler and the device time of its kernels (a split's partial-product sum, an
XLA reduction, included) is divided by the calls and by R. Bytes: the weights read (values and
scales) and the activations. Each picked configuration is also checked against the unsplit
kernel on the device.

    PYTHONPATH=. OUT=out python benchmarks/gemm_decode.py --budget-s 300
    PYTHONPATH=. python benchmarks/gemm_decode.py --smoke    # small shapes, interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import ceilings, environment, write_json
from benchmarks.hc_fused import compile_highest, device_times
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.group_metadata import dense_tiles


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    fmt: str
    n: int  # outputs per group
    k: int  # inputs
    groups: int  # stacked weights (experts) to choose from; 1 for a linear
    tiles: int  # row tiles in use (pairs for experts, groups for a batched linear)
    swiglu: bool = False  # two weights (w1, w3) and the fused SwiGLU

    @property
    def weight_bytes_per_tile(self) -> int:
        per = self.n * self.k if self.fmt != "fp4" else self.n * self.k // 2
        scales = {"fp8": (self.n // 128) * (self.k // 128), "fp4": self.n * self.k // 32,
                  "fp8_k128": self.n * self.k // 128, "dense": 0}[self.fmt]
        mult = 2 if self.fmt == "dense" else 1
        return (per * mult + scales) * (2 if self.swiglu else 1)


def flash_shapes() -> list[Shape]:
    d, i, h, hd, q, og, orank = 4096, 2048, 64, 512, 1024, 8, 1024
    return [  # the largest per-layer costs first (a run stopped by its budget keeps them)
        Shape("routed swiglu, 1 token (fp8)", "fp8_k128", i, d, 256, 6, swiglu=True),
        Shape("routed w2, 1 token (fp8)", "fp8_k128", d, i, 256, 6),
        Shape("attn.wq_b", "fp8", h * hd, q, 1, 1),
        Shape("attn.wo_a (8 groups)", "fp8", orank, h * hd // og, og, og),
        Shape("attn.wo_b", "fp8", d, og * orank, 1, 1),
        Shape("shared w1 + w3 swiglu", "fp8", i, d, 1, 1, swiglu=True),
        Shape("shared w2", "fp8", d, i, 1, 1),
        Shape("attn.wq_a", "fp8", q, d, 1, 1),
        Shape("attn.wkv", "fp8", hd, d, 1, 1),
        Shape("indexer.wq_b", "fp8", 64 * 128, q, 1, 1),
        Shape("drafter main_proj", "fp8", d, 3 * d, 1, 1),
        Shape("routed swiglu, 6 tokens (fp8)", "fp8_k128", i, d, 256, 36, swiglu=True),
        Shape("routed w2, 6 tokens (fp8)", "fp8_k128", d, i, 256, 36),
        Shape("routed swiglu, 1 token (fp4)", "fp4", i, d, 256, 6, swiglu=True),
        Shape("routed w2, 1 token (fp4)", "fp4", d, i, 256, 6),
        Shape("routed swiglu, 6 tokens (fp4)", "fp4", i, d, 256, 36, swiglu=True),
        Shape("routed w2, 6 tokens (fp4)", "fp4", d, i, 256, 36),
        # a batch-32 verify (192 tokens, ~4.5 pairs per expert): every expert one 16-row tile
        Shape("routed swiglu, 192 tokens (fp8)", "fp8_k128", i, d, 256, 256, swiglu=True),
        Shape("routed w2, 192 tokens (fp8)", "fp8_k128", d, i, 256, 256),
    ]


def smoke_shapes() -> list[Shape]:
    return [Shape("linear", "fp8", 256, 1024, 1, 1), Shape("experts swiglu", "fp8_k128", 128, 512, 8, 3, swiglu=True),
            Shape("experts w2", "fp4", 256, 256, 8, 3)]


def random_weights(key, shape: Shape) -> gm.Weights:
    g, n, k = shape.groups, shape.n, shape.k
    kv, ks = jax.random.split(key)
    if shape.fmt == "dense":
        return gm.Weights(jax.random.normal(kv, (g, n, k), jnp.bfloat16) * 0.02, None, "dense")
    if shape.fmt == "fp4":
        vals = jax.random.randint(kv, (g, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        return gm.Weights(vals, jax.random.randint(ks, (g, n, k // 32), 118, 124, jnp.int32).astype(jnp.uint8), "fp4")
    vals = (jax.random.normal(kv, (g, n, k), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    sshape = (g, n // 128, k // 128) if shape.fmt == "fp8" else (g, n, k // 128)
    return gm.Weights(vals, jax.random.randint(ks, sshape, 118, 124, jnp.int32).astype(jnp.uint8), shape.fmt)


def build(shape: Shape, copies: int, key):
    """(x, weight sets, tile metadata per call, row weights)."""
    bm = 16
    keys = jax.random.split(key, copies * 2 + 2)
    sets = [tuple(random_weights(keys[2 * c + j], shape) for j in range(2 if shape.swiglu else 1))
            for c in range(copies)]
    rows = shape.tiles * bm
    x = jax.random.normal(keys[-1], (rows, shape.k), jnp.bfloat16)
    rng = np.random.default_rng(0)
    metas = []
    for _ in range(copies):
        if shape.groups == 1:
            tg, nt = dense_tiles(rows, 1, bm)
        elif shape.groups == shape.tiles:  # a batched linear: group after group
            tg, nt = dense_tiles(bm, shape.groups, bm)
        else:  # experts: a random choice of distinct experts per call
            tg = jnp.asarray(rng.choice(shape.groups, shape.tiles, replace=shape.tiles > shape.groups), jnp.int32)
            nt = jnp.full((1,), shape.tiles, jnp.int32)
        metas.append((tg, nt))
    rw = jax.random.uniform(keys[-2], (rows,), jnp.float32)
    return x, sets, metas, rw


def call(shape: Shape, x, ws, meta, rw, cfg, interpret):
    tg, nt = meta
    if shape.swiglu:
        return gm.swiglu_kernel(x, ws[0], ws[1], rw, tg, nt, block_m=16, limit=10.0, config=cfg, interpret=interpret)
    return gm.kernel(x, ws[0], tg, nt, block_m=16, config=cfg, interpret=interpret)


def candidates(shape: Shape, smoke: bool) -> list[gm.GemmConfig]:
    base = gm.default_config(16, shape.fmt)
    if smoke:
        return [dataclasses.replace(base, block_n=32, split_k=2).fit(shape.n, shape.k, shape.fmt)]
    out = []
    for bn, bk, split in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8)):
        c = dataclasses.replace(base, block_n=bn, block_k=bk, split_k=split)
        fit = c.fit(shape.n, shape.k, shape.fmt)
        if (fit.split_k, fit.block_n, fit.block_k) == (split, bn, bk) and fit not in out:
            out.append(fit)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--no-sweep", action="store_true", help="only the picked and the unsplit configuration")
    ap.add_argument("--calls", type=int, default=3, help="traced executions of each program")
    ap.add_argument("--only", default="", help="comma-separated substrings of the shape names to run")
    ap.add_argument("--pipelines", default="",
                    help="comma-separated WARPSxSTAGES (e.g. 4x3,4x5,8x4): the sweep's three fastest configs "
                         "timed again with each")
    ap.add_argument("--codes-only", action="store_true",
                    help="FP8 weights: sweep only the rows as fp8 codes (as the model multiplies them at decode)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    pipelines = [tuple(int(v) for v in p.split("x")) for p in args.pipelines.split(",") if p]
    t0 = time.time()
    interpret = args.smoke
    env = environment()
    ceil = ceilings(0.0625, 512) if args.smoke else ceilings()
    print(env, ceil, flush=True)
    out = {"env": env, "ceilings": ceil, "method": __doc__.split("\n\n")[2], "shapes": []}
    shapes = smoke_shapes() if args.smoke else flash_shapes()
    if args.only:
        shapes = [s for s in shapes if any(o in s.name for o in args.only.split(","))]
    trace_root = tempfile.mkdtemp(prefix="dspark_gemm_decode_")
    for si, shape in enumerate(shapes):
        if time.time() - t0 > args.budget_s:
            print("budget exhausted", flush=True)
            break
        call_bytes = shape.weight_bytes_per_tile * shape.tiles
        copies = 2 if args.smoke else (1 if shape.groups > 1 else min(32, max(2, -(-(256 << 20) // call_bytes))))
        calls = copies if shape.groups == 1 or shape.groups == shape.tiles else 16
        x, sets, metas, rw = build(shape, copies, jax.random.key(si))
        metas = (metas * calls)[:calls]
        nbytes = call_bytes + x.size * 2
        picked = gm.default_config(16, shape.fmt, n=shape.n, k=shape.k, tiles=shape.tiles,
                                   weights=2 if shape.swiglu else 1)
        picked = picked.fit(shape.n, shape.k, shape.fmt)
        unsplit = dataclasses.replace(picked, split_k=1)
        row = {**dataclasses.asdict(shape), "bytes_per_call": nbytes, "calls_per_program": calls,
               "picked": picked.__dict__, "configs": []}
        out["shapes"].append(row)
        ref = np.asarray(call(shape, x, sets[0], metas[0], rw, unsplit, interpret), np.float32)
        got = np.asarray(call(shape, x, sets[0], metas[0], rw, picked, interpret), np.float32)
        row["picked_vs_unsplit_max_rel"] = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
        a8 = shape.fmt in ("fp8", "fp8_k128")  # also with the rows as fp8 codes (e4m3 x e4m3 dots)
        sweep_bf16 = not args.no_sweep and not (a8 and args.codes_only)
        configs = [unsplit, picked] + (candidates(shape, args.smoke) if sweep_bf16 else [])
        configs = [(c, "bf16") for c in dict.fromkeys(configs)]
        if a8:
            x8 = gm.ActQuant.of(x)
            got8 = np.asarray(call(shape, x8, sets[0], metas[0], rw, picked, interpret), np.float32)
            ref8 = np.asarray(call(shape, x8.values(), sets[0], metas[0], rw, picked, interpret), np.float32)
            row["a8_vs_rounded_rows_max_rel"] = float(np.max(np.abs(got8 - ref8)) / max(np.max(np.abs(ref8)), 1e-30))
            # rows the kernel quantises itself: the same codes, so the same bits
            xq = gm.QuantRows(x)
            got8q = np.asarray(call(shape, xq, sets[0], metas[0], rw, picked, interpret), np.float32)
            row["a8q_vs_a8_max_abs"] = float(np.max(np.abs(got8q - got8)))
            configs += [(c, "fp8") for c in dict.fromkeys([picked, unsplit] + (
                [] if args.no_sweep else candidates(shape, args.smoke)))]
            configs += [(picked, "fp8q")]

        def time_configs(configs, tag):
            compiled = {}
            for ci, (cfg, rows) in enumerate(configs):
                xi = {"fp8": x8 if a8 else None, "fp8q": gm.QuantRows(x) if a8 else None}.get(rows, x)
                fn = functools.partial(lambda cfg, x, sets, metas, rw: [
                    call(shape, x, sets[c % copies], metas[c], rw, cfg, interpret) for c in range(calls)], cfg)
                try:
                    c, module, _, _ = compile_highest(fn, f"gemm_decode_{si}_{tag}{ci}", xi, sets, metas, rw)
                    compiled[ci] = (c, module, (xi, sets, metas, rw))
                except Exception as e:  # noqa: BLE001 (a config the compiler rejects is a result too)
                    row["configs"].append({"config": cfg.__dict__, "rows": rows,
                                           "error": f"{type(e).__name__}: {str(e)[:160]}"})
            for ci, t in device_times(compiled, args.calls, trace_root).items():
                cfg, rows = configs[ci]
                if "device_us" not in t:
                    row["configs"].append({"config": cfg.__dict__, "rows": rows, **t})
                    continue
                us = t["device_us"] / calls
                row["configs"].append({"config": cfg.__dict__, "rows": rows, "us": us, "GBps": nbytes / us / 1e3,
                                       "launches_per_call": t["launches"] / calls})

        time_configs(configs, "")
        if pipelines:  # the fastest three of the sweep (rows as the model multiplies them) per warps x stages
            kind = "fp8" if a8 else "bf16"
            top = sorted((r for r in row["configs"] if "us" in r and r["rows"] == kind), key=lambda r: r["us"])[:3]
            again = [(dataclasses.replace(gm.GemmConfig(**r["config"]), num_warps=w, num_stages=st), kind)
                     for r in top for w, st in pipelines]
            time_configs([c for c in dict.fromkeys(again) if c not in configs], "p")
        key = lambda cfg, rows: json.dumps([cfg.__dict__, rows], sort_keys=True)  # noqa: E731
        timed = {json.dumps([r["config"], r["rows"]], sort_keys=True): r for r in row["configs"] if "us" in r}
        row["unsplit"] = timed.get(key(unsplit, "bf16"))
        row["picked_time"] = timed.get(key(picked, "bf16"))
        row["picked_a8"] = timed.get(key(picked, "fp8"))
        row["picked_a8q"] = timed.get(key(picked, "fp8q"))
        for rows in ("bf16", "fp8"):
            mine = [r for r in timed.values() if r["rows"] == rows]
            if mine:
                row["best" if rows == "bf16" else "best_a8"] = min(mine, key=lambda r: r["us"])
        u, p_, b_ = row["unsplit"], row["picked_time"], row.get("best")
        if a8 and row["picked_a8"]:
            a, ba = row["picked_a8"], row.get("best_a8")
            print(f"  fp8 rows: picked {a['us']:6.1f} us {a['GBps']:5.0f} GB/s | best {ba['us']:6.1f} us "
                  f"{ba['config']} | rel diff vs rounded rows {row['a8_vs_rounded_rows_max_rel']:.1e}", flush=True)
            q = row["picked_a8q"]
            print(f"  rows quantised in the kernel: {q['us'] if q else float('nan'):6.1f} us | max abs diff vs "
                  f"codes given {row['a8q_vs_a8_max_abs']:.1e}", flush=True)
        print(f"{shape.name:30s} {shape.fmt:7s} N {shape.n:5d} K {shape.k:5d} tiles {shape.tiles:2d} | unsplit "
              f"{u['us'] if u else float('nan'):6.1f} us | picked (split {picked.split_k}) "
              f"{p_['us'] if p_ else float('nan'):6.1f} us {p_['GBps'] if p_ else 0:5.0f} GB/s | best "
              f"{b_['us'] if b_ else float('nan'):6.1f} us {b_['config'] if b_ else ''} | rel diff "
              f"{row['picked_vs_unsplit_max_rel']:.1e}", flush=True)
        write_json("gemm_decode.json", out)
        del x, sets
    print("\n| shape | format | N | K | tiles | unsplit us | picked split | picked us (GB/s) | best us (config) "
          "| fp8 rows: picked us (GB/s) | fp8 rows: best us (config) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in out["shapes"]:
        b, u, p_ = r.get("best"), r.get("unsplit"), r.get("picked_time")
        def best(b):
            if not b:
                return "-"
            c = b["config"]
            return (f"{b['us']:.1f} (bn {c['block_n']}, bk {c['block_k']}, split {c['split_k']}, w {c['num_warps']}, "
                    f"st {c['num_stages']})")
        a = r.get("picked_a8")
        a8 = f"{a['us']:.1f} ({a['GBps']:.0f})" if a else "-"
        print(f"| {r['name']} | {r['fmt']} | {r['n']} | {r['k']} | {r['tiles']} | {u['us'] if u else float('nan'):.1f} "
              f"| {r['picked']['split_k']} | {p_['us'] if p_ else float('nan'):.1f} ({p_['GBps'] if p_ else 0:.0f}) "
              f"| {best(b)} | {a8} | {best(r.get('best_a8'))} |")
    write_json("gemm_decode.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
