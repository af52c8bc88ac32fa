"""mHC's steps between sub-blocks on the device: the fused Pallas kernels (``pallas_kernels.hc_fused``,
``sinkhorn="fused"``) against the plain-XLA GPU path with the gates + Sinkhorn kernel of
``hc_weights`` (``sinkhorn="kernel"``), at DeepSeek-V4-Flash widths (4 streams of 4096, bf16
streams, float32 parameters), for T tokens per call.

The pieces are the model's steps (``dspark_jax.model.block``): ``pre_norm`` (hc_pre + attn_norm,
a block's first step), ``post_pre_norm`` (the attention's hc_post + the MoE's hc_pre + ffn_norm),
``post`` (the MoE's hc_post) and ``head_norm`` (hc_head + the final norm). For each T, path and
piece, compiled on its own:

- ``kernels``: kernel-launching instructions of the compiled program (``profile_step.Attribution``);
- ``device_us``: device time of its kernels per call, from a profiler trace of ``--calls`` calls,
  and ``launches`` per call seen in the trace. The calls cycle through copies of the piece's large
  parameters (``cold_copies``), so that each reads fn from memory as a decode step does: timed on
  one copy, fn stays in the L2 from call to call, and the one-token mixes took 32 programs' reads of
  48 KB each without the cost they have in a step (docs/benchmarks.md, 2026-12-06 (night));
- ``max_rel_err``: the largest deviation of each output from plain JAX with the Sinkhorn
  iterations as a loop (float32 matmuls at HIGHEST), divided by the output's largest magnitude;
- ``roofline_us``: the piece's bytes (parameters + streams read once, outputs written once) over the
  copy bandwidth measured in the same run.

And per path ``layer_us``: wall time per layer's mHC steps (pre_norm, post_pre_norm, post; each
sub-block replaced by its input) of a chain of ``--chain`` dependent layers in one program, each
launch included as in a step.

    python -m benchmarks.hc_fused                     # writes hc_fused.json under $OUT
    python -m benchmarks.hc_fused --tokens 1,6 --sweep  # also tilings of the fused pre_norm (dots, multiply-adds)
    python -m benchmarks.hc_fused --smoke             # tiny widths on CPU (interpret mode): the script runs
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import ceilings, environment, median_time, write_json
from benchmarks.profile_step import Attribution, profiler_trace, trace_events
from dspark_jax.model.hyper import hc_head, hc_post, hc_post_pre_norm, hc_pre, hc_pre_norm
from pallas_kernels import hc_fused

N, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6
PIECES = ("pre_norm", "post_pre_norm", "post", "head_norm")
T0 = time.time()


def inputs(tokens: int, d: int, seed: int = 0) -> dict:
    """Each piece's arguments: streams x [1, T, n, d] bf16, the pre / head units' parameters and a
    norm weight, a sub-block output f and the (reference's) post weights and mixing matrix."""
    rng = np.random.default_rng(seed)
    m = (2 + N) * N
    x = jnp.asarray(rng.standard_normal((1, tokens, N, d)), jnp.bfloat16)
    pre = (jnp.asarray(rng.standard_normal((m, N * d)) * 0.02, jnp.float32),
           jnp.asarray(rng.standard_normal(m) * 0.5, jnp.float32), jnp.asarray([0.7, 1.3, 0.9], jnp.float32))
    head = (jnp.asarray(rng.standard_normal((N, N * d)) * 0.02, jnp.float32),
            jnp.asarray(rng.standard_normal(N) * 0.5, jnp.float32), jnp.asarray([1.1], jnp.float32))
    w = jnp.asarray(1.0 + 0.2 * rng.standard_normal(d), jnp.float32)
    _, post_w, comb = hc_pre(x, *pre, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    f = jnp.asarray(rng.standard_normal((1, tokens, d)), jnp.bfloat16)
    return {"pre_norm": (x, *pre, w), "post_pre_norm": (f, x, post_w, comb, *pre, w), "post": (f, x, post_w, comb),
            "head_norm": (x, *head, w)}


def pieces(path: str, config: hc_fused.HcConfig | None = None) -> dict:
    """The pieces (arguments as ``inputs`` gives them) for a path: "fused", "current" (XLA with the
    Sinkhorn kernel) or "reference" (XLA, the Sinkhorn iterations as a loop)."""
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, out_eps=NORM_EPS)
    impl = {"fused": "fused", "current": "kernel", "reference": "loop"}[path]
    fused = path == "fused"

    def pre_norm(x, fn, base, scale, w):
        if config is not None:
            return hc_fused.pre_kernel(x, fn, base, scale, norm_weight=w, config=config, **kw)
        return hc_pre_norm(x, fn, base, scale, w, sinkhorn_impl=impl, **kw)

    def post_pre_norm(f, x, post_w, comb, fn, base, scale, w):
        if config is not None:
            return hc_fused.post_pre_kernel(f, x, post_w, comb, fn, base, scale, norm_weight=w, config=config, **kw)
        return hc_post_pre_norm(f, x, post_w, comb, fn, base, scale, w, sinkhorn_impl=impl, **kw)

    return {"pre_norm": pre_norm, "post_pre_norm": post_pre_norm,
            "post": lambda f, x, post_w, comb: hc_post(f, x, post_w, comb, fused=fused),
            "head_norm": lambda x, fn, base, scale, w: hc_head(x, fn, base, scale, hc_eps=HC_EPS, norm_eps=NORM_EPS,
                                                               fused=fused, norm_weight=w, out_eps=NORM_EPS)}


def layer_chain(path: str, layers: int):
    """``layers`` dependent layers' mHC steps: x -> pre_norm -> post_pre_norm(f = y) -> post(f = y')
    -> x' (arguments: pre_norm's)."""
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, out_eps=NORM_EPS,
              sinkhorn_impl={"fused": "fused", "current": "kernel"}[path])

    def chain(x, fn, base, scale, w):
        for _ in range(layers):
            y, post_w, comb = hc_pre_norm(x, fn, base, scale, w, **kw)
            x, y, post_w, comb = hc_post_pre_norm(y, x, post_w, comb, fn, base, scale, w, **kw)
            x = hc_post(y, x, post_w, comb, fused=path == "fused")
        return x

    return chain


