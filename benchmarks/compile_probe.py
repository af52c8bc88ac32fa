"""Where does the compile time of the target training step go? Lowers and compiles the shipped
config's train step in variants that each remove or change one thing, every variant in its own
process with a time limit, and writes compile_probe.json under $OUT.

    python benchmarks/compile_probe.py                     # all variants, 150 s each
    python benchmarks/compile_probe.py --batch 2 --seq 256 --limit 60
    python benchmarks/compile_probe.py --only as_trained,sinkhorn_unrolled

Variants: the step as trained (Sinkhorn as a loop); Sinkhorn unrolled; without C4 layers; without C128
layers; window-only layers; 2 layers; the forward pass alone; and on a GPU, XLA autotuning off
and Triton GEMM fusion off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

CONFIG_CHANGES = {
    "as_trained": {},
    "sinkhorn_unrolled": {},
    "no_c4": {"compress_ratios": (0, 0, 0, 128, 0, 128, 0)},
    "no_c128": {"compress_ratios": (0, 0, 4, 0, 4, 0, 4)},
    "window_only": {"compress_ratios": (0,) * 7},
    "two_layers": {"num_hidden_layers": 2, "compress_ratios": (0, 4), "num_hash_layers": 1},
    "forward_only": {},
}
GPU_FLAGS = {"autotune_off": "--xla_gpu_autotune_level=0", "triton_gemm_off": "--xla_gpu_enable_triton_gemm=false"}


def probe(variant: str, batch: int, seq: int) -> dict:
    """Lower and compile one variant in this process; returns times and sizes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax import config as model_config
    from dspark_jax.model.deepseek_v4 import DeepSeekV4
    from dspark_jax.train.config import shipped
    from dspark_jax.train.optim import init_state, make_optimizer
    from dspark_jax.train.run import training_numerics
    from dspark_jax.train.target import make_target_eval, make_target_step

    cfg = model_config.shipped(dspark=False).replace(**CONFIG_CHANGES.get(variant, {}))
    run = shipped()
    num = training_numerics(jnp.bfloat16, **({"sinkhorn": "unrolled"} if variant == "sinkhorn_unrolled" else {}))
    model = DeepSeekV4(cfg, num, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.zeros((batch, seq), jnp.int32)
    if variant == "forward_only":
        fn, args = make_target_eval(graphdef), (params, rest, ids)
    else:
        dtypes = jax.tree.map(lambda x: x.dtype, params)
        tx = make_optimizer(run.target.optim, params)
        fn, args = make_target_step(graphdef, dtypes, tx), (init_state(params, tx), rest, ids, 1e-3)
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return {"variant": variant, "lower_s": t1 - t0, "compile_s": t2 - t1,
            "stablehlo_lines": lowered.as_text().count("\n"), "optimized_hlo_lines": compiled.as_text().count("\n"),
            "backend": jax.default_backend()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", help="run one variant in this process and print its JSON")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--limit", type=float, default=150.0, help="seconds per variant")
    ap.add_argument("--only", default=None, help="comma-separated variants (default: all)")
    args = ap.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(probe(args.variant, args.batch, args.seq)), flush=True)
        return

    import jax

    from benchmarks.common import environment, out_dir, write_json

    runs = [(v, "") for v in CONFIG_CHANGES]
    if jax.default_backend() == "gpu":
        runs += [(f"as_trained+{k}", flag) for k, flag in GPU_FLAGS.items()]
    if args.only:
        runs = [r for r in runs if r[0] in args.only.split(",")]
    results = []
    for name, flag in runs:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip())
        cmd = [sys.executable, __file__, "--variant", name.split("+")[0], "--batch", str(args.batch),
               "--seq", str(args.seq)]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.limit)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            r = json.loads(line[7:]) if line else {"error": p.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            r = {"error": f"not compiled within {args.limit:.0f} s"}
        r.update(variant=name, xla_flags=flag, process_s=time.perf_counter() - t0)
        results.append(r)
        print(json.dumps(r), flush=True)
    write_json("compile_probe.json", {"env": environment(), "batch": args.batch, "seq": args.seq,
                                      "results": results})


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
