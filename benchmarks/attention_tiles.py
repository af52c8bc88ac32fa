"""The attention kernel's tiles at one call shape, as the model calls it (the queries' norm +
RoPE in the kernel's prologue, ``q_rope``; the output's inverse RoPE in the split merge,
``out_rope``, or by XLA when the keys are not split), timed by a profiler trace.

For a layer kind, pool layout, batch, tokens per request (1 at a decode step, 6 at a verify) and
context, each candidate (heads per program x key tile x key splits) is compiled as one call, run
``--calls`` times under the profiler, and timed by the device time of every kernel of the call
(the attention kernel, the split merge or XLA's inverse RoPE; launches counted); its output is
checked against the XLA path. The first candidate is what the engine takes now
(``attention_configs.select`` from the table). Timed instead per call inside a jitted loop (as
``benchmarks/kernels.py`` times), the loop's own cost, 10-100 us, moved by more than decode
candidates differed and ranked slower tiles first (docs/benchmarks.md). ``--write-table`` puts the
winners that beat the table's selection into the table as entries of this batch and tokens per
request (replacing such entries); C128 (prefix) entries depend on the context they were
measured at (their keys grow with it; the verify entries' was 32k).

    PYTHONPATH=. OUT=out python benchmarks/attention_tiles.py                 # decode, batch 1, 2k
    PYTHONPATH=. OUT=out python benchmarks/attention_tiles.py --q-len 6 --ctx 32768 --batch 64
    PYTHONPATH=. python benchmarks/attention_tiles.py --smoke     # interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

import jax.numpy as jnp
import numpy as np

from benchmarks.attention_cases import FLASH, SMOKE, TABLE_KIND, Case, build_case
from benchmarks.common import environment, write_json
from benchmarks.hc_fused import compile_highest, device_times
from dspark_jax import config
from dspark_jax.model.norms_rope import layer_inv_freq
from pallas_kernels import attention_configs as ac
from pallas_kernels import ragged_attention as ra

RATIO = {"swa": 0, "c4": 4, "c128": 128}


def rope_args(positions, kind: str):
    """``(out_rope, q_rope)`` as a Flash layer of ``kind`` passes them (its RoPE frequencies and
    norm epsilon; the positions given)."""
    cfg = config.flash()
    pos = jnp.asarray(positions, jnp.int32)
    inv_freq = layer_inv_freq(cfg, RATIO[kind])
    return (pos, inv_freq), (pos, inv_freq, cfg.rms_norm_eps)


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


def with_entries(table: dict, winners: dict, env: dict, heads: int, q_len: int, batch: int) -> dict:
    """``table`` with one CUDA entry of ``q_len`` tokens per request at ``batch`` per (kind, pool)
    of ``winners`` ({(kind, pool): result with "config" and "us"}), replacing the entry of that
    shape if there is one; every other entry kept."""
    def same(e):
        return (e["platform"], e["heads"], e["q_len"], e["batch"]) == ("cuda", heads, q_len, batch) and (
            e["kind"], e["pool"]) in winners

    keep = [e for e in table["entries"] if not same(e)]
    for (kind, pool), r in sorted(winners.items()):
        keep.append(dict(platform="cuda", kind=kind, pool=pool, heads=heads, q_len=q_len, batch=batch,
                         config=r["config"], source=dict(device=env["device"], date=env["date"], commit=env["commit"],
                                     us=round(r["us"], 2))))
    order = lambda e: (e["platform"], ac.KINDS.index(e["kind"]), e["pool"], -e["batch"], -e["q_len"])  # noqa: E731
    return dict(table, entries=sorted(keep, key=order))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="swa,c4,c128")
    ap.add_argument("--layouts", default="bf16,fp8")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="requests")
    ap.add_argument("--q-len", type=int, default=1, help="tokens per request (1: decode, 6: verify)")
    ap.add_argument("--rows", default="16,32,64", help="heads per program")
    ap.add_argument("--splits", default="1,2,3,5,8", help="key splits")
    ap.add_argument("--calls", type=int, default=20, help="traced calls of each candidate")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--write-table", action="store_true", help="put winners that beat the selection into the table")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    dims = dict(SMOKE if args.smoke else FLASH, ctx=512 if args.smoke else args.ctx)
    env = environment()
    trace_root = tempfile.mkdtemp(prefix="dspark_attention_tiles_")
    out = {"env": env, "method": __doc__.split("\n\n")[1], "dims": dims, "cases": []}
    print(env, flush=True)
    winners = {}
    for kind in args.kinds.split(","):
        for layout in args.layouts.split(","):
            case = Case(kind, args.batch, dims["ctx"], args.q_len, layout)
            (q, window, entries, sink, meta), _, _ = build_case(case, dims)
            out_rope, q_rope = rope_args(np.asarray(meta.win_hi), kind)  # each token's position
            table_cfg = ra.select_config(q, window, entries, meta)  # what the engine takes
            n_keys = dims["ring"] + (dims["topk"] if kind == "c4" else dims["ctx"] // 128 if kind == "c128" else 0)

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
                    c, module, _, _ = compile_highest(call(cfg), f"attn_tiles_{kind}_{layout}_{i}", q, window,
                                                      entries, sink)
                    got = np.asarray(c(q, window, entries, sink), np.float32)
                    err = float(np.abs(got - ref).max())
                    r.update(max_abs_err=err, ok=bool(np.isfinite(got).all() and err <= 2e-2 * np.abs(ref).max()))
                    if not args.smoke:
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
            write_json("attention_tiles.json", out)
            good = sorted((r for r in row["results"] if r["ok"] and "us" in r), key=lambda r: r["us"])
            if good:
                row["best"] = good[0]
                print(f"  best {good[0]['config']} {good[0]['us']:.2f} us; table {row['results'][0].get('us')}",
                      flush=True)
                if not good[0]["table"]:
                    winners[(TABLE_KIND[kind], layout)] = good[0]
    write_json("attention_tiles.json", out)
    if args.write_table and winners and not args.smoke:
        with open(ac.TABLE_PATH) as f:
            table = with_entries(json.load(f), winners, env, dims["heads"], args.q_len, args.batch)
        with open(ac.TABLE_PATH, "w") as f:
            f.write(json.dumps(table, indent=1) + "\n")
        write_json("attention_configs.json", table)
        print("table updated", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
