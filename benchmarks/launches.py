"""Pallas kernel launches of a target step at DeepSeek-V4-Flash dimensions, counted without a GPU.

The step (``api.forward_step``, batch ``--batch``, ``--tokens`` tokens per request, caches of
``--context`` tokens) is traced as it is for a GPU: under an abstract device (``--arch``: an H200
or gfx950, ``pallas_kernels.lowering``) the dispatchers pick what they pick on that GPU (the
Pallas kernels, mHC's fused units: ``Numerics`` "auto"). Every ``pallas_call`` of the traced
program is listed in program order (``lowering.pallas_calls``): the Pallas kernels one step
launches. XLA's own fusions between them are not counted: they exist only once XLA compiles the
program for a device (``profile_step.py`` lists every kernel of a profiled step).

Slices of 2 and 4 layers (``config.flash_slice``: layers 0-1 keep a window only, layer 2 is a C4
layer with the indexer, layer 3 a C128 layer; Flash's 41 layers after the first two alternate
C4 / C128) give the launches of a C4 + C128 layer pair as the difference of the two lists, and
the 43-layer step as

    launches(43) = launches(4) + (43 - 4) / 2 * pair

Prints the counts and the pair's launches by name and writes ``launches.json``. The model is never
built (its parameters stay abstract): any context fits in a CPU machine's memory.
"""

from __future__ import annotations

import argparse
import collections
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import add_launch_options, apply_launch_options, source_commit, write_json
from dspark_jax import config
from dspark_jax.api import forward_step
from dspark_jax.cache import init_cache
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4
from dspark_jax.model.moe import MoE
from pallas_kernels import lowering

ARCHS = {"NVIDIA H200": "cuda", "gfx950": "rocm"}
LAYERS = config.flash().num_hidden_layers  # 43


def abstract_step(depth: int, *, batch: int, tokens: int, context: int, moe_one_row: str = ""):
    """(fn, args): one target step of a ``depth``-layer Flash slice (FP8 weights, the reference's
    activation rounding) on abstract parameters and caches, for ``make_jaxpr`` or
    ``lowering.lower``; ``moe_one_row``: every MoE layer's ``one_row`` (default the model's)."""
    cfg = config.flash_slice(depth, dspark=False)
    num = Numerics(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, quant_sim=True, weight_format="fp8")
    module = nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0)))
    for _, mod in nnx.iter_graph(module):
        if moe_one_row and isinstance(mod, MoE):
            mod.one_row = moe_one_row
    graphdef, state = nnx.split(module)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context + 128))
    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    n_valid = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return (lambda s, i, n, c: forward_step(graphdef, s, i, n, c, logits="last")), (state, ids, n_valid, cache)


def step_launches(depth: int, *, batch: int, tokens: int, context: int, arch: str, moe_one_row: str = ""
                  ) -> list[str]:
    """The names of the Pallas kernels one target step of a ``depth``-layer Flash slice launches,
    in program order, traced for ``arch``."""
    fn, args = abstract_step(depth, batch=batch, tokens=tokens, context=context, moe_one_row=moe_one_row)
    device = jax.sharding.AbstractDevice(arch, 1, ARCHS[arch])
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        jaxpr = jax.make_jaxpr(fn)(*args)
    return [name for name, _ in lowering.pallas_calls(jaxpr.jaxpr)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1, help="tokens per request (1: a decode step; 6: a verify)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--arch", default="NVIDIA H200", choices=sorted(ARCHS))
    ap.add_argument("--moe-one-row", default="", help="MoE.one_row in every layer (default: the model's)")
    add_launch_options(ap)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    launch_options = apply_launch_options(args)
    shape = dict(batch=args.batch, tokens=args.tokens, context=args.context, arch=args.arch,
                 moe_one_row=args.moe_one_row)
    two, four = (step_launches(d, **shape) for d in (2, 4))
    pair = collections.Counter(four) - collections.Counter(two)
    if collections.Counter(two) - collections.Counter(four):
        raise RuntimeError("the 4-layer slice lacks launches of the 2-layer one: the slices do not nest")
    n_pair = sum(pair.values())
    out = {"args": vars(args), "commit": source_commit(), "date": time.strftime("%Y-%m-%d"),
           "launch_options": launch_options,
           "launches_2_layers": len(two), "launches_4_layers": len(four), "launches_c4_c128_pair": n_pair,
           "launches_per_layer": n_pair / 2, "launches_43_layers": len(four) + (LAYERS - 4) / 2 * n_pair,
           "pair_by_name": dict(sorted(pair.items())), "four_layers_in_order": four}
    print(f"{args.arch}, batch {args.batch}, {args.tokens} token(s) per request, context {args.context}:")
    print(f"  Pallas launches: 2 layers {len(two)}, 4 layers {len(four)}; a C4 + C128 layer pair {n_pair} "
          f"({n_pair / 2:.1f} per layer); 43-layer step {out['launches_43_layers']:.0f}")
    for name, n in sorted(pair.items()):
        print(f"    {n:3d}  {name}")
    print(f"  ({time.perf_counter() - start:.1f} s) -> {write_json('launches.json', out)}")
    return out


if __name__ == "__main__":
    main()
