"""The official DeepSeek-V4 / DSpark checkpoint layout: ``config.json`` + safetensors, in and out.

Parameter paths of the NNX model are the official tensor names, except that routed experts are
stacked: ``layers.{i}.ffn.experts.{e}.w1.weight`` -> ``layers.{i}.ffn.experts.w1[e]`` (and their
``.scale`` -> ``layers.{i}.ffn.experts.w1_scale[e]`` when kept quantised).

Storage formats of the official checkpoints (``official_format``):
- fp8 (F8_E4M3 + ``.scale`` F8_E8M0, 128 x 128 blocks): attention ``wq_a``, ``wq_b``, ``wkv``,
  ``wo_a``, ``wo_b``, ``indexer.wq_b``, ``shared_experts.w1/w2/w3``, DSpark ``main_proj``;
- fp4 (I8 with two e2m1 codes per byte + ``.scale`` F8_E8M0 per 32 inputs): routed experts;
- fp32: ``hc_*``, ``attn_sink``, ``ape``, ``gate.bias``; integer: ``gate.tid2eid``;
- bf16: everything else (embed, head, norms, compressors, ``weights_proj``, router weight,
  Markov and confidence heads).
The loader accepts any of those encodings (or plain BF16 / F16 / F32) for any float matrix. A
model with ``weight_format="official"`` keeps FP8 / FP4 tensors as stored (codes and scale bytes,
no conversion; a tensor stored otherwise is quantised while read); a ``"dense"`` model gets every
matrix dequantised to its parameter dtype while reading.

MTP tensors: the DSpark drafter lives under ``mtp.{0..S-1}.``; S is the number of such stage
prefixes in the weights (DSpark checkpoints keep ``num_nextn_predict_layers: 1`` while shipping
3 stages). A stage holding the legacy next-token MTP tensors (``e_proj``, ``h_proj``, ``enorm``,
``hnorm``, in the non-DSpark Flash / Pro checkpoints) is not used by this project and skipped
whole; any other tensor the model does not have is an error.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dspark_jax import sharding as shd
from dspark_jax.checkpoint import codecs, files
from dspark_jax.checkpoint.files import TensorEntry
from dspark_jax.config import from_hf_config
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4

_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
_MTP = re.compile(r"^mtp\.(\d+)\.")
_LEGACY_MTP = re.compile(r"^mtp\.(\d+)\.(e_proj|h_proj|enorm|hnorm)\.")

_FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.ffn\.shared_experts\.w[123]"
                  r"|\.main_proj)\.weight$")
_FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP32 = re.compile(r"(^|\.)(hc_\w+_(fn|base|scale)|attn_sink|ape|gate\.bias)$")
_INT = re.compile(r"\.gate\.tid2eid$")

ENCODINGS = ("bf16", "official")
_PLAIN_FLOATS = ("BF16", "F16", "F32", "F64")
_INTS = ("I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64")
_SCALE_DTYPES = ("F8_E8M0", "U8", "F32")
_CHUNK_BYTES = 16 << 20  # rows read per step while converting a tensor
_RELEASE_BYTES = 4 << 20  # flush deferred host-buffer releases after placing tensors this large

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                       "weight_block_size": [codecs.FP8_BLOCK, codecs.FP8_BLOCK]}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into."""


# ---------------------------------------------------------------------------- names
def param_path(name: str) -> tuple[str, int | None]:
    """Official tensor name -> (model state path, expert index or None)."""
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.{m.group(3)}" + ("_scale" if m.group(4) == "scale" else ""), int(m.group(2))
    return name, None


_STACKED = (".experts.w1", ".experts.w2", ".experts.w3")


def scale_path(path: str) -> str:
    """Model path of the scale bytes kept beside a quantised weight."""
    return path + "_scale" if path.endswith(_STACKED) else path[: -len(".weight")] + ".scale"


def stored_format(flat: dict[str, nnx.Variable], path: str) -> str:
    """How the model holds a weight: "fp8" (128 x 128 scale blocks), "fp4", "fp8_k128" (FP4 values
    widened to e4m3; codes + scale bytes per row and 128 inputs) or "dense"."""
    if scale_path(path) not in flat or path == scale_path(path):
        return "dense"
    if flat[path].dtype != jnp.float8_e4m3fn:
        return "fp4"
    return "fp8_k128" if path.endswith(_STACKED) else "fp8"


def flat_variables(state: nnx.State) -> dict[str, nnx.Variable]:
    """Path -> variable, without dense copies (``Linear.weight_copy``: not checkpoint tensors)."""
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}
    return {p: v for p, v in flat.items() if not p.endswith(".weight_copy")}


