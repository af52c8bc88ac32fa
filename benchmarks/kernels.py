"""GPU benchmark and tuner of the Pallas kernels: device time, numerics on the device, roofline.

One command does everything, most important first, printing each result as it comes and
rewriting its outputs after every phase (a run stopped by ``--budget-s`` or killed keeps what it
had):

1. ceilings in the same run: a large device copy (GB/s, bytes read + written) and a large bf16
   matmul (TFLOP/s); the host's dispatch time of one jitted call;
2. fp8 keys dequantised (and folded) bit-exactly inside the attention kernel;
3. the tuning sweep of the ragged attention kernel (at most ~30 configurations, each compiled
   once): tiles at batch 64 and key splits at batch 1, for C128 / C4 / window-only layers and
   bf16 / fp8 pools at DeepSeek-V4-Flash sizes (64 heads x 512, window 128 -> ring 144, top-512,
   32k context, 6 verify tokens). The winners are written as this GPU platform's entries of the
   table the engine reads (``$OUT/attention_configs.json`` and ``pallas_kernels/attention_configs.json``);
4. before / after: per case the kernel with the configuration the engine now picks (the table),
   the kernel as it was before (``benchmarks/baseline_attention.py``, its old default
   configuration) and the XLA path, at batch 1 / 8 / 64, 8k-64k context, verify and decode;
5. registers and spills of the timed kernels, from the PTX that XLA dumps (``ptxas -v``; CUDA
   only, when a ptxas is found);
6. the fp8 KV write kernel, bit-exact against its reference, then timed.

Device time: each timed executable runs the call N times inside one ``lax.fori_loop`` whose carry
is the query (each call's output is the next call's query, so nothing can be hoisted and nothing
is added between calls); the first call is peeled off and checked against the reference. Per
call = (wall time of the executable - host dispatch of a trivial call) / N. Calls follow each
other as in a decode step; at batch 1-8 the keys stay in the GPU's L2 cache between calls (warm),
which a real step, with other layers in between, would not give.

Per case: unique bytes per request (q + output + every distinct KV row the request's tokens
read), useful FLOPs (4 x heads x head_dim per (token, key) pair), the roofline time
max(bytes / copy bandwidth, FLOPs / matmul peak) and the fraction of it achieved.

    PYTHONPATH=. OUT=out timeout 590 python benchmarks/kernels.py --device-time --budget-s 480
    python benchmarks/kernels.py --smoke          # tiny shapes, any machine (interpret mode on CPU)
    python benchmarks/kernels.py --plot-from out/kernels.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import device_time  # noqa: E402

# before JAX starts its backend: XLA dumps the timed kernels' modules (registers / spills from their PTX)
XLA_DUMP = None if any(a in sys.argv for a in ("--smoke", "--plot-from", "--no-registers")) else \
    device_time.enable_xla_dump("ragged_probe")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks import baseline_attention as before  # noqa: E402
from benchmarks.attention_cases import FLASH, SMOKE, TABLE_KIND, Case, build_case  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.device_time import DeviceTimer, looped  # noqa: E402
from pallas_kernels import attention_configs as ac  # noqa: E402
from pallas_kernels import attention_metadata as am  # noqa: E402
from pallas_kernels import backend, kv_fp8  # noqa: E402
from pallas_kernels import ragged_attention as ra  # noqa: E402

LABEL = {"swa": "window only", "c128": "C128", "c4": "C4 (top-512)"}


def measure_ceilings(smoke: bool) -> dict:
    """Device copy GB/s and bf16 matmul TFLOP/s (``common.ceilings``; tiny sizes for --smoke)."""
    if smoke:
        return common.ceilings(copy_gib=1 / 4096, matmul_n=256)
    return common.ceilings()


def roofline(info, ceil) -> dict:
    t_mem = info["bytes"] / (ceil["copy_GBps"] * 1e9)
    t_flop = info["useful_flops"] / (ceil["bf16_matmul_TFLOPs"] * 1e12)
    return dict(roofline_us=max(t_mem, t_flop) * 1e6, bound="compute" if t_flop > t_mem else "memory")


def compare(out, ref) -> dict:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = float(np.abs(out - ref).max())
    scale = float(np.abs(ref).max())
    ok = bool(np.isfinite(out).all() and err <= 2e-2 * max(scale, 1e-3))
    return dict(max_abs_err=err, max_abs_ref=scale, ok=ok)


class Runner:
    """Builds cases once, compiles each (case, implementation, config) once, keeps the results."""

    def __init__(self, dims, ceil, timer: DeviceTimer, smoke: bool):
        self.dims, self.ceil, self.timer, self.smoke = dims, ceil, timer, smoke
        self.cases, self.refs, self.results, self.probes = {}, {}, {}, []

    def n_calls(self, case: Case) -> int:
        return 2 if self.smoke else (16 if case.batch >= 32 else 48)

    def case(self, case: Case):
        if case.key not in self.cases:
            self.cases[case.key] = build_case(case, self.dims)
        return self.cases[case.key]

    def reference(self, case: Case):
        """The XLA path on the device: first output (the check's reference) and its time."""
        if case.key not in self.refs:
            inputs, _, info = self.case(case)
            n = self.n_calls(case)
            exe = looped(lambda *a: ra.reference(*a), n, f"xla_loop_{len(self.refs)}")
            first, _ = exe(*inputs)
            self.refs[case.key] = dict(out=first, us=self.timer.per_call(exe, inputs, n) * 1e6)
        return self.refs[case.key]

    def kernel(self, case: Case, config, *, old: bool = False) -> dict:
        """Device time and check of the kernel (or the old one) with ``config``."""
        key = (case.key, "before" if old else "after", str(config))
        if key in self.results:
            return self.results[key]
        inputs, old_meta, info = self.case(case)
        n = self.n_calls(case)
        name = f"ragged_probe_{len(self.probes)}"
        self.probes.append(dict(name=name, case=case.key, impl=key[1], config=_cfg_dict(config)))
        if old:
            call = lambda q, w, e, s, m: before.kernel(q, w, e, s, m, config=config)  # noqa: E731
            args = (*inputs[:4], old_meta)
        else:
            call = lambda q, w, e, s, m: ra.kernel(q, w, e, s, m, config=config)  # noqa: E731
            args = inputs
        ref = self.reference(case)
        r = dict(config=_cfg_dict(config), probe=name)
        try:
            exe = looped(call, n, name)
            first, _ = exe(*args)
            r.update(compare(first, ref["out"]))
            r["us"] = self.timer.per_call(exe, args, n) * 1e6
        except Exception as e:  # e.g. a configuration Triton cannot compile: record it, go on
            r.update(ok=False, error=repr(e)[:400])
            print("  failed:", case.key, key[1], config, traceback.format_exc()[-600:], flush=True)
        self.results[key] = r
        return r


def _cfg_dict(config) -> dict | None:
    return None if config is None else dataclasses.asdict(config)


# ------------------------------------------------------------------------------ the tuning sweep
M64 = dict(block_t=1, block_h=64, num_warps=8, num_stages=2)
ROWS16 = dict(block_t=1, block_h=16, num_warps=4, num_stages=2)
ROWS32 = dict(block_t=1, block_h=32, num_warps=8, num_stages=2)


def _cfg(**kw) -> ra.BlockConfig:
    return ra.BlockConfig(**kw)


def tile_candidates(layout: str, smoke: bool) -> list[ra.BlockConfig]:
    """Batch-64 tiles (64 rows = one token's heads; 8 warps keep its 64 x 512 fp32 accumulator in
    registers), from an offline compilation: bk 32 spills nothing inside the loop, bk 64 halves
    the per-tile overhead; fp8 tiles are converted in column blocks (block_d) to fit."""
    if smoke:
        return [_cfg(block_h=16, block_k=16, num_warps=4), _cfg(block_h=16, block_k=32, num_warps=4, block_d=64)]
    if layout == "bf16":
        return [_cfg(**M64, block_k=32), _cfg(**dict(M64, num_stages=3), block_k=32), _cfg(**M64, block_k=64),
                _cfg(**M64, block_k=64, block_d=256)]
    return [_cfg(**M64, block_k=32, block_d=256), _cfg(**dict(M64, num_stages=3), block_k=32, block_d=256),
            _cfg(**M64, block_k=64, block_d=128), _cfg(**M64, block_k=32), _cfg(**M64, block_k=32, fp8_fold=True)]


def split_candidates(layout: str, smoke: bool) -> list[ra.BlockConfig]:
    """Batch-1 programs: 16 / 32 / 64 rows with key splits (C128 at 32k: 12 key tiles of 32)."""
    if smoke:
        return [_cfg(block_h=16, block_k=16, num_warps=4, kv_splits=2), _cfg(block_h=16, block_k=16, num_warps=4,
                                                                            kv_splits=4)]
    d = 512 if layout == "bf16" else 256
    cands = [_cfg(**ROWS16, block_k=32, kv_splits=4, block_d=d), _cfg(**ROWS32, block_k=32, kv_splits=8, block_d=d)]
    if layout == "bf16":
        cands += [_cfg(**ROWS16, block_k=32, kv_splits=2), _cfg(**M64, block_k=32, kv_splits=12)]
    return cands


def key_tiles(kind: str, dims, block_k: int) -> int:
    """Key tiles of one verify token at the sweep's context."""
    entries = {"swa": 0, "c128": dims["ctx"] // 128, "c4": dims["topk"]}[kind]
    return -(-dims["window"] // block_k) + -(-entries // block_k)


def splits_for(kind: str, best: ra.BlockConfig, dims, programs_per_split: int, sms: int) -> list[int]:
    """Batch-1 splits for another layer kind: as many key tiles per split as the C128 winner,
    and as many splits as fill one wave of ``sms`` programs."""
    per = max(1, -(-key_tiles("c128", dims, best.block_k) // best.kv_splits))
    tiles = key_tiles(kind, dims, best.block_k)
    return sorted({max(1, min(tiles, -(-tiles // per))), max(1, min(tiles, sms // programs_per_split))})


def sweep(runner: Runner, classes, say) -> dict:
    """Time each candidate of each class; returns {class: best result} (checked results only)."""
    chosen = {}
    for cls, cands in classes:
        kind, batch, layout = cls
        case = Case(kind, batch, runner.dims["ctx"], 6, layout)
        results = []
        for cfg in cands:
            if runner.over_budget(("sweep", case.key, str(cfg))):
                break
            r = runner.kernel(case, cfg)
            results.append((cfg, r))
            say("sweep", case=case.key, config=r["config"], us=r.get("us"), ok=r["ok"], err=r.get("max_abs_err"),
                error=r.get("error"))
        good = sorted(((r["us"], cfg) for cfg, r in results if r["ok"] and "us" in r), key=lambda x: x[0])
        if good:
            chosen[cls] = dict(config=good[0][1], us=good[0][0], ranked=[c for _, c in good])
    return chosen


def update_table(chosen: dict, platform: str, env: dict, path: str, out_path: str) -> dict:
    """This platform's entries of the table replaced by the measured winners (other entries kept)."""
    with open(path) as f:
        table = json.load(f)
    measured = {(TABLE_KIND[k], layout, b): v for (k, b, layout), v in chosen.items()}
    entries = [e for e in table["entries"]
               if not (e["platform"] == platform and (e["kind"], e["pool"], e["batch"]) in measured)]
    for (kind, pool, batch), v in sorted(measured.items()):
        entries.append(dict(platform=platform, kind=kind, pool=pool, heads=64, q_len=6, batch=batch,
                            config=dataclasses.asdict(v["config"]),
                            source=dict(device=env["device"], date=env["date"], commit=env["commit"],
                                        us=round(v["us"], 2))))
    table["entries"] = sorted(entries, key=lambda e: (e["platform"], ac.KINDS.index(e["kind"]), e["pool"],
                                                      -e["batch"]))
    for p in (out_path, path):
        with open(p, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
    ac._read.cache_clear()
    return table


# ------------------------------------------------------------------------------ fp8 checks and write
def fp8_dequant_exact(dims) -> dict:
    """With a one-position window and no sink mass the kernel returns the key row itself: the
    device's dequantised (or folded) fp8 keys must equal the XLA dequantisation bit for bit."""
    s, ring, d, h = 8, dims["ring"], dims["head_dim"], dims["heads"]
    key = jax.random.key(11)
    rows = (jax.random.normal(key, (s, ring, d)) * jnp.exp(jax.random.uniform(key, (s, ring, 1), minval=-8,
                                                                                maxval=8))).astype(jnp.bfloat16)
    lengths = np.arange(s) * 37 + 5
    meta, _ = am.verify(np.full(s, 3), lengths, window=1, num_tokens=3 * s, max_q_len=3)
    q = jax.random.normal(jax.random.key(12), (3 * s, h, d), jnp.float32).astype(jnp.bfloat16)
    sink = jnp.full((h,), -1e30, jnp.float32)
    pool = kv_fp8.quantize(rows, dims["rope"])
    ref = np.asarray(jax.jit(lambda *a: ra.reference(*a))(q, pool, None, sink, meta)).view(np.uint16)
    res = {}
    rows_cfg = dict(block_t=1, block_h=min(64, max(16, h)), num_warps=8 if h >= 64 else 4)
    for name, cfg in (("dequantised", ra.BlockConfig(**rows_cfg, block_d=256)),
                      ("folded", ra.BlockConfig(**rows_cfg, fp8_fold=True, kv_splits=2))):
        try:
            out = jax.jit(lambda *a, c=cfg: ra.kernel(*a, config=c))(q, pool, None, sink, meta)
            res[name] = bool(np.array_equal(np.asarray(out).view(np.uint16), ref))
        except Exception as e:
            res[name] = f"failed: {e!r}"[:300]
    return res


def run_fp8_write_case(n_rows, pool_rows, dims, ceil, timer: DeviceTimer, block_rows=16, n=20) -> dict:
    d = dims["head_dim"]
    rows = jax.random.normal(jax.random.key(7), (n_rows, d), jnp.float32).astype(jnp.bfloat16)
    slots = jax.random.permutation(jax.random.key(8), pool_rows)[:n_rows].astype(jnp.int32)
    slots = slots.at[::17].set(-1)  # a few skipped rows
    a = jax.jit(lambda p, s, x: kv_fp8.write_kernel(p, s, x, block_rows=block_rows))(
        kv_fp8.zeros((pool_rows,), d, dims["rope"]), slots, rows)
    b = jax.jit(kv_fp8.write_reference)(kv_fp8.zeros((pool_rows,), d, dims["rope"]), slots, rows)
    exact = bool(np.array_equal(np.asarray(a.nope), np.asarray(b.nope))
                 and np.array_equal(np.asarray(a.rope).view(np.uint16), np.asarray(b.rope).view(np.uint16)))
    del a, b
    written = int((np.asarray(slots) >= 0).sum())
    nbytes = n_rows * (2 * d + 4) + written * kv_fp8.row_bytes(d, dims["rope"], "fp8")

    def chained(write):
        return jax.jit(lambda p, s, x: lax.fori_loop(0, n, lambda i, p: write(p, s, x), p), donate_argnums=0)

    r = dict(rows=n_rows, pool_rows=pool_rows, block_rows=block_rows, bit_exact=exact, bytes=nbytes)
    for name, write in (("kernel", lambda p, s, x: kv_fp8.write_kernel(p, s, x, block_rows=block_rows)),
                        ("xla", kv_fp8.write_reference)):
        exe = chained(write)
        pool = kv_fp8.zeros((pool_rows,), d, dims["rope"])
        pool = exe(pool, slots, rows)  # compile
        times = []
        for _ in range(timer.reps):
            t0 = time.perf_counter()
            pool = exe(pool, slots, rows)
            jax.block_until_ready(pool)
            times.append(time.perf_counter() - t0)
        r[f"{name}_us"] = max(statistics.median(times) - timer.dispatch_s, 0.0) / n * 1e6
    r.update(kernel_GBps=nbytes / r["kernel_us"] / 1e3, speedup_vs_xla=r["xla_us"] / r["kernel_us"])
    r["bw_fraction"] = r["kernel_GBps"] / ceil["copy_GBps"]
    return r


# ------------------------------------------------------------------------------ report
def markdown(result) -> str:
    c, meta = result["ceilings"], result["meta"]
    lines = [f"Device: {meta['device']}; jax {meta['jax']}; commit {meta['commit']}; {meta['date']}",
             f"Ceilings (same run): device copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} "
             f"TFLOP/s; host dispatch of a trivial call {result['dispatch_us']:.1f} us (subtracted)", "",
             "Device time per call (us). roofline = max(unique bytes / copy BW, useful FLOPs / matmul peak); "
             "after = the configuration the engine picks from the table; before = the previous kernel with "
             "its default configuration.", "",
             "| layer | pool | batch | context | tokens/req | unique KB/req | roofline us | bound | after us | "
             "% roofline | before us | % roofline | XLA us | after vs before | after vs XLA | after config | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in result["attention"]:
        new, old = a.get("after", {}), a.get("before", {})

        def us(r):
            return f"{r['us']:.1f}" if "us" in r else "failed" if r else "-"

        def frac(r):
            return f"{100 * a['roofline_us'] / r['us']:.0f}" if r.get("us") else "-"

        ratio = lambda x, y: f"{x['us'] / y['us']:.2f}" if x.get("us") and y.get("us") else "-"  # noqa: E731
        cfg = new.get("config") or {}
        cfg_s = (f"{cfg.get('block_t')}x{cfg.get('block_h')} k{cfg.get('block_k')} w{cfg.get('num_warps')} "
                 f"s{cfg.get('num_stages')} p{cfg.get('kv_splits')} d{cfg.get('block_d')}"
                 f"{' fold' if cfg.get('fp8_fold') else ''}") if cfg else "-"
        check = "ok" if new.get("ok") and old.get("ok", True) else "MISMATCH" if new else "-"
        xla = a.get("xla_us")
        lines.append(f"| {LABEL[a['kind']]} | {a['layout']} | {a['batch']} | {a['ctx']} | {a['q_len']} | "
                     f"{a['unique_bytes_per_request'] / 1e3:.0f} | {a['roofline_us']:.1f} | {a['bound']} | {us(new)} | "
                     f"{frac(new)} | {us(old)} | {frac(old)} | {xla:.1f} | {ratio(old, new)} | "
                     f"{ratio(dict(us=xla), new)} | {cfg_s} | {check} |")
    if result.get("fp8_write"):
        lines += ["", "| fp8 write rows | kernel us | GB/s | % BW | XLA us | speed-up | bit-exact |",
                  "|---|---|---|---|---|---|---|"]
        for w in result["fp8_write"]:
            if "kernel_us" in w:
                lines.append(f"| {w['rows']} | {w['kernel_us']:.1f} | {w['kernel_GBps']:.0f} | "
                             f"{100 * w['bw_fraction']:.0f} | {w['xla_us']:.1f} | {w['speedup_vs_xla']:.2f} | "
                             f"{w['bit_exact']} |")
    return "\n".join(lines) + "\n"


def plot(result, path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {e}"
    att = [a for a in result["attention"] if a.get("after", {}).get("us")]
    if not att:
        return "no plot: no timed case"
    labels = [f"{a['kind']} {a['layout']} b{a['batch']} {a['ctx'] // 1024}k q{a['q_len']}" for a in att]
    y = np.arange(len(att))
    fig, axes = plt.subplots(1, 2, figsize=(16, 0.35 * len(att) + 2))
    for off, key, name in ((-0.2, "after", "after"), (0.2, "before", "before")):
        axes[0].barh(y + off, [a["roofline_us"] / a[key]["us"] if a.get(key, {}).get("us") else 0 for a in att],
                     height=0.4, label=name)
    axes[0].axvline(0.7, color="r", ls="--", label="goal 70%")
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[0].set(xlabel="fraction of roofline (device time)", title="ragged verify attention")
    axes[0].legend()
    for off, key, name in ((-0.27, "after", "after"), (0, "before", "before"), (0.27, "xla", "XLA")):
        vals = [a["xla_us"] if key == "xla" else a.get(key, {}).get("us", 0) for a in att]
        axes[1].barh(y + off, vals, height=0.27, label=name)
    axes[1].axvline(10, color="r", ls="--", label="10 us")
    axes[1].set_yticks(y, labels, fontsize=7)
    axes[1].set(xscale="log", xlabel="device time per call (us)", title="per call")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def write_outputs(result, out_dir) -> None:
    with open(os.path.join(out_dir, "kernels.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out_dir, "kernels.md"), "w") as f:
        f.write(markdown(result))


# ------------------------------------------------------------------------------ main
def table_cases(dims, smoke: bool) -> list[list[Case]]:
    """Before / after cases in groups, most important first."""
    ctx = dims["ctx"]
    if smoke:
        return [[Case("c128", 2, ctx, 6, "fp8"), Case("c4", 2, ctx, 6, "bf16")], [Case("swa", 1, ctx, 6, "bf16")]]
    kinds, layouts = ("c128", "c4", "swa"), ("bf16", "fp8")
    return [[Case(k, 64, ctx, 6, lay) for k in kinds for lay in layouts],
            [Case(k, 1, ctx, 6, lay) for k in kinds for lay in layouts],
            [Case("c128", 8, ctx, 6, "bf16"), Case("c4", 8, ctx, 6, "bf16"), Case("c128", 64, 8192, 6, "bf16"),
             Case("c128", 64, 65536, 6, "bf16"), Case("c128", 64, ctx, 1, "bf16"), Case("c128", 64, ctx, 1, "fp8"),
             Case("c4", 64, ctx, 1, "bf16")]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Pallas kernel benchmark and tuner (see the module docstring)")
    ap.add_argument("--device-time", action="store_true", default=True,
                    help="time calls inside one jitted loop (the only method; kept for the documented command)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs anywhere, interpret mode off GPU)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new measurements after this")
    ap.add_argument("--no-tune", action="store_true", help="skip the sweep; measure the table as it is")
    ap.add_argument("--no-registers", action="store_true", help="do not dump PTX for registers / spills")
    ap.add_argument("--plot-from", metavar="JSON", help="only redraw kernels.png / kernels.md from a saved kernels.json")
    args = ap.parse_args(argv)
    out_dir = common.out_dir()
    if args.plot_from:
        with open(args.plot_from) as f:
            saved = json.load(f)
        with open(os.path.join(out_dir, "kernels.md"), "w") as f:
            f.write(markdown(saved))
        print(plot(saved, os.path.join(out_dir, "kernels.png")) or "redrawn")
        return 0

    start = time.time()
    dims = SMOKE if args.smoke else FLASH
    platform = backend.gpu_platform() or "cuda"
    env = common.environment()
    result = dict(meta=dict(env, smoke=args.smoke, dims=dims, platform=platform,
                            interpret_mode=backend.interpret_mode(), budget_s=args.budget_s),
                  attention=[], sweep=[], skipped=[], fp8_write=[])

    def say(what, **kw):
        print(json.dumps(dict(t=round(time.time() - start, 1), what=what, **kw), default=str), flush=True)

    def over_budget(what) -> bool:
        if time.time() - start > args.budget_s:
            result["skipped"].append(what)
            return True
        return False

    say("environment", **result["meta"])
    ceil = result["ceilings"] = measure_ceilings(args.smoke)
    timer = DeviceTimer()
    result["dispatch_us"] = timer.dispatch_s * 1e6
    say("ceilings", **ceil, dispatch_us=result["dispatch_us"])
    runner = Runner(dims, ceil, timer, args.smoke)
    runner.over_budget = over_budget
    result["fp8_attention_dequant_bit_exact"] = fp8_dequant_exact(dims)
    say("fp8 keys bit-exact in the attention kernel", **result["fp8_attention_dequant_bit_exact"])

    chosen = {}

    def tune(classes):
        chosen.update(sweep(runner, classes, say))
        result["sweep"] = [dict(case=k[0], impl=k[1], **v) for k, v in runner.results.items() if k[1] == "after"]
        result["chosen"] = {"-".join(map(str, k)): dict(config=dataclasses.asdict(v["config"]), us=v["us"])
                            for k, v in chosen.items()}
        if chosen and not args.smoke:
            table_path = os.path.join(out_dir, "attention_configs.json")
            update_table(chosen, platform, env, ac.TABLE_PATH, table_path)
            say("table written", path=table_path, classes=list(result["chosen"]))
        write_outputs(result, out_dir)

    def measure(cases):
        for case in cases:
            if over_budget(("table", case.key)):
                continue
            inputs, _, info = runner.case(case)
            row = dict(info, **roofline(info, ceil))
            cfg = ra.select_config(inputs[0], inputs[1], inputs[2], inputs[4])  # what the engine picks
            row["after"] = runner.kernel(case, cfg)
            row["before"] = runner.kernel(case, None, old=True)
            row["xla_us"] = runner.reference(case)["us"]
            result["attention"].append(row)
            say("case", case=case.key, roofline_us=row["roofline_us"], after_us=row["after"].get("us"),
                before_us=row["before"].get("us"), xla_us=row["xla_us"], ok=row["after"]["ok"],
                config=row["after"]["config"])
        write_outputs(result, out_dir)

    groups = table_cases(dims, args.smoke)
    tile_classes = [(("c128", 64 if not args.smoke else 2, lay), tile_candidates(lay, args.smoke))
                    for lay in ("bf16", "fp8")]
    if not args.no_tune:
        tune(tile_classes)
        follow = []
        for lay in ("bf16", "fp8"):
            ranked = chosen.get(("c128", 64 if not args.smoke else 2, lay), {}).get("ranked", [])
            if ranked:
                follow += [(("c4", 64 if not args.smoke else 2, lay), ranked[:2]),
                           (("swa", 64 if not args.smoke else 2, lay), ranked[:1])]
        tune(follow)
    measure(groups[0])
    if not args.no_tune:
        split_classes = [(("c128", 1, lay), split_candidates(lay, args.smoke)) for lay in ("bf16", "fp8")]
        tune(split_classes)
        follow = []
        sms = 132 if not args.smoke else 8
        for lay in ("bf16", "fp8"):
            best = chosen.get(("c128", 1, lay))
            if best:
                cfg = best["config"]
                rows = ac.row_programs(cfg, dims["heads"], 6, 1)
                for kind in ("c4", "swa"):
                    follow.append(((kind, 1, lay), [dataclasses.replace(cfg, kv_splits=p)
                                                    for p in splits_for(kind, cfg, dims, rows, sms)]))
        tune(follow)
    for group in groups[1:]:
        measure(group)

    # registers and spills of the timed kernels: the configurations the engine picks, and before
    wanted = {a[k]["probe"] for a in result["attention"] for k in ("after", "before") if a.get(k, {}).get("probe")}
    left = args.budget_s + 60 - (time.time() - start)
    result["registers"] = device_time.ptx_registers(XLA_DUMP, runner.probes, wanted, budget_s=max(left, 20))
    say("registers", status=result["registers"]["status"],
        kernels={k: v.get("functions") or v.get("error") for k, v in result["registers"].get("kernels", {}).items()})
    write_outputs(result, out_dir)

    writes = [(16, 64), (100, 256)] if args.smoke else [(64 * 6, 1 << 20), (8192, 1 << 20), (65536, 1 << 20)]
    for n, p in writes:
        if over_budget(("fp8 write", n)):
            continue
        try:
            r = run_fp8_write_case(n, p, dims, ceil, timer, n=2 if args.smoke else 20)
        except Exception as e:
            r = dict(rows=n, pool_rows=p, error=repr(e)[:400])
        result["fp8_write"].append(r)
        say("fp8 write", **r)

    att = result["attention"]
    result["summary"] = dict(
        all_checks_ok=all(a["after"]["ok"] and a["before"].get("ok", False) for a in att) and bool(att),
        fp8_attention_dequant_bit_exact=result["fp8_attention_dequant_bit_exact"],
        cases_measured=len(att), skipped=len(result["skipped"]), wall_s=time.time() - start)
    for a in att:
        if a["after"].get("us"):
            result["summary"][a["case"]] = dict(after_us=round(a["after"]["us"], 2),
                                                roofline_fraction=round(a["roofline_us"] / a["after"]["us"], 3),
                                                before_us=round(a["before"].get("us", float("nan")), 2),
                                                xla_us=round(a["xla_us"], 2))
    write_outputs(result, out_dir)
    note = plot(result, os.path.join(out_dir, "kernels.png"))
    say("summary", **result["summary"])
    print(note or f"wrote {out_dir}/kernels.json, kernels.md, kernels.png"
          + ("" if args.smoke or args.no_tune else ", attention_configs.json"), flush=True)
    exact = all(v is True for v in result["fp8_attention_dequant_bit_exact"].values())
    writes_ok = all(w.get("bit_exact") for w in result["fp8_write"])
    return 0 if result["summary"]["all_checks_ok"] and exact and writes_ok else 1


if __name__ == "__main__":
    sys.exit(main())
