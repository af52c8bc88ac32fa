"""The cost of one more kernel on a chain of dependent kernels: what a decode step pays per launch
that moves (almost) no bytes, whatever that kernel computes.

One program chains ``--chain`` Pallas kernels, each taking the previous one's output row (so no
two can run at the same time), compiled with the decoding programs' XLA options
(``compile_cache.COMPILER_OPTIONS``: command buffers, concurrent scheduling). Each kernel runs
``P`` programs; program i adds the sum of its own weight tile ``[R, 128]`` (bf16) to its 128
columns of the row, so a kernel reads ``P R 256`` bytes of weights (R = 0: the row alone).
Measured per kernel:

- ``span_us``: the program's device span (first kernel's start to last kernel's end, in a
  profiler trace) / chain: what one more dependent kernel adds to a step;
- ``kernel_us``: the kernels' own durations / chain (on an H100 ~0.15 us above the span: the
  recorded times of consecutive kernels overlap, so no gap between them shows);
- ``wall_us``: wall time of ``--calls`` back-to-back calls / (calls x chain).

``--pdl off,on`` measures each chain again with XLA's programmatic dependent launch off / on (the
compiler option ``xla_gpu_enable_pdl``; the engine's options state it on).

A byte-free kernel's span is the floor under each of a step's small kernels on the chain (norms,
the router, the selection, mHC's units); the weight sizes show how a kernel's time grows from
that floor to a bandwidth-bound read.

    PYTHONPATH=. OUT=out python benchmarks/launch_floor.py
    PYTHONPATH=. python benchmarks/launch_floor.py --smoke    # interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.common import ceilings, environment, with_pdl, write_json
from benchmarks.profile_step import profiler_trace, trace_events
from dspark_jax.compile_cache import COMPILER_OPTIONS
from pallas_kernels import backend

WIDTH = 128  # columns of the row per program
CHUNK = 32  # weight rows per loop step


def _add_tile_sums(x_ref, w_ref, o_ref):
    """o[:, i] = x[:, i] + the sum of program i's weight rows (float32), over its 128 columns."""
    i = pl.program_id(0)
    cols = pl.ds(i * WIDTH, WIDTH)
    row = x_ref[pl.ds(0, 1), cols]
    if w_ref is not None:  # in chunks of at most 32 rows
        rows = w_ref.shape[1]
        chunk = min(rows, CHUNK)

        def add(c, acc):
            return acc + w_ref[i, pl.ds(c * chunk, chunk), :].astype(jnp.float32)

        acc = jax.lax.fori_loop(0, rows // chunk, add, jnp.zeros((chunk, WIDTH), jnp.float32))
        row = row + jnp.sum(acc, axis=0, keepdims=True)
    o_ref[pl.ds(0, 1), cols] = row


def one_kernel(x, w, *, interpret: bool):
    """One launch of ``P`` programs: x [1, P 128] float32, w [P, R, 128] bf16 or None."""
    programs = x.shape[1] // WIDTH
    kernel = _add_tile_sums if w is not None else (lambda x_ref, o_ref: _add_tile_sums(x_ref, None, o_ref))
    args = (x,) if w is None else (x, w)
    return pl.pallas_call(kernel, grid=(programs,), out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                          interpret=interpret, compiler_params=backend.compiler_params(4, 1),
                          name="chained")(*args)


def chain(x, ws, *, interpret: bool):
    """``len(ws)`` dependent launches (each kernel's weights its own: none is read twice)."""
    for w in ws:
        x = one_kernel(x, w, interpret=interpret)
    return x


def reference(x, ws):
    for w in ws:
        if w is not None:
            x = x + jnp.sum(w.astype(jnp.float32), axis=1).reshape(1, -1)
    return x


def measure(programs: int, rows: int, length: int, calls: int, interpret: bool, trace_root: str,
            pdl: str = "default") -> dict:
    key = jax.random.key(programs * 1000 + rows)
    x = jax.random.normal(key, (1, programs * WIDTH), jnp.float32)
    ws = [jax.random.normal(jax.random.fold_in(key, j), (programs, rows, WIDTH), jnp.bfloat16) if rows else None
          for j in range(length)]

    def program(x, ws):
        return chain(x, ws, interpret=interpret)

    program.__name__ = f"chain_{programs}x{rows}_pdl_{pdl}"  # the module's name (in dumps and traces)
    options = None if interpret else with_pdl(COMPILER_OPTIONS, pdl)
    compiled = jax.jit(program).lower(x, ws).compile(compiler_options=options)
    got = np.asarray(compiled(x, ws))
    want = np.asarray(reference(x, ws))
    rec = {"programs": programs, "rows": rows, "xla_pdl": pdl, "weight_bytes_per_kernel": programs * rows * WIDTH * 2,
           "chain": length, "max_abs_err": float(np.abs(got - want).max()),
           "scale": float(np.abs(want).max())}
    if interpret:
        return rec
    for _ in range(3):
        jax.block_until_ready(compiled(x, ws))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = compiled(x, ws)
    jax.block_until_ready(out)
    rec["wall_us"] = (time.perf_counter() - t0) / calls / length * 1e6
    out_dir = tempfile.mkdtemp(dir=trace_root)
    with profiler_trace(out_dir):
        for _ in range(calls):
            jax.block_until_ready(compiled(x, ws))
    files = sorted(glob.glob(os.path.join(out_dir, "**", "*.xplane.pb"), recursive=True))
    module = compiled.as_text().split(",")[0].split()[-1]
    events, source = trace_events(files[-1], module)
    events = [e for e in events if "chained" in e.kernel or "chained" in e.hlo_op] or events
    events.sort(key=lambda e: e.start_ns)
    spans, kernels = [], []
    for c in range(len(events) // length):  # one call = ``length`` consecutive kernels
        run = events[c * length:(c + 1) * length]
        spans.append(run[-1].start_ns + run[-1].dur_ns - run[0].start_ns)
        kernels.append(sum(e.dur_ns for e in run))
    rec.update(span_us=float(np.median(spans)) / length / 1e3, kernel_us=float(np.median(kernels)) / length / 1e3,
               traced_calls=len(spans), events=len(events), source=source)
    rec["GBps"] = rec["weight_bytes_per_kernel"] / rec["span_us"] / 1e3
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="1,128", help="programs per kernel, comma-separated")
    ap.add_argument("--rows", default="0,8,64,512", help="weight rows per program, comma-separated (0: none)")
    ap.add_argument("--chain", type=int, default=64, help="dependent kernels per program")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--pdl", default="default",
                    help="XLA's programmatic dependent launch for each run, comma-separated: default (the decoding "
                         "programs' options as they are), on, off (``benchmarks.common.with_pdl``)")
    ap.add_argument("--smoke", action="store_true", help="small chain in interpret mode (CPU)")
    args = ap.parse_args(argv)
    interpret = args.smoke or jax.default_backend() == "cpu"
    length = 3 if args.smoke else args.chain
    env = environment()
    ceil = {} if interpret else ceilings()
    print(env, ceil, flush=True)
    out = {"env": env, "ceilings": ceil, "method": __doc__.split("\n\n")[1], "rows": []}
    trace_root = tempfile.mkdtemp(prefix="dspark_launch_floor_")
    runs = [(pdl, int(p), int(r)) for pdl in args.pdl.split(",") for p in args.programs.split(",")
            for r in args.rows.split(",")]
    for pdl, programs, rows in runs:
        rec = measure(programs, rows, length, args.calls, interpret, trace_root, pdl)
        if rec["max_abs_err"] > 1e-4 * max(rec["scale"], 1.0):
            raise AssertionError(f"chain of {programs} x {rows} rows: max error {rec['max_abs_err']}")
        out["rows"].append(rec)
        timed = (f"span {rec['span_us']:6.2f} us, kernel {rec['kernel_us']:6.2f} us, wall {rec['wall_us']:6.2f} us "
                 f"per kernel, {rec['GBps']:6.0f} GB/s" if "span_us" in rec else "values checked")
        print(f"pdl {pdl:7s} programs {programs:4d} weight rows {rows:4d} "
              f"({rec['weight_bytes_per_kernel'] / 1e6:7.3f} MB): {timed}", flush=True)
        write_json("launch_floor.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
