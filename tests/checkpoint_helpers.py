"""Helpers of the checkpoint tests: fast random models and a reference decoder written from the
format definitions (bit fields), independent of ``dspark_jax.checkpoint.codecs``."""

from __future__ import annotations

import json
import math
import os
import struct

import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4


def random_model(cfg, seed: int = 0, param_dtype=jnp.float32, *, tokenizer=None) -> dspark_jax.Model:
    """A model with every parameter random (numpy; much faster than ``init`` + ``perturb``).

    Matrix rows get power-of-two gains 2**U(-3, 3) so quantisation blocks need different scales.
    """
    num = Numerics(dtype=param_dtype, param_dtype=param_dtype)
    abstract = nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    for key, var in nnx.to_flat_state(state):
        path, shape, dt = ".".join(map(str, key)), tuple(var.shape), np.dtype(var.dtype)
        n = rng.standard_normal(shape, np.float32)
        if np.issubdtype(dt, np.integer):
            v = rng.integers(0, cfg.n_routed_experts, shape)
        elif path.endswith("norm.weight"):
            v = 1 + 0.1 * n
        elif "hc_" in path:
            v = {"fn": 0.02 * n, "base": 0.3 * n, "scale": 1 + 0.1 * n}[path.rsplit("_", 1)[1]]
        elif len(shape) == 1 or path.endswith(".ape"):
            v = 0.3 * n
        else:
            gain = np.exp2(rng.integers(-3, 4, shape[:-1] + (1,))).astype(np.float32)
            v = n * gain / math.sqrt(shape[-1])
        var.set_value(jnp.asarray(np.asarray(v).astype(dt)))
    return dspark_jax.Model(nnx.merge(graphdef, state), tokenizer=tokenizer)


def flat_params(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model.module))}


# ---------------------------------------------------------------------------- raw file access
def read_safetensors(path: str) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of a checkpoint directory as (dtype name, raw bytes as uint8 [.., itemsize])."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    out = {}
    for name in names:
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        for k, info in header.items():
            if k == "__metadata__":
                continue
            b0, b1 = info["data_offsets"]
            raw = np.frombuffer(data[8 + n + b0:8 + n + b1], np.uint8)
            out[k] = (info["dtype"], raw, tuple(info["shape"]))
    return out


# ---------------------------------------------------------------------------- reference decoders
def ref_e8m0(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    return np.where(b == 255, np.nan, 2.0 ** (b - 127))


def ref_e4m3(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes: sign | 4 exponent bits (bias 7) | 3 mantissa bits; 0x7f / 0xff = NaN."""
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * value)


def ref_e2m1(code: np.ndarray) -> np.ndarray:
    """e2m1 4-bit codes: sign | 2 exponent bits (bias 1) | 1 mantissa bit."""
    code = code.astype(np.int64)
    sign = np.where(code & 0x8, -1.0, 1.0)
    exp, man = (code >> 1) & 0x3, code & 0x1
    return sign * np.where(exp == 0, man * 0.5, (1 + man / 2.0) * 2.0 ** (exp - 1))


def ref_decode_fp8(q_bytes: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    s = ref_e8m0(scale_bytes)
    full = np.kron(s, np.ones((128, 128)))[: q_bytes.shape[0], : q_bytes.shape[1]]
    return ref_e4m3(q_bytes) * full


def ref_decode_fp4(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    p = packed.astype(np.int64) & 0xFF
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[0], -1)  # low nibble first
    return ref_e2m1(codes) * np.repeat(ref_e8m0(scale_bytes), 32, axis=1)


def ref_decode(dtype: str, raw: np.ndarray, shape, scale=None) -> np.ndarray:
    """A stored tensor as float64 (or int64), decoding fp8 / fp4 with its scale entry."""
    if dtype == "F8_E4M3":
        return ref_decode_fp8(raw.reshape(shape), scale[1].reshape(scale[2]))
    if dtype == "I8" and scale is not None:
        return ref_decode_fp4(raw.view(np.int8).reshape(shape), scale[1].reshape(scale[2]))
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape).astype(np.float64)
    if dtype == "F32":
        return raw.view(np.float32).reshape(shape).astype(np.float64)
    if dtype == "I64":
        return raw.view(np.int64).reshape(shape)
    raise AssertionError(f"no reference decoder for {dtype}")