def _expected(flat: dict[str, nnx.Variable]) -> dict[str, tuple[str, int | None, tuple[int, ...]]]:
    """Official tensor name -> (model path, expert index, logical shape) for every weight; the
    scale bytes of quantised weights come with their weights and are not listed. The shape is
    the matrix the tensor holds (a packed fp4 weight [out, in / 2] is an [out, in] matrix)."""
    out = {}
    scales = {scale_path(p) for p in flat if stored_format(flat, p) != "dense"}
    for path, var in flat.items():
        if path in scales:
            continue
        shape = tuple(var.shape)
        if stored_format(flat, path) == "fp4":
            shape = (*shape[:-1], 2 * shape[-1])
        if path.endswith(_STACKED):
            stem, w = path.rsplit(".", 1)
            for e in range(shape[0]):
                out[f"{stem}.{e}.{w}.weight"] = (path, e, shape[1:])
        else:
            out[path] = (path, None, shape)
    return out


def official_names(model: nnx.Module) -> dict[str, tuple[str, int | None, tuple[int, ...]]]:
    """Every tensor the official checkpoint must hold for this model: name -> (path, expert, shape)."""
    return _expected(flat_variables(nnx.state(model)))


def official_format(name: str) -> str:
    """How the official checkpoints store a tensor: "fp8", "fp4", "fp32", "int" or "bf16"."""
    if _FP4.search(name):
        return "fp4"
    if _FP8.search(name):
        return "fp8"
    if _FP32.search(name):
        return "fp32"
    if _INT.search(name):
        return "int"
    return "bf16"


def scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + ".scale"


def mtp_stages(names) -> tuple[list[int], list[int]]:
    """(DSpark stage indices, legacy MTP stage indices) among ``mtp.{k}.`` tensor prefixes."""
    legacy = sorted({int(m.group(1)) for n in names if (m := _LEGACY_MTP.match(n))})
    stages = sorted({int(m.group(1)) for n in names if (m := _MTP.match(n))} - set(legacy))
    if stages != list(range(len(stages))):
        raise CheckpointError(f"DSpark stages must be numbered mtp.0 .. mtp.{len(stages) - 1}; found mtp.{stages}")
    return stages, legacy


# ---------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class Source:
    """One stored tensor feeding a parameter (or one expert of a stacked parameter)."""

    weight: TensorEntry
    scale: TensorEntry | None
    fmt: str  # "plain" | "fp8" | "fp4"

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale is not None else 0)


def _check_source(name: str, shape: tuple[int, ...], integer: bool, entries: dict[str, TensorEntry],
                  problems: list[str]) -> Source | None:
    e = entries[name]
    scale = entries.get(scale_name(name)) if name.endswith(".weight") else None
    found = f"{e.dtype} {list(e.shape)}" + (f" with .scale {scale.dtype} {list(scale.shape)}" if scale else "")
    if integer:
        if e.dtype not in _INTS or scale is not None:
            problems.append(f"tensor {name}: expected dtype integer (I64 / I32), found {found}")
        elif e.shape != shape:
            problems.append(f"tensor {name}: expected shape {list(shape)}, found {list(e.shape)}")
        else:
            return Source(e, None, "plain")
        return None
    if scale is not None and scale.dtype not in _SCALE_DTYPES:
        problems.append(f"tensor {scale.name}: expected dtype F8_E8M0 (or F32), found {scale.dtype}")
        return None
    if e.dtype in _PLAIN_FLOATS and scale is None:
        if e.shape != shape:
            problems.append(f"tensor {name}: expected shape {list(shape)}, found {list(e.shape)}")
            return None
        return Source(e, None, "plain")
    if e.dtype == "F8_E4M3" and scale is not None and len(shape) == 2:
        want = codecs.fp8_scale_shape(shape)
        if e.shape != shape or scale.shape != want:
            problems.append(f"tensor {name}: expected shape {list(shape)} with .scale {list(want)} (fp8), "
                            f"found {found}")
            return None
        return Source(e, scale, "fp8")
    if e.dtype in ("I8", "U8") and scale is not None and len(shape) == 2 and shape[1] % codecs.FP4_BLOCK == 0:
        packed, want = codecs.fp4_shapes(shape)
        if e.shape != packed or scale.shape != want:
            problems.append(f"tensor {name}: expected packed fp4 shape {list(packed)} with .scale {list(want)} "
                            f"for a {list(shape)} matrix, found {found}")
            return None
        return Source(e, scale, "fp4")
    problems.append(f"tensor {name}: expected dtype BF16 / F16 / F32, F8_E4M3 + F8_E8M0 .scale, or I8-packed fp4 "
                    f"+ .scale for a {list(shape)} float parameter, found {found}")
    return None


