"""User-facing model handle: ``init`` (random weights), ``load`` (official checkpoint directory),
and ``Model.logits`` (one-shot scoring of token sequences)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.cache import KV_LAYOUTS, commit, init_cache
from dspark_jax.checkpoint import hf
from dspark_jax.checkpoint.files import read_json
from dspark_jax.config import ModelConfig
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4


class InputError(ValueError):
    """Bad user input (token ids, lengths, sampling parameters, ...)."""


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """An integer argument (bools and floats rejected) within [lo, hi), as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi})" if lo is not None else f"< {hi}"
        raise InputError(f"{name} must be {bounds}, got {value}")
    return value


def check_float(name: str, value: Any) -> float:
    """A finite real argument (bools and strings rejected), as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise InputError(f"{name} must be finite, got {value!r}")
    return float(value)


def check_kv_cache(kv_cache: str) -> None:
    """The ``kv_cache`` argument of ``generate`` and ``Model.logits``: a target KV pool layout."""
    if kv_cache not in KV_LAYOUTS:
        raise InputError(f"kv_cache must be one of {KV_LAYOUTS}, got {kv_cache!r}")


@functools.partial(jax.jit, static_argnames=("graphdef", "capture", "logits"), donate_argnames=("cache",))
def forward_step(graphdef, state, ids, n_valid, cache, *, capture=(), logits="all"):
    """Jitted ``DeepSeekV4.forward`` on split (graphdef, state)."""
    model = nnx.merge(graphdef, state)
    with model.num.precision_scope():
        return model.forward(ids, n_valid, cache, capture=capture, logits=logits)


class Model:
    """A DeepSeek-V4 (+ DSpark) model ready for inference.

    module: the Flax NNX module (parameter paths = official tensor names); tokenizer: an optional
    ``tokenizers.Tokenizer``; sts_temperatures: optional per-position confidence temperatures.
    """

    def __init__(self, module: DeepSeekV4, *, tokenizer=None, sts_temperatures: Sequence[float] | None = None,
                 path: str | None = None):
        self.module = module
        self.config: ModelConfig = module.cfg
        self.numerics: Numerics = module.num
        self.tokenizer = tokenizer
        self.sts_temperatures = None if sts_temperatures is None else tuple(float(t) for t in sts_temperatures)
        self.path = path
        self.graphdef, self.state = nnx.split(module)

    def __repr__(self):
        c = self.config
        return (f"Model(layers={c.num_hidden_layers}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
                f"dspark={c.dspark is not None}, dtype={self.numerics.dtype.name}, "
                f"quant_sim={self.numerics.quant_sim}, "
                f"weights={self.numerics.weight_format} {self.weight_bytes / 2**20:,.1f} MiB)")

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer as held in device memory (all devices together)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self.state))

    def check_ids(self, ids: Any, what: str = "token ids") -> np.ndarray:
        try:
            ids = np.asarray(ids)
        except (ValueError, TypeError) as e:  # ragged nested lists
            raise InputError(f"{what} must form a rectangular array of integers ({e})") from None
        if ids.size == 0:
            raise InputError(f"{what} are empty")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"{what} must be integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise InputError(f"{what} contain ids outside [0, {self.config.vocab_size}): {np.unique(ids[bad])[:10]}")
        return ids.astype(np.int32)

    def logits(self, token_ids: Any, *, chunk_size: int | None = None, kv_cache: str = "bf16") -> jax.Array:
        """fp32 logits [batch, seq, vocab] of every position by prefill from an empty cache.

        token_ids: [seq] or [batch, seq] integers. chunk_size: prefill in chunks of this many
        tokens (default: the whole sequence at once; chunks of up to 17 tokens take the decode /
        verify attention path). kv_cache: "bf16" or "fp8" target KV pools, as in ``generate``.
        """
        check_kv_cache(kv_cache)
        ids = self.check_ids(token_ids, "token_ids")
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise InputError(f"token_ids must be [seq] or [batch, seq], got shape {ids.shape}")
        b, t = ids.shape
        if t > self.config.max_position_embeddings:
            raise InputError(f"sequence of {t} tokens exceeds the model context "
                             f"(max_position_embeddings={self.config.max_position_embeddings})")
        step = t if chunk_size is None else check_int("chunk_size", chunk_size, lo=1)
        cache = init_cache(self.config, b, t, self.numerics.dtype, kv_layout=kv_cache)
        devices = jax.tree_util.tree_leaves(self.state)[0].devices()
        if len(devices) == 1:  # committed like forward_step's outputs: one program for every chunk
            cache = jax.device_put(cache, next(iter(devices)))
        out = []
        for s in range(0, t, step):
            part = jnp.asarray(ids[:, s:s + step])
            n = jnp.full((b,), part.shape[1], jnp.int32)
            lg, _, cache = forward_step(self.graphdef, self.state, part, n, cache)
            cache = commit(cache, n)
            out.append(lg)
        return jnp.concatenate(out, axis=1)


def init(config: ModelConfig, seed: int = 0, *, dtype=jnp.bfloat16, param_dtype=None, quant_sim: bool = False,
         moe_impl: str = "auto", weight_format: str = "dense", matmul_precision: str = "highest",
         tokenizer=None) -> Model:
    """A randomly initialised model (normal(0, 0.02) matrices, unit norms, zero sinks / ape / bias).
    ``weight_format="official"`` draws the FP8 linears and FP4 experts directly in those formats
    (random codes of about the same size). See ``dspark_jax.model.common.Numerics`` for the options."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    dtype = jnp.dtype(dtype)
    num = Numerics(dtype=dtype, param_dtype=jnp.dtype(param_dtype or dtype), quant_sim=quant_sim, moe_impl=moe_impl,
                   weight_format=weight_format, matmul_precision=matmul_precision)
    return Model(DeepSeekV4(config, num, rngs=nnx.Rngs(seed)), tokenizer=tokenizer)


