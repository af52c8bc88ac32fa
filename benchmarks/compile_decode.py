"""Compile time of the decoding programs (prefill chunk, first token, round) for target-only and
DSpark decoding, each variant in its own process, plus kernel counts of the compiled programs and
the round's run time. Writes compile_decode.json under $OUT and prints one line per variant.

    python benchmarks/compile_decode.py                              # the shipped model, all variants
    python benchmarks/compile_decode.py --only flash4 --limit 300    # a 4-layer Flash slice (FP4 / FP8)

Variants: ``shipped`` (the default model as ``generate`` loads it), with XLA autotuning off, with
Triton GEMM fusion off, with mHC's Sinkhorn as a loop or unrolled (the default on a GPU is the
``hc_weights`` kernel); ``flash4``: 4 layers at Flash dimensions
with FP8 linears and FP4 experts widened to e4m3 (weight_format="fp8").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import out_dir, write_json

VARIANTS = {
    "shipped": {},
    "shipped_autotune_off": {"xla_flags": "--xla_gpu_autotune_level=0"},
    "shipped_triton_gemm_off": {"xla_flags": "--xla_gpu_enable_triton_gemm=false"},
    "shipped_sinkhorn_loop": {"sinkhorn": "loop"},
    "shipped_sinkhorn_unrolled": {"sinkhorn": "unrolled"},
    "flash4": {"flash_layers": 4},
}


def kernel_counts(text: str) -> dict:
    return {"fusions": text.count(" fusion("), "custom_calls": text.count(" custom-call(")}


def probe(variant: str, batch: int, rounds: int, modes: tuple[str, ...] = ("target", "dspark")) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import dspark_jax
    from dspark_jax import SamplingParams
    from dspark_jax.decoding.engine import Engine, chunk_width
    from dspark_jax.decoding.generate import default_model

    spec = VARIANTS[variant]
    t0 = time.time()
    if "flash_layers" in spec:
        cfg = dspark_jax.config.flash_slice(spec["flash_layers"])
        model = dspark_jax.init(cfg, 0, weight_format="fp8", quant_sim=True)
        prompt_len = 64
    else:
        model = default_model()
        prompt_len = 40
    if "sinkhorn" in spec:
        model = dspark_jax.with_numerics(model, sinkhorn=spec["sinkhorn"])
    out = {"variant": variant, "device": jax.devices()[0].device_kind, "load_s": time.time() - t0, "batch": batch}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size - 1, prompt_len) for _ in range(batch)]
    params = [SamplingParams(max_new_tokens=8 * rounds)] * batch
    for name, gamma in (("target", 0), ("dspark", model.config.dspark.block_size)):
        if name not in modes:
            continue
        eng = Engine(model, gamma=gamma)
        bs = eng.init_state(prompts, params, list(range(batch)), prompt_len + 8 * rounds + 32)
        c = chunk_width(prompt_len, eng.chunk_limit(batch))
        ids = jnp.zeros((batch, c), jnp.int32)
        n = jnp.full((batch,), c, jnp.int32)
        last = jnp.zeros((batch, model.config.vocab_size), jnp.float32)
        steps = {"prefill": (eng._prefill, (eng.params, bs, ids, n, last, jnp.ones((batch,), bool)), {}),
                 "first": (eng._first, (eng.params, bs, last, jnp.ones((batch,), bool)), {}),
                 "round": (eng._round, (eng.params, bs), dict(sampled=False, top_k=False, top_p=False))}
        for step, (fn, args, static) in steps.items():
            t1 = time.time()
            lowered = fn.lower(*args, **static)
            t2 = time.time()
            compiled = lowered.compile()
            t3 = time.time()
            out[f"{name}_{step}"] = {"lower_s": t2 - t1, "compile_s": t3 - t2, **kernel_counts(compiled.as_text())}
            print(variant, name, step, out[f"{name}_{step}"], flush=True)
        bs, _ = eng.prefill(bs, prompts)
        times = []
        for _ in range(rounds):
            t1 = time.perf_counter()
            bs, res = eng.round(bs, sampled=False, top_k=False, top_p=False)
            jax.block_until_ready(res.tokens)
            times.append(time.perf_counter() - t1)
        out[f"{name}_round_ms"] = 1e3 * float(np.median(times[2:]))
        out[f"{name}_total_compile_s"] = sum(out[f"{name}_{s}"]["lower_s"] + out[f"{name}_{s}"]["compile_s"]
                                             for s in steps)
        print(variant, name, "round ms", out[f"{name}_round_ms"], "compile s", out[f"{name}_total_compile_s"],
              flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(VARIANTS))
    ap.add_argument("--limit", type=float, default=240, help="seconds per variant")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--parallel", action="store_true", help="run the variants at the same time")
    ap.add_argument("--modes", default="target,dspark", help="target-only and / or DSpark decoding")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        result = probe(args.probe, args.batch, args.rounds, tuple(args.modes.split(",")))
        print("RESULT " + json.dumps(result), flush=True)
        return
    procs, start = {}, time.time()
    for v in args.only.split(","):
        env = dict(os.environ)
        if "xla_flags" in VARIANTS[v]:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + VARIANTS[v]["xla_flags"]).strip()
        if args.parallel:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(round(0.9 / len(args.only.split(",")), 2))
        cmd = [sys.executable, __file__, "--probe", v, "--batch", str(args.batch), "--rounds", str(args.rounds),
               "--modes", args.modes]
        log = open(os.path.join(out_dir(), f"compile_{v}.log"), "w")  # progress survives a kill
        procs[v] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), log)
        if not args.parallel:
            procs[v] = _finish(v, procs[v], time.time() + args.limit)
    # in parallel every variant has the same deadline: a slow one does not eat the others' time
    results = [p if isinstance(p, dict) else _finish(v, p, start + args.limit) for v, p in procs.items()]
    write_json("compile_decode.json", {"results": results})


def _finish(variant, proc_log, deadline: float) -> dict:
    proc, log = proc_log
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"{variant}: over the time limit", flush=True)
    log.close()
    with open(log.name) as f:
        text = f.read()
    lines = [ln for ln in text.splitlines() if "Warning" not in ln and "warn(" not in ln]
    print("\n".join(ln for ln in lines if not ln.startswith("RESULT")), flush=True)
    res = [json.loads(ln[7:]) for ln in lines if ln.startswith("RESULT ")]
    return res[0] if res else {"variant": variant, "error": "\n".join(lines[-15:])}


if __name__ == "__main__":
    main()