def plan_sources(flat: dict[str, nnx.Variable], entries: dict[str, TensorEntry], *, skip_prefixes=(),
                 where: str = "checkpoint") -> dict[str, list[Source]]:
    """Match every model parameter with its stored tensors, or raise one CheckpointError listing
    missing tensors, unexpected tensors and every shape / dtype mismatch."""
    expected = _expected(flat)
    relevant = {n: e for n, e in entries.items() if not n.startswith(tuple(skip_prefixes))}
    scales = {scale_name(n) for n in expected if n.endswith(".weight")}
    missing = sorted(set(expected) - set(relevant))
    unexpected = sorted(n for n in relevant if n not in expected and n not in scales)
    unexpected += sorted(n for n in relevant if n in scales and n[: -len(".scale")] + ".weight" not in relevant)
    problems: list[str] = []
    plans: dict[str, list[Source | None]] = {}
    for name, (path, expert, shape) in expected.items():
        if name not in relevant:
            continue
        integer = stored_format(flat, path) == "dense" and jnp.issubdtype(flat[path].dtype, jnp.integer)
        src = _check_source(name, shape, integer, relevant, problems)
        n_experts = flat[path].shape[0] if expert is not None else 1
        plans.setdefault(path, [None] * n_experts)[expert or 0] = src
    if missing or unexpected or problems:
        lines = [f"{where} does not match the model:"]
        if missing:
            lines.append(f"  missing tensors ({len(missing)}): {missing[:30]}" + (" ..." if len(missing) > 30 else ""))
        if unexpected:
            lines.append(f"  unexpected tensors ({len(unexpected)}): {unexpected[:30]}"
                         + (" ..." if len(unexpected) > 30 else ""))
        lines += [f"  {p}" for p in problems[:30]] + ([f"  ... {len(problems) - 30} more"] if len(problems) > 30 else [])
        raise CheckpointError("\n".join(lines))
    return plans  # type: ignore[return-value]


# ---------------------------------------------------------------------------- reading
def _rows_per_chunk(e: TensorEntry, multiple: int) -> int:
    rows = max(1, _CHUNK_BYTES // max(1, e.row_bytes))
    return max(multiple, rows // multiple * multiple)


def read_source(reader: files.TensorReader, src: Source, shape: tuple[int, ...], dtype) -> np.ndarray:
    """One stored tensor decoded into a new ``dtype`` array of the parameter ``shape``.

    Conversions go row chunk by row chunk into the output, so the host holds the output array
    plus one chunk of the stored tensor.
    """
    dtype = np.dtype(dtype)
    w = src.weight
    if src.fmt == "plain" and (w.np_dtype == dtype or not shape):
        return reader.read(w).astype(dtype, copy=False)
    out = np.empty(shape, dtype)
    if src.fmt == "plain":
        step = _rows_per_chunk(w, 1)
        for r in range(0, shape[0], step):
            out[r:r + step] = reader.read_rows(w, r, min(r + step, shape[0]))
    elif src.fmt == "fp8":
        scale = reader.read(src.scale)
        step = _rows_per_chunk(w, codecs.FP8_BLOCK)
        for r in range(0, shape[0], step):
            codecs.decode_fp8_rows(reader.read_rows(w, r, min(r + step, shape[0])), scale, r, out[r:r + step])
    else:
        scale = reader.read(src.scale)
        step = _rows_per_chunk(w, 1)
        for r in range(0, shape[0], step):
            r1 = min(r + step, shape[0])
            codecs.decode_fp4_rows(reader.read_rows(w, r, r1), scale[r:r1], out[r:r1])
    return out


def _read_ids(reader: files.TensorReader, src: Source, dtype, upper: int) -> np.ndarray:
    """An integer table (``tid2eid``: expert ids) checked to lie in [0, upper) before narrowing."""
    raw = reader.read(src.weight)
    if raw.size and (raw.min() < 0 or raw.max() >= upper):
        raise CheckpointError(f"tensor {src.weight.name}: values must lie in [0, {upper}), "
                              f"found {raw.min()}..{raw.max()}")
    return raw.astype(dtype)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, device):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=jax.sharding.SingleDeviceSharding(device))


