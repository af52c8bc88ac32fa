"""Device meshes and where every parameter lives on them (DESIGN 7).

One place maps parameter paths to logical axes and logical axes to mesh axes. The default for
8 GPUs puts everything on a ``model`` axis: attention heads (``wq_b`` rows, sinks), output groups
(``wo_a`` rows, ``wo_b`` columns), indexer heads, routed experts, the shared expert's
intermediate dim, and the vocabulary of the embedding, the lm_head and the Markov head
(vocab-parallel). Small tensors (norms, mHC, the router, compressors, low-rank ``wq_a`` /
``wkv``) are replicated. A logical axis is sharded only when its unit count (heads, groups,
experts, vocabulary rows, ...) divides by the mesh axis size, so shards always hold whole heads
or groups; otherwise that dim is replicated.

The mesh uses ``AxisType.Auto``: the model's math carries no sharding annotations and XLA's
propagation places the intermediate results.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dspark_jax.config import ModelConfig

MODEL = "model"
DATA = "data"

# Logical axis -> mesh axis.
LOGICAL_AXES: dict[str, str] = {
    "vocab": MODEL,
    "heads": MODEL,
    "o_groups": MODEL,
    "index_heads": MODEL,
    "experts": MODEL,
    "ffn": MODEL,
    "batch": DATA,
}

# Parameter path (the official tensor name, routed experts stacked) -> logical axis of each dim.
# First match wins; no match = replicated.
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"^embed\.weight$", ("vocab", None)),
    (r"^head\.weight$", ("vocab", None)),
    (r"\.markov_head\.markov_w[12]\.weight$", ("vocab", None)),
    (r"\.attn\.wq_b\.weight$", ("heads", None)),
    (r"\.attn\.attn_sink$", ("heads",)),
    (r"\.attn\.wo_a\.weight$", ("o_groups", None)),
    (r"\.attn\.wo_b\.weight$", (None, "o_groups")),
    (r"\.attn\.indexer\.wq_b\.weight$", ("index_heads", None)),
    (r"\.attn\.indexer\.weights_proj\.weight$", ("index_heads", None)),
    (r"\.ffn\.experts\.w[123]$", ("experts", None, None)),
    (r"\.ffn\.shared_experts\.w[13]\.weight$", ("ffn", None)),
    (r"\.ffn\.shared_experts\.w2\.weight$", (None, "ffn")),
)
_COMPILED = tuple((re.compile(p), axes) for p, axes in PARAM_RULES)


def unit_count(axis: str, cfg: ModelConfig) -> int:
    """How many indivisible units a logical axis has (a shard must hold whole units)."""
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


def logical_axes(path: str) -> tuple[str | None, ...]:
    for pattern, axes in _COMPILED:
        if pattern.search(path):
            return axes
    return ()


def partition_spec(path: str, shape: tuple[int, ...], cfg: ModelConfig, mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of one parameter, replicating any dim whose units do not divide evenly."""
    axes = logical_axes(path)
    if len(axes) > len(shape):
        raise ValueError(f"sharding rule for {path} names {len(axes)} dims; the parameter has shape {shape}")
    spec: list[str | None] = []
    for dim, axis in zip(shape, axes + (None,) * (len(shape) - len(axes))):
        mesh_axis = LOGICAL_AXES.get(axis) if axis is not None else None
        size = mesh.shape.get(mesh_axis, 1) if mesh_axis is not None else 1
        units = unit_count(axis, cfg) if size > 1 else 0
        ok = size > 1 and units % size == 0 and dim % units == 0
        spec.append(mesh_axis if ok else None)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def _flat(state_or_module) -> list[tuple[str, Any]]:
    state = state_or_module if isinstance(state_or_module, nnx.State) else nnx.state(state_or_module)
    return [(".".join(map(str, k)), v) for k, v in nnx.to_flat_state(state)]


def param_shardings(state_or_module, cfg: ModelConfig, mesh: Mesh) -> dict[str, NamedSharding]:
    """Parameter path -> NamedSharding for every variable of a (possibly abstract) model."""
    return {path: NamedSharding(mesh, partition_spec(path, tuple(var.shape), cfg, mesh))
            for path, var in _flat(state_or_module)}


def shard_state(state: nnx.State, shardings: Mapping[str, NamedSharding]) -> nnx.State:
    """A copy of ``state`` with every array placed on its sharding."""
    flat = []
    for key, var in nnx.to_flat_state(state):
        path = ".".join(map(str, key))
        flat.append((key, var.replace(jax.device_put(var.get_value(), shardings[path]))))
    return nnx.from_flat_state(flat)


def shard_model(model, mesh: Mesh):
    """The same model with its parameters placed by ``param_shardings`` (a new ``Model``)."""
    from dspark_jax.api import Model

    graphdef, state = nnx.split(model.module)
    state = shard_state(state, param_shardings(state, model.config, mesh))
    return Model(nnx.merge(graphdef, state), tokenizer=model.tokenizer, sts_temperatures=model.sts_temperatures,
                 path=model.path)


def model_mesh(model) -> Mesh | None:
    """The mesh a model's parameters are placed on, or None for a single device."""
    for leaf in jax.tree_util.tree_leaves(model.state):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
            return sh.mesh
    return None


def batch_sharding(mesh: Mesh, batch: int) -> NamedSharding:
    """Per-request state (caches, lengths, sampling arrays): split over ``data`` when the batch
    divides by it, else replicated. The KV latent has no head axis to split over ``model``."""
    data = mesh.shape.get(DATA, 1)
    return NamedSharding(mesh, PartitionSpec(DATA) if data > 1 and batch % data == 0 else PartitionSpec())
