"""Write the trained pair in the official checkpoint layout with bounded file sizes:
``config.json``, ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` (or one
``model.safetensors``), ``tokenizer.json`` and ``sts.json``. Weights go through
``checkpoint.hf.save_official`` (unquantised bf16 / fp32 / int64 tensors)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
from flax import nnx

from dspark_jax.checkpoint import hf

INDEX = "model.safetensors.index.json"
HEADER_ALLOWANCE = 256 * 1024  # room left in every weight file for its safetensors JSON header


class ExportError(ValueError):
    """The export would break the size limits of the shipped files."""


def round_to_checkpoint(model: nnx.Module) -> None:
    """Round every parameter to the precision the (unquantised) official layout stores: bf16 except
    fp32 / integer tensors. Norm weights, for instance, are fp32 in the model but bf16 in the files;
    rounding before the final evaluation makes the evaluated model exactly the shipped one."""
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(model))}
    for name, (path, expert, _) in hf.official_names(model).items():
        if expert in (None, 0) and hf.official_format(name) not in ("fp32", "int"):
            var = flat[path]
            var.set_value(var[...].astype(jnp.bfloat16).astype(var.dtype))


def export_model(model: nnx.Module, path: str, *, tokenizer=None, sts: dict | None = None,
                 max_file_mib: float = 16.0, max_total_mib: float = 32.0) -> dict[str, int]:
    """Write the official-layout directory; returns {file name: bytes}. Raises ExportError if a
    file exceeds ``max_file_mib`` or all together exceed ``max_total_mib``."""
    os.makedirs(path, exist_ok=True)
    for stale in os.listdir(path):  # an earlier export may have had a different number of shards
        if stale.endswith(".safetensors") or stale == INDEX:
            os.remove(os.path.join(path, stale))
    hf.save_official(model, path, max_shard_bytes=int(max_file_mib * 2**20) - HEADER_ALLOWANCE)
    if tokenizer is not None:
        tokenizer.save(os.path.join(path, "tokenizer.json"))
    if sts is not None:
        with open(os.path.join(path, "sts.json"), "w") as f:
            json.dump(sts, f, indent=2)
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))}
    big = {f: s for f, s in sizes.items() if s > max_file_mib * 2**20}
    if big:
        raise ExportError(f"files over {max_file_mib} MiB: {big}")
    if sum(sizes.values()) > max_total_mib * 2**20:
        raise ExportError(f"export totals {sum(sizes.values()) / 2**20:.2f} MiB > {max_total_mib} MiB: {sizes}")
    return sizes