# Writes one expert into a device's part of a stacked array in place (the part is donated).
_set_row = jax.jit(lambda part, x, i: jax.lax.dynamic_update_index_in_dim(part, x.astype(part.dtype), i, 0),
                   donate_argnums=0)


def _release_host_buffers():
    # jaxlib frees the host source of a finished transfer lazily, from a Python gc callback
    # (jax-ml/jax#14882); a young-generation collection runs it, so the next tensor is read
    # only after the previous one's host copy is gone.
    gc.collect(0)


def _place(x: np.ndarray, sharding) -> jax.Array:
    out = jax.device_put(x) if sharding is None else jax.device_put(x, sharding)
    out.block_until_ready()
    if x.nbytes >= _RELEASE_BYTES:
        del x
        _release_host_buffers()
    return out


def read_stored(reader: files.TensorReader, src: Source, shape: tuple[int, ...], fmt: str,
                dtype) -> tuple[np.ndarray, ...]:
    """One stored tensor as the model holds it: (values,) decoded to ``dtype`` for "dense", or
    (codes, scale bytes) for "fp8" / "fp4" — copied as stored when the checkpoint has that
    format, else quantised from the decoded values."""
    if fmt == "dense":
        return (read_source(reader, src, shape, dtype),)
    if fmt == "fp8_k128":
        packed, scales = read_stored(reader, src, shape, "fp4", dtype)
        return codecs.fp4_to_e4m3_k128(packed, scales, src.weight.name)
    if src.fmt == fmt:
        codes = reader.read(src.weight)
        codes = codes.view(np.uint8) if fmt == "fp4" else codes.astype(ml_dtypes.float8_e4m3fn, copy=False)
        scales = reader.read(src.scale)
        scales = scales.view(np.uint8) if scales.dtype.itemsize == 1 else codecs.float_to_e8m0(scales).view(np.uint8)
        return codes, scales
    dense = read_source(reader, src, shape, np.float32)
    codes, scales = (codecs.encode_fp8 if fmt == "fp8" else codecs.encode_fp4)(dense)
    return (codes.view(np.uint8) if fmt == "fp4" else codes), scales.view(np.uint8)


def _read_param(reader, path: str, flat: dict[str, nnx.Variable], sources: list[Source], shardings,
                cfg) -> list[tuple[str, jax.Array]]:
    """(model path, array) for a parameter and, when kept quantised, its scale bytes."""
    var, fmt = flat[path], stored_format(flat, path)
    paths = [path] if fmt == "dense" else [path, scale_path(path)]
    targets = [(p, tuple(flat[p].shape), np.dtype(flat[p].dtype), shardings.get(p)) for p in paths]
    if len(sources) == 1 and not path.endswith(_STACKED):
        if np.issubdtype(var.dtype, np.integer):
            return [(path, _place(_read_ids(reader, sources[0], np.dtype(var.dtype), cfg.n_routed_experts),
                                  shardings.get(path)))]
        shape = tuple(var.shape) if fmt != "fp4" else (*var.shape[:-1], 2 * var.shape[-1])
        arrays = read_stored(reader, sources[0], shape, fmt, targets[0][2])
        return [(p, _place(a, sh)) for (p, _, _, sh), a in zip(targets, arrays)]
    shape = tuple(var.shape[1:]) if fmt != "fp4" else (*var.shape[1:-1], 2 * var.shape[-1])
    arrays = _stack_experts(lambda src: read_stored(reader, src, shape, fmt, targets[0][2]), sources,
                            [t[1:] for t in targets])
    return [(p, a) for (p, *_), a in zip(targets, arrays)]


def _stack_experts(read, sources: list[Source], targets: list[tuple[tuple[int, ...], np.dtype, object]]
                   ) -> list[jax.Array]:
    """Routed experts [E, ...] read one expert at a time (``read(source)`` gives one array per
    target: the weights, and their scale bytes when kept quantised); each device receives only
    the experts (and the slices of them) that its shard holds, written in place into its part."""
    stacks = []
    for shape, dtype, sharding in targets:
        if sharding is None:
            index_map = {jax.devices()[0]: tuple(slice(None) for _ in shape)}
        else:
            index_map = sharding.addressable_devices_indices_map(shape)
        parts = {d: _zeros_fn(tuple(len(range(n)[i]) for n, i in zip(shape, index)), dtype, d)()
                 for d, index in index_map.items()}
        rows = {d: range(shape[0])[index[0]] for d, index in index_map.items()}
        stacks.append((index_map, parts, rows))
    for e, src in enumerate(sources):
        for arr, (index_map, parts, rows) in zip(read(src), stacks):
            for device, index in index_map.items():
                if e in rows[device]:
                    piece = jax.device_put(np.ascontiguousarray(arr[index[1:]]), device)
                    parts[device] = _set_row(parts[device], piece, np.int32(rows[device].index(e)))
            del arr
    out = []
    for (shape, _, sharding), (_, parts, _) in zip(targets, stacks):
        for part in parts.values():
            part.block_until_ready()
        out.append(next(iter(parts.values())) if sharding is None else
                   jax.make_array_from_single_device_arrays(shape, sharding, list(parts.values())))
    _release_host_buffers()
    return out


