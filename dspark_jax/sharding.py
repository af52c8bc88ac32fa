"""Device meshes and where every parameter and cache array lives on them (DESIGN 7).

One table maps array paths to logical axes (``PARAM_RULES`` for the model, ``STATE_RULES`` for
caches and per-request decoding state) and one maps logical axes to mesh axes (``LOGICAL_AXES``).
Every leaf must match a rule: a path that matches none raises ``UnknownPathError`` naming it, so
no array is replicated by omission; small arrays are replicated by rules that say so
(``REPLICATED``).

The mesh is ``(data, model)``:

- ``model``: attention heads (``wq_b`` rows, sinks), output groups (``wo_a`` rows, ``wo_b``
  columns), indexer heads, the shared expert's intermediate dim, and the vocabulary of the
  embedding, the lm_head and the Markov head (vocab-parallel);
- ``data`` x ``model``: the routed experts, spread over every device of the mesh (expert
  parallelism; mesh axes of size 1 are left out of a spec, so a (1, 8) mesh puts them on
  ``model`` and an (8, 1) mesh on ``data``);
- ``data``: requests. Every cache array and every per-request array is split by request over
  ``data`` and replicated over ``model``: the KV latent is one 512-d row per token shared by all
  query heads (MQA), so there is no head axis to split it by, and each device of a ``model`` group
  holds its requests' whole caches. Cache memory therefore divides by ``data`` only.

Replicated: norms, mHC, the router (weight, bias, hash table), the compressors, the low-rank
``wq_a`` / ``wkv`` shared by all heads, the drafter's ``main_proj`` and confidence head.

A logical axis is sharded only when its unit count (heads, groups, experts, vocabulary rows,
requests) divides by the size of its mesh axes, so a shard always holds whole units; otherwise
that dim is replicated. FP8 block scales (one e8m0 byte per 128 x 128 block) and FP4 expert
scales (per 32 inputs) follow their weight (``SCALE_RULES``): a weight dim is split only where
each shard holds whole scale blocks, and its scale is split the same way, so a scale shard
describes exactly its weight shard.

Activations have logical axes too (``activation_spec``: queries ``("batch", None, "heads")``).
The mesh uses ``AxisType.Auto``: XLA's propagation places most intermediate results, but what it
cannot partition well runs per device in a ``shard_map`` (set up by ``attach_mesh``): the
attention kernels on each device's requests and heads (``Attention.per_device``), the
compressors, fp8 cache writes and top-k selections on its requests (``per_request``), and the
routed experts of the grouped MoE path on its experts (``moe.expert_parallel``).
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dspark_jax.config import ModelConfig

MODEL = "model"
DATA = "data"
REPLICATED: tuple[str | None, ...] = ()

# Logical axis -> mesh axes (in mesh order).
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "vocab": (MODEL,),
    "heads": (MODEL,),
    "o_groups": (MODEL,),
    "index_heads": (MODEL,),
    "experts": (DATA, MODEL),
    "ffn": (MODEL,),
    "batch": (DATA,),
}

# Parameter path (the official tensor name, routed experts stacked) -> logical axis of each dim
# (trailing dims not named are not split). First match wins; every parameter must match.
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    # vocab-parallel
    (r"^embed\.weight$", ("vocab", None)),
    (r"^head\.weight$", ("vocab", None)),
    (r"^mtp\.\d+\.markov_head\.markov_w[12]\.weight$", ("vocab", None)),
    # attention of the target layers and of the drafter stages: heads and output groups
    (r"\.attn\.wq_b\.weight$", ("heads", None)),
    (r"\.attn\.attn_sink$", ("heads",)),
    (r"\.attn\.wo_a\.weight$", ("o_groups", None)),
    (r"\.attn\.wo_b\.weight$", (None, "o_groups")),
    (r"\.attn\.indexer\.wq_b\.weight$", ("index_heads", None)),
    (r"\.attn\.indexer\.weights_proj\.weight$", ("index_heads", None)),
    # MoE: routed experts over the expert axis, the shared expert's intermediate dim over model
    (r"\.ffn\.experts\.w[123]$", ("experts", None, None)),
    (r"\.ffn\.shared_experts\.w[13]\.weight$", ("ffn", None)),
    (r"\.ffn\.shared_experts\.w2\.weight$", (None, "ffn")),
    # replicated: low-rank projections shared by all heads, norms, compressors, router, mHC
    (r"\.attn\.(wq_a|wkv)\.weight$", REPLICATED),
    (r"\.attn\.(q_norm|kv_norm)\.weight$", REPLICATED),
    (r"\.attn\.(indexer\.)?compressor\.(wkv|wgate|norm)\.weight$", REPLICATED),
    (r"\.attn\.(indexer\.)?compressor\.ape$", REPLICATED),
    (r"\.ffn\.gate\.(weight|bias|tid2eid)$", REPLICATED),
    (r"^(layers|mtp)\.\d+\.(attn_norm|ffn_norm)\.weight$", REPLICATED),
    (r"^(layers\.\d+\.hc_(attn|ffn)|mtp\.\d+\.hc_(attn|ffn|head)|hc_head)_(fn|base|scale)$", REPLICATED),
    (r"^(mtp\.\d+\.)?norm\.weight$", REPLICATED),
    (r"^mtp\.\d+\.main_norm\.weight$", REPLICATED),
    (r"^mtp\.\d+\.main_proj\.weight$", REPLICATED),
    (r"^mtp\.\d+\.confidence_head\.proj\.weight$", REPLICATED),
)

# Scale path -> its weight's path: FP8 linears ``x.weight`` / ``x.scale`` (128 x 128 blocks),
# FP4 routed experts ``w1`` / ``w1_scale`` (per 32 inputs; widened to e4m3: per 128).
SCALE_RULES: tuple[tuple[str, str], ...] = (
    (r"^(.*)\.scale$", r"\1.weight"),
    (r"^(.*\.experts\.w[123])_scale$", r"\1"),
)

# Cache and per-request decoding state (``TargetCache``, ``DraftCache``, the engine's
# ``BatchState``; paths with or without the ``cache.`` / ``draft.`` prefix). Every leaf has the
# request as its leading dim; fp8 pools are ``.nope`` / ``.rope`` pairs, fp8 indexer keys ``.codes`` / ``.scales``.
STATE_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"^(cache\.)?layers\.\d+\.window(\.nope|\.rope)?$", ("batch", None, None)),
    (r"^(cache\.)?layers\.\d+\.(compressor|indexer)\.(kv|score)$", ("batch", None, None)),
    (r"^(cache\.)?layers\.\d+\.(compressor|indexer)\.entries(\.nope|\.rope|\.codes|\.scales)?$", ("batch", None, None)),
    (r"^(cache\.)?lengths$", ("batch",)),
    (r"^(draft\.)?rings\.\d+$", ("batch", None, None)),
    (r"^(anchor|active|n_generated|max_new)$", ("batch",)),
    (r"^stop_ids$", ("batch", None)),
    (r"^sampling\.(temperature|top_k|top_p|seed)$", ("batch",)),
)
_PARAM = tuple((re.compile(p), axes) for p, axes in PARAM_RULES)
_SCALE = tuple((re.compile(p), w) for p, w in SCALE_RULES)
_STATE = tuple((re.compile(p), axes) for p, axes in STATE_RULES)


class UnknownPathError(KeyError):
    """An array path that no sharding rule names."""

    def __str__(self):
        return str(self.args[0])


def unit_count(axis: str, cfg: ModelConfig | None, dim: int) -> int:
    """How many indivisible units a logical axis has (a shard must hold whole units); ``batch``
    counts requests (the dim itself)."""
    if axis == "batch":
        return dim
    return {
        "vocab": cfg.vocab_size,
        "heads": cfg.num_attention_heads,
        "o_groups": cfg.o_groups,
        "index_heads": cfg.index_n_heads,
        "experts": cfg.n_routed_experts,
        "ffn": cfg.moe_intermediate_size,
    }[axis]


def make_mesh(model: int | None = None, data: int = 1, *, devices=None) -> Mesh:
    """A ``(data, model)`` mesh with Auto axes; by default every device on the ``model`` axis."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or len(devices) % data:
        raise ValueError(f"data={data} must be a positive divisor of the {len(devices)} devices")
    model = len(devices) // data if model is None else model
    if model < 1 or model * data > len(devices):
        raise ValueError(f"a mesh of data={data} x model={model} needs {model * data} devices; "
                         f"{len(devices)} are available")
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:model * data])


