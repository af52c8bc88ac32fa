"""The attention kernel's tiles at a decode step (one token per request), as the model calls it:
the queries' norm + RoPE in the kernel's prologue (``q_rope``) and the output's inverse RoPE in
the split merge (``out_rope``; by XLA when the keys are not split).

The table (``pallas_kernels/attention_configs.json``) was tuned at verify shapes (6 tokens per
request) before the kernel took ``q_rope``; a decode step takes those entries with their key
splits rescaled (``attention_configs.select``). Here each candidate (rows per program x key
splits x key tile) is compiled as one call and timed by a profiler trace (the device time of
every kernel of the call: the attention kernel, the split merge or XLA's inverse RoPE; launches
counted), and checked against the XLA path. (Timed instead per call inside a jitted loop, the
loop's own cost, 10-100 us, moved by more than the candidates differed and picked tiles that
were slower in the step: docs/benchmarks.md.) ``--write-table`` adds the winners that beat
the table's selection as entries of 1 token per request (``q_len`` 1; ``select`` prefers them at decode steps) for the
window-only and C4 (top-512) layers, whose keys do not grow with the context; C128 layers keep
the verify entries (their keys do).

    PYTHONPATH=. OUT=out python benchmarks/attention_decode.py --write-table
    PYTHONPATH=. python benchmarks/attention_decode.py --smoke     # interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, write_json
from benchmarks.hc_fused import compile_highest, device_times
from benchmarks.attention_cases import FLASH, SMOKE, TABLE_KIND, Case, build_case
from pallas_kernels import attention_configs as ac
from pallas_kernels import ragged_attention as ra

EPS = 1e-6


def rope_args(positions, rope: int):
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, rope, 2, dtype=jnp.float32) / rope))
    pos = jnp.asarray(positions, jnp.int32)
    return (pos, inv_freq), (pos, inv_freq, EPS)


def candidates(layout: str, n_keys: int, rows: list[int], splits: list[int], smoke: bool) -> list[ra.BlockConfig]:
    """Rows per program (heads of the token; 8 warps from 32 rows) x key tiles of 32 / 64 x key
    splits (no more than the tiles)."""
    if smoke:
        return [ra.BlockConfig(block_h=16, block_k=16, num_warps=4, kv_splits=s) for s in (1, 2)]
    d = 512 if layout == "bf16" else 256
    out = []
    for bh in rows:
        warps = 4 if bh < 32 else 8
        for bk in (32, 64):
            tiles = -(-n_keys // bk)
            for s in sorted(set(splits)):
                if s <= tiles:
                    out.append(ra.BlockConfig(block_t=1, block_h=bh, block_k=bk, num_warps=warps, num_stages=2,
                                              kv_splits=s, block_d=d))
    return out


def with_decode_entries(table: dict, winners: dict, env: dict, heads: int) -> dict:
    """``table`` with one CUDA entry of 1 token per request at batch 1 per (kind, pool) of
    ``winners`` ({(kind, pool): result with "config" and "us"}), replacing such entries of a
    previous run; every other entry kept."""
    keep = [e for e in table["entries"] if not (e["platform"] == "cuda" and e["q_len"] == 1 and e["batch"] == 1
                                                 and e["heads"] == heads and (e["kind"], e["pool"]) in winners)]
    for (kind, pool), r in sorted(winners.items()):
        keep.append(dict(platform="cuda", kind=kind, pool=pool, heads=heads, q_len=1, batch=1, config=r["config"],
                         source=dict(device=env["device"], date=env["date"], commit=env["commit"],
                                     us=round(r["us"], 2))))
    order = lambda e: (e["platform"], ac.KINDS.index(e["kind"]), e["pool"], -e["batch"], -e["q_len"])  # noqa: E731
    return dict(table, entries=sorted(keep, key=order))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="swa,c4,c128")
    ap.add_argument("--layouts", default="bf16,fp8")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--rows", default="16,32,64", help="heads per program")
    ap.add_argument("--splits", default="1,2,3,5,8", help="key splits")
    ap.add_argument("--calls", type=int, default=20, help="traced calls of each candidate")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--write-table", action="store_true", help="add the winners (window, C4) as q_len 1 entries")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    dims = dict(SMOKE if args.smoke else FLASH, ctx=512 if args.smoke else args.ctx)
    env = environment()
    trace_root = tempfile.mkdtemp(prefix="dspark_attention_decode_")
    out = {"env": env, "method": __doc__.split("\n\n")[1], "dims": dims, "cases": []}
    print(env, flush=True)
    winners = {}
    for kind in args.kinds.split(","):
        for layout in args.layouts.split(","):
            case = Case(kind, 1, dims["ctx"], 1, layout)
            inputs, _, info = build_case(case, dims)
            q, window, entries, sink, meta = inputs
            out_rope, q_rope = rope_args(np.asarray(meta.win_hi), dims["rope"])  # each token's position
            fp8 = layout == "fp8"
            n_keys = dims["ring"] + (dims["topk"] if kind == "c4" else dims["ctx"] // 128 if kind == "c128" else 0)
            table_cfg = ac.select(dims["heads"], 1, 1, TABLE_KIND[kind], fp8, n_keys=n_keys)

            def call(cfg):
                return lambda q, w, e, s: ra.ragged_attention(q, w, e, s, meta, scale=dims["head_dim"] ** -0.5,
                                                              out_rope=out_rope, q_rope=q_rope, config=cfg)

            ref = np.asarray(ra.ragged_attention(q, window, entries, sink, meta, scale=dims["head_dim"] ** -0.5,
                                                 out_rope=out_rope, q_rope=q_rope, impl="xla"), np.float32)
            row = {"case": case.key, "kind": kind, "layout": layout, "table": dataclasses.asdict(table_cfg),
                   "results": []}
            out["cases"].append(row)
            compiled = {}
            cands = [table_cfg] + [c for c in candidates(layout, n_keys, [int(v) for v in args.rows.split(",")],
                                                         [int(v) for v in args.splits.split(",")], args.smoke)
                                   if c != table_cfg]
            for i, cfg in enumerate(cands):
                if time.time() - t0 > args.budget_s:
                    print("budget exhausted", flush=True)
                    break
                r = {"config": dataclasses.asdict(cfg), "table": i == 0}
                row["results"].append(r)
                try:
                    got = np.asarray(call(cfg)(q, window, entries, sink), np.float32)
                    err = float(np.abs(got - ref).max())
                    r.update(max_abs_err=err, ok=bool(np.isfinite(got).all() and err <= 2e-2 * np.abs(ref).max()))
                    if not args.smoke:
                        c, module, _, _ = compile_highest(call(cfg), f"attn_decode_{kind}_{layout}_{i}", q, window,
                                                          entries, sink)
                        compiled[i] = (c, module, (q, window, entries, sink))
                except Exception as e:  # noqa: BLE001 (a configuration the compiler rejects is a result too)
                    r.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            if compiled:  # one trace for the case's candidates
                for i, t in device_times(compiled, args.calls, trace_root).items():
                    if "device_us" in t:
                        row["results"][i].update(us=t["device_us"], launches=t["launches"])
            for r in row["results"]:
                cfg = r["config"]
                print(f"{case.key:22s} {'table ' if r['table'] else '      '}h{cfg['block_h']:3d} k{cfg['block_k']:3d} "
                      f"s{cfg['kv_splits']:2d} w{cfg['num_warps']} {r.get('us', float('nan')):7.2f} us "
                      f"{r.get('launches', 0):.0f} launches ok={r['ok']}", flush=True)
            write_json("attention_decode.json", out)
            good = sorted((r for r in row["results"] if r["ok"] and "us" in r), key=lambda r: r["us"])
            if good:
                row["best"] = good[0]
                print(f"  best {good[0]['config']} {good[0]['us']:.2f} us; table {row['results'][0].get('us')}",
                      flush=True)
                if kind != "c128" and not good[0]["table"]:
                    winners[(TABLE_KIND[kind], layout)] = good[0]
    write_json("attention_decode.json", out)
    if args.write_table and winners and not args.smoke:
        with open(ac.TABLE_PATH) as f:
            table = with_decode_entries(json.load(f), winners, env, dims["heads"])
        with open(ac.TABLE_PATH, "w") as f:
            f.write(json.dumps(table, indent=1) + "\n")
        write_json("attention_configs.json", table)
        print("table updated", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
