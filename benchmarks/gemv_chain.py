"""The attention's output projection at one token, wo_a then wo_b: two ``gemv`` launches against
one (``pallas_kernels.gemv_chain``), at DeepSeek-V4-Flash shapes (FP8, 8 groups of 1024 x 4096,
then 4096 x 8192).

Correctness on the device first: the one launch's partial sums must equal the two launches' bit
for bit for ``--checks`` calls on other rows each (a second-linear program that read rows before
they were written would show), with the library's tiles and with a K split of the second linear
whose programs read two rows of the first.

Timing: one program runs ``--copies`` x ``--loops`` products in sequence, each on its own weight
copy (together more than the L2) and each taking its rows from the previous product (an XLA
fusion between them, as mHC's kernel consumes the product in the model); calls queued back to
back, wall time per product. The variants are timed in rotating order (pass p starts at the
p-th), and the paired differences per pass are reported with the medians.

    PYTHONPATH=. OUT=out python benchmarks/gemv_chain.py
    PYTHONPATH=. python benchmarks/gemv_chain.py --smoke    # small shapes, interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import ceilings, environment, write_json
from benchmarks.gemm_decode import Shape, random_weights
from pallas_kernels import gemv_chain
from pallas_kernels.gemv import GemvConfig


def shapes(smoke: bool) -> tuple[Shape, Shape]:
    if smoke:
        return Shape("wo_a", "fp8", 256, 512, 4, 4), Shape("wo_b", "fp8", 128, 1024, 1, 1)
    return Shape("attn.wo_a (8 groups)", "fp8", 1024, 4096, 8, 8), Shape("attn.wo_b", "fp8", 4096, 8192, 1, 1)


VARIANTS = {"two launches": gemv_chain.reference, "one launch": gemv_chain.gemv_chain}


def check(x, w1, w2, calls: int, config2: GemvConfig | None) -> dict:
    """Calls of both on other rows each; every one compared bit for bit."""
    one = jax.jit(lambda x: gemv_chain.gemv_chain(x, w1, w2, mid_dtype=jnp.bfloat16, config2=config2).parts)
    two = jax.jit(lambda x: gemv_chain.reference(x, w1, w2, mid_dtype=jnp.bfloat16, config2=config2).parts)
    bad, largest = 0, 0.0
    for c in range(calls):
        xc = (x.astype(jnp.float32) * (1.0 + c / 7.0)).astype(x.dtype)
        got, want = np.asarray(one(xc)), np.asarray(two(xc))
        largest = max(largest, float(np.abs(want).max()))
        bad += int(not np.array_equal(got, want))
    return {"config2": None if config2 is None else str(config2), "calls": calls, "unequal_calls": bad,
            "largest_output": largest}


def program(fn, copies: int, loops: int):
    """``copies * loops`` products in sequence, product i on weight copy i mod copies, its rows
    from the previous product's output."""
    def run(x, sets):
        for _ in range(loops):
            for w1, w2 in sets:
                y = fn(x, w1, w2, mid_dtype=jnp.bfloat16).total()  # [1, N2]
                x = (x.astype(jnp.float32) * 0.5 + 1e-4 * y[:, :x.shape[1]]).astype(x.dtype)
        return x
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checks", type=int, default=20)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--calls", type=int, default=10, help="calls queued per timing")
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    env = environment()
    s1, s2 = shapes(args.smoke)
    ceil = ceilings(0.0625, 512) if args.smoke else ceilings()
    print(env, ceil, flush=True)
    keys = jax.random.split(jax.random.key(0), 2 * args.copies + 1)
    sets = [(random_weights(keys[2 * c], s1), random_weights(keys[2 * c + 1], s2)) for c in range(args.copies)]
    x = jax.random.normal(keys[-1], (s1.groups, s1.k), jnp.bfloat16)
    w1, w2 = sets[0]
    out = {"env": env, "ceilings": ceil, "method": __doc__.split("\n\n")[1:3], "shapes": [str(s1), str(s2)],
           "configs": [str(c) for c in gemv_chain.configs(s1.groups, w1, w2)], "checks": []}
    for config2 in (None, GemvConfig(split_k=4)):
        out["checks"].append(check(x, w1, w2, 2 if args.smoke else args.checks, config2))
        print("check", out["checks"][-1], flush=True)
    write_json("gemv_chain.json", out)
    if args.smoke:
        return 0 if all(c["unequal_calls"] == 0 for c in out["checks"]) else 1
    progs = {name: program(fn, args.copies, args.loops) for name, fn in VARIANTS.items()}
    products = args.copies * args.loops * args.calls
    for name, p in progs.items():
        t0 = time.time()
        jax.block_until_ready(p(x, sets))
        print(f"{name}: compiled and ran in {time.time() - t0:.1f} s", flush=True)
    names = list(progs)
    times = {n: [] for n in names}
    for p_i in range(args.passes):
        for n in names[p_i % len(names):] + names[:p_i % len(names)]:
            y = x
            t0 = time.perf_counter()
            for _ in range(args.calls):
                y = progs[n](y, sets)
            jax.block_until_ready(y)
            times[n].append((time.perf_counter() - t0) / products * 1e6)
    bytes_per = (s1.weight_bytes_per_tile * s1.groups + s2.weight_bytes_per_tile)
    out["us_per_product"] = {n: float(np.median(v)) for n, v in times.items()}
    out["passes_us"] = times
    diff = np.asarray(times["one launch"]) - np.asarray(times["two launches"])
    out["one_minus_two_us"] = {"median": float(np.median(diff)), "quartiles": np.percentile(diff, [25, 75]).tolist(),
                               "faster_share": float(np.mean(diff < 0))}
    out["bytes_per_product"] = bytes_per
    out["GBps"] = {n: bytes_per / v / 1e3 for n, v in out["us_per_product"].items()}
    print({k: out[k] for k in ("us_per_product", "one_minus_two_us", "GBps")}, flush=True)
    write_json("gemv_chain.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