def load_module(path: str, *, dtype=jnp.bfloat16, param_dtype=None, quant_sim: bool | None = None,
                weight_format: str | None = None, moe_impl: str = "auto", mesh=None, dspark: bool | None = None,
                progress: bool = True, matmul_precision: str = "highest") -> DeepSeekV4:
    """Build a ``DeepSeekV4`` module from an official checkpoint directory, streaming tensor by tensor.

    The module is created abstractly (no random init); each parameter is read, dequantised to
    its dtype and placed on its sharding (``dspark_jax.sharding`` rules when ``mesh`` is given)
    before the next one is read.

    quant_sim: None = True iff the checkpoint stores FP8 / FP4 weights.
    weight_format: "official" (FP8 / FP4 kept as stored), "fp8" (FP4 experts widened to e4m3
        codes with scales per 128 inputs, same values; ``codecs.fp4_to_e4m3_k128``) or "dense";
        None = "official" iff the checkpoint stores FP8 / FP4 weights.
    dspark: None = load the DSpark drafter if the checkpoint has one; True = require it (error
        for a DSpark-less checkpoint); False = target model only (``mtp.*`` tensors ignored).
    """
    entries = files.inventory(path)
    stages, legacy = mtp_stages(entries)
    # (without DSpark stages in the weights any dspark_* config keys are ignored below)
    cfg = from_hf_config(path, num_dspark_stages=len(stages) or 1)
    if stages and cfg.dspark is None:
        raise CheckpointError(f"{path}: the weights hold DSpark stages mtp.0 .. mtp.{len(stages) - 1} but config.json "
                              f"has no dspark_* keys (dspark_block_size, dspark_noise_token_id, "
                              f"dspark_target_layer_ids, dspark_markov_rank)")
    if dspark and not stages:
        what = "only a legacy MTP module (mtp.*.e_proj)" if legacy else "no mtp.* tensors"
        raise CheckpointError(f"{path} has no DSpark drafter ({what}); speculative decoding needs a DSpark "
                              f"checkpoint such as DeepSeek-V4-Flash-DSpark. Load with dspark=False for target-only "
                              f"decoding.")
    use_dspark = bool(stages) and dspark is not False
    if not use_dspark:
        cfg = cfg.replace(dspark=None)
    skip = tuple(f"mtp.{k}." for k in legacy) + (() if use_dspark else tuple(f"mtp.{k}." for k in stages))

    used = {n: e for n, e in entries.items() if not n.startswith(skip)}
    quantized = any(e.dtype == "F8_E4M3" or (e.dtype in ("I8", "U8") and scale_name(n) in used)
                    for n, e in used.items() if n.endswith(".weight"))
    num = Numerics(dtype=dtype, param_dtype=param_dtype or dtype,
                   quant_sim=quantized if quant_sim is None else bool(quant_sim), moe_impl=moe_impl,
                   weight_format=weight_format or ("official" if quantized else "dense"),
                   matmul_precision=matmul_precision)
    abstract = nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = flat_variables(state)
    plans = plan_sources(flat, entries, skip_prefixes=skip, where=f"checkpoint {path}")
    shardings = shd.param_shardings(state, cfg, mesh) if mesh is not None else {}

    order = sorted(plans, key=lambda p: (plans[p][0].weight.file, plans[p][0].weight.start))
    total = sum(s.nbytes for p in order for s in plans[p])
    with files.TensorReader() as reader, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                              desc=f"loading {os.path.basename(os.path.normpath(path))}") as bar:
        for p in order:
            for q, value in _read_param(reader, p, flat, plans[p], shardings, cfg):
                flat[q].set_value(value)
            bar.update(sum(s.nbytes for s in plans[p]))
    module = nnx.merge(graphdef, state)
    return module if mesh is None else shd.attach_mesh(module, mesh)


