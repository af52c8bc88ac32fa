"""mHC's gates + Sinkhorn on the device: the Pallas kernel against the XLA forms (unrolled
iterations, loop), same inputs, with the kernel's deviation from the reference.

    python benchmarks/hc_weights.py            # writes hc_weights.json under $OUT
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_time, environment, write_json
from pallas_kernels import hc_weights

N, ITERS, EPS = 4, 20, 1e-6


def main():
    env = environment()
    print(env, flush=True)
    rows = []
    for tokens in (1, 6, 64, 2048, 8192):
        z = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, (2 + N) * N)).astype(np.float32) * 3)
        forms = {
            "kernel": lambda z: hc_weights.weights_kernel(z, n=N, iters=ITERS, eps=EPS)[2],
            "xla_unrolled": lambda z: hc_weights.weights_reference(z, n=N, iters=ITERS, eps=EPS, unroll=True)[2],
            "xla_loop": lambda z: hc_weights.weights_reference(z, n=N, iters=ITERS, eps=EPS, unroll=False)[2],
        }
        row = {"tokens": tokens}
        ref = np.asarray(jax.jit(forms["xla_loop"])(z))
        for name, fn in forms.items():
            t0 = time.time()
            out = np.asarray(jax.jit(fn)(z))
            row[f"{name}_compile_and_first_s"] = time.time() - t0
            row[f"{name}_max_abs_err"] = float(np.abs(out - ref).max())
            row[f"{name}_us"] = 1e6 * device_time(fn, z)
        rows.append(row)
        print(row, flush=True)
        write_json("hc_weights.json", {"env": env, "results": rows})


if __name__ == "__main__":
    main()
