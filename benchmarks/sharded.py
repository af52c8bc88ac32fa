"""The model over a device mesh: per-device bytes of DeepSeek-V4-Flash, sharded == unsharded on a
small expert-parallel config, and the collectives of its compiled decoding round (DESIGN 7).

The small config uses every path that matters under a mesh: 32 routed experts (the grouped / ragged
MoE path, more than 16 experts), a C4 layer with its indexer, a C128 layer, one DSpark stage, and
the Pallas kernels (interpret mode on CPU) for the ragged attention and the grouped matmul.

    python -m benchmarks.sharded                       # all of it on 8 (virtual CPU) devices
    python -m benchmarks.sharded --meshes 1x8 8x1      # equality on some meshes only
    python -m benchmarks.sharded --no-check --hlo      # bytes and collectives only

Meshes are written ``DATAxMODEL``. On a CPU host the 8 devices are virtual
(``--xla_force_host_platform_device_count=8``, set below before JAX starts).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import time

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax
from dspark_jax import config, sharding
from dspark_jax.cache import commit, init_cache
from dspark_jax.decoding.engine import Engine
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4
from dspark_jax.model.dspark import draft_block, init_draft_cache, write_context

MESHES = ((1, 8), (2, 4), (8, 1))  # (data, model)
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")


def small_config() -> config.ModelConfig:
    """Tiny widths, a C4 + indexer layer and a C128 layer, 32 routed experts, one DSpark stage."""
    ds = config.DSparkConfig(block_size=3, noise_token_id=511, target_layer_ids=(0, 1), markov_rank=16, num_stages=1)
    return config.tiny().replace(num_hidden_layers=2, compress_ratios=(4, 128), num_hash_layers=1,
                                 n_routed_experts=32, dspark=ds)


def small_model(seed: int = 3, kernels: str = "pallas") -> dspark_jax.Model:
    """``small_config`` in fp32 with random weights; sinks, ape, biases and hc bases made non-zero
    (noise of 0.3 x their spread on every float array) so that a misplaced one shows."""
    cfg = small_config()
    module = DeepSeekV4(cfg, Numerics(dtype=jnp.float32, param_dtype=jnp.float32, kernels=kernels),
                        rngs=nnx.Rngs(seed))
    state = nnx.state(module)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    key = jax.random.key(seed)
    for i, x in enumerate(leaves):
        if jnp.issubdtype(x.dtype, jnp.floating):
            std = jnp.maximum(jnp.std(x), 0.05) * 0.3
            leaves[i] = x + std * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
    nnx.update(module, jax.tree_util.tree_unflatten(treedef, leaves))
    return dspark_jax.Model(module)


@functools.partial(jax.jit, static_argnames="graphdef")
def _target_and_draft(graphdef, state, ids, cache, draft):
    model = nnx.merge(graphdef, state)
    with model.num.precision_scope():
        b, capture = ids.shape[0], model.cfg.dspark.target_layer_ids
        logits = []
        for start, width in ((0, ids.shape[1] - 4), (ids.shape[1] - 4, 4)):  # a prefill chunk, a verify chunk
            n = jnp.full((b,), width, jnp.int32)
            lg, hid, new = model.forward(ids[:, start:start + width], n, cache, capture=capture)
            draft = write_context(model.mtp, draft, hid, cache.lengths, n)
            cache = commit(new, n)
            logits.append(lg)
        out = draft_block(model, draft, ids[:, -1], cache.lengths, lambda lg, k: jnp.argmax(lg, axis=-1))
        return jnp.concatenate(logits, axis=1), out.logits


def target_and_draft_logits(model: dspark_jax.Model, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 target logits of ``ids`` [b, t] (a prefill chunk of t - 4 tokens, then a 4-token verify
    chunk through the kernels) and the drafter's logits [b, block, vocab] for the block after them.
    Caches are placed by ``sharding.state_shardings`` when the model is on a mesh."""
    b = ids.shape[0]
    state = {"cache": init_cache(model.config, b, 64, model.numerics.dtype),
             "draft": init_draft_cache(model.config, b, model.numerics.dtype)}
    mesh = sharding.model_mesh(model)
    if mesh is not None:
        state = jax.device_put(state, sharding.state_shardings(state, mesh))
    target, draft = _target_and_draft(model.graphdef, model.state, jnp.asarray(ids), state["cache"], state["draft"])
    return np.asarray(target), np.asarray(draft)


def greedy_tokens(model: dspark_jax.Model, prompts: list[list[int]], max_new: int = 8) -> list[list[int]]:
    """Speculative greedy generation (the model's DSpark drafter)."""
    res = dspark_jax.generate(prompts, model=model, sampling=SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    return [r.tokens for r in res]


def check_inputs(vocab: int) -> tuple[np.ndarray, list[list[int]]]:
    ids = np.random.default_rng(0).integers(2, vocab - 12, (2, 24)).astype(np.int32)
    return ids, [ids[0, :9].tolist(), ids[1, :13].tolist()]


def round_hlo(model: dspark_jax.Model, prompts: list[list[int]], max_len: int = 128) -> str:
    """The compiled HLO text of one greedy speculative decoding round (after SPMD partitioning)."""
    gamma = model.config.dspark.block_size
    engine = Engine(model, gamma=gamma)
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True)] * len(prompts)
    bs = engine.init_state([np.asarray(p, np.int32) for p in prompts], params, list(range(len(prompts))), max_len)
    lowered = engine._round.lower(model.state, bs, sampled=False, top_k=False, top_p=False)
    return lowered.compile().as_text()


