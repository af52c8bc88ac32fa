"""Fast restart: converted parameters saved with orbax and restored straight into a sharded layout.

Directory layout::

    path/config.json      the official config (DSpark stage count in the compress_ratios tail)
    path/dspark_jax.json  format version and the matrix dtype of the saved parameters
    path/params/          orbax checkpoint of {parameter path: array}

``restore`` builds the model abstractly, gives every parameter its ``dspark_jax.sharding``
placement (when a mesh is given) and lets orbax read each array directly into it.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from dspark_jax import sharding as shd
from dspark_jax.checkpoint.hf import flat_variables
from dspark_jax.config import from_hf_config
from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4

FORMAT = "dspark_jax.orbax/1"
META_FILE = "dspark_jax.json"
PARAMS_DIR = "params"


def save(model, path: str | os.PathLike, *, force: bool = False) -> None:
    """Save a ``dspark_jax.Model``'s parameters (any sharding) and config under ``path``."""
    path = os.path.abspath(os.fspath(path))
    target = os.path.join(path, PARAMS_DIR)
    if os.path.exists(target) and not force:
        raise FileExistsError(f"{target} exists; pass force=True to overwrite")
    os.makedirs(path, exist_ok=True)
    flat = flat_variables(nnx.state(model.module))
    arrays = {p: v.get_value() for p, v in flat.items()}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(target, arrays, force=force)
        ckptr.wait_until_finished()
    cfg = model.config
    num = model.numerics
    meta = {"format": FORMAT, "param_dtype": jnp.dtype(num.param_dtype).name, "dtype": jnp.dtype(num.dtype).name,
            "quant_sim": bool(num.quant_sim), "weight_format": num.weight_format, "dspark_stages": cfg.dspark.num_stages if cfg.dspark is not None else 0}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save(os.path.join(path, "tokenizer.json"))


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.exists(os.path.join(os.fspath(path), META_FILE))


def restore(path: str | os.PathLike, *, mesh=None, dtype=None, quant_sim: bool | None = None,
            moe_impl: str = "auto"):
    """A ``dspark_jax.Model`` from a directory written by ``save``; with ``mesh`` every array is
    read straight into its ``dspark_jax.sharding`` placement (otherwise onto the default device).

    dtype / quant_sim: None = as the saved model (parameters keep their saved dtypes).
    """
    from dspark_jax.api import Model
    from dspark_jax.checkpoint.tokenizer import load_tokenizer

    path = os.path.abspath(os.fspath(path))
    meta_file = os.path.join(path, META_FILE)
    if not os.path.exists(meta_file):
        raise FileNotFoundError(f"{path} is not an orbax checkpoint written by dspark_jax (no {META_FILE})")
    with open(meta_file) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_file}: unsupported format {meta.get('format')!r}, expected {FORMAT!r}")
    cfg = from_hf_config(path, num_dspark_stages=meta["dspark_stages"] or None)
    if not meta["dspark_stages"]:
        cfg = cfg.replace(dspark=None)
    num = Numerics(dtype=jnp.dtype(meta["dtype"] if dtype is None else dtype), param_dtype=jnp.dtype(meta["param_dtype"]),
                   quant_sim=meta["quant_sim"] if quant_sim is None else bool(quant_sim), moe_impl=moe_impl,
                   weight_format=meta.get("weight_format", "dense"))
    abstract = nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = flat_variables(state)
    if mesh is not None:
        shardings = shd.param_shardings(state, cfg, mesh)
    else:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = {p: device for p in flat}
    target = {p: jax.ShapeDtypeStruct(tuple(v.shape), np.dtype(v.dtype), sharding=shardings[p])
              for p, v in flat.items()}
    with ocp.StandardCheckpointer() as ckptr:
        arrays = ckptr.restore(os.path.join(path, PARAMS_DIR), target)
    for p, var in flat.items():
        var.set_value(arrays[p])
    module = nnx.merge(graphdef, state)
    if mesh is not None:
        shd.attach_mesh(module, mesh)
    return Model(module, tokenizer=load_tokenizer(path), path=path)
