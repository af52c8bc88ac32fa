"""How the programs that decode are compiled: the XLA options they compile with
(``COMPILER_OPTIONS``) and JAX's persistent compilation cache: the engine's prefill and round
compile once per shape and machine, then load from disk (on an H200 the first decoding call of
the shipped model compiles for minutes; on a CPU for seconds).

Call ``enable_compile_cache()`` before the first computation; ``DSPARK_JAX_COMPILE_CACHE`` names
another directory, or turns the cache off when set to ``off``."""

from __future__ import annotations

import os
import warnings

import jax

ENV = "DSPARK_JAX_COMPILE_CACHE"

# XLA options of the decoding programs (``jax.jit(compiler_options=...)``; ``Engine`` takes others).
# On GPUs XLA runs a program's kernels as command buffers (CUDA / HIP graphs) and by default
# (``LHS``) in program order; ``CONCURRENT`` orders them only by the buffers they share, so
# kernels that do not depend on each other run at the same time: at a batch-1 Flash step the new
# KV rows, the compressors and the indexer's keys beside wq_b, the router beside the shared
# expert. On an H200 the batch-1 DSpark round of Flash slices took 7-10 % less wall time in every
# run (docs/benchmarks.md). Temporaries that may now be live at the same time are kept apart: a
# 2-layer slice's batch-1 round held 16.5-46 MB of them instead of 9.5, a 4-layer slice's batch-32
# round 500 MB instead of 355. ``xla_gpu_enable_pdl``: programmatic dependent launch (Hopper and
# later), XLA's default, stated since the step depends on it: a kernel that waits on its
# predecessor is launched before the predecessor ends. On an H100 each dependent launch took 0.2 us
# less with it (0.85 against 1.04 us), the batch-1 step of a 6-layer Flash slice 25 us less
# (docs/benchmarks.md). CPUs ignore both options.
COMPILER_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", "xla_gpu_enable_pdl": True}


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dspark_jax", "xla")


def enable_compile_cache(path: str | os.PathLike | None = None, *, min_compile_s: float = 0.5) -> str | None:
    """Cache every compiled program that took at least ``min_compile_s`` under ``path`` (default:
    ``$DSPARK_JAX_COMPILE_CACHE``, else ``~/.cache/dspark_jax/xla``). Returns the directory, or None
    when ``DSPARK_JAX_COMPILE_CACHE=off`` or the directory cannot be created (with a warning)."""
    if path is None:
        path = os.environ.get(ENV) or default_dir()
    if str(path).lower() == "off":
        return None
    path = os.path.abspath(os.fspath(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home must not stop generation: compile every time instead
        warnings.warn(f"compilation cache disabled: cannot create {path} ({e})", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    return path
