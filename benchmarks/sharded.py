"""The model over a device mesh: per-device bytes of DeepSeek-V4-Flash, sharded == unsharded on a
small expert-parallel config, and the collectives of a compiled decoding round (DESIGN 7).

The small config takes the paths that matter under a mesh: 32 routed experts (the grouped / ragged
MoE path, more than 16 experts), a C4 layer with its indexer, one DSpark stage, and the Pallas
kernels (interpret mode on CPU) for the ragged attention and the grouped matmul. The Flash figures
come from a round compiled for real Flash dims from abstract arrays.

    python -m benchmarks.sharded                       # per-device bytes, sharded == unsharded
    python -m benchmarks.sharded --meshes 1x8 8x1      # equality on some meshes only
    python -m benchmarks.sharded --no-check --hlo      # collectives per round, at Flash dims too

Meshes are written ``DATAxMODEL``. On a CPU host the 8 devices are virtual
(``--xla_force_host_platform_device_count=8``, set below before JAX starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
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


def small_model(seed: int = 3, kernels: str = "pallas", weight_format: str = "dense",
                cfg: config.ModelConfig | None = None) -> dspark_jax.Model:
    """``cfg`` (default ``small_config``) in fp32 with random weights (``weight_format="official"``:
    FP8 linears with their 128 x 128 block scales and FP4 routed experts, as in the checkpoint);
    sinks, ape, biases and hc bases made non-zero (noise of 0.3 x their spread on every fp32
    array) so that a misplaced one shows."""
    cfg = cfg or small_config()
    num = Numerics(dtype=jnp.float32, param_dtype=jnp.float32, weight_format=weight_format, kernels=kernels)
    module = DeepSeekV4(cfg, num, rngs=nnx.Rngs(seed))
    state = nnx.state(module)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    rng = np.random.default_rng(seed)  # numpy noise: no random program to compile per parameter shape
    for i, x in enumerate(leaves):
        if x.dtype == jnp.float32:
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
    round_hlo: str | None  # the compiled decoding round (after SPMD partitioning); None for ragged rounds
    state: BatchState  # the engine's state after the last round


RAGGED_LENS = np.array([0, 1, 2, 3, 4, 1, 2, 3])  # tokens slot r verifies in round k: RAGGED_LENS[(r - k) % 8]


def run_check(model: dspark_jax.Model, ids: np.ndarray, n_prompt: np.ndarray, max_new: int = 6, *,
              ragged: bool = False) -> Check:
    """fp32 target logits of a prefill and a verify chunk, the drafter's logits, and greedy
    speculative generation of ``max_new`` tokens per request continuing from there: the engine's
    decoding round, with the engine's state placement (``sharding.state_shardings`` on a mesh).
    Two programs to compile (most of the check's time on a CPU): ``_prefill_and_verify``, which
    also serves as the prefill, and the engine's round. ``ragged``: ragged rounds instead
    (``Engine.round(verify_lens=)``, 8 requests verifying ``RAGGED_LENS`` rolled by one slot per
    round: 0 to γ + 1 tokens each, always 16 in all, one verify bucket); no round HLO then."""
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
    flags = dict(sampled=False, top_k=False, top_p=False)
    if ragged:
        round_ = None
        step = lambda bs, k: engine.round(bs, **flags, verify_lens=np.roll(RAGGED_LENS, k))  # noqa: E731
    else:
        round_ = engine._round.lower(engine.params, bs, **flags).compile()
        step = lambda bs, k: round_(engine.params, bs)  # noqa: E731
    k = 0
    while np.any(np.asarray(bs.active)):
        bs, out = step(bs, k)
        k += 1
        for i, (row, n) in enumerate(zip(np.asarray(out.tokens), np.asarray(out.n_new))):
            tokens[i] += row[:n].tolist()
    valid = np.arange(prefill.shape[1])[None, :, None] < np.asarray(n_prompt)[:, None, None]
    return Check(prefill=np.where(valid, np.asarray(prefill), 0), verify=np.asarray(verify), draft=np.asarray(draft),
                 tokens=tokens, round_hlo=None if round_ is None else round_.as_text(), state=bs)


def check_inputs(vocab: int, batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [batch, 24] and prompt lengths 20, 17, 14, 20, ... (ragged requests)."""
    ids = np.random.default_rng(0).integers(2, vocab - 12, (batch, 20 + VERIFY)).astype(np.int32)
    return ids, 20 - 3 * (np.arange(batch) % 3)


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


def _dims(shape_text: str) -> list[tuple[int, ...]]:
    """The dims of each array of an HLO type such as ``f32[8,128]{1,0}`` or a tuple of them."""
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", shape_text)]


def _with_rows_flattened(shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    """A shape and the same array with its leading dims flattened (``[b, n, d]`` -> ``[b * n, d]``)."""
    return {tuple(shape), (math.prod(shape[:-1]), shape[-1])} if len(shape) > 2 else {tuple(shape)}


def _gathered(a) -> tuple[set[tuple[int, ...]], set[tuple[int, ...]]]:
    """The dims of a placed array's per-device shard, and of that shard gathered over one or more
    of the mesh axes the array is split over (the whole array among them); leading dims also
    flattened."""
    mesh, spec = a.sharding.mesh, tuple(a.sharding.spec)
    sizes = []  # per dim: its size gathered over each subset of its mesh axes
    for i, n in enumerate(a.shape):
        axes = spec[i] if i < len(spec) and spec[i] is not None else ()
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        subsets = [c for k in range(len(axes) + 1) for c in itertools.combinations(axes, k)]
        sizes.append({n * math.prod(mesh.shape[x] for x in sub) // math.prod(mesh.shape[x] for x in axes)
                      for sub in subsets})
    shard = tuple(a.sharding.shard_shape(tuple(a.shape)))
    gathered = {dims for dims in itertools.product(*sizes) if dims != shard}
    return _with_rows_flattened(shard), {f for dims in gathered for f in _with_rows_flattened(dims)}


def gathers_of(hlo: str, arrays) -> list[str]:
    """The all-gathers of a compiled program that move one of ``arrays`` (placed arrays, or shape
    structs with a sharding: e.g. expert weight stacks, KV pools): those whose operand has the dims
    of an array's per-device shard and whose result has the dims of that shard gathered over one
    or more of the array's mesh axes (either one also with its leading dims flattened: expert
    stacks [E, out, in] are gathered as [E * out, in]). Dims only: the XLA CPU compiler widens
    narrow types (fp8 codes to f16, bf16 to f32) before a collective. Returns the offending
    instructions."""
    forms = [_gathered(a) for a in arrays]  # a replicated array has no gathered form
    types = {}  # instruction name -> its result type
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) [\w\-]+\(", line)
        if m:
            types[m.group(1)] = m.group(2)
    bad = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) all-gather(?:-start)?\(([^)]*)\)", line)
        if not m:
            continue
        operands = {d for name in re.findall(r"%?([\w.\-]+)", m.group(3)) for d in _dims(types.get(name, ""))}
        results = set(_dims(m.group(2)))
        if any(operands & shard and results & gathered for shard, gathered in forms):
            bad.append(line.strip()[:200])
    return bad