def with_dense_copies(model: Model) -> Model:
    """The same model with every FP8 linear's weight also held dequantised in the activation dtype
    (``Linear.weight_copy``): calls of many rows (verify rounds of >= 11 requests, prefill) then
    multiply by the copies in XLA's GEMM, which on an H200 is 1.2-2.8x faster there than the
    grouped-matmul kernel on the FP8 weights (docs/benchmarks.md); decode steps keep the kernel.
    The same values (exact products, fp32 sums in another order). Costs memory: each copy holds
    twice its FP8 weight's bytes (DeepSeek-V4-Flash: 11.7 GiB over all layers and devices, 0.8 of
    them the drafter's; ``Model.weight_bytes`` counts them). Placed like their weights on a mesh;
    never saved. A model without FP8 linears gets no copies. A new ``Model``; ``model`` is
    unchanged."""
    from dspark_jax.model.common import Linear

    graphdef, state = nnx.split(model.module)
    module = nnx.merge(graphdef, state)
    for _, mod in nnx.iter_modules(module):
        if isinstance(mod, Linear):
            mod.keep_dense_copy()
    return Model(module, tokenizer=model.tokenizer, sts_temperatures=model.sts_temperatures, path=model.path)


def with_numerics(model: Model, **changes) -> Model:
    """The same model (the same parameter arrays) computing with other ``Numerics`` options, e.g.
    ``with_numerics(model, sinkhorn="fused")`` or ``kernels="xla"``: a new ``Model``; ``model`` is
    unchanged. Options that decide what the parameters are (``dtype``, ``param_dtype``,
    ``weight_format``) cannot change here: load or init the model with them."""
    fixed = {"dtype", "param_dtype", "weight_format"} & set(changes)
    if fixed:
        raise ValueError(f"with_numerics cannot change {sorted(fixed)}: they decide the parameters' arrays; "
                         "load or init the model with them")
    num = dataclasses.replace(model.numerics, **changes)  # validates the options
    graphdef, state = nnx.split(model.module)
    module = nnx.merge(graphdef, state)
    for _, mod in nnx.iter_graph(module):
        if isinstance(getattr(mod, "num", None), Numerics):
            mod.num = num
    return Model(module, tokenizer=model.tokenizer, sts_temperatures=model.sts_temperatures, path=model.path)


def load(path: str | os.PathLike, *, dtype=jnp.bfloat16, param_dtype=None, quant_sim: bool | None = None,
         weight_format: str | None = None, moe_impl: str = "auto", mesh=None, dspark: bool | None = None,
         progress: bool = True, matmul_precision: str = "highest") -> Model:
    """Load an official-layout checkpoint directory (config.json + model.safetensors or a sharded
    model.safetensors.index.json [+ tokenizer.json]); see ``dspark_jax.checkpoint.hf``.

    mesh: place every parameter on its ``dspark_jax.sharding`` layout while reading (e.g.
        ``dspark_jax.sharding.make_mesh()`` over 8 GPUs); None = the default device.
    quant_sim: None = True iff the checkpoint stores FP8 / FP4 weights (the real checkpoints).
    weight_format: "official" keeps the FP8 linears and FP4 routed experts as stored (a bf16
        tensor in their place is quantised while read), "fp8" does the same with the FP4 experts
        widened to one e4m3 code per value, one scale per row and 128 inputs (the same values:
        faster on GPUs without FP4 arithmetic, twice FP4's bytes), "dense" dequantises everything
        to ``param_dtype``; None = "official" iff the checkpoint stores FP8 / FP4 weights.
    dspark: None = load the DSpark drafter when present; True = require it; False = target only.
    progress: show a progress bar.
    matmul_precision: "highest" (float32 matmuls in true float32, as the reference) or "default"
        (the backend's choice: TF32 on NVIDIA GPUs); see ``dspark_jax.model.common.Numerics``.
    """
    from dspark_jax.checkpoint.tokenizer import load_tokenizer

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    module = hf.load_module(path, dtype=dtype, param_dtype=param_dtype, quant_sim=quant_sim,
                            weight_format=weight_format, moe_impl=moe_impl, mesh=mesh, dspark=dspark,
                            progress=progress, matmul_precision=matmul_precision)
    return Model(module, tokenizer=load_tokenizer(path), sts_temperatures=read_sts(path, module.cfg), path=path)


def read_sts(path: str, config: ModelConfig) -> tuple[float, ...] | None:
    """Per-position confidence temperatures from ``sts.json`` (written by STS calibration), if any."""
    file = os.path.join(path, "sts.json")
    if not os.path.exists(file) or config.dspark is None:
        return None
    content = read_json(file, hf.CheckpointError)
    temps = content.get("temperatures") if isinstance(content, dict) else None
    numbers_ok = isinstance(temps, list) and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in temps)
    if not numbers_ok or len(temps) != config.dspark.block_size or any(t <= 0 for t in temps):
        raise hf.CheckpointError(f"{file}: expected {config.dspark.block_size} positive temperatures, got {temps}")
    return tuple(float(t) for t in temps)
