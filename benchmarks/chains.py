"""Chained products at one token in one launch against the launches they replace, at
DeepSeek-V4-Flash shapes: the attention's output projection, wo_a then wo_b (FP8, 8 groups of 1024
x 4096, then 4096 x 8192; ``pallas_kernels.gemv_chain`` against two ``gemv`` launches), and a
decode step's routed experts, the SwiGLU, its quantisation and w2 (``fp8_k128``, 6 pairs in their
own 16-row tiles; ``pallas_kernels.grouped_chain`` against the grouped matmul's three launches).

Correctness on the device first: the one launch's output must equal the launches' bit for bit for
``--checks`` calls on other rows each (a program that read rows before they were written would
show); for wo_a / wo_b with the library's tiles and with a K split of wo_b whose programs read two
rows of wo_a.

Timing: one program runs ``--copies`` x ``--loops`` products in sequence, each on its own weights
(wo_a / wo_b: a weight copy each; the experts: 6 other experts of 48 each), together more than the
L2, each taking its rows from the previous product (XLA fusions between them, as mHC's kernel
consumes the product in the model); calls queued back to back, wall time per product. The
variants are timed in rotating order (pass p starts at the p-th), and the paired differences per
pass are reported with the medians.

    PYTHONPATH=. OUT=out python benchmarks/chains.py
    PYTHONPATH=. python benchmarks/chains.py --smoke    # small shapes, interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import ceilings, environment, write_json
from benchmarks.gemm_decode import Shape, random_weights
from pallas_kernels import gemv_chain, grouped_chain
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.gemv import GemvConfig

LIMIT = 10.0
BM = 16


class OutProjection:
    """wo_a then wo_b: x [8, 4096] bf16 -> wo_b's partial sums."""

    name = "attn.wo_a + wo_b"

    def __init__(self, smoke: bool, copies: int, key):
        self.s1, self.s2 = ((Shape("wo_a", "fp8", 256, 512, 4, 4), Shape("wo_b", "fp8", 128, 1024, 1, 1)) if smoke
                            else (Shape("wo_a", "fp8", 1024, 4096, 8, 8), Shape("wo_b", "fp8", 4096, 8192, 1, 1)))
        keys = jax.random.split(key, 2 * copies + 1)
        self.sets = [(random_weights(keys[2 * c], self.s1), random_weights(keys[2 * c + 1], self.s2))
                     for c in range(copies)]
        self.x = jax.random.normal(keys[-1], (self.s1.groups, self.s1.k), jnp.bfloat16)
        self.bytes = self.s1.weight_bytes_per_tile * self.s1.groups + self.s2.weight_bytes_per_tile

    def product(self, one: bool, x, c: int, **kw):
        w1, w2 = self.sets[c % len(self.sets)]
        fn = gemv_chain.gemv_chain if one else gemv_chain.reference
        return fn(x, w1, w2, mid_dtype=jnp.bfloat16, **kw).total()  # [1, N2]

    def next_rows(self, x, y):
        return (x.astype(jnp.float32) * 0.5 + 1e-4 * y[:, :x.shape[1]]).astype(x.dtype)

    def checks(self):
        return [dict(config2=None), dict(config2=GemvConfig(split_k=4))]  # wo_b's programs over one / two rows

    def variants(self):
        return {"one launch": {}}


