"""The indexer's top-k on the device: the rank kernel (``pallas_kernels.top_k``) under a few tiles
against XLA's ``lax.top_k``, k = 512 of n scores per row (n: a C4 layer's compressed entries,
context / 4), rows = the queries of a step (batch x tokens).

Device time per call from a profiler trace of ``--calls`` calls of each compiled program (as
``benchmarks/hc_fused.py``), and whether the kernel's indices equal XLA's on the device.

    PYTHONPATH=. OUT=out python benchmarks/top_k.py
    PYTHONPATH=. python benchmarks/top_k.py --smoke     # small rows on CPU (interpret mode)
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, write_json
from benchmarks.hc_fused import compile_highest, device_times
from pallas_kernels import top_k

CONFIGS = tuple(top_k.TopKConfig(block_i=i, block_j=j, num_warps=w)
                for i, j, w in ((32, 256, 4), (16, 256, 4), (64, 256, 4), (32, 512, 4), (16, 128, 4), (32, 256, 8)))
CASES = ((1, 512), (6, 512), (32, 512), (192, 512), (1, 2048), (6, 2048), (32, 2048), (1, 8192), (6, 8192))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--smoke", action="store_true", help="rows x n <= 6 x 512, two tilings")
    args = p.parse_args()
    cases = [c for c in CASES if c[0] * c[1] <= 6 * 512] if args.smoke else CASES
    configs = CONFIGS[:2] if args.smoke else CONFIGS
    out = {"env": environment(), "k": args.k, "configs": [repr(c) for c in configs], "results": []}
    print(out["env"], flush=True)
    trace_root = tempfile.mkdtemp(prefix="top_k_trace")
    t0 = time.time()
    for rows, n in cases:
        s = jnp.asarray(np.random.default_rng(rows * n).standard_normal((rows, n)), jnp.float32)
        want = np.asarray(jax.lax.top_k(s, args.k)[1])
        compiled = {"xla": compile_highest(lambda x: jax.lax.top_k(x, args.k)[1], f"xla_{rows}_{n}", s)}
        row = {"rows": rows, "n": n, "comparisons": rows * n * n}
        for i, cfg in enumerate(configs):
            c = compile_highest(lambda x, cfg=cfg: top_k.kernel(x, args.k, config=cfg), f"kernel{i}_{rows}_{n}", s)
            compiled[f"kernel{i}"] = c
            row[f"kernel{i}_equal"] = bool((np.asarray(c[0](s)) == want).all())
        times = device_times({key: (c[0], c[1], (s,)) for key, c in compiled.items()}, args.calls, trace_root)
        for key, t in times.items():
            row[f"{key}_us"] = t.get("device_us")
        out["results"].append(row)
        print(f"[{time.time() - t0:.0f} s]", {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()},
              flush=True)
        write_json("top_k.json", out)


if __name__ == "__main__":
    main()