def forbidden_arrays(model: dspark_jax.Model, bs: BatchState) -> list:
    """What no program of a decoding round may all-gather, of those split over the mesh: the
    routed experts' weights and scales (every layer and drafter stage), the FP8 linears' weights
    and scales, and the caches' pools and rings (every 3-d leaf of the target and drafter caches)."""
    from dspark_jax.model.common import Linear
    from dspark_jax.model.moe import Experts

    out = [x for x in jax.tree_util.tree_leaves((bs.cache, bs.draft)) if x.ndim == 3]
    for _, mod in nnx.iter_modules(model.module):
        if isinstance(mod, Experts):
            out += [v.get_value() for name, v in vars(mod).items() if re.fullmatch(r"w[123](_scale)?", name)]
        elif isinstance(mod, Linear) and mod.quantized:
            out += [mod.weight.get_value(), mod.scale.get_value()]
    return [a for a in out if a.sharding.shard_shape(tuple(a.shape)) != tuple(a.shape)]


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


# ------------------------------------------------------------------ collectives at Flash dims
# Per-GPU link bandwidth, one direction, for a collective over a group of g GPUs of an 8-GPU node:
# - 8 x H200 (HGX): NVLink 4, 900 GB/s per GPU (both directions together) through NVSwitch, i.e.
#   450 GB/s each way to any set of peers (https://www.nvidia.com/en-us/data-center/h200/).
# - 8 x MI355X (OAM platform): 7 Infinity Fabric links per GPU of 153.6 GB/s (both directions
#   together), one to each other GPU of the node (fully connected, no switch), i.e. 76.8 GB/s
#   each way per peer: a collective over g GPUs uses g - 1 links
#   (https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html).
LINKS = {"8 x H200": lambda g: 450e9, "8 x MI355X": lambda g: (g - 1) * 76.8e9}


