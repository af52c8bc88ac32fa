"""Write the trained pair in the official checkpoint layout, sharded into files of bounded size:
``config.json``, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json``), ``tokenizer.json`` and ``sts.json``.

Tensor names and dtypes are those of ``checkpoint.hf.official_tensors`` (the same as
``save_official``); only the split into several files is added here.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.flax import save_file

from dspark_jax.checkpoint.hf import official_tensors

INDEX = "model.safetensors.index.json"
HEADER_ALLOWANCE = 256 * 1024  # room left in every file for the safetensors JSON header


class ExportError(ValueError):
    """The export would break the size limits of the shipped files."""


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensors into as few groups of at most ``max_bytes`` data bytes as first-fit decreasing finds
    (largest tensor first, each into the first group with room); names sorted within a group."""
    groups: list[list[str]] = []
    used: list[int] = []
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        n = sizes[name]
        if n > max_bytes:
            raise ExportError(f"tensor {name} ({n} bytes) alone exceeds the shard limit of {max_bytes} bytes")
        for i, u in enumerate(used):
            if u + n <= max_bytes:
                groups[i].append(name)
                used[i] += n
                break
        else:
            groups.append([name])
            used.append(n)
    return [sorted(g) for g in groups]


def save_sharded(model: nnx.Module, path: str, *, max_file_bytes: int) -> list[str]:
    """Write the safetensors file(s) of ``model``; returns the file names."""
    tensors = {}
    for name, value in official_tensors(model):
        tensors[name] = value.astype(np.int64) if name.endswith(".tid2eid") else value
    groups = plan_shards({k: v.nbytes for k, v in tensors.items()}, max_file_bytes - HEADER_ALLOWANCE)
    meta = {"format": "pt"}
    if len(groups) == 1:
        save_file({k: jnp.asarray(v) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: jnp.asarray(tensors[k]) for k in names}, os.path.join(path, fname), metadata=meta)
        files.append(fname)
        weight_map.update({k: fname for k in names})
    total = int(sum(v.nbytes for v in tensors.values()))
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files + [INDEX]


def export_model(model: nnx.Module, path: str, *, tokenizer=None, sts: dict | None = None,
                 max_file_mib: float = 16.0, max_total_mib: float = 32.0) -> dict[str, int]:
    """Write the official-layout directory; returns {file name: bytes}. Raises ExportError if a
    file exceeds ``max_file_mib`` or all together exceed ``max_total_mib``."""
    os.makedirs(path, exist_ok=True)
    for stale in os.listdir(path):  # an earlier export may have used a different sharding
        if stale.endswith(".safetensors") or stale == INDEX:
            os.remove(os.path.join(path, stale))
    files = save_sharded(model, path, max_file_bytes=int(max_file_mib * 2**20))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.cfg.to_hf_dict(), f, indent=2)
    files.append("config.json")
    if tokenizer is not None:
        tokenizer.save(os.path.join(path, "tokenizer.json"))
        files.append("tokenizer.json")
    if sts is not None:
        with open(os.path.join(path, "sts.json"), "w") as f:
            json.dump(sts, f, indent=2)
        files.append("sts.json")
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in files}
    big = {f: s for f, s in sizes.items() if s > max_file_mib * 2**20}
    if big:
        raise ExportError(f"files over {max_file_mib} MiB: {big}")
    if sum(sizes.values()) > max_total_mib * 2**20:
        raise ExportError(f"export totals {sum(sizes.values()) / 2**20:.2f} MiB > {max_total_mib} MiB: {sizes}")
    return sizes
