"""Safetensors files of a checkpoint directory: tensor inventory and ranged reads.

A checkpoint is ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
Tensors are read with numpy straight from the file at the offsets of the safetensors header
(8-byte little-endian header length, JSON header, raw little-endian data), one row range at a
time if asked, so a tensor costs exactly its own size in host memory. The safetensors numpy
binding cannot return float8 arrays (safetensors issue #682), hence this small reader; writing
goes through ``safetensors.numpy.save_file``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import dataclass

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32), "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}


class CheckpointFileError(ValueError):
    """A malformed or inconsistent checkpoint file: safetensors file, index, tokenizer."""


if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("reading safetensors files needs a little-endian host")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, safetensors dtype name, shape, absolute byte range."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def read_json(file: str, error: type[Exception] = CheckpointFileError):
    """The content of a JSON file; a malformed one raises ``error`` naming the file."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{file}: not valid JSON ({e})") from None


def read_header(file: str) -> dict[str, TensorEntry]:
    """Parse and check the header of one safetensors file."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointFileError(f"{file}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointFileError(f"{file}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointFileError(f"{file}: unreadable safetensors header ({e})") from None
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = info.get("dtype"), tuple(int(s) for s in info.get("shape", ()))
        b0, b1 = (int(x) for x in info.get("data_offsets", (-1, -1)))
        if dtype not in DTYPES:
            raise CheckpointFileError(f"{file}: tensor {name} has unsupported dtype {dtype!r}")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if not (0 <= b0 <= b1 and base + b1 <= size and b1 - b0 == want):
            raise CheckpointFileError(f"{file}: tensor {name} ({dtype} {list(shape)}) has a bad byte range "
                                      f"[{b0}, {b1}) for {want} bytes in a file of {size} bytes")
        out[name] = TensorEntry(name, file, dtype, shape, base + b0, base + b1)
    return out


def checkpoint_files(path: str) -> list[str]:
    """The weight files of a checkpoint directory (sharded index or a single file)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointFileError(f"{index} has no weight_map of tensor names to file names")
        return [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def inventory(path: str) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint directory, from the safetensors headers of all its files.

    With an index, the index and the file headers must agree tensor by tensor.
    """
    entries: dict[str, TensorEntry] = {}
    for file in checkpoint_files(path):
        if not os.path.exists(file):
            raise CheckpointFileError(f"{os.path.join(path, INDEX_FILE)} lists {os.path.basename(file)}, "
                                      f"which does not exist")
        for name, e in read_header(file).items():
            if name in entries:
                raise CheckpointFileError(f"tensor {name} appears in both {entries[name].file} and {file}")
            entries[name] = e
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        weight_map = read_json(index)["weight_map"]  # checked by checkpoint_files
        wrong = sorted(n for n, file in weight_map.items()
                       if n not in entries or os.path.basename(entries[n].file) != file)
        unlisted = sorted(set(entries) - set(weight_map))
        if wrong or unlisted:
            raise CheckpointFileError(f"{index} disagrees with the shard headers: {len(wrong)} tensors not in the "
                                      f"listed file {wrong[:10]}, {len(unlisted)} tensors not listed {unlisted[:10]}")
    return entries


class TensorReader:
    """Reads tensors (or row ranges of them) from the files of one checkpoint."""

    def __init__(self):
        self._files: dict[str, object] = {}

    def _handle(self, file: str):
        if file not in self._files:
            self._files[file] = open(file, "rb")
        return self._files[file]

    def read_rows(self, e: TensorEntry, row0: int = 0, row1: int | None = None) -> np.ndarray:
        """Rows [row0, row1) of a tensor (the whole tensor by default) as a new numpy array."""
        if not e.shape:
            row0, row1, start, count = 0, 1, e.start, 1
        else:
            row1 = e.shape[0] if row1 is None else row1
            start, count = e.start + row0 * e.row_bytes, (row1 - row0) * e.row_bytes // e.np_dtype.itemsize
        f = self._handle(e.file)
        f.seek(start)
        arr = np.fromfile(f, dtype=e.np_dtype, count=count)  # safetensors data is little-endian, like the host
        if arr.size != count:
            raise CheckpointFileError(f"{e.file}: tensor {e.name} is truncated")
        return arr.reshape((row1 - row0, *e.shape[1:]) if e.shape else ())

    def read(self, e: TensorEntry) -> np.ndarray:
        return self.read_rows(e)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_index(path: str, weight_map: dict[str, str], total_size: int) -> None:
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, f,
                  indent=2)
