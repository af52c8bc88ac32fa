"""The DeepSeek-V4-Flash MoE layer on one GPU: the grouped-matmul kernel over FP4 / bf16 experts
against XLA's ragged dot, and against the byte and FLOP rooflines measured in the same run.

For each token count the routing is drawn at random (top-6 of 256 distinct experts per token, as
a learned router spreads them) and the script times, as device time (many calls in one jitted
loop, ``common.device_time``):

- ``routed``: the routed experts alone (sort into tiles, fused SwiGLU kernel, down kernel,
  combine), FP4 (the checkpoint's format) and bf16 weights;
- ``xla_ragged_dot``: the same math through ``jax.lax.ragged_dot`` (bf16; what the model used
  before), where it fits in memory;
- ``layer``: the whole MoE layer (router, routed experts, FP8 / bf16 shared expert).

Bytes = the distinct chosen experts' weights as stored + activations; FLOPs = 2 x pairs x 3 x D x I.
``--tune`` also times a few kernel configurations per regime; ``--block-m 16,32,64`` the routed
experts at other row tiles (each with its default configuration). Writes moe.json and moe.png under
$OUT and prints a table as it goes.

    python benchmarks/moe.py --tokens 1,6,48,192,1024,8192 --tune

``--decode``: one whole MoE layer (learned routing, routed and shared experts) at decode token
counts (default 1 and 2), the decode path (router kernels + pair kernels: ``MoE.decode_path``,
its bound raised to the largest token count asked for, e.g. ``--tokens 1,2,6`` for a batch-1
verify step) against the grouped path (``MoE.decode_max_pairs = 0``): device time, the kernels
of the compiled layer (kernel-launching HLO instructions, Pallas custom calls among them) and the
largest difference of the outputs; also the router alone (kernels vs XLA: time, selections that
differ). ``--decode-tune`` adds a few pair-kernel tiles. Writes moe_decode.json under $OUT.

    python -m benchmarks.moe --decode
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import ceilings, device_time, environment, out_dir, write_json
from dspark_jax import config as config_lib
from dspark_jax.model.common import Numerics
from dspark_jax.model.moe import MoE, grouped_experts
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import gemv, pair_experts

TUNE = {  # row tile -> configurations tried
    16: [gm.GemmConfig(64, 256, 4, 4), gm.GemmConfig(32, 256, 4, 4), gm.GemmConfig(128, 128, 4, 3),
         gm.GemmConfig(64, 512, 4, 3), gm.GemmConfig(64, 128, 4, 4), gm.GemmConfig(32, 512, 2, 4)],
    32: [gm.GemmConfig(128, 64, 4, 3), gm.GemmConfig(64, 128, 4, 4), gm.GemmConfig(128, 128, 4, 3),
         gm.GemmConfig(64, 256, 4, 3)],
    64: [gm.GemmConfig(128, 64, 8, 3), gm.GemmConfig(128, 64, 4, 3), gm.GemmConfig(64, 128, 4, 3),
         gm.GemmConfig(128, 128, 8, 3)],
}


PREFILL_TUNE = [(bm, gm.GemmConfig(bn, 64, w, st)) for bm, bn, w, st in (
    (64, 128, 8, 3), (64, 256, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (128, 64, 4, 3),
    (128, 128, 4, 3))]


def ragged_dot_experts(x, w, idx, w1, w2, w3, limit):
    """The routed experts through XLA's ragged dot (bf16 weights), for comparison."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w1.shape[0]).astype(jnp.int32)
    xs = x[order // k]
    mm = lambda a, b: jax.lax.ragged_dot(a, b.transpose(0, 2, 1), sizes, preferred_element_type=jnp.float32)  # noqa: E731
    h = gm.swiglu(mm(xs, w1).astype(x.dtype), mm(xs, w3).astype(x.dtype), limit)
    h = (h * w.reshape(-1)[order][:, None]).astype(x.dtype)
    y = mm(h, w2).astype(x.dtype).astype(jnp.float32)
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[order // k].add(y)


def routing(rng, tokens: int, cfg) -> tuple[np.ndarray, np.ndarray]:
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, k)).astype(np.float32)
    return idx, w / w.sum(1, keepdims=True) * cfg.routed_scaling_factor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=None, help="1,6,48,192,1024,8192 (--decode: 1,2)")
    ap.add_argument("--formats", default=None, help="weight formats: official (FP4 experts), fp8 (FP4 values as "
                    "e4m3 codes), dense (bf16); default official,fp8,dense (--decode: fp8,official)")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-prefill", action="store_true",
                    help="only the many-token regime: row tiles 64 / 128 x wider column tiles, 8192 tokens")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new size after this many seconds (400; --decode: 90)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-m", default="", help="also time the routed experts at these row tiles (e.g. 16,32,64; "
                    "each with its default configuration), against the library's choice")
    ap.add_argument("--one-token-swiglu", default="",
                    help="at one token also time the routed experts with grouped_matmul.ONE_TOKEN_SWIGLU_BLOCK_N = "
                         "each of these (e.g. 32,64: the SwiGLU unsplit, no swiglu_quantise launch)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on CPU: checks the script runs")
    ap.add_argument("--decode", action="store_true",
                    help="decode path vs grouped path of a whole layer (tokens default 1,2; formats fp8,official)")
    ap.add_argument("--decode-tune", action="store_true", help="with --decode: also a few pair-kernel tiles")
    args = ap.parse_args()
    if args.decode:
        return decode(args)
    args.budget_s = args.budget_s or 400.0
    args.tokens = args.tokens or "1,6,48,192,1024,8192"
    args.formats = args.formats or "official,fp8,dense"
    t_start = time.time()
    env = environment()
    print(env, flush=True)
    ceil = ceilings(0.0625, 512) if args.smoke else ceilings()
    print(ceil, flush=True)
    cfg = config_lib.flash(dspark=False)
    if args.smoke:
        cfg = config_lib.tiny(dspark=False).replace(n_routed_experts=32, num_experts_per_tok=6)
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    impl = "xla" if args.smoke else "pallas"
    results, tuning = [], []
    rng = np.random.default_rng(0)
    out = {"env": env, "ceilings": ceil, "config": {"experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
                                                    "hidden": d, "intermediate": i}, "results": results, "tuning": tuning}

    def over_budget():
        return time.time() - t_start > args.budget_s

    for fmt in args.formats.split(","):
        num = Numerics(weight_format=fmt, quant_sim=True, kernels=impl)
        moe = MoE(cfg, False, num, rngs=nnx.Rngs(0))
        ws = tuple(moe.experts.weights(n) for n in ("w1", "w2", "w3"))
        expert_bytes = sum(w.nbytes for w in ws) // cfg.n_routed_experts
        graphdef, state = nnx.split(moe)

        def routed(x, w, idx, ws, **kw):
            return grouped_experts(x, w, idx, *ws, limit=cfg.swiglu_limit, quant_sim=True, impl=impl, **kw)

        def layer(x, state):  # (a one-token step returns its terms for mHC to add: gemv.ExpertRows)
            y = nnx.merge(graphdef, state)(x[None], jnp.zeros((1, x.shape[0]), jnp.int32))
            return gemv.total(y)[0]

        for tokens in (int(t) for t in args.tokens.split(",")):
            if over_budget():
                print("budget exhausted", flush=True)
                break
            idx_np, w_np = routing(rng, tokens, cfg)
            idx, w = jnp.asarray(idx_np), jnp.asarray(w_np)
            x = jax.random.normal(jax.random.key(tokens), (tokens, d), jnp.bfloat16)
            distinct = len(np.unique(idx_np))
            pairs = tokens * cfg.num_experts_per_tok
            nbytes = distinct * expert_bytes + tokens * d * 2 * 2 + pairs * (d + i) * 2 * 2
            flops = 2 * pairs * 3 * d * i
            r = {"format": fmt, "tokens": tokens, "distinct_experts": distinct, "bytes": nbytes, "flops": flops,
                 "block_m": gm.block_m_for(pairs, cfg.n_routed_experts)}
            t0 = time.time()
            y = jax.jit(routed)(x, w, idx, ws)
            r["compile_s"] = time.time() - t0
            if tokens <= 48:  # the kernel against the loop reference on the GPU
                ref = jax.jit(lambda *a: grouped_experts(*a, limit=cfg.swiglu_limit, quant_sim=True, impl="xla"))(
                    x, w, idx, *ws)
                err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
                r["max_rel_err_vs_reference"] = err
            r["routed_s"] = device_time(routed, x, w, idx, ws, reps=args.reps)
            r["pct_copy_bw"] = 100 * nbytes / r["routed_s"] / (ceil["copy_GBps"] * 1e9)
            r["pct_matmul_peak"] = 100 * flops / r["routed_s"] / (ceil["bf16_matmul_TFLOPs"] * 1e12)
            r["layer_s"] = device_time(layer, x, state, reps=args.reps)
            for bn in (int(b) for b in args.one_token_swiglu.split(",") if b and tokens == 1):
                gm.ONE_TOKEN_SWIGLU_BLOCK_N = bn
                fn = jax.jit(lambda x, w, idx, ws: routed(x, w, idx, ws))  # (a new trace: the constant is read there)
                tt = device_time(fn, x, w, idx, ws, reps=args.reps)
                same = bool(jnp.array_equal(fn(x, w, idx, ws), y))
                gm.ONE_TOKEN_SWIGLU_BLOCK_N = 0
                r.setdefault("routed_s_by_one_token_swiglu", {0: r["routed_s"]})[bn] = tt
                print("one-token swiglu", fmt, bn, f"{tt * 1e6:.1f} us (split: {r['routed_s'] * 1e6:.1f} us), "
                      f"output {'equal' if same else 'differs'}", flush=True)
            for bm in (int(b) for b in args.block_m.split(",") if b):
                if bm == r["block_m"]:
                    continue
                tt = device_time(lambda x, w, idx, ws: routed(x, w, idx, ws, block_m=bm), x, w, idx, ws,
                                 reps=args.reps)
                r.setdefault("routed_s_by_block_m", {r["block_m"]: r["routed_s"]})[bm] = tt
                print("block_m", fmt, tokens, bm, f"{tt * 1e6:.1f} us (library's {r['block_m']}: "
                      f"{r['routed_s'] * 1e6:.1f} us)", flush=True)
            if fmt == "dense" and tokens <= 1024:
                try:
                    r["xla_ragged_dot_s"] = device_time(
                        lambda x, w, idx, ws: ragged_dot_experts(x, w, idx, ws[0].values, ws[1].values, ws[2].values,
                                                                 cfg.swiglu_limit), x, w, idx, ws, reps=max(2, args.reps // 4))
                except Exception as e:  # out of memory at the larger sizes
                    r["xla_ragged_dot_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if not args.smoke:
                r["peak_GiB"] = jax.devices()[0].memory_stats().get("peak_bytes_in_use", 0) / 2**30
            print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            results.append(r)
            if args.tune and fmt != "dense" and tokens in (6, 192, 8192) and not over_budget():
                for c in TUNE[gm.block_m_for(pairs, cfg.n_routed_experts)]:
                    try:
                        tt = device_time(lambda x, w, idx, ws: routed(x, w, idx, ws, config=c), x, w, idx, ws,
                                         reps=args.reps)
                        tuning.append({"tokens": tokens, "config": c.__dict__, "routed_s": tt})
                        print("tune", tokens, c, f"{tt * 1e6:.1f} us", flush=True)
                    except Exception as e:
                        print("tune", tokens, c, "failed", type(e).__name__, str(e)[:200], flush=True)
            if args.tune_prefill and tokens >= 4096:
                for bm, c in PREFILL_TUNE:
                    if over_budget():
                        break
                    try:
                        tt = device_time(lambda x, w, idx, ws: routed(x, w, idx, ws, config=c, block_m=bm), x, w,
                                         idx, ws, reps=args.reps)
                        tuning.append({"tokens": tokens, "format": fmt, "block_m": bm, "config": c.__dict__,
                                       "routed_s": tt,
                                       "pct_matmul_peak": 100 * flops / tt / (ceil["bf16_matmul_TFLOPs"] * 1e12)})
                        print("tune-prefill", fmt, tokens, bm, c, f"{tt * 1e6:.1f} us",
                              f"{tuning[-1]['pct_matmul_peak']:.1f} % of peak", flush=True)
                    except Exception as e:
                        print("tune-prefill", fmt, tokens, bm, c, "failed", type(e).__name__, str(e)[:200], flush=True)
            write_json("moe.json", out)
        del moe, ws, state

    print("\nformat tokens experts | routed us | %BW %peak | layer us | ragged_dot us")
    for r in results:
        rd = r.get("xla_ragged_dot_s")
        print(f"{r['format']:>8} {r['tokens']:>6} {r['distinct_experts']:>4} | {r['routed_s'] * 1e6:9.1f} | "
              f"{r['pct_copy_bw']:5.1f} {r['pct_matmul_peak']:5.1f} | {r['layer_s'] * 1e6:8.1f} | "
              f"{'-' if rd is None else f'{rd * 1e6:.1f}'}")
    plot(results, env)


DECODE_TUNE = [  # (up, down) pair-kernel tiles tried by --decode-tune, beside the defaults
    (gm.GemmConfig(32, 256, 4, 4), gm.GemmConfig(32, 256, 4, 4)),
    (gm.GemmConfig(64, 128, 4, 4), gm.GemmConfig(16, 128, 4, 4)),
    (gm.GemmConfig(32, 128, 4, 3), gm.GemmConfig(64, 128, 4, 3)),
    (gm.GemmConfig(128, 128, 4, 3), gm.GemmConfig(32, 512, 4, 3)),
]


def compiled_kernels(fn, *args):
    """``jit(fn)`` compiled for ``args``, and its kernel-launching HLO instructions as 'opcode name'."""
    from benchmarks.profile_step import Attribution

    compiled = jax.jit(fn).lower(*args).compile()
    attr = Attribution(compiled.as_text())
    return compiled, [f"{attr.instrs[n].opcode} {n}" for n in attr.kernel_instructions()]


def decode(args):
    """The ``--decode`` mode (module docstring)."""
    t_start = time.time()
    budget = args.budget_s or 90.0
    env = environment()
    print(env, flush=True)
    tokens_list = [int(t) for t in (args.tokens or "1,2").split(",")]
    formats = (args.formats or "fp8,official").split(",")
    if args.smoke:
        cfg = config_lib.tiny(dspark=False).replace(n_routed_experts=32, num_experts_per_tok=6)
    else:  # one DeepSeek-V4-Flash MoE layer
        cfg = config_lib.flash(dspark=False)
    reps = 3 if args.smoke else args.reps
    results, tuning = [], []
    out = {"env": env, "config": {"experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
                                  "hidden": cfg.hidden_size, "intermediate": cfg.moe_intermediate_size},
           "results": results, "tuning": tuning}

    def over_budget():
        if time.time() - t_start > budget:
            print("budget exhausted", flush=True)
            return True
        return False

    for f_i, fmt in enumerate(formats):
        if over_budget():
            break
        num = Numerics(weight_format=fmt, quant_sim=True, kernels="pallas")
        moe = MoE(cfg, False, num, rngs=nnx.Rngs(0))
        graphs = {}
        for path in ("decode", "grouped"):
            moe.decode_max_pairs = max(tokens_list) * cfg.num_experts_per_tok if path == "decode" else 0
            graphs[path], state = nnx.split(moe)

        def layer(x, state, graph):
            return nnx.merge(graph, state)(x[None], jnp.zeros((1, x.shape[0]), jnp.int32))[0]

        for tokens in tokens_list:
            if over_budget():
                break
            x = jax.random.normal(jax.random.key(tokens), (tokens, cfg.hidden_size), jnp.bfloat16)
            r = {"format": fmt, "tokens": tokens, "pairs": tokens * cfg.num_experts_per_tok}
            ys, kernel_lists = {}, {}
            for path, graph in graphs.items():
                fn = functools.partial(layer, graph=graph)
                t0 = time.time()
                compiled, kernels = compiled_kernels(fn, x, state)
                r[f"{path}_kernels"] = len(kernels)
                r[f"{path}_custom_calls"] = sum(k.startswith("custom-call") for k in kernels)
                ys[path] = np.asarray(compiled(x, state), np.float32)
                r[f"{path}_s"] = device_time(fn, x, state, reps=reps)
                r[f"{path}_compile_and_time_s"] = time.time() - t0
                kernel_lists[f"{path}_kernel_list"] = kernels
                print({k: (round(v, 7) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            r["max_rel_diff"] = float(np.abs(ys["decode"] - ys["grouped"]).max() / np.abs(ys["grouped"]).max())
            r["speedup"] = r["grouped_s"] / r["decode_s"]
            if f_i == 0:  # the router alone (the same for every weight format)
                gate = moe.gate
                ids = jnp.zeros((tokens,), jnp.int32)
                route = {k: jax.jit(lambda x, k=k: gate(x, ids, kernel=k)) for k in (True, False)}
                sel = {k: np.sort(np.asarray(f(x)[1]), axis=1) for k, f in route.items()}
                r["router_selections_differ"] = int((sel[True] != sel[False]).any(axis=1).sum())
                r["router_kernels_s"] = device_time(lambda x: route[True](x)[0], x, reps=reps)
                r["router_xla_s"] = device_time(lambda x: route[False](x)[0], x, reps=reps)
            print({k: (round(v, 7) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            results.append(dict(r, **kernel_lists))
            write_json("moe_decode.json", out)
            if args.decode_tune:
                weights = tuple(moe.experts.weights(n) for n in ("w1", "w2", "w3"))
                shared = moe.shared_experts.weights()
                w = jnp.full((tokens, cfg.num_experts_per_tok), 0.25, jnp.float32)
                idx = jnp.asarray(routing(np.random.default_rng(tokens), tokens, cfg)[0])
                for up, down in [pair_experts.default_configs(weights[0].fmt), *DECODE_TUNE]:
                    if over_budget():
                        break

                    def pairs(x, up=up, down=down):
                        return pair_experts.kernel(x, w, idx, *weights, limit=cfg.swiglu_limit, quant_sim=True,
                                                   shared=shared, out_dtype=x.dtype, up_config=up, down_config=down)
                    try:
                        tt = device_time(pairs, x, reps=reps)
                        tuning.append({"format": fmt, "tokens": tokens, "up": up.__dict__, "down": down.__dict__,
                                       "pairs_s": tt})
                        print("tune", fmt, tokens, up, down, f"{tt * 1e6:.1f} us", flush=True)
                    except Exception as e:
                        print("tune", fmt, tokens, up, down, "failed", type(e).__name__, str(e)[:200], flush=True)
                write_json("moe_decode.json", out)
        del moe, state, graphs

    print("\nformat tokens | decode us kernels (custom) | grouped us kernels (custom) | speed-up | max rel diff")
    for r in results:
        print(f"{r['format']:>8} {r['tokens']:>6} | {r['decode_s'] * 1e6:9.1f} {r['decode_kernels']:4d} "
              f"({r['decode_custom_calls']}) | {r['grouped_s'] * 1e6:10.1f} {r['grouped_kernels']:4d} "
              f"({r['grouped_custom_calls']}) | {r['speedup']:5.2f}x | {r['max_rel_diff']:.2e}")
    print("written", os.path.join(out_dir(), "moe_decode.json"), flush=True)


def plot(results, env):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fmt in sorted({r["format"] for r in results}):
        rs = [r for r in results if r["format"] == fmt]
        ax.plot([r["tokens"] for r in rs], [r["routed_s"] * 1e3 for r in rs], marker="o", label=f"kernel, {fmt}")
        rd = [r for r in rs if "xla_ragged_dot_s" in r]
        if rd:
            ax.plot([r["tokens"] for r in rd], [r["xla_ragged_dot_s"] * 1e3 for r in rd], marker="x", ls="--",
                    label=f"XLA ragged_dot, {fmt}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("routed experts, ms")
    ax.set_title(f"DeepSeek-V4-Flash MoE layer (256 experts, top-6)\n{env['device']}, commit {env['commit']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir(), "moe.png"), dpi=120)


if __name__ == "__main__":
    main()
