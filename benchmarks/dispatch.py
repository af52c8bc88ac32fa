"""Host cost of a decode round: how long the host takes to hand a round to the GPU, against how
long the GPU takes to run it, under XLA's command-buffer settings.

A round is one jitted call (``Engine._round``) with the model's parameters and the donated batch
state as arguments. Its wall time per round is the larger of two costs when rounds are
dispatched back to back, and roughly their sum when the host waits for every round (as a
serving loop that reads each round's tokens does):

- host: the call itself (argument handling for every parameter and state leaf, then XLA's
  executable launch: with command buffers (CUDA graphs) one graph launch per captured region,
  plus updating the graph's nodes whose buffer addresses changed since the last run; without
  them one launch per kernel);
- device: the kernels.

Measured per round, for each program (model x mode):

- ``call_ms``: time for the jitted call to return while rounds are dispatched back to back
  (the host's share; the GPU runs behind it unless the host had to wait);
- ``pipelined_ms``: wall time per round of ``--rounds`` rounds dispatched back to back;
- ``sync_ms``: wall time per round when the host waits for each round's result;
- ``args_ms``: a jitted call taking the same arguments that does almost nothing (the argument
  handling alone, no donation).

``--rounds-per-call 1,4,8`` times each program also as k rounds per call (``Engine.rounds``: one
program looping over the round on the device): call, pipelined and sync times are then per round
(a call's time / k), so the host's share of a round falls as k grows where the host bounds it.
``--mesh-model N`` spreads the models over a (1, N) mesh first (``sharding.shard_model``; on a
CPU over N virtual devices): every parameter array is then N device buffers per call.

Each XLA setting (``--variants``) runs in its own process (XLA reads its flags once):
``default`` (the installed jax's defaults and the engine's compiler options,
``compile_cache.COMPILER_OPTIONS``: kernels that share no buffer run concurrently),
``xla_order`` (the engine without its options, ``Engine(compiler_options={})``: XLA's default
command-buffer order), ``off`` (no command buffers: one launch per kernel),
``skip_temp`` (``--xla_gpu_command_buffer_update_mode=SKIP_TEMP``: temporaries at stable virtual
addresses, so their graph nodes need no update), ``min1`` (``--xla_gpu_graph_min_graph_size=1``).
A setting the installed XLA does not know is recorded as failed.

Programs: ``shipped`` (the shipped tiny pair in float32, as ``generate`` loads it) and
``flash2`` (a 2-layer DeepSeek-V4-Flash slice, FP8 weights, bf16 KV, with the 3-stage drafter;
the acceptance profile of ``benchmarks/decode.py``), target-only (γ = 0) and DSpark (γ = 5),
batch 1 at context 2048 (caches filled with random rows, no prefill). Under the ``default``
setting the shipped model also runs through ``generate`` (one prompt, target-only and DSpark):
its wall time per round includes the serving loop's own host work (the timed call is the second:
``compile_s_after_warmup`` is what it compiled, 0 when nothing recompiles), and one more call under
cProfile records where that host time goes (``host_profile``: the top functions, ms per round).

    python benchmarks/dispatch.py --budget-s 280
    python benchmarks/dispatch.py --smoke        # CPU: checks the script runs
    python -m benchmarks.dispatch --variants default --models shipped --rounds-per-call 1,4 --mesh-model 8

Writes dispatch.json (after every program) and dispatch.md under $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {
    "default": "",
    "xla_order": "",  # (an engine option, not a flag: ``child``)
    "off": "--xla_gpu_enable_command_buffer=",
    "skip_temp": "--xla_gpu_command_buffer_update_mode=SKIP_TEMP",
    "min1": "--xla_gpu_graph_min_graph_size=1",
}


def child(args) -> None:
    """Measure every program under the XLA flags this process was started with; one JSON line each."""
    import jax

    if args.mesh_model:
        jax.config.update("jax_num_cpu_devices", args.mesh_model)  # (CPU only; before the first computation)
    import jax.numpy as jnp
    import numpy as np

    import dspark_jax
    from benchmarks.decode import DEFAULT_PROFILE, at_context, random_state, sliced
    from dspark_jax import SamplingParams, config
    from dspark_jax.config import MAX_VERIFY_TOKENS
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.generate import default_model
    from dspark_jax.sharding import make_mesh, shard_model

    def models():
        placed = (lambda m: shard_model(m, make_mesh(model=args.mesh_model))) if args.mesh_model else (lambda m: m)
        if "shipped" in args.models:
            yield "shipped", placed(default_model())
        if "flash2" in args.models:
            full = config.tiny() if args.smoke else config.flash()
            yield "flash2", placed(dspark_jax.init(sliced(full, 2), 0, dtype=jnp.bfloat16, weight_format="fp8",
                                                   quant_sim=True))

    n = args.rounds
    for name, model in models():
        for mode in args.modes.split(","):
            gamma = model.config.dspark.block_size if mode == "dspark" else 0
            profile = DEFAULT_PROFILE if (mode == "dspark" and name != "shipped") else None
            eng = Engine(model, gamma=gamma, accept_profile=profile,
                         compiler_options={} if args.variant == "xla_order" else None)
            ks = [int(v) for v in args.rounds_per_call.split(",")]
            rounds = max((2 * max(1, n // k) + max(1, 3 // k)) * k for k in ks)  # of one repeat (each starts afresh)
            growth = (gamma + 1) * rounds + 128  # their tokens
            limit = model.config.max_position_embeddings + MAX_VERIFY_TOKENS
            context = min(args.context, limit - growth)  # the shipped model stops at 1024 positions
            if context < 1:
                raise ValueError(f"{name}: 2 x {n} rounds do not fit its {limit} positions")
            start = at_context(random_state(eng, 1, context + growth, seed=0), context)
            fresh = lambda: jax.tree.map(jnp.copy, start)  # noqa: E731
            for k in ks:  # rounds per call: the ms below are per round
                flags = dict(sampled=False, top_k=False, top_p=False)
                t0 = time.perf_counter()
                fn = (eng._round.lower(eng.params, start, **flags) if k == 1
                      else eng._rounds.lower(eng.params, start, count=k, **flags)).compile()
                compile_s = time.perf_counter() - t0
                params, m = eng.params, max(1, n // k)  # m calls of k rounds each
                calls, pipelined, sync = [], [], []
                for _ in range(args.repeats):
                    bs = fresh()
                    for _ in range(max(1, 3 // k)):
                        bs, res = fn(params, bs)
                    jax.block_until_ready(res.n_new)
                    t0 = time.perf_counter()
                    for _ in range(m):
                        c0 = time.perf_counter()
                        bs, res = fn(params, bs)
                        calls.append(time.perf_counter() - c0)
                    jax.block_until_ready(res.n_new)
                    pipelined.append((time.perf_counter() - t0) / (m * k))
                    for _ in range(m):
                        c0 = time.perf_counter()
                        bs, res = fn(params, bs)
                        jax.block_until_ready(res.n_new)
                        sync.append((time.perf_counter() - c0) / k)
                touch = jax.jit(lambda p, s: s.anchor + 1)
                jax.block_until_ready(touch(params, bs))
                args_t = []
                for _ in range(n):
                    c0 = time.perf_counter()
                    out = touch(params, bs)
                    args_t.append(time.perf_counter() - c0)
                jax.block_until_ready(out)
                leaves = len(jax.tree.leaves(params)), len(jax.tree.leaves(bs))
                row = {"variant": args.variant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "model": name,
                       "mode": mode, "gamma": gamma, "context": context, "devices": len(jax.devices()),
                       "mesh_model": args.mesh_model, "rounds_per_call": k, "compile_s": compile_s,
                       "param_leaves": leaves[0], "state_leaves": leaves[1],
                       "call_ms": 1e3 * float(np.median(calls)) / k,
                       "pipelined_ms": 1e3 * float(np.median(pipelined)), "sync_ms": 1e3 * float(np.median(sync)),
                       "args_ms": 1e3 * float(np.median(args_t)),
                       "tokens_per_round": float(np.mean(np.asarray(res.n_new)))}
                print("ROW " + json.dumps(row), flush=True)
        if name == "shipped" and args.variant == "default":  # generate's serving loop (its host work included)
            for speculative, k in ((s, k) for s in (False, True) for k in args.rounds_per_call.split(",")):
                kw = dict(model=model, sampling=SamplingParams(max_new_tokens=args.new_tokens),
                          speculative=speculative, rounds_per_call=int(k))
                dspark_jax.generate(["def main():"], **kw)  # compiles
                st = dspark_jax.generate(["def main():"], **kw)[0].stats
                row = {"variant": args.variant, "model": name, "rounds_per_call": int(k),
                       "devices": len(jax.devices()), "mesh_model": args.mesh_model,
                       "mode": "generate " + ("DSpark" if speculative else "target-only"),
                       "round_ms": 1e3 * st["decode_s"] / max(1, st["rounds"] - 1), "rounds": st["rounds"],
                       "tokens_per_s": st["tokens_per_s"], "compile_s_after_warmup": st["compile_s"],
                       "host_profile": host_profile(kw, st["rounds"])}
                print("ROW " + json.dumps(row), flush=True)


def host_profile(kw: dict, rounds: int, top: int = 15) -> list[dict]:
    """Where a ``generate`` call's host time goes: one more call under cProfile (which slows it),
    the ``top`` functions by own time, in ms per round (blocking reads of device outputs show up
    as ``_value``: time waiting for the device)."""
    import cProfile
    import pstats

    import dspark_jax

    prof = cProfile.Profile()
    prof.enable()
    dspark_jax.generate(["def main():"], **kw)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{os.path.basename(f)}:{line}({fn})", "calls_per_round": v[0] / max(1, rounds),
             "own_ms_per_round": 1e3 * v[2] / max(1, rounds), "cumulative_ms_per_round": 1e3 * v[3] / max(1, rounds)}
            for (f, line, fn), v in rows]


def table(rows: list[dict]) -> str:
    lines = ["| variant | program | rounds per call | call ms | pipelined ms | sync ms | args ms | compile s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} | | | | | | |")
            continue
        if "round_ms" in r:
            lines.append(f"| {r['variant']} | {r['model']} {r['mode']} | {r.get('rounds_per_call', 1)} | | "
                         f"{r['round_ms']:.3f} (per round, "
                         f"{r['rounds']} rounds) | | | {r.get('compile_s_after_warmup', float('nan')):.1f} "
                         "(second call) |")
            continue
        lines.append(f"| {r['variant']} | {r['model']} {r['mode']} | {r.get('rounds_per_call', 1)} | "
                     f"{r['call_ms']:.3f} | {r['pipelined_ms']:.3f} | "
                     f"{r['sync_ms']:.3f} | {r['args_ms']:.3f} | {r['compile_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="default,xla_order,off,skip_temp,min1")
    ap.add_argument("--models", default="shipped,flash2")
    ap.add_argument("--modes", default="target,dspark")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=30, help="rounds per timed repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per generate call (shipped model)")
    ap.add_argument("--budget-s", type=float, default=0, help="start no variant after this many seconds (0 = none)")
    ap.add_argument("--rounds-per-call", default="1",
                    help="rounds per call to time, e.g. 1,4,8 (Engine.rounds: k rounds in one program)")
    ap.add_argument("--mesh-model", type=int, default=0,
                    help="spread the models over a (1, N) mesh (on a CPU: N virtual devices); 0: one device")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script runs")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.context, args.rounds, args.repeats, args.new_tokens = 64, 3, 1, 16
    if args.child:
        return child(args)

    from benchmarks.common import environment, out_dir, write_json

    start, rows = time.perf_counter(), []
    meta = {"env": environment(), "args": vars(args), "doc": __doc__, "rows": rows}
    base = os.environ.get("XLA_FLAGS", "")
    for variant in args.variants.split(","):
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            rows.append({"variant": variant, "error": "skipped: budget"})
            continue
        env = dict(os.environ, XLA_FLAGS=f"{base} {VARIANTS[variant]}".strip())
        cmd = [sys.executable, "-m", "benchmarks.dispatch", "--child", "--variant", variant, "--models", args.models,
               "--modes", args.modes, "--context", str(args.context), "--rounds", str(args.rounds),
               "--repeats", str(args.repeats), "--new-tokens", str(args.new_tokens),
               "--rounds-per-call", args.rounds_per_call, "--mesh-model", str(args.mesh_model)
               ] + (["--smoke"] if args.smoke else [])
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail = []
        for line in proc.stdout:
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                print(rows[-1], flush=True)
                write_json("dispatch.json", meta)
            else:
                tail = (tail + [line.rstrip()])[-20:]
        if proc.wait() != 0:
            rows.append({"variant": variant, "error": " / ".join(tail[-3:])})
            print(f"{variant} failed:\n" + "\n".join(tail), flush=True)
        print(f"{variant}: {time.perf_counter() - t0:.0f} s", flush=True)
        write_json("dispatch.json", meta)
    text = table(rows)
    with open(os.path.join(out_dir(), "dispatch.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
