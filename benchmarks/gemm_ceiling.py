"""What a Pallas (Triton) bf16 matmul reaches on this device, against XLA's own GEMM.

The MoE kernel's prefill regime is a grouped GEMM built from Pallas dots; this script measures the
ceiling of the same building block without grouping: a dense [M, K] @ [K, N] bf16 matmul with fp32
accumulation, tiled like the MoE kernel (row tiles of 32-128, column tiles of 64-256), for the
shapes of one Flash expert projection summed over a 8192-token prefill (M = 8192 x 6 = 49152
rows, K = 4096, N = 2048) and of a square 8192 matmul. Writes gemm_ceiling.json under $OUT.

    python benchmarks/gemm_ceiling.py
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.common import environment, median_time, write_json
from pallas_kernels import backend


def _mm_kernel(x_ref, w_ref, o_ref, *, block_k: int):
    k = x_ref.shape[1]

    def body(i, acc):
        xs = x_ref[:, pl.ds(i * block_k, block_k)]
        ws = w_ref[pl.ds(i * block_k, block_k), :]
        return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k // block_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bm", "bn", "bk", "warps", "stages"))
def pallas_matmul(x, w, *, bm: int, bn: int, bk: int, warps: int, stages: int):
    m, k = x.shape
    n = w.shape[1]
    with backend.quiet_triton_deprecation():
        return pl.pallas_call(
            functools.partial(_mm_kernel, block_k=bk),
            grid=(m // bm, n // bn),
            in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((k, bn), lambda i, j: (0, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
            compiler_params=backend.compiler_params(warps, stages),
            name="gemm_ceiling",
        )(x, w)


def main():
    env = environment()
    print(env, flush=True)
    rows = []
    for m, k, n in ((49152, 4096, 2048), (8192, 8192, 8192)):
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
        flops = 2 * m * k * n
        t = median_time(jax.jit(lambda a, b: a @ b), x, w)
        row = {"shape": [m, k, n], "xla_TFLOPs": flops / t / 1e12, "pallas": []}
        print(row, flush=True)
        for bm, bn, bk, warps, stages in itertools.product((64, 128), (128, 256), (64,), (4, 8), (3, 4)):
            try:
                t = median_time(functools.partial(pallas_matmul, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages),
                                x, w, repeat=5)
                r = {"bm": bm, "bn": bn, "bk": bk, "warps": warps, "stages": stages, "TFLOPs": flops / t / 1e12}
            except Exception as e:  # a tile that does not fit the shared memory is reported, not fatal
                r = {"bm": bm, "bn": bn, "bk": bk, "warps": warps, "stages": stages, "error": str(e)[:200]}
            row["pallas"].append(r)
            print(r, flush=True)
        best = max((r for r in row["pallas"] if "TFLOPs" in r), key=lambda r: r["TFLOPs"], default=None)
        row["pallas_best"] = best
        rows.append(row)
        write_json("gemm_ceiling.json", {"env": env, "results": rows})


if __name__ == "__main__":
    main()
