"""Command line: ``dspark-jax generate | bench | convert | train``."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _sampling(args):
    from dspark_jax import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, seed=args.seed)


def _load(args):
    import jax.numpy as jnp

    import dspark_jax
    from dspark_jax.decoding.generate import default_model

    if args.model is None:
        return default_model()
    return dspark_jax.load(args.model, dtype=jnp.dtype(args.dtype))


def cmd_generate(args) -> int:
    import dspark_jax

    model = _load(args)
    prompts = args.prompt or [sys.stdin.read()]
    res = dspark_jax.generate(prompts, model=model, sampling=_sampling(args), speculative=not args.no_speculative,
                              progress=True)
    for r in res:
        print(r.text if r.text is not None else r.tokens)
        s = r.stats
        print(f"[{len(r.tokens)} tokens, finish={r.finish_reason}, mean accept length "
              f"{s['mean_accept_length']:.2f}, {s['tokens_per_s']:.1f} tok/s]", file=sys.stderr)
    return 0


def speed_comparison(model, prompts, sampling, repeats: int = 1) -> dict:
    """Speculative vs target-only decoding of the same prompts, measured in the same run (the first
    call of each mode compiles and is not timed)."""
    import dspark_jax

    out = {}
    for name, spec in (("target_only", False), ("dspark", True)):
        dspark_jax.generate(prompts, model=model, sampling=sampling, speculative=spec)  # compile
        times, res = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = dspark_jax.generate(prompts, model=model, sampling=sampling, speculative=spec)
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        n = sum(len(r.tokens) for r in res)
        out[name] = {"seconds": t, "tokens": n, "tokens_per_s": n / t, "results": res,
                     "mean_accept_length": sum(r.stats["mean_accept_length"] * r.stats["rounds"] for r in res
                                               if r.stats["rounds"]) / max(1, sum(r.stats["rounds"] for r in res))}
    out["speedup"] = out["dspark"]["tokens_per_s"] / out["target_only"]["tokens_per_s"]
    return out


def cmd_bench(args) -> int:
    model = _load(args)
    prompts = args.prompt or ["def fibonacci(n):", "import os\n\n\ndef main():"]
    r = speed_comparison(model, prompts, _sampling(args), repeats=args.repeats)
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "results"} if isinstance(v, dict) else v
               for k, v in r.items()}
    print(json.dumps(summary, indent=2))
    return 0


def cmd_convert(args) -> int:
    import jax.numpy as jnp

    import dspark_jax
    from dspark_jax.checkpoint.hf import save_official

    model = dspark_jax.load(args.src, dtype=jnp.float32)
    save_official(model.module, args.dst)
    print(f"wrote {args.dst}")
    return 0


def cmd_train(args) -> int:
    from dspark_jax.train import __main__ as train_main

    return train_main.main([args.out] + (["--minutes", str(args.minutes)] if args.minutes else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dspark-jax", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("generate", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
        p.add_argument("--prompt", action="append", help="prompt text (repeatable; default stdin / built-in)")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--dtype", default="float32")
        if name == "generate":
            p.add_argument("--no-speculative", action="store_true")
        else:
            p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("convert", help="re-write a checkpoint in the official layout")
    p.add_argument("src")
    p.add_argument("dst")
    p = sub.add_parser("train", help="train the tiny DeepSeek-V4 + DSpark pair")
    p.add_argument("out")
    p.add_argument("--minutes", type=float, default=None)
    args = ap.parse_args(argv)
    if args.cmd in ("generate", "bench"):
        from dspark_jax.compile_cache import enable_compile_cache
        enable_compile_cache()
    return {"generate": cmd_generate, "bench": cmd_bench, "convert": cmd_convert, "train": cmd_train}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