# ---------------------------------------------------------------------------- writing
def official_tensors(model: nnx.Module):
    """Yield (official name, numpy array) for every parameter, experts unstacked, in name order
    (weights kept quantised are yielded dequantised, in float32)."""
    flat = flat_variables(nnx.state(model))
    for name, (path, expert, _) in sorted(_expected(flat).items()):
        value = np.asarray(flat[path][...])
        fmt = stored_format(flat, path)
        if fmt != "dense":
            scale = np.asarray(flat[scale_path(path)][...])
            if expert is not None:
                value, scale = value[expert], scale[expert]
            decode = {"fp8": codecs.decode_fp8, "fp4": codecs.decode_fp4, "fp8_k128": codecs.decode_fp8_k128}[fmt]
            yield name, decode(value.view(np.int8) if fmt == "fp4" else value, scale)
            continue
        if expert is not None:
            value = value[expert]
        yield name, value


def encode_tensor(name: str, value: np.ndarray, encoding: str = "bf16") -> list[tuple[str, np.ndarray]]:
    """The stored tensors for one parameter: [(name, array)] plus (name.scale, scales) when quantised.

    encoding "bf16": unquantised (bf16, with fp32 / integer tensors as in the official files);
    "official": fp8 / fp4 where the official checkpoints have them.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    fmt = official_format(name)
    if fmt == "int":
        return [(name, np.asarray(value).astype(np.int64))]
    if fmt == "fp32":
        return [(name, np.asarray(value, np.float32))]
    if encoding == "official" and fmt == "fp8":
        q, s = codecs.encode_fp8(np.asarray(value, np.float32))
        return [(name, q), (scale_name(name), s)]
    if encoding == "official" and fmt == "fp4":
        q, s = codecs.encode_fp4(np.asarray(value, np.float32))
        return [(name, q), (scale_name(name), s)]
    return [(name, np.asarray(value).astype(ml_dtypes.bfloat16))]


def save_official(model, path: str, *, encoding: str = "bf16", config: dict | None = None,
                  max_shard_bytes: int | None = None, progress: bool = False) -> None:
    """Write ``config.json`` and the weights in the official layout (and ``tokenizer.json`` when the
    model has a tokenizer).

    model: a ``dspark_jax.Model`` or a ``DeepSeekV4`` module. encoding: see ``encode_tensor``.
    max_shard_bytes: split into ``model-0000k-of-0000n.safetensors`` shards of about this size
    plus ``model.safetensors.index.json`` (default: one ``model.safetensors``). A shard is
    assembled in host memory before it is written, so large models need this.
    """
    from safetensors.numpy import save_file

    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    module = getattr(model, "module", model)
    os.makedirs(path, exist_ok=True)
    shards: list[list[str]] = [[]]
    shard_bytes, weight_map, total = 0, {}, 0
    tmp_names: list[str] = []

    umask = os.umask(0)
    os.umask(umask)

    def flush(tensors: dict[str, np.ndarray]):
        tmp = os.path.join(path, f".shard-{len(tmp_names):05d}.safetensors.tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates owner-only files
        tmp_names.append(tmp)

    pending: dict[str, np.ndarray] = {}
    for name, value in tqdm(official_tensors(module), disable=not progress, desc="writing", unit="tensor"):
        for n, arr in encode_tensor(name, value, encoding):
            if max_shard_bytes is not None and pending and shard_bytes + arr.nbytes > max_shard_bytes:
                flush(pending)
                pending, shard_bytes = {}, 0
                shards.append([])
            pending[n] = np.ascontiguousarray(arr)
            shards[-1].append(n)
            shard_bytes += arr.nbytes
            total += arr.nbytes
    flush(pending)

    for old in (files.SINGLE_FILE, files.INDEX_FILE):
        if os.path.exists(os.path.join(path, old)):
            os.remove(os.path.join(path, old))
    if max_shard_bytes is None:
        os.replace(tmp_names[0], os.path.join(path, files.SINGLE_FILE))
    else:
        n = len(tmp_names)
        for i, (tmp, names) in enumerate(zip(tmp_names, shards)):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(path, fname))
            weight_map.update({name: fname for name in names})
        files.write_index(path, weight_map, total)

    cfg = dict(config) if config is not None else module.cfg.to_hf_dict()
    if encoding == "official":
        cfg.setdefault("quantization_config", QUANTIZATION_CONFIG)
        cfg.setdefault("expert_dtype", "fp4")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save(os.path.join(path, "tokenizer.json"))
