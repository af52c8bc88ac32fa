"""Command line: dspark-jax generate | bench | convert | train."""

from __future__ import annotations

import argparse
import json
import sys
import time

from dspark_jax.decoding.generate import ROUNDS_PER_CALL

DESCRIPTION = """DeepSeek-V4 with DSpark speculative decoding (JAX / Flax NNX / Pallas).

Without --model, generate and bench use the small DeepSeek-V4 + DSpark pair shipped in
dspark_jax/assets/tiny. Compiled programs are kept on disk (~/.cache/dspark_jax/xla, or
$DSPARK_JAX_COMPILE_CACHE; "off" disables), so later runs start faster."""

EXAMPLES = """examples:
  dspark-jax generate --prompt "def quicksort(items):" --max-new-tokens 64
  echo "import json" | dspark-jax generate --temperature 0.8 --seed 1
  dspark-jax bench --repeats 3
  dspark-jax convert /data/DeepSeek-V4-Flash-DSpark /data/flash-bf16
  dspark-jax train /tmp/tiny --minutes 7"""


def user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that report a mistake in the command's input (arguments, files), not a bug."""
    from dspark_jax.api import InputError
    from dspark_jax.checkpoint.files import CheckpointFileError
    from dspark_jax.checkpoint.hf import CheckpointError
    from dspark_jax.config import ConfigError

    return InputError, CheckpointError, CheckpointFileError, ConfigError, OSError


def _sampling(args):
    from dspark_jax import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, seed=args.seed)


def _load(args):
    import jax.numpy as jnp

    import dspark_jax
    from dspark_jax.decoding.generate import default_model

    model = default_model() if args.model is None else dspark_jax.load(args.model, dtype=jnp.dtype(args.dtype))
    return dspark_jax.with_dense_copies(model) if args.dense_copies else model


def _read_prompt() -> str:
    if sys.stdin.isatty():
        print("reading the prompt from standard input; end it with Ctrl-D (or pass --prompt TEXT)", file=sys.stderr)
    return sys.stdin.read()


def cmd_generate(args) -> int:
    import dspark_jax

    sampling = _sampling(args)
    prompts = args.prompt or [_read_prompt()]
    model = _load(args)
    res = dspark_jax.generate(prompts, model=model, sampling=sampling, speculative=not args.no_speculative,
                              progress=True, rounds_per_call=args.rounds_per_call)
    for r in res:
        print(r.text if r.text is not None else r.tokens)
        s = r.stats
        print(f"[{len(r.tokens)} tokens, finish={r.finish_reason}, mean accept length {s['mean_accept_length']:.2f}, "
              f"{s['tokens_per_s']:.1f} tok/s decoding, compile {s['compile_s']:.1f} s]", file=sys.stderr)
    return 0


def speed_comparison(model, prompts, sampling, repeats: int = 1, progress: bool = False,
                     rounds_per_call: int = ROUNDS_PER_CALL) -> dict:
    """Speculative vs target-only decoding of the same prompts, measured in the same run (the first
    call of each mode compiles and is not timed). progress: phases and progress bars on stderr.
    rounds_per_call: ``generate``'s, for both modes."""
    from tqdm.auto import tqdm

    import dspark_jax
    from dspark_jax.decoding.generate import greedy_exact

    out = {}
    for name, spec in (("target_only", False), ("dspark", True)):
        if progress:
            print(f"{name}: first call (compiles unless cached)", file=sys.stderr)
        kw = dict(model=model, sampling=sampling, speculative=spec, rounds_per_call=rounds_per_call)
        dspark_jax.generate(prompts, progress=progress, **kw)
        times, res = [], None
        for _ in tqdm(range(repeats), desc=f"{name}: timed runs", disable=not progress, unit="run"):
            t0 = time.perf_counter()
            res = dspark_jax.generate(prompts, **kw)
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        n = sum(len(r.tokens) for r in res)
        out[name] = {"seconds": t, "tokens": n, "tokens_per_s": n / t, "results": res,
                     "mean_accept_length": sum(r.stats["mean_accept_length"] * r.stats["rounds"] for r in res
                                               if r.stats["rounds"]) / max(1, sum(r.stats["rounds"] for r in res))}
    out["speedup"] = out["dspark"]["tokens_per_s"] / out["target_only"]["tokens_per_s"]
    out["outputs_identical"] = all(a.tokens == b.tokens for a, b in zip(out["dspark"]["results"],
                                                                         out["target_only"]["results"]))
    out["greedy_exact"] = greedy_exact(model)
    return out