def _rule(path: str, rules) -> tuple[str | None, ...]:
    for pattern, axes in rules:
        if pattern.search(path):
            return axes
    raise UnknownPathError(f"no sharding rule for {path!r}: every array needs a rule in dspark_jax.sharding "
                           f"(replicated ones too)")


def logical_axes(path: str) -> tuple[str | None, ...]:
    """The logical axes of a parameter (``REPLICATED`` = not split); unknown paths raise."""
    return _rule(path, _PARAM)


def weight_of(path: str) -> str | None:
    """The weight a scale path belongs to, or None for a path that is not a scale."""
    for pattern, weight in _SCALE:
        if pattern.match(path):
            return pattern.sub(weight, path)
    return None


def mesh_axes(axis: str, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a logical axis is split over (those of more than one device)."""
    return tuple(a for a in LOGICAL_AXES[axis] if mesh.shape.get(a, 1) > 1)


def batch_axes(batch: int, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a batch of ``batch`` requests is split over: those of ``batch`` (``data``)
    when the requests divide by their size, else none (as ``STATE_RULES`` place the caches)."""
    names = mesh_axes("batch", mesh)
    return names if names and batch % math.prod(mesh.shape[a] for a in names) == 0 else ()


def _spec(path: str, axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, units,
          scale_shape: tuple[int, ...] | None = None) -> PartitionSpec:
    """A PartitionSpec splitting each named dim over its mesh axes when the shards hold whole units
    (and, for a weight with block scales ``scale_shape``, whole scale blocks); else replicated."""
    if len(axes) > len(shape):
        raise ValueError(f"sharding rule for {path} names {len(axes)} dims; the array has shape {shape}")
    spec: list[str | tuple[str, ...] | None] = []
    for i, (dim, axis) in enumerate(zip(shape, axes + (None,) * (len(shape) - len(axes)))):
        entry = None
        if axis is not None:
            names = mesh_axes(axis, mesh)
            n = math.prod(mesh.shape[a] for a in names)
            n_units = units(axis, dim)
            ok = n > 1 and n_units % n == 0 and dim % n_units == 0
            if ok and scale_shape is not None:
                blocks = scale_shape[i]
                block = -(-dim // blocks)
                ok = blocks % n == 0 and dim // n == (blocks // n) * block
            if ok:
                entry = names[0] if len(names) == 1 else names
        spec.append(entry)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def activation_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                    cfg: ModelConfig) -> PartitionSpec:
    """The PartitionSpec of an activation whose dims have these logical axes (e.g. queries
    ``("batch", None, "heads")``), by the rules of the parameters and caches: a dim is split only
    when its requests / heads / ... divide by its mesh axes, so it lines up with their layout."""
    return _spec("activation", axes, shape, mesh, lambda axis, dim: unit_count(axis, cfg, dim))


def per_request(fn, mesh: Mesh | None, *args, replicated: tuple = ()):
    """``fn(*replicated, *args)`` where every array of ``args`` and of the result has the request
    (or token) as its leading dim: on a mesh, every device runs ``fn`` in a ``shard_map`` on its
    own requests (split over ``data`` as ``batch_axes`` splits them; ``replicated``, e.g. a
    module's weights, whole on every device). For per-request work that XLA's partitioner would
    otherwise run on gathered inputs: Pallas calls, top-k selections, gathers by position."""
    if mesh is None:
        return fn(*replicated, *args)
    axes = batch_axes(jax.tree_util.tree_leaves(args)[0].shape[0], mesh)
    req = PartitionSpec(axes) if axes else PartitionSpec()
    n = len(replicated)
    return jax.shard_map(fn, mesh=mesh, in_specs=(PartitionSpec(),) * n + (req,) * len(args), out_specs=req,
                         check_vma=False)(*replicated, *args)


def partition_spec(path: str, shape: tuple[int, ...], cfg: ModelConfig, mesh: Mesh,
                   scale_shape: tuple[int, ...] | None = None) -> PartitionSpec:
    """The PartitionSpec of one parameter (a weight with block scales: pass the scale's shape)."""
    return _spec(path, logical_axes(path), shape, mesh, lambda axis, dim: unit_count(axis, cfg, dim), scale_shape)


def _flat(state_or_module) -> list[tuple[str, Any]]:
    state = state_or_module if isinstance(state_or_module, nnx.State) else nnx.state(state_or_module)
    return [(".".join(map(str, k)), v) for k, v in nnx.to_flat_state(state)]


def param_shardings(state_or_module, cfg: ModelConfig, mesh: Mesh) -> dict[str, NamedSharding]:
    """Parameter path -> NamedSharding for every variable of a (possibly abstract) model; a scale
    (and a dense copy, ``Linear.weight_copy``) gets its weight's spec. Raises ``UnknownPathError``
    for a path no rule names."""
    flat = dict(_flat(state_or_module))
    copies = {path: path.removesuffix("_copy") for path in flat if path.endswith(".weight_copy")}  # dense copies
    for path in copies:
        del flat[path]
    scale_of = {}
    for path in flat:
        weight = weight_of(path)
        if weight is not None:
            if weight not in flat:
                raise UnknownPathError(f"scale {path!r} has no weight {weight!r}")
            scale_of[weight] = path
    specs = {}
    for path, var in flat.items():
        if weight_of(path) is None:
            scale = scale_of.get(path)
            specs[path] = partition_spec(path, tuple(var.shape), cfg, mesh,
                                         None if scale is None else tuple(flat[scale].shape))
    for weight, scale in scale_of.items():
        specs[scale] = specs[weight]
    for copy, weight in copies.items():  # a dense copy: its weight's shape, so its weight's spec
        specs[copy] = specs[weight]
    return {path: NamedSharding(mesh, spec) for path, spec in specs.items()}


def key_path(keys) -> str:
    """A pytree key path as a dotted string (``cache.layers.2.window.nope``)."""
    parts = []
    for k in keys:
        for attr in ("name", "idx", "key"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def state_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of one cache / per-request array (``STATE_RULES``)."""
    return _spec(path, _rule(path, _STATE), shape, mesh, lambda axis, dim: unit_count(axis, None, dim))


def state_shardings(tree, mesh: Mesh):
    """NamedShardings (a pytree like ``tree``) for caches and per-request decoding state (arrays
    or ``jax.ShapeDtypeStruct``): split by request over ``data`` when the batch divides by it,
    replicated over ``model``. Raises ``UnknownPathError`` for a leaf no rule names."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [NamedSharding(mesh, state_spec(key_path(k), tuple(x.shape), mesh)) for k, x in leaves])


def shard_bytes(abstract_tree, shardings) -> int:
    """Bytes one device holds of ``abstract_tree`` placed by ``shardings``: a model (state or
    module) with a path -> sharding dict from ``param_shardings``, or a pytree of arrays with a
    pytree of shardings from ``state_shardings``. Every split is even, so every device holds
    the same bytes."""
    if isinstance(abstract_tree, (nnx.State, nnx.Module)):
        items = [(tuple(v.shape), v.dtype, shardings[p]) for p, v in _flat(abstract_tree)]
    else:
        items = [(tuple(x.shape), x.dtype, sh) for x, sh in zip(jax.tree_util.tree_leaves(abstract_tree),
                                                                  jax.tree_util.tree_leaves(shardings))]
    return sum(math.prod(sh.shard_shape(shape)) * jax.numpy.dtype(dtype).itemsize for shape, dtype, sh in items)


def shard_state(state: nnx.State, shardings: Mapping[str, NamedSharding]) -> nnx.State:
    """A copy of ``state`` with every array placed on its sharding."""
    flat = []
    for key, var in nnx.to_flat_state(state):
        path = ".".join(map(str, key))
        flat.append((key, var.replace(jax.device_put(var.get_value(), shardings[path]))))
    return nnx.from_flat_state(flat)


def attach_mesh(module, mesh: Mesh):
    """Tell the modules of ``module`` (placed by ``param_shardings``) which mesh they run on, so
    that their per-request work runs per device in a ``shard_map``: the attention kernels, the
    compressors, fp8 cache writes, the fused mHC kernels and top-k selections (indexer, router) on
    each device's requests (and heads), the FP8 linears (``Linear`` with an FP8 weight) on each
    device's requests and weight shard (column- or row-parallel as the weight is split), and the
    routed experts (grouped MoE path, ``moe.expert_parallel``) on each device's experts, when the
    experts are split (else the partitioner would gather every expert); returns ``module``."""
    from dspark_jax.model.attention import Attention
    from dspark_jax.model.block import Block
    from dspark_jax.model.common import Linear
    from dspark_jax.model.compressor import Compressor
    from dspark_jax.model.deepseek_v4 import DeepSeekV4
    from dspark_jax.model.indexer import Indexer
    from dspark_jax.model.moe import Experts, Gate

    axes = mesh_axes("experts", mesh)
    split = bool(axes) and module.cfg.n_routed_experts % math.prod(mesh.shape[a] for a in axes) == 0
    multi = mesh.size > 1
    specs = param_shardings(module, module.cfg, mesh)
    for path, mod in nnx.iter_modules(module):
        if isinstance(mod, Experts):
            mod.mesh = mesh if split else None
        elif isinstance(mod, (Attention, Compressor, Indexer, Gate, Block, DeepSeekV4)):
            mod.mesh = mesh if multi else None
        elif isinstance(mod, Linear) and mod.quantized:  # the FP8 GEMM: per device on its weight shard
            mod.mesh = mesh if multi else None
            mod.spec = specs[".".join(map(str, (*path, "weight")))].spec if multi else None
    return module


def shard_model(model, mesh: Mesh):
    """The same model with its parameters placed by ``param_shardings`` (a new ``Model``)."""
    from dspark_jax.api import Model

    graphdef, state = nnx.split(model.module)
    state = shard_state(state, param_shardings(state, model.config, mesh))
    return Model(attach_mesh(nnx.merge(graphdef, state), mesh), tokenizer=model.tokenizer,
                 sts_temperatures=model.sts_temperatures, path=model.path)


def model_mesh(model) -> Mesh | None:
    """The mesh a model's parameters are placed on, or None for a single device."""
    for leaf in jax.tree_util.tree_leaves(model.state):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
            return sh.mesh
    return None
