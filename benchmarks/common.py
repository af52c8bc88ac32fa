"""Shared benchmark helpers: timing medians and the device ceilings measured in the same run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np


def out_dir() -> str:
    path = os.environ.get("OUT", "out")
    os.makedirs(path, exist_ok=True)
    return path


def median_time(fn, *args, repeat: int = 10, warmup: int = 2) -> float:
    """Median wall time of ``fn(*args)`` in seconds (device work included)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def best_time(fn, *args, repeat: int = 20, warm_s: float = 0.5) -> tuple[float, float]:
    """(fastest, median) wall time of ``fn(*args)`` in seconds over ``repeat`` calls, after calls
    for at least ``warm_s`` seconds (at least two) so that the device's clocks have risen."""
    t_end, warm = time.perf_counter() + warm_s, 0
    while warm < 2 or time.perf_counter() < t_end:
        jax.block_until_ready(fn(*args))
        warm += 1
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.min(times)), float(np.median(times))


def ceilings(copy_gib: float = 2.0, matmul_n: int = 8192) -> dict:
    """Memory bandwidth of a large device copy (bytes read + written; the byte rooflines' ceiling),
    of a large read (``read_GBps``: the float32 sum of a bf16 array of half the copy's bytes: how
    fast a weight stream can go without writing) and bf16 matmul FLOP/s. (A one-row product
    against a 1 GiB weight, the first read measure, read 1.8-2.6 TB/s on H200s, slower than the
    copy, while the lm_head's product in a step reads 4.0-4.5: XLA's one-row GEMV is no ceiling,
    docs/benchmarks.md.) Each is the fastest of 20 calls after half a second of warm-up
    (``best_time``; the ``*_median`` keys: the median): a ceiling is the best the device did, and
    the median of 10 calls straight after the weights were built moved the copy's rate by 15 %
    between runs on one H200 (2.1-2.8 TB/s), and every roofline ratio with it."""
    n = int(copy_gib * 2**30 // 2)
    x = jnp.ones((n,), jnp.bfloat16)
    t, t_med = best_time(jax.jit(lambda a: a + jnp.bfloat16(1)), x)
    del x
    w = jnp.ones((max(n // 2, 1),), jnp.bfloat16)
    tr, tr_med = best_time(jax.jit(lambda w: jnp.sum(w, dtype=jnp.float32)), w)
    a = jax.random.normal(jax.random.key(0), (matmul_n, matmul_n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (matmul_n, matmul_n), jnp.bfloat16)
    tm, tm_med = best_time(jax.jit(lambda p, q: p @ q), a, b)
    read_bytes = w.size * 2
    del w, a, b
    copy_bytes, flops = 2 * n * 2, 2 * matmul_n**3
    return {"copy_GBps": copy_bytes / t / 1e9, "read_GBps": read_bytes / tr / 1e9,
            "bf16_matmul_TFLOPs": flops / tm / 1e12, "copy_GBps_median": copy_bytes / t_med / 1e9,
            "read_GBps_median": read_bytes / tr_med / 1e9, "bf16_matmul_TFLOPs_median": flops / tm_med / 1e12}


def source_commit() -> str:
    """The git commit of the working tree; ``<commit>+dirty.<hash of the diff>`` when tracked files
    differ from it (a copied tree whose git metadata lags behind its files says so)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
        diff = git("diff", "HEAD")
    except OSError:
        return "unknown"
    return f"{commit}+dirty.{hashlib.sha1(diff.encode()).hexdigest()[:8]}" if diff else commit


def environment() -> dict:
    dev = jax.devices()[0]
    commit = source_commit()
    return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "python": platform.python_version(), "commit": commit, "date": time.strftime("%Y-%m-%d")}


def write_json(name: str, data: dict) -> str:
    path = os.path.join(out_dir(), name)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path


def device_time(fn, x, *args, reps: int = 20, repeat: int = 5) -> float:
    """Seconds per call of ``fn(x, *args)`` measured as ``reps`` calls inside one jitted loop (so
    dispatch is paid once per loop, not per call): each call gets x scaled by a loop-dependent
    factor and the sum of its output feeds the loop carry, so nothing can be hoisted or dropped.
    Median of ``repeat`` loops."""
    def loop(x, *args):
        def body(i, acc):
            y = fn(x * (1 + i.astype(x.dtype) * 1e-3), *args)
            return acc + jnp.sum(jnp.asarray(y, jnp.float32))
        return jax.lax.fori_loop(0, reps, body, jnp.zeros((), jnp.float32))

    return median_time(jax.jit(loop), x, *args, repeat=repeat, warmup=1) / reps


def add_split_option(ap) -> None:
    """``--split-programs``: the grouped matmul's K-split target (``SPLIT_TARGET_PROGRAMS``; 0 =
    no split), to measure the library's choice against another in the same code."""
    ap.add_argument("--split-programs", type=int, default=None,
                    help="grouped-matmul K-split target programs (default: the library's; 0: no split)")


def apply_split_option(args) -> int:
    from pallas_kernels import grouped_matmul as gm

    if args.split_programs is not None:
        gm.SPLIT_TARGET_PROGRAMS = args.split_programs
    return gm.SPLIT_TARGET_PROGRAMS


def add_launch_options(ap) -> None:
    """The switches that change how a decode step's small kernels launch (module-level settings read
    when a step is traced), for an A/B of one against the other in the same process or run."""
    from dspark_jax.model import attention, moe
    from pallas_kernels import compressor_pool

    ap.add_argument("--one-token-swiglu", type=int, default=0,
                    help="a decode step's routed SwiGLU unsplit in this many columns per program, w2 quantising "
                         "its rows (grouped_matmul.ONE_TOKEN_SWIGLU_BLOCK_N; 0: K split, then swiglu_quantise)")
    ap.add_argument("--compressor-launches", type=int, choices=(1, 2),
                    default=1 if compressor_pool.WRITE_IN_POOL else 2,
                    help="each compressor's step as one launch (pooling and the entries' write) or two (the pooling "
                         "over channel blocks, then the write): compressor_pool.WRITE_IN_POOL on / off")
    ap.add_argument("--new-rows", default=attention.NEW_ROWS, choices=attention.NEW_ROWS_MODES,
                    help="how a step's new rows launch (attention.NEW_ROWS): one (window row + q_norm and the "
                         "compressors' pooling in one launch), apart (q_norm on its own), separate")
    ap.add_argument("--x-linears", choices=("together", "apart"),
                    default="together" if attention.X_LINEARS_TOGETHER else "apart",
                    help="a compressed layer's linears of x at one token: wq_a, wkv and its compressors' in one "
                         "launch, or wq_a + wkv in one and the compressors' in another (attention.X_LINEARS_TOGETHER)")
    ap.add_argument("--indexer-linears", choices=("with-compressor", "apart"),
                    default="apart" if attention.INDEXER_LINEARS_APART else "with-compressor",
                    help="a C4 layer's indexer linears of x at one token: in the compressor's launch or in one of "
                         "their own (attention.INDEXER_LINEARS_APART)")
    ap.add_argument("--compressor-split", type=int, default=attention.COMPRESSOR_SPLIT,
                    help="the K split of a compressed layer's one-token launch of its compressors' linears "
                         "(attention.COMPRESSOR_SPLIT; 0: automatic)")
    ap.add_argument("--shared-split", type=int, default=moe.SHARED_SPLIT,
                    help="the K split of the shared expert's one-row gemv launches (moe.SHARED_SPLIT; 0: automatic)")
    ap.add_argument("--wq-b-apart", action="store_true",
                    help="a C4 layer's wq_b and its indexer's wq_b in a launch each (attention.WQ_B_TOGETHER off)")
    ap.add_argument("--xla-pdl", choices=("default", "on", "off"), default="default",
                    help="XLA's programmatic dependent launch (the compiler option xla_gpu_enable_pdl) on top of "
                         "the programs' compiler options; default: as they have it")
    ap.add_argument("--queries-max-programs", type=int, default=-1,
                    help="index_scores.QUERIES_MAX_PROGRAMS (0: the indexer's queries in their own launch; "
                         "-1: the library's)")
    ap.add_argument("--hc-config", default="",
                    help="mHC kernels' settings (pallas_kernels.hc_fused.CONFIG) as comma-separated name=value "
                         "pairs on top of the library's HcConfig(), e.g. 'one_block_k=64,collapse_warps=2'")


def apply_launch_options(args) -> dict:
    """Sets the switches of ``add_launch_options``; returns them as set (for the results' config)."""
    from dspark_jax.model import attention
    from dspark_jax.model import moe
    from pallas_kernels import compressor_pool, grouped_matmul as gm, hc_fused, index_scores

    gm.ONE_TOKEN_SWIGLU_BLOCK_N = args.one_token_swiglu
    attention.INDEXER_LINEARS_APART = args.indexer_linears == "apart"
    moe.SHARED_SPLIT = args.shared_split
    attention.COMPRESSOR_SPLIT = args.compressor_split
    compressor_pool.WRITE_IN_POOL = args.compressor_launches == 1
    attention.NEW_ROWS = args.new_rows
    attention.WQ_B_TOGETHER = not args.wq_b_apart
    attention.X_LINEARS_TOGETHER = args.x_linears == "together"
    if args.queries_max_programs >= 0:
        index_scores.QUERIES_MAX_PROGRAMS = args.queries_max_programs
    hc_fused.CONFIG = hc_config(args.hc_config)
    return {"one_token_swiglu": gm.ONE_TOKEN_SWIGLU_BLOCK_N, "compressor_write_in_pool": compressor_pool.WRITE_IN_POOL,
            "new_rows": attention.NEW_ROWS, "wq_b_together": attention.WQ_B_TOGETHER,
            "x_linears_together": attention.X_LINEARS_TOGETHER,
            "indexer_linears_apart": attention.INDEXER_LINEARS_APART, "shared_split": moe.SHARED_SPLIT,
            "compressor_split": attention.COMPRESSOR_SPLIT,
            "queries_max_programs": index_scores.QUERIES_MAX_PROGRAMS, "xla_pdl": args.xla_pdl,
            "hc_config": dataclasses.asdict(hc_fused.CONFIG)}


def hc_config(text: str):
    """``--hc-config``: ``hc_fused.HcConfig()`` with the fields named in "name=value,..." replaced
    (integers; booleans as 0 / 1)."""
    from pallas_kernels import hc_fused

    fields = {f.name: f.type for f in dataclasses.fields(hc_fused.HcConfig)}
    values = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = pair.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--hc-config takes name=value pairs of HcConfig's fields {sorted(fields)}, got {pair!r}")
        values[name] = bool(int(value)) if fields[name] in (bool, "bool") else int(value)
    return dataclasses.replace(hc_fused.HcConfig(), **values)


def with_pdl(options: dict | None, pdl: str) -> dict | None:
    """Compiler options (None: the engine's, ``compile_cache.COMPILER_OPTIONS``) with XLA's
    programmatic dependent launch set on or off (``--xla-pdl``; "default": as they are)."""
    if pdl == "default":
        return options
    from dspark_jax.compile_cache import COMPILER_OPTIONS

    return {**(COMPILER_OPTIONS if options is None else options), "xla_gpu_enable_pdl": pdl == "on"}


def launch_variants(text: str, args) -> list[tuple[str, object]]:
    """``--variants``: launch switch sets timed side by side in one process, separated by "|", each
    the flags of ``add_launch_options`` (and ``--moe-one-row``) on top of the command's own (an
    empty set: the command's): e.g. ``"|--wq-b-apart|--compressor-launches 1 --wq-b-apart"``.
    Returns (label, namespace) per set, the label its flags ("base" for none)."""
    import argparse
    import copy
    import shlex

    parser = argparse.ArgumentParser(prog="--variants", exit_on_error=False)
    add_launch_options(parser)
    parser.add_argument("--moe-one-row", default="")
    out = []
    for flags in text.split("|"):
        try:
            ns = parser.parse_args(shlex.split(flags), namespace=copy.copy(args))
        except (argparse.ArgumentError, SystemExit) as err:
            raise ValueError(f"--variants: cannot parse {flags!r}: {err}") from err
        out.append((flags.strip() or "base", ns))
    if len({label for label, _ in out}) < len(out):
        raise ValueError(f"--variants names a set twice: {text!r}")
    return out


def with_moe_one_row(model, value: str):
    """The same model (the same arrays) with ``MoE.one_row = value`` in every MoE layer (how a
    one-token step starts its router and shared expert; ``dspark_jax.model.moe.ONE_ROW``): a new
    ``dspark_jax.Model``."""
    from flax import nnx

    import dspark_jax
    from dspark_jax.model.moe import ONE_ROW, MoE

    if value not in ONE_ROW:
        raise ValueError(f"MoE.one_row must be one of {ONE_ROW}, got {value!r}")
    module = nnx.merge(*nnx.split(model.module))
    for _, mod in nnx.iter_graph(module):
        if isinstance(mod, MoE):
            mod.one_row = value
    return dspark_jax.Model(module, tokenizer=model.tokenizer, sts_temperatures=model.sts_temperatures,
                            path=model.path)