def cmd_bench(args) -> int:
    sampling = _sampling(args)
    print("loading the model", file=sys.stderr)
    model = _load(args)
    prompts = args.prompt or ["def fibonacci(n):", "import os\n\n\ndef main():"]
    r = speed_comparison(model, prompts, sampling, repeats=args.repeats, progress=True,
                         rounds_per_call=args.rounds_per_call)
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "results"} if isinstance(v, dict) else v
               for k, v in r.items()}
    print(json.dumps(summary, indent=2))
    return 0


def cmd_convert(args) -> int:
    import os
    import shutil

    import jax.numpy as jnp

    import dspark_jax
    from dspark_jax.checkpoint.hf import save_official

    model = dspark_jax.load(args.src, dtype=jnp.float32)
    save_official(model.module, args.dst)
    for name in ("tokenizer.json", "sts.json"):  # what load() reads besides config.json and the weights
        src, dst = os.path.join(args.src, name), os.path.join(args.dst, name)
        if os.path.exists(src) and not (os.path.exists(dst) and os.path.samefile(src, dst)):
            shutil.copyfile(src, dst)
    print(f"wrote {args.dst}")
    return 0


def cmd_train(args) -> int:
    from dspark_jax.train import __main__ as train_main

    return train_main.main([args.out] + (["--minutes", str(args.minutes)] if args.minutes else []))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dspark-jax", description=DESCRIPTION, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    helps = {"generate": "generate text for one or more prompts, with DSpark speculative decoding by default",
             "bench": "time DSpark against target-only decoding of the same prompts, as JSON"}
    for name in ("generate", "bench"):
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        p.add_argument("--model", default=None, metavar="DIR",
                       help="checkpoint directory in the official layout (default: the shipped model)")
        p.add_argument("--prompt", action="append", metavar="TEXT",
                       help="prompt text; repeat for a batch (default: " +
                            ("standard input)" if name == "generate" else "two built-in prompts)"))
        p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                       help="tokens to generate per prompt at most (default: %(default)s)")
        p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                       help="0 = greedy (default), > 0 = sampling at this temperature")
        p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                       help="nucleus sampling mass in (0, 1] (default: 1 = off)")
        p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest tokens (0 = off)")
        p.add_argument("--seed", type=int, default=None, help="random seed of sampled requests (default: fixed)")
        p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                       help="compute dtype of a --model checkpoint (default: %(default)s; greedy speculative "
                            "output equals target-only output token for token in float32 on the CPU, not in "
                            "bfloat16); the shipped model always runs in float32")
        p.add_argument("--dense-copies", action="store_true",
                       help="also hold the checkpoint's FP8 linears dequantised (twice their bytes more memory): "
                            "verify rounds of many requests and prefills multiply by the copies, faster on GPUs")
        p.add_argument("--rounds-per-call", type=int, default=ROUNDS_PER_CALL, metavar="K",
                       help="decoding rounds handed to the device per call, up to K (default: %(default)s); "
                            "the host's cost of a call is paid once per K rounds, the tokens are the same")
        if name == "generate":
            p.add_argument("--no-speculative", action="store_true", help="decode with the target model alone")
        else:
            p.add_argument("--repeats", type=int, default=3, metavar="N",
                           help="timed runs per mode after the first (compiling) one; the median is reported")
    p = sub.add_parser("convert", help="re-write a checkpoint in the official layout with bf16 weights",
                       description="Load a checkpoint directory (bf16, FP8 or FP4 weights) and write it again "
                                   "in the official layout with unquantised bf16 weights, with its "
                                   "tokenizer.json and sts.json.")
    p.add_argument("src", help="checkpoint directory to read")
    p.add_argument("dst", help="directory to write (created if needed)")
    p = sub.add_parser("train", help="train the tiny DeepSeek-V4 + DSpark pair from scratch",
                       description="Train the tiny DeepSeek-V4 target and its DSpark drafter on this Python's "
                                   "standard library sources, calibrate and export them (python -m dspark_jax.train "
                                   "has every option).")
    p.add_argument("out", help="output directory (the model lands in OUT/model)")
    p.add_argument("--minutes", type=float, default=None, help="training time budget in minutes")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cmd in ("generate", "bench"):
        from dspark_jax.compile_cache import enable_compile_cache
        enable_compile_cache()
    command = {"generate": cmd_generate, "bench": cmd_bench, "convert": cmd_convert, "train": cmd_train}[args.cmd]
    try:
        return command(args)
    except user_errors() as e:
        print(f"dspark-jax {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