def _group_size(line: str) -> int:
    """Devices per group of a collective (``replica_groups`` in any of its HLO spellings)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    return 2  # collective-permute: point to point


def traffic(hlo: str) -> list[dict]:
    """Every collective of a compiled program: kind, result type, group size g, the layer or
    drafter stage it belongs to (from its op_name) and the bytes one device sends (ring / direct
    algorithms: all-gather (g-1)/g x result, reduce-scatter (g-1) x result, all-reduce 2(g-1)/g x
    size, all-to-all (g-1)/g x size, collective-permute its size unless every pair is a self-copy)."""
    rows = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.+?) (all-to-all|all-gather|reduce-scatter|all-reduce|"
                     r"collective-permute)(-start)?\(", line)
        if not m:
            continue
        kind, size, g = m.group(2), result_bytes(m.group(1)), _group_size(line)
        if kind == "collective-permute":
            pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[-1].split("}}")[0] + "}")
            moved = size if any(a != b for a, b in pairs) else 0
        else:
            moved = {"all-gather": size * (g - 1) / g, "reduce-scatter": size * (g - 1),
                     "all-reduce": 2 * size * (g - 1) / g, "all-to-all": size * (g - 1) / g}[kind]
        name = re.search(r'op_name="[^"/]*/([^"]*)"', line)
        scope = re.search(r"(layer\d+|stage\d+)", name.group(1)) if name else None
        rows.append(dict(kind=kind, type=m.group(1), group=g, moved=moved, scope=scope.group(1) if scope else "other"))
    return rows


def flash_round_hlo(data: int, model: int, n_requests: int = 64, context: int = 65536, n_layers: int = 4) -> tuple:
    """(config, compiled HLO text, abstract state) of one greedy speculative round of a
    ``flash_slice(n_layers)`` (real Flash dims; window, C4 and C128 layers, the 3 DSpark stages)
    with the checkpoint's FP4 experts / FP8 linears and fp8 KV pools, compiled for a (data, model)
    mesh from abstract arrays (nothing allocated). Kernels: the XLA references (the attention runs
    per device in a ``shard_map`` either way; on GPUs the FP8 linears would be Pallas calls)."""
    mesh = sharding.make_mesh(model=model, data=data)
    cfg = config.flash_slice(n_layers)
    num = Numerics(weight_format="official", kernels="xla")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0))))
    shardings = sharding.param_shardings(state, cfg, mesh)
    flat = [(k, v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[".".join(map(str, k))])))
            for k, v in nnx.to_flat_state(state)]
    model_ = dspark_jax.Model(sharding.attach_mesh(nnx.merge(graphdef, nnx.from_flat_state(flat)), mesh))
    engine = Engine(model_, gamma=cfg.dspark.block_size, kv_layout="fp8")
    bs = jax.eval_shape(lambda: engine.init_slots(n_requests, context))
    bs = jax.tree_util.tree_map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), bs,
                                sharding.state_shardings(bs, mesh))
    hlo = engine._round.lower(engine.params, bs, sampled=False, top_k=False, top_p=False).compile().as_text()
    return model_, hlo, bs


def flash_round_totals(rows: list[dict], n_layers: int = 4) -> dict[str, dict[str, float]]:
    """Per collective kind: count and bytes one device sends per round of the full
    DeepSeek-V4-Flash (43 layers), from a ``flash_slice(4)`` round: each Flash layer counts as the
    slice's layer of its kind (window-only: layer 1, C4: layer 2, C128: layer 3); the drafter's
    stages and the rest (embedding, head, acceptance) as measured."""
    if n_layers != 4:
        raise ValueError("the Flash scaling maps layer kinds onto a 4-layer slice")
    ratios = config.flash().compress_ratios
    weight = {"layer1": sum(r == 0 for r in ratios), "layer2": sum(r == 4 for r in ratios),
              "layer3": sum(r == 128 for r in ratios), "layer0": 0}
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        w = weight.get(r["scope"], 1)
        t = out.setdefault(r["kind"], {"count": 0, "bytes": 0.0, **{name: 0.0 for name in LINKS}})
        t["count"] += w
        t["bytes"] += w * r["moved"]
        for name, bw in LINKS.items():
            t[name] += w * r["moved"] / bw(r["group"])
    return out


def exchange_patterns(data: int, model: int, tokens: int = 384, hidden: int = 4096) -> dict[str, list[dict]]:
    """The collectives of three lossless token exchanges for the routed experts of one MoE layer
    at Flash dims (``tokens`` = 64 requests x 6 verify rows, bf16 in, fp32 partial outputs),
    each compiled alone (the experts' work replaced by a cast) on a (data, model) mesh with the
    tokens split over data as the activations are:

    - "all-reduce": every device gets all tokens (gathered by the partitioner) and the outputs
      are all-reduced over all devices (the exchange before ``moe.expert_parallel``);
    - "gather / reduce-scatter": ``moe.expert_parallel`` (all-gather over data, reduce-scatter
      over data, all-reduce over model);
    - "all-to-all": each device sends each of its tokens once to every device (a static buffer
      of all its tokens per destination: exact, since any token may pick experts of one device
      only) and gets the outputs back the same way, then all-gathers them over model."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = sharding.make_mesh(model=model, data=data)
    axes, tok = sharding.mesh_axes("experts", mesh), sharding.batch_axes(tokens, mesh)
    rest = tuple(a for a in axes if a not in tok)
    tok_spec = P(tok) if tok else P()
    work = lambda x: x.astype(jnp.float32) * 2  # noqa: E731  (stands for the experts)

    def all_reduce(x):
        return jax.lax.psum(work(x), axes)

    def gather_scatter(x):
        y = work(jax.lax.all_gather(x, tok, axis=0, tiled=True)) if tok else work(x)
        y = jax.lax.psum_scatter(y, tok, scatter_dimension=0, tiled=True) if tok else y
        return jax.lax.psum(y, rest) if rest else y

    def all_to_all(x):  # x: this device's share of the data shard's tokens (split over model too)
        n = x.shape[0]
        sent = jnp.broadcast_to(x[None], (mesh.size, n, x.shape[1]))  # a buffer per destination
        got = jax.lax.all_to_all(sent, axes, 0, 0, tiled=False)
        back = jax.lax.all_to_all(work(got), axes, 0, 0, tiled=False)
        y = jnp.sum(back, axis=0)
        return jax.lax.all_gather(y, rest, axis=0, tiled=True) if rest else y

    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16, sharding=NamedSharding(mesh, tok_spec))
    every = P(axes if len(axes) > 1 else axes[0])
    programs = {"all-reduce": (all_reduce, P(), P()), "gather / reduce-scatter": (gather_scatter, tok_spec, tok_spec),
                "all-to-all": (all_to_all, every, tok_spec)}
    out = {}
    for name, (fn, spec_in, spec_out) in programs.items():
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec_in, out_specs=spec_out, check_vma=False))
        out[name] = traffic(f.lower(x).compile().as_text())
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--meshes", nargs="+", default=[f"{d}x{m}" for d, m in MESHES], help="DATAxMODEL")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip sharded == unsharded")
    ap.add_argument("--hlo", action="store_true", help="collectives of the compiled round per mesh (small config "
                    "and DeepSeek-V4-Flash dims)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=65536)
    args = ap.parse_args(argv)
    meshes = [tuple(int(v) for v in s.split("x")) for s in args.meshes]

    print(f"DeepSeek-V4-Flash per device (FP4 experts, FP8 linears; fp8 KV caches of {args.requests} requests x "
          f"{args.context:,} tokens + drafter rings):")
    for data, model, w, c in flash_per_device(args.requests, args.context):
        print(f"  mesh data={data} x model={model}: {(w + c) / 1e9:6.1f} GB = weights {w / 1e9:5.1f} + caches "
              f"{c / 1e9:5.1f}")

    small = small_model()
    ids, n_prompt = check_inputs(small.config.vocab_size)
    if args.check:
        t0 = time.perf_counter()
        ref = run_check(small, ids, n_prompt)
        print(f"unsharded reference: {time.perf_counter() - t0:.0f} s; max |logit| prefill "
              f"{np.abs(ref.prefill).max():.3f}, verify {np.abs(ref.verify).max():.3f}, "
              f"drafter {np.abs(ref.draft).max():.3f}")
        for data, size in meshes:
            t0 = time.perf_counter()
            got = run_check(sharding.shard_model(small, sharding.make_mesh(model=size, data=data)), ids, n_prompt)
            diffs = {k: float(np.abs(getattr(got, k) - getattr(ref, k)).max()) for k in ("prefill", "verify", "draft")}
            ok = all(diffs[k] <= 1e-5 * np.abs(getattr(ref, k)).max() for k in diffs) and got.tokens == ref.tokens
            print(f"mesh {data}x{size}: max |diff| " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
                  + f"; greedy tokens {'identical' if got.tokens == ref.tokens else 'DIFFERENT'} -> "
                  f"{'OK' if ok else 'FAIL'} ({time.perf_counter() - t0:.0f} s)")
            if args.hlo:
                found = {k: v for k, v in collectives(got.round_hlo).items() if v}
                print("    compiled round (8 requests): " + ", ".join(
                    f"{k} x{len(v)} {sum(result_bytes(i.rsplit(' ', 1)[0]) for i in v) / 1e3:.1f} KB"
                    for k, v in found.items()))
    if not args.hlo:
        return
    print(f"\nDeepSeek-V4-Flash, one greedy round (64 requests x {6} verify rows, drafter block 5), from the "
          f"compiled HLO of a 4-layer slice scaled to 43 layers; bytes one device sends, time at link bandwidth "
          f"(latency not counted):")
    for data, size in meshes:
        t0 = time.perf_counter()
        model_, hlo, bs = flash_round_hlo(data, size, args.requests, args.context)
        rows = traffic(hlo)
        bad = gathers_of(hlo, forbidden_arrays(model_, bs))
        print(f"mesh {data}x{size} ({time.perf_counter() - t0:.0f} s to compile): "
              + ("no gather of an expert weight, FP8 linear weight or cache array" if not bad else f"GATHERS {bad}"))
        totals = flash_round_totals(rows)
        for kind, t in sorted(totals.items()):
            print(f"    {kind:18s} x{t['count']:4d} {t['bytes'] / 1e6:8.1f} MB  "
                  + "  ".join(f"{name} {_ms(t[name])}" for name in LINKS))
        print(f"    {'total':18s} x{sum(t['count'] for t in totals.values()):4d} "
              f"{sum(t['bytes'] for t in totals.values()) / 1e6:8.1f} MB  "
              + "  ".join(f"{name} {_ms(sum(t[name] for t in totals.values()))}" for name in LINKS))
        for name, prow in exchange_patterns(data, size).items():
            moved = sum(r["moved"] for r in prow)
            print(f"    routed-expert exchange per MoE layer, {name:24s}: {moved / 1e6:6.2f} MB  "
                  + "  ".join(f"{n} {_ms(sum(r['moved'] / bw(r['group']) for r in prow))}" for n, bw in LINKS.items())
                  + "  (" + ", ".join(f"{r['kind']} {r['type'].split('{')[0]}/{r['group']}" for r in prow) + ")")


if __name__ == "__main__":
    main()
