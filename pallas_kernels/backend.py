"""The one place that decides how a kernel runs.

Two implementations exist for every kernel in this package:

- ``"pallas"``: the Pallas kernel. On a GPU (CUDA or ROCm) it is compiled through the Triton
  lowering, the only Pallas GPU backend on ROCm; anywhere else (CPU) it runs in interpret mode.
- ``"xla"``: the kernel's pure-JAX reference, i.e. plain XLA.

The choice is read when a function is traced. It comes from, in order: an explicit ``impl=``
argument, the innermost ``use(...)`` context, the environment variable ``DSPARK_KERNELS``
(``pallas`` or ``xla``), and the default ``pallas``. Because it is read at trace time, a jitted
function keeps the implementation it was traced with: choose before the first call (or pass
``impl=`` and make it a static argument of your jit).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Iterator

import jax
from jax.experimental.pallas import triton as pltriton

IMPLS = ("pallas", "xla")
ENV_VAR = "DSPARK_KERNELS"

_local = threading.local()


def _check(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"kernel implementation must be one of {IMPLS}, got {impl!r}")
    return impl


def current() -> str:
    """The implementation selected now (context > environment > default ``pallas``)."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    env = os.environ.get(ENV_VAR)
    if env is not None and env.strip():
        impl = env.strip().lower()
        if impl not in IMPLS:
            raise ValueError(f"environment variable {ENV_VAR}={env!r}: expected one of {IMPLS}")
        return impl
    return "pallas"


def resolve(impl: str | None) -> str:
    """``impl`` if given (validated), else ``current()``."""
    return current() if impl is None else _check(impl)


@contextlib.contextmanager
def use(impl: str) -> Iterator[None]:
    """Run the enclosed traces with the given implementation (``"pallas"`` or ``"xla"``)."""
    _check(impl)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(impl)
    try:
        yield
    finally:
        stack.pop()


def on_gpu() -> bool:
    """True when the default JAX backend is a GPU (CUDA or ROCm)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def gpu_platform() -> str | None:
    """``"cuda"`` or ``"rocm"``: the GPU that kernels are being compiled for, i.e. the abstract
    device of the current abstract mesh (deviceless lowering) if it has one, else the default
    device; None off GPU."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    device = getattr(get_mesh(), "abstract_device", None) if get_mesh is not None else None
    platform = getattr(device, "platform", None)
    if platform in ("cuda", "rocm"):
        return platform
    if platform == "gpu" and str(device.device_kind).startswith("gfx"):
        return "rocm"
    if not on_gpu():  # (no abstract device, a CPU mesh's, or an abstract "gpu" one: CUDA's name)
        return "cuda" if platform == "gpu" else None
    device = jax.devices()[0]
    version = str(getattr(device.client, "platform_version", "")).lower()
    rocm = device.platform == "rocm" or str(getattr(device, "compute_capability", "")).startswith("gfx")
    return "rocm" if rocm or "rocm" in version else "cuda"


def interpret_mode(interpret: bool | None = None) -> bool:
    """Whether a Pallas kernel must run in interpret mode: explicitly given, else off GPU (and not
    lowering for an abstract GPU device: ``lowering.lower`` of a whole model step, e.g.
    ``benchmarks/launches.py``)."""
    return (gpu_platform() is None) if interpret is None else bool(interpret)


# The deepest software pipeline a kernel gets on ROCm. The routed experts' one-token SwiGLU tiles
# (``grouped_matmul``, 4 stages, tuned on an H200) failed to compile for gfx950 at 4 stages in the
# ``triton`` 3.9 package's AMD pipeline (its block ping-pong pass) and compiled at 3
# (``benchmarks/kernel_resources.py``, docs/kernels.md); nothing has run on AMD hardware.
ROCM_MAX_STAGES = 3


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
    """Triton compiler parameters; always passed so that the Triton lowering is selected on
    every JAX version and on ROCm (where the Mosaic GPU backend does not exist). On ROCm the
    pipeline depth is capped at ``ROCM_MAX_STAGES``."""
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if gpu_platform() == "rocm":
        num_stages = min(num_stages, ROCM_MAX_STAGES)
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@contextlib.contextmanager
def quiet_triton_deprecation() -> Iterator[None]:
    """Silence the deprecation warning every Triton ``pallas_call`` emits (JAX >= 0.11)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        yield


def next_power_of_2(n: int) -> int:
    if n < 1:
        raise ValueError(f"expected a positive size, got {n}")
    return 1 << (n - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap`` (1 if none larger)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b
