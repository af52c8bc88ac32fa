"""Compiled memory of one decoding round against k rounds per call (``Engine.rounds``) at
DeepSeek-V4-Flash dimensions, from abstract arrays (nothing allocated): the loop over rounds must
carry the batch state in place (donated, aliased) and add no copy of the caches or the weights.

Compiled for this machine's backend with the XLA reference kernels (``Numerics(kernels="xla")``;
on a CPU its temporaries include dequantised weights, which the GPU kernels do not make): what
matters is the difference between k = 1 and k > 1 in one run.

    python -m benchmarks.rounds_memory --layers 4 --slots 16 --context 16384 --counts 1,4

Prints one JSON line per (mode, k) and writes rounds_memory.json under $OUT.
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import time

LARGE = 1 << 20  # elements: a copy of this size or more is listed


def large_copies(hlo: str) -> dict[str, int]:
    """``dtype[shape]`` -> count of the compiled program's copy instructions of >= ``LARGE`` elements."""
    out = collections.Counter()
    for m in re.finditer(r"= (\w+)\[([\d,]*)\][^ ]* copy\(", hlo):
        if math.prod(int(d) for d in m.group(2).split(",") if d) >= LARGE:
            out[f"{m.group(1)}[{m.group(2)}]"] += 1
    return dict(out)


def measure(layers: int, slots: int, context: int, counts: tuple[int, ...]) -> list[dict]:
    """One row per (mode, rounds per call): compile seconds, the compiled program's memory (MiB) and
    its large copies (``large_copies``)."""
    import jax
    from flax import nnx

    import dspark_jax
    from dspark_jax import config
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.model.common import Numerics
    from dspark_jax.model.deepseek_v4 import DeepSeekV4

    cfg = config.flash_slice(layers)
    num = Numerics(weight_format="fp8", kernels="xla")
    model = dspark_jax.Model(nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0))))
    mb = lambda v: v / 2**20  # noqa: E731
    rows = []
    for mode, gamma in (("target", 0), ("dspark", cfg.dspark.block_size)):
        eng = Engine(model, gamma=gamma, kv_layout="fp8")
        bs = jax.eval_shape(lambda: eng.init_slots(slots, context))  # noqa: B023
        flags = dict(sampled=False, top_k=False, top_p=False)
        for k in counts:
            t0 = time.perf_counter()
            lowered = (eng._round.lower(eng.params, bs, **flags) if k == 1
                       else eng._rounds.lower(eng.params, bs, count=k, **flags))
            compiled = lowered.compile()
            m = compiled.memory_analysis()
            rows.append(dict(mode=mode, rounds_per_call=k, compile_s=time.perf_counter() - t0,
                             state_mb=mb(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(bs))),
                             temp_mb=mb(m.temp_size_in_bytes), argument_mb=mb(m.argument_size_in_bytes),
                             output_mb=mb(m.output_size_in_bytes), alias_mb=mb(m.alias_size_in_bytes),
                             large_copies=large_copies(compiled.as_text())))
            print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="layers of the Flash slice (4: window, C4 and C128 layers)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--counts", default="1,4", help="rounds per call to compile, e.g. 1,4")
    args = ap.parse_args(argv)

    from benchmarks.common import environment, write_json

    rows = measure(args.layers, args.slots, args.context, tuple(int(c) for c in args.counts.split(",")))
    write_json("rounds_memory.json", {"env": environment(), "args": vars(args), "doc": __doc__, "rows": rows})


if __name__ == "__main__":
    main()
