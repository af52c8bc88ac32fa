"""A long prompt through chunked prefill at Flash dimensions: time, memory, and the decode step after it.

Builds ``flash_slice(layers)`` with random weights in the GPU weight format, prefills one
``--tokens``-long prompt (default 32k) through the engine's chunked prefill for each chunk size in
``--chunks``, and reports per chunk size: compile time, prefill time and tokens/s, the compiled
prefill program's temporary bytes, the device's peak memory, and a few target-only decoding steps
at that context. Writes prefill.json under $OUT after every measurement.

    python benchmarks/prefill.py --layers 4 --tokens 32768 --chunks 256,2048
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import dspark_jax
from benchmarks.common import environment, write_json
from dspark_jax import SamplingParams
from dspark_jax.decoding.engine import Engine


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def bench_chunk(model, prompt: np.ndarray, chunk: int, gamma: int, rounds: int) -> dict:
    n = len(prompt)
    eng = Engine(model, gamma=gamma, prefill_chunk=chunk)
    params = [SamplingParams(max_new_tokens=8 * rounds + 8)]
    max_len = -(-(n + 8 * rounds + 64) // 128) * 128
    bs = eng.init_state([prompt], params, [0], max_len)
    ids = jnp.zeros((1, chunk), jnp.int32)
    last = jnp.zeros((1, model.config.vocab_size), jnp.float32)
    t0 = time.time()
    compiled = eng._prefill.lower(eng.params, bs, ids, jnp.full((1,), chunk, jnp.int32), last,
                                  jnp.ones((1,), bool)).compile()
    out = {"chunk": chunk, "gamma": gamma, "prefill_compile_s": time.time() - t0}
    mem = compiled.memory_analysis()
    if mem is not None:
        out["prefill_temp_bytes"] = int(mem.temp_size_in_bytes)
    t0 = time.perf_counter()
    bs, first = eng.prefill(bs, [prompt])
    jax.block_until_ready(bs.cache.lengths)
    out["prefill_s"] = time.perf_counter() - t0  # includes the first-token program's compile (a few s)
    out["prefill_tok_s"] = n / out["prefill_s"]
    out["committed"] = int(np.asarray(bs.cache.lengths)[0])
    out["first_token"] = int(first[0])
    out["peak_bytes"] = peak_bytes()
    print({k: v for k, v in out.items()}, flush=True)
    times = []
    for i in range(rounds + 2):
        t0 = time.perf_counter()
        bs, res = eng.round(bs, sampled=False, top_k=False, top_p=False)
        jax.block_until_ready(res.tokens)
        times.append(time.perf_counter() - t0)
    out["round_compile_and_first_s"] = times[0]
    out["round_ms"] = 1e3 * float(np.median(times[2:]))
    out["peak_bytes_after_rounds"] = peak_bytes()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunks", default="2048,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dspark", action="store_true", help="DSpark engine (drafter context rings written too)")
    ap.add_argument("--weights", default="fp8", choices=("official", "fp8", "dense"))
    ap.add_argument("--dense-copies", action="store_true",
                    help="hold the FP8 linears also dequantised (dspark_jax.with_dense_copies): the chunks' linears "
                         "multiply by the copies in XLA's GEMM")
    ap.add_argument("--smoke", action="store_true", help="tiny config, CPU-sized: checks the script runs")
    args = ap.parse_args()

    env = environment()
    print(env, flush=True)
    cfg = dspark_jax.config.flash_slice(args.layers)
    if args.smoke:
        cfg, args.tokens, args.chunks = dspark_jax.config.tiny(), 300, "64"
    t0 = time.time()
    model = dspark_jax.init(cfg, 0, dtype=jnp.bfloat16, weight_format=args.weights, quant_sim=not args.smoke)
    if args.dense_copies:
        model = dspark_jax.with_dense_copies(model)
    info = {"env": env, "layers": cfg.num_hidden_layers, "tokens": args.tokens, "weights": args.weights,
            "dense_copies": args.dense_copies,
            "weight_bytes": model.weight_bytes, "init_s": time.time() - t0, "peak_bytes_after_init": peak_bytes(),
            "results": []}
    print({k: v for k, v in info.items() if k != "results"}, flush=True)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size - 1, args.tokens)
    gamma = cfg.dspark.block_size if args.dspark else 0
    for c in (int(x) for x in args.chunks.split(",")):
        info["results"].append(bench_chunk(model, prompt, c, gamma, args.rounds))
        print(info["results"][-1], flush=True)
        write_json("prefill.json", info)


if __name__ == "__main__":
    main()