class RoutedExperts:
    """A decode step's 6 routed pairs: rows [6 x 16, 4096] quantised -> w2's rows [96, 4096]."""

    name = "routed experts (6 pairs)"

    def __init__(self, smoke: bool, copies: int, key):
        d, i, self.groups = (512, 256, 12) if smoke else (4096, 2048, 8 * copies if copies > 1 else 12)
        self.tiles = 6
        k1, k2, k3, kx, kr = jax.random.split(key, 5)
        up = Shape("w13", "fp8_k128", i, d, self.groups, 6)
        self.w1, self.w3 = random_weights(k1, up), random_weights(k2, up)
        self.w2 = random_weights(k3, Shape("w2", "fp8_k128", d, i, self.groups, 6))
        rows = self.tiles * BM
        self.x = jax.random.normal(kx, (rows, d), jnp.bfloat16)
        rw = jnp.zeros((rows,), jnp.float32).at[::BM].set(jax.random.uniform(kr, (self.tiles,), minval=0.1))
        self.rw, self.num_tiles = rw, jnp.asarray([self.tiles], jnp.int32)
        self.bytes = self.tiles * 3 * (i * d + i * d // 128)

    def product(self, one: bool, x, c: int, **kw):
        tg = (jnp.arange(self.tiles, dtype=jnp.int32) + self.tiles * c) % self.groups  # 6 other experts each
        args = (gm.ActQuant.of(x), self.w1, self.w3, self.w2, self.rw, tg, self.num_tiles)
        if one:
            return grouped_chain.swiglu_down(*args, block_m=BM, limit=LIMIT, **kw)
        return grouped_chain.reference(*args, block_m=BM, limit=LIMIT)

    def next_rows(self, x, y):
        return (x.astype(jnp.float32) * 0.5 + 1e-3 * y.astype(jnp.float32)).astype(x.dtype)

    def checks(self):
        return [{}, dict(num_stages=2)]

    def variants(self):
        return {"one launch": {}, "one launch, 2 stages": dict(num_stages=2)}


def check(case, calls: int, kw: dict) -> dict:
    """Calls of both on other rows each; every one compared bit for bit."""
    one = jax.jit(lambda x: case.product(True, x, 0, **kw))
    two = jax.jit(lambda x: case.product(False, x, 0, **kw))
    bad, largest = 0, 0.0
    for c in range(calls):
        xc = (case.x.astype(jnp.float32) * (1.0 + c / 7.0)).astype(case.x.dtype)
        got, want = np.asarray(one(xc), np.float32), np.asarray(two(xc), np.float32)
        largest = max(largest, float(np.abs(want).max()))
        bad += int(not np.array_equal(got, want))
    return {"options": {k: str(v) for k, v in kw.items()}, "calls": calls, "unequal_calls": bad,
            "largest_output": largest}


def program(case, one: bool, copies: int, loops: int, **kw):
    """``copies * loops`` products in sequence, product i on weights i mod copies, its rows from
    the previous product's output."""
    def run(x):
        for _ in range(loops):
            for c in range(copies):
                x = case.next_rows(x, case.product(one, x, c, **kw))
        return x
    return jax.jit(run)


def time_case(case, args) -> dict:
    progs = {"launches": program(case, False, args.copies, args.loops),
             **{n: program(case, True, args.copies, args.loops, **kw) for n, kw in case.variants().items()}}
    products = args.copies * args.loops * args.calls
    for name, p in progs.items():
        t0 = time.time()
        jax.block_until_ready(p(case.x))
        print(f"{case.name} / {name}: compiled and ran in {time.time() - t0:.1f} s", flush=True)
    names = list(progs)
    times = {n: [] for n in names}
    for p_i in range(args.passes):
        for n in names[p_i % len(names):] + names[:p_i % len(names)]:
            y = case.x
            t0 = time.perf_counter()
            for _ in range(args.calls):
                y = progs[n](y)
            jax.block_until_ready(y)
            times[n].append((time.perf_counter() - t0) / products * 1e6)
    us = {n: float(np.median(v)) for n, v in times.items()}
    paired = {}
    for n in names[1:]:
        diff = np.asarray(times[n]) - np.asarray(times["launches"])
        paired[n] = {"median": float(np.median(diff)), "quartiles": np.percentile(diff, [25, 75]).tolist(),
                     "faster_share": float(np.mean(diff < 0))}
    return {"us_per_product": us, "passes_us": times, "bytes_per_product": case.bytes,
            "GBps": {n: case.bytes / v / 1e3 for n, v in us.items()}, "minus_launches_us": paired}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checks", type=int, default=20)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--calls", type=int, default=10, help="calls queued per timing")
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--only", default="", help="comma-separated cases in the order to run: out, experts")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    env = environment()
    ceil = ceilings(0.0625, 512) if args.smoke else ceilings()
    print(env, ceil, flush=True)
    out = {"env": env, "ceilings": ceil, "method": __doc__.split("\n\n")[1:4], "cases": []}
    kinds = {"out": OutProjection, "experts": RoutedExperts}
    for key in args.only.split(",") if args.only else kinds:
        kind = kinds[key]
        case = kind(args.smoke, 2 if args.smoke else args.copies, jax.random.key(len(out["cases"])))
        row = {"name": case.name, "checks": []}
        out["cases"].append(row)
        for kw in case.checks():
            row["checks"].append(check(case, 2 if args.smoke else args.checks, kw))
            print(case.name, "check", row["checks"][-1], flush=True)
        write_json("chains.json", out)
        if args.smoke or any(c["unequal_calls"] for c in row["checks"]):
            continue
        row.update(time_case(case, args))
        print(case.name, {k: row[k] for k in ("us_per_product", "minus_launches_us", "GBps")}, flush=True)
        write_json("chains.json", out)
        del case
    return 0 if all(c["unequal_calls"] == 0 for r in out["cases"] for c in r["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
