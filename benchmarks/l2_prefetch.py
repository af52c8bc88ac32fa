"""Weights read into the L2 ahead of their linear (``pallas_kernels.l2_prefetch``): does it pay
at a batch-1 decode step?

A chain of stages like a step's: a latency-bound kernel (one program spinning for a set time,
the stand-in for mHC, the norms or attention), then a one-row FP8 linear (``gemv``) on its
output, each stage on its own weight copy (together far more than the L2). Variants: ``plain``
(the chain as it is), ``prefetch`` (each stage's weight read by ``prefetch`` beside the spin,
the linear waiting for it), and the spins or the linears alone. Wall time per stage: calls
dispatched back to back (host time hidden), the median of ``--repeats`` batches, compiled with
the engine's options (``compile_cache.COMPILER_OPTIONS``: independent kernels run concurrently).

    PYTHONPATH=. OUT=out python benchmarks/l2_prefetch.py
    PYTHONPATH=. python benchmarks/l2_prefetch.py --smoke    # interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.common import environment, write_json
from benchmarks.gemm_decode import Shape, random_weights
from dspark_jax.compile_cache import COMPILER_OPTIONS
from pallas_kernels import backend
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.gemv import gemv, gemv_swiglu
from pallas_kernels.l2_prefetch import prefetch

LIMIT = 10.0


def _spin_kernel(y_ref, x0_ref, *refs, iters: int):
    o_ref = refs[-1]  # refs[:-1]: ordering inputs, not read
    v = y_ref[pl.ds(0, 1), pl.ds(0, 128)].astype(jnp.float32)
    v = jax.lax.fori_loop(0, iters, lambda i, v: v * 0.999 + 1e-3, v)  # a dependent chain: latency only
    k = x0_ref.shape[1]
    for c in range(0, k, 128):
        o_ref[pl.ds(0, 1), pl.ds(c, 128)] = (x0_ref[pl.ds(0, 1), pl.ds(c, 128)].astype(jnp.float32)
                                             + v * 1e-30).astype(o_ref.dtype)


def spin(y, x0, iters: int, interpret: bool, after=()):
    """x0 (+ 1e-30 of a value from y's first 128 columns after ``iters`` dependent steps): one
    program, one warp."""
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(functools.partial(_spin_kernel, iters=iters), grid=(1,),
                              out_shape=jax.ShapeDtypeStruct(x0.shape, x0.dtype), interpret=interpret,
                              compiler_params=backend.compiler_params(1, 1), name="spin")(y, x0, *after)


def stage_linear(shape: Shape, x, ws, after):
    if shape.swiglu:
        return gemv_swiglu(gm.QuantRows(x), ws[0], ws[1], np.zeros((1,), np.int32), limit=LIMIT, after=after)
    return gemv(gm.QuantRows(x), ws[0], np.zeros((1,), np.int32), out_dtype=jnp.bfloat16, after=after)


def chain(variant: str, shape: Shape, iters: int, programs: int, interpret: bool):
    def run(x0, sets):
        y, pending = x0, ()
        for ws in sets:
            tok = ()
            if variant.startswith("prefetch"):
                tok = (prefetch(tuple(w.values for w in ws), y, programs=programs, interpret=interpret),)
            if variant == "prefetch_nowait":  # the linear does not wait: the next stage's spin does
                tok, pending = (), tok
            x = spin(y, x0, iters, interpret, pending) if variant != "linears" else x0 + y[:, :1] * 0
            y = stage_linear(shape, x, ws, tok) if variant != "spins" else x
        return y if not pending else (y, pending)
    return jax.jit(run, compiler_options=COMPILER_OPTIONS if not interpret else None)


def per_stage_us(fn, args, stages: int, batch: int, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(batch)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / batch / stages * 1e6)
    return float(np.median(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=12)
    ap.add_argument("--iters", default="0,500,1500", help="spin lengths (dependent steps)")
    ap.add_argument("--programs", default="32,64,128", help="prefetch launch sizes")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    interpret = backend.interpret_mode(None)
    d, i, h, hd, q = 4096, 2048, 64, 512, 1024
    shapes = ([Shape("linear", "fp8", 256, 512, 1, 1)] if args.smoke else
              [Shape("attn.wq_b", "fp8", h * hd, q, 1, 1), Shape("attn.wo_b", "fp8", d, 8 * q, 1, 1),
               Shape("shared w1 + w3 swiglu", "fp8", i, d, 1, 1, swiglu=True)])
    stages = 2 if args.smoke else args.stages
    out = {"env": environment(), "method": __doc__.split("\n\n")[1], "stages": stages, "rows": []}
    print(out["env"], flush=True)
    for si, shape in enumerate(shapes):
        keys = jax.random.split(jax.random.key(si), stages * 2 + 1)
        sets = [tuple(random_weights(keys[2 * c + j], shape) for j in range(2 if shape.swiglu else 1))
                for c in range(stages)]
        x0 = jax.random.normal(keys[-1], (1, shape.k), jnp.bfloat16)
        want = None
        for iters in [int(v) for v in args.iters.split(",")]:
            variants = [("spins", 0), ("linears", 0), ("plain", 0)] + [
                (v, int(p)) for p in args.programs.split(",") for v in ("prefetch", "prefetch_nowait")]
            for variant, programs in variants:
                if variant == "linears" and iters != int(args.iters.split(",")[0]):
                    continue
                fn = chain(variant, shape, iters, programs, interpret)
                got = fn(x0, sets)
                got = got[0] if isinstance(got, tuple) else got
                if variant in ("plain", "prefetch", "prefetch_nowait"):  # the prefetch changes no value
                    got = np.asarray(got, np.float32)
                    if want is None:
                        want = got
                    if not np.array_equal(got, want):
                        raise AssertionError(f"{shape.name}: {variant} changed the chain's output")
                us = (float("nan") if args.smoke else
                      per_stage_us(fn, (x0, sets), stages, args.batch, args.repeats))
                row = {"shape": shape.name, "weight_MB": shape.weight_bytes_per_tile * shape.groups / 1e6, "iters": iters, "variant": variant, "programs": programs,
                    "us_per_stage": us}
                out["rows"].append(row)
                print(f"{shape.name:24s} spin {iters:5d} {variant:9s} P {programs:4d} {us:8.2f} us/stage", flush=True)
                write_json("l2_prefetch.json", out)
        del sets
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
