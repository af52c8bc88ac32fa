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
import dataclasses
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
from dspark_jax.decoding.engine import BatchState, Engine
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4
from dspark_jax.model.dspark import draft_block, init_draft_cache, write_context

MESHES = ((1, 8), (2, 4), (8, 1))  # (data, model)
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")


def small_config() -> config.ModelConfig:
    """Tiny widths, one C4 layer with its indexer and hash-routed experts, 32 routed experts, one
    DSpark stage (window attention, learned routing). A C128 layer would add nothing here: the
    check's 24 tokens never fill a 128-token window, so it would hold no compressed entry."""
    ds = config.DSparkConfig(block_size=3, noise_token_id=511, target_layer_ids=(0,), markov_rank=16, num_stages=1)
    return config.tiny().replace(num_hidden_layers=1, compress_ratios=(4,), num_hash_layers=1,
                                 n_routed_experts=32, dspark=ds)


def small_model(seed: int = 3, kernels: str = "pallas") -> dspark_jax.Model:
    """``small_config`` in fp32 with random weights; sinks, ape, biases and hc bases made non-zero
    (noise of 0.3 x their spread on every float array) so that a misplaced one shows."""
    cfg = small_config()
    module = DeepSeekV4(cfg, Numerics(dtype=jnp.float32, param_dtype=jnp.float32, kernels=kernels),
                        rngs=nnx.Rngs(seed))
    state = nnx.state(module)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    rng = np.random.default_rng(seed)  # numpy noise: no random program to compile per parameter shape
    for i, x in enumerate(leaves):
        if jnp.issubdtype(x.dtype, jnp.floating):
            a = np.asarray(x)
            std = max(float(a.std()), 0.05) * 0.3
            leaves[i] = jnp.asarray(a + std * rng.standard_normal(a.shape).astype(a.dtype))
    nnx.update(module, jax.tree_util.tree_unflatten(treedef, leaves))
    return dspark_jax.Model(module)


VERIFY = 4  # tokens of the check's verify chunk
MAX_LEN = 72  # cache tokens per request of the check (18 C4 entries: pool sizes no activation of the round has)


@functools.partial(jax.jit, static_argnames="graphdef")
def _prefill_and_verify(graphdef, state, ids, n_prompt, cache, draft):
    """Target forward over a prefill chunk (the first ``n_prompt`` [b] of the ``t - VERIFY`` first
    columns of ``ids`` [b, t]), then over a verify chunk (each row's next VERIFY tokens, through the
    attention kernels), both committed with their context rows written to the drafter rings; then
    the first generated token (greedy) and the drafter's block after it, as a decoding round drafts it."""
    model = nnx.merge(graphdef, state)
    with model.num.precision_scope():
        b, t = ids.shape
        capture = model.cfg.dspark.target_layer_ids
        verify = jnp.take_along_axis(ids, n_prompt[:, None] + jnp.arange(VERIFY)[None], axis=1)
        logits = []
        for chunk, n in ((ids[:, :t - VERIFY], n_prompt), (verify, jnp.full((b,), VERIFY, jnp.int32))):
            lg, hid, new = model.forward(chunk, n, cache, capture=capture)
            draft = write_context(model.mtp, draft, hid, cache.lengths, n)
            cache = commit(new, n)
            logits.append(lg)
        first = jnp.argmax(logits[1][:, -1], axis=-1).astype(jnp.int32)
        out = draft_block(model, draft, first, cache.lengths, lambda lg, k: jnp.argmax(lg, axis=-1))
        return logits[0], logits[1], out.logits, first, cache, draft


@dataclasses.dataclass
class Check:
    """What the sharded == unsharded check compares (numpy arrays, token lists)."""

    prefill: np.ndarray  # target logits of the prefill chunk [b, t - VERIFY, vocab] (rows >= n_prompt: 0)
    verify: np.ndarray  # target logits of the verify chunk [b, VERIFY, vocab]
    draft: np.ndarray  # drafter logits of the first round's block [b, block, vocab]
    tokens: list[list[int]]  # greedy speculative generation, the first token included
    round_hlo: str  # the compiled decoding round (after SPMD partitioning)
    state: BatchState  # the engine's state after the last round