def compile_highest(fn, name: str, *args):
    """``jax.jit(fn)`` compiled with float32 matmuls at HIGHEST (as the model's inference entry
    points trace), as the HLO module ``jit_<name>``: (compiled, module name, kernel instructions,
    seconds)."""
    def named(*a):
        return fn(*a)

    named.__name__ = named.__qualname__ = name
    t0 = time.time()
    with jax.default_matmul_precision("highest"):
        compiled = jax.jit(named).lower(*args).compile()
    text = compiled.as_text()
    module = text.split(",")[0].split()[-1] if text.startswith("HloModule") else ""
    return compiled, module, sum(Attribution(text).static_kernels().values()), time.time() - t0


def piece_bytes(name: str, tokens: int, d: int) -> int:
    stream, k = 2 * tokens * d, N * d  # bf16 bytes of one stream (or of y, f)
    pre = 4 * (2 + N) * N * k + 4 * d  # the unit's fn and the norm weight
    return {"pre_norm": pre + N * stream + stream,
            "post_pre_norm": pre + stream + N * stream + N * stream + stream,
            "post": N * stream + stream + N * stream,
            "head_norm": 4 * N * k + 4 * d + N * stream + stream}[name]


def cold_copies(args: tuple, budget: int = 128 << 20) -> list[tuple]:
    """``args`` and copies of it whose parameters of 256 KiB or more (fn: 1.5 MiB per unit at Flash
    widths) are distinct buffers, together about ``budget`` bytes (more than twice a 50 MB L2).
    Calls that cycle through them read those parameters from memory, as a decode step does (each
    layer's once); calls on one set find them in the L2."""
    def is_big(a) -> bool:
        return getattr(a, "nbytes", 0) >= 256 << 10

    big = sum(a.nbytes for a in jax.tree_util.tree_leaves(args) if is_big(a))
    if not big:
        return [args]
    copy = functools.partial(jax.tree_util.tree_map, lambda a: jnp.array(a, copy=True) if is_big(a) else a)
    return [args] + [copy(args) for _ in range(min(256, max(2, budget // big)) - 1)]


def device_times(compiled: dict, calls: int, trace_root: str, cold: bool = False) -> dict:
    """Device microseconds and kernel launches per call of each compiled program ({key: (compiled,
    module name, arguments)}), from one trace; with ``cold`` each program's calls cycle through
    ``cold_copies`` of its arguments (else every call takes the same ones)."""
    out_dir = tempfile.mkdtemp(dir=trace_root)
    copies = {key: cold_copies(a) if cold else [a] for key, (_, _, a) in compiled.items()}
    for c, _, a in compiled.values():
        jax.block_until_ready(c(*a))
    with profiler_trace(out_dir):
        for key, (c, _, _) in compiled.items():
            for i in range(calls):
                jax.block_until_ready(c(*copies[key][(i + 1) % len(copies[key])]))
    files = sorted(glob.glob(os.path.join(out_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        return {k: {"error": f"no trace written under {out_dir}"} for k in compiled}
    res = {}
    for key, (_, module, _) in compiled.items():
        events, source = trace_events(files[-1], module)
        res[key] = {"device_us": sum(e.dur_ns for e in events) / calls / 1e3, "launches": len(events) / calls}
        if "no event of module" in source:
            res[key]["note"] = source
    return res


def rel_err(got, want) -> float:
    got = [np.asarray(g, np.float32) for g in jax.tree_util.tree_leaves(got)]
    want = [np.asarray(w, np.float32) for w in jax.tree_util.tree_leaves(want)]
    return max(float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)) for g, w in zip(got, want))


def run_tokens(tokens: int, d: int, args, ceil: dict, trace_root: str) -> dict:
    inp = inputs(tokens, d)
    row = {"tokens": tokens}
    compiled, outs = {}, {}
    for path in ("reference", "current", "fused"):
        for name, fn in pieces(path).items():
            try:
                c, module, kernels, secs = compile_highest(fn, f"{path}_{name}_t{tokens}", *inp[name])
                outs[(path, name)] = jax.block_until_ready(c(*inp[name]))
            except Exception as err:  # noqa: BLE001 (recorded, and the other pieces still run)
                row[f"{path}/{name}"] = {"error": f"{type(err).__name__}: {str(err)[:2000]}"}
                print(f"T={tokens} {path}/{name} FAILED:", row[f"{path}/{name}"]["error"], flush=True)
                continue
            if path == "reference":
                continue
            compiled[(path, name)] = (c, module, inp[name])
            row[f"{path}/{name}"] = {"kernels": kernels, "compile_s": round(secs, 2)}
    for (path, name), out in outs.items():
        if path != "reference" and ("reference", name) in outs:
            row[f"{path}/{name}"]["max_rel_err"] = rel_err(out, outs[("reference", name)])
            row[f"{path}/{name}"]["roofline_us"] = piece_bytes(name, tokens, d) / ceil["copy_GBps"] / 1e3
    for path in ("current", "fused"):
        print(f"[{time.time() - T0:.0f} s] T={tokens} {path}:", {n: row.get(f"{path}/{n}") for n in PIECES},
              flush=True)
    for key, times in device_times(compiled, args.calls, trace_root, cold=True).items():
        row[f"{key[0]}/{key[1]}"].update(times)
    print(f"[{time.time() - T0:.0f} s] T={tokens} device us, launches per call:",
          {k: (round(v.get("device_us", float("nan")), 2), v.get("launches")) for k, v in row.items()
           if isinstance(v, dict)}, flush=True)
    for path in ("current", "fused"):
        if any((path, n) not in compiled for n in ("pre_norm", "post_pre_norm", "post")):
            continue  # (a piece failed above)
        a = inp["pre_norm"]
        c, _, kernels, secs = compile_highest(layer_chain(path, args.chain), f"{path}_layers_t{tokens}", *a)
        row[f"{path}/layer"] = {"layer_us": 1e6 * median_time(c, *a, repeat=args.repeat) / args.chain,
                                "kernels_per_layer": kernels / args.chain, "compile_s": round(secs, 2)}
    print(f"[{time.time() - T0:.0f} s] T={tokens} a layer's mHC steps:",
          {p: row.get(f"{p}/layer") for p in ("current", "fused")}, flush=True)
    return row


_DOTS, _FMA = hc_fused.HcConfig(fma_tokens=0), hc_fused.HcConfig(fma_tokens=64)
SWEEP = (_DOTS, dataclasses.replace(_DOTS, split_k=128), dataclasses.replace(_DOTS, split_k=256),
         dataclasses.replace(_DOTS, block_k=64), _FMA,
         *(dataclasses.replace(_FMA, fma_split_k=k) for k in (128, 256, 1024)),
         *(dataclasses.replace(_FMA, fma_block=b) for b in (2048, 8192)),
         *(dataclasses.replace(_FMA, fma_split_k=256, num_warps=w) for w in (2, 8)),
         *(dataclasses.replace(hc_fused.HcConfig(), collapse_warps=w) for w in (1, 2, 4, 8)),
         hc_fused.HcConfig(), *(hc_fused.HcConfig(one_block_k=k) for k in (16, 64, 128)),
         hc_fused.HcConfig(fma_split_k=64))


def sweep(tokens: int, d: int, args, trace_root: str) -> list[dict]:
    """Device time of the fused pre_norm and post_pre_norm under a few tilings."""
    inp = inputs(tokens, d)
    compiled = {}
    chosen = range(len(SWEEP)) if args.sweep_configs is None else [int(i) for i in args.sweep_configs.split(",")]
    for i, cfg in ((i, SWEEP[i]) for i in chosen):
        for name in ("pre_norm", "post_pre_norm"):
            c, module, _, _ = compile_highest(pieces("fused", cfg)[name], f"sweep{i}_{name}_t{tokens}", *inp[name])
            compiled[(i, name)] = (c, module, inp[name])
    rows = []
    for (i, name), times in device_times(compiled, args.calls, trace_root, cold=True).items():
        rows.append({"tokens": tokens, "piece": name, "config": repr(SWEEP[i]), **times})
        print("sweep", rows[-1], flush=True)
    return rows


def main():
    global ITERS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,6,32,192,2048", help="tokens per call (comma-separated)")
    p.add_argument("--calls", type=int, default=20, help="calls of each piece under the profiler")
    p.add_argument("--chain", type=int, default=4, help="dependent layers per program for layer_us")
    p.add_argument("--repeat", type=int, default=10, help="timed runs of the chain (median)")
    p.add_argument("--sweep", action="store_true",
                   help="also time a few tilings of the fused pre_norm and post_pre_norm")
    p.add_argument("--sweep-tokens", default=None, help="tokens per call of the sweep (default: --tokens)")
    p.add_argument("--sweep-configs", default=None, help="indices into SWEEP to time (default: all)")
    p.add_argument("--iters", type=int, default=ITERS, help="Sinkhorn iterations (the model's: 20)")
    p.add_argument("--smoke", action="store_true", help="d = 128, T <= 6 (on a CPU: interpret mode)")
    args = p.parse_args()
    ITERS = args.iters
    d = 128 if args.smoke else 4096
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.smoke:
        tokens = [t for t in tokens if t <= 6] or [6]
    env = environment()
    print(env, flush=True)
    ceil = ceilings(copy_gib=0.25 if args.smoke else 1.0, matmul_n=512 if args.smoke else 4096)
    print(ceil, flush=True)
    out = {"env": env, "ceilings": ceil, "config": {"n": N, "d": d, "iters": ITERS, "chain": args.chain,
                                                    "calls": args.calls, "fused_tiles": repr(hc_fused.HcConfig())},
           "results": [], "sweep": []}
    trace_root = tempfile.mkdtemp(prefix="hc_fused_trace")
    for t in tokens:
        out["results"].append(run_tokens(t, d, args, ceil, trace_root))
        write_json("hc_fused.json", out)
    if args.sweep:
        for t in ([int(t) for t in args.sweep_tokens.split(",")] if args.sweep_tokens else tokens):
            out["sweep"] += sweep(t, d, args, trace_root)
            write_json("hc_fused.json", out)


if __name__ == "__main__":
    main()