def collectives(hlo: str) -> dict[str, list[str]]:
    """Collective instructions of an HLO module by kind: 'shape name' of each (async starts counted once)."""
    out = {k: [] for k in COLLECTIVES}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%?[\w.\-]+) = (.+?) (all-to-all|all-gather|reduce-scatter|all-reduce|"
                     r"collective-permute)(-start)?\(", line)
        if m:
            out[m.group(3)].append(f"{m.group(2)} {m.group(1)}")
    return out


_ITEMSIZE = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "u8": 1, "s8": 1,
             "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "s64": 8, "u64": 8}


def result_bytes(shape_text: str) -> int:
    """Bytes of an HLO result type such as ``f32[8,128]{1,0}`` or a tuple of them."""
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_text):
        total += math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[dtype]
    return total


def flash_per_device(n_requests: int = 64, context: int = 65536, kv_layout: str = "fp8"):
    """(data, model, weight bytes, cache bytes) per device of DeepSeek-V4-Flash (FP4 experts, FP8
    linears as in the checkpoint) with caches of ``n_requests`` x ``context`` tokens, per mesh."""
    cfg = config.flash()
    abstract = nnx.eval_shape(lambda: DeepSeekV4(cfg, Numerics(weight_format="official"), rngs=nnx.Rngs(0)))
    caches = jax.eval_shape(lambda: {"cache": init_cache(cfg, n_requests, context, jnp.bfloat16, kv_layout=kv_layout),
                                     "draft": init_draft_cache(cfg, n_requests)})
    rows = []
    for data, model in MESHES:
        mesh = sharding.make_mesh(model=model, data=data)
        w = sharding.shard_bytes(abstract, sharding.param_shardings(abstract, cfg, mesh))
        c = sharding.shard_bytes(caches, sharding.state_shardings(caches, mesh))
        rows.append((data, model, w, c))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--meshes", nargs="+", default=[f"{d}x{m}" for d, m in MESHES], help="DATAxMODEL")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip sharded == unsharded")
    ap.add_argument("--hlo", action="store_true", help="collectives of the compiled round per mesh")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=65536)
    args = ap.parse_args(argv)
    meshes = [tuple(int(v) for v in s.split("x")) for s in args.meshes]

    print(f"DeepSeek-V4-Flash per device (FP4 experts, FP8 linears; fp8 KV caches of {args.requests} requests x "
          f"{args.context:,} tokens + drafter rings):")
    for data, model, w, c in flash_per_device(args.requests, args.context):
        print(f"  mesh data={data} x model={model}: {(w + c) / 1e9:6.1f} GB = weights {w / 1e9:5.1f} + caches "
              f"{c / 1e9:5.1f}")

    model = small_model()
    ids, prompts = check_inputs(model.config.vocab_size)
    if args.check:
        t0 = time.perf_counter()
        ref = target_and_draft_logits(model, ids) + (greedy_tokens(model, prompts),)
        print(f"unsharded reference: {time.perf_counter() - t0:.0f} s; max |logit| target "
              f"{np.abs(ref[0]).max():.3f}, drafter {np.abs(ref[1]).max():.3f}")
        for data, size in meshes:
            t0 = time.perf_counter()
            m = sharding.shard_model(model, sharding.make_mesh(model=size, data=data))
            target, draft = target_and_draft_logits(m, ids)
            tokens = greedy_tokens(m, prompts)
            dt, dd = np.abs(target - ref[0]).max(), np.abs(draft - ref[1]).max()
            ok = dt <= 1e-5 * np.abs(ref[0]).max() and dd <= 1e-5 * np.abs(ref[1]).max() and tokens == ref[2]
            print(f"mesh {data}x{size}: target logits max |diff| {dt:.2e}, drafter logits {dd:.2e}, greedy tokens "
                  f"{'identical' if tokens == ref[2] else 'DIFFERENT'} -> {'OK' if ok else 'FAIL'} "
                  f"({time.perf_counter() - t0:.0f} s)")
    if args.hlo:
        for data, size in meshes:
            m = sharding.shard_model(model, sharding.make_mesh(model=size, data=data))
            found = collectives(round_hlo(m, prompts))
            print(f"mesh {data}x{size}: compiled greedy round: "
                  + ", ".join(f"{k} x{len(v)}" for k, v in found.items()))
            for kind, items in found.items():
                for item in items:
                    print(f"    {kind}: {item}")


if __name__ == "__main__":
    main()