def run_check(model: dspark_jax.Model, ids: np.ndarray, n_prompt: np.ndarray, max_new: int = 6) -> Check:
    """fp32 target logits of a prefill and a verify chunk, the drafter's logits, and greedy
    speculative generation of ``max_new`` tokens per request continuing from there: the engine's
    decoding round, with the engine's state placement (``sharding.state_shardings`` on a mesh).
    Two programs to compile (most of the check's time on a CPU): ``_prefill_and_verify``, which
    also serves as the prefill, and the engine's round."""
    b = ids.shape[0]
    engine = Engine(model, gamma=model.config.dspark.block_size)
    params = [SamplingParams(max_new_tokens=max_new, ignore_eos=True)] * b
    bs = engine.init_state([ids[i] for i in range(b)], params, list(range(b)), MAX_LEN)
    prefill, verify, draft, first, cache, rings = _prefill_and_verify(
        model.graphdef, model.state, jnp.asarray(ids), jnp.asarray(n_prompt, jnp.int32), bs.cache, bs.draft)
    bs = dataclasses.replace(bs, cache=cache, draft=rings, anchor=first, n_generated=jnp.ones((b,), jnp.int32))
    if engine.mesh is not None:  # the engine's layout, which its round keeps
        bs = jax.device_put(bs, sharding.state_shardings(bs, engine.mesh))
    tokens = [[int(t)] for t in np.asarray(first)]
    round_ = engine._round.lower(model.state, bs, sampled=False, top_k=False, top_p=False).compile()
    while np.any(np.asarray(bs.active)):
        bs, out = round_(model.state, bs)
        for i, (row, n) in enumerate(zip(np.asarray(out.tokens), np.asarray(out.n_new))):
            tokens[i] += row[:n].tolist()
    valid = np.arange(prefill.shape[1])[None, :, None] < np.asarray(n_prompt)[:, None, None]
    return Check(prefill=np.where(valid, np.asarray(prefill), 0), verify=np.asarray(verify), draft=np.asarray(draft),
                 tokens=tokens, round_hlo=round_.as_text(), state=bs)


def check_inputs(vocab: int, batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [batch, 24] and prompt lengths 20, 17, 14, 20, ... (ragged requests)."""
    ids = np.random.default_rng(0).integers(2, vocab - 12, (batch, 20 + VERIFY)).astype(np.int32)
    return ids, 20 - 3 * (np.arange(batch) % 3)


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


def _shapes(shape_text: str) -> list[tuple[int, tuple[int, ...]]]:
    """(itemsize, dims) of each array of an HLO result type."""
    return [(_ITEMSIZE[dtype], tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_text)]


def forbidden_gathers(hlo: str, pools, stacks) -> list[str]:
    """The all-gathers of a compiled program that could rebuild one of ``pools`` (arrays or shape
    structs, e.g. KV pools: a result with the same itemsize and element count, in any shape) or
    move matrices of one of ``stacks`` (e.g. expert weights [E, out, in]: a result of >= 3 dims
    ending in the stack's two matrix dims, with its itemsize)."""
    pool_keys = {(jnp.dtype(a.dtype).itemsize, math.prod(a.shape)) for a in pools}
    stack_keys = {(jnp.dtype(a.dtype).itemsize, tuple(a.shape[-2:])) for a in stacks}
    bad = []
    for item in collectives(hlo)["all-gather"]:
        for size, dims in _shapes(item.rsplit(" ", 1)[0]):
            if (size, math.prod(dims)) in pool_keys or (len(dims) >= 3 and (size, dims[-2:]) in stack_keys):
                bad.append(item)
    return bad


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
