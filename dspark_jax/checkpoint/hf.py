"""Official DeepSeek-V4 / DSpark checkpoint layout (``config.json`` + safetensors) to model params.

Parameter paths of the NNX model are the official tensor names, except that routed experts are
stacked: ``layers.{i}.ffn.experts.{e}.w1.weight`` -> ``layers.{i}.ffn.experts.w1[e]``.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_MTP = re.compile(r"^mtp\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into."""


def safetensors_files(path: str) -> list[str]:
    """The weight files of a checkpoint directory (sharded index or a single file)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def tensor_names(path: str) -> dict[str, str]:
    """Official tensor name -> file holding it."""
    names = {}
    for file in safetensors_files(path):
        with safe_open(file, "flax") as f:
            for k in f.keys():
                names[k] = file
    return names


def count_mtp_stages(names) -> int:
    return len({int(m.group(1)) for n in names if (m := _MTP.match(n))})


def param_path(name: str) -> tuple[str, int | None]:
    """Official tensor name -> (model state path, expert index or None)."""
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    return name, None


def official_names(model: nnx.Module) -> dict[str, tuple[str, int | None, tuple[int, ...]]]:
    """Every tensor the official checkpoint must hold for this model: name -> (path, expert, shape)."""
    out = {}
    for key, var in nnx.to_flat_state(nnx.state(model)):
        path = ".".join(map(str, key))
        shape = tuple(var.shape)
        if path.endswith((".experts.w1", ".experts.w2", ".experts.w3")):
            stem, w = path.rsplit(".", 1)
            for e in range(shape[0]):
                out[f"{stem}.{e}.{w}.weight"] = (path, e, shape[1:])
        else:
            out[path] = (path, None, shape)
    return out


def load_into(model: nnx.Module, path: str, *, ignore_prefixes: tuple[str, ...] = ()) -> None:
    """Fill ``model``'s parameters from an official checkpoint directory, checking every tensor."""
    expected = official_names(model)
    found = tensor_names(path)
    relevant = {k: v for k, v in found.items() if not k.startswith(ignore_prefixes)}
    missing = sorted(set(expected) - set(relevant))
    unexpected = sorted(set(relevant) - set(expected))
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors: {missing[:20]}")
    if unexpected:
        raise CheckpointError(f"checkpoint {path} has {len(unexpected)} unexpected tensors: {unexpected[:20]}")

    state = nnx.state(model)
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}
    stacks: dict[str, list] = defaultdict(lambda: None)
    by_file = defaultdict(list)
    for name in expected:
        by_file[relevant[name]].append(name)
    for file, names in by_file.items():
        with safe_open(file, "flax") as f:
            for name in names:
                ppath, expert, shape = expected[name]
                t = f.get_tensor(name)
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"tensor {name}: expected shape {shape}, found {tuple(t.shape)}")
                var = flat[ppath]
                t = t.astype(var.dtype)
                if expert is None:
                    var.set_value(t)
                else:
                    if stacks[ppath] is None:
                        stacks[ppath] = [None] * var.shape[0]
                    stacks[ppath][expert] = t
    for ppath, parts in stacks.items():
        flat[ppath].set_value(jnp.stack(parts))
    nnx.update(model, state)


def official_tensors(model: nnx.Module):
    """Yield (official name, numpy array) for every parameter, experts unstacked, in name order."""
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(model))}
    for name, (ppath, expert, _) in sorted(official_names(model).items()):
        value = flat[ppath][...]
        if expert is not None:
            value = value[expert]
        yield name, np.asarray(value)


def save_official(model: nnx.Module, path: str, *, config: dict | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the official layout (unquantised: matrices
    in their parameter dtype, fp32 norms / mHC / sinks / ape / router bias, int64 ``tid2eid``)."""
    from safetensors.flax import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, value in official_tensors(model):
        if name.endswith(".tid2eid"):
            value = value.astype(np.int64)
        tensors[name] = jnp.asarray(value)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config if config is not None else model.cfg.to_hf_dict(), f, indent=2)
