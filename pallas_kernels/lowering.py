"""Deviceless lowering of Pallas kernels for a GPU target (the CI legality check).

``lower(fn, *args, arch="gfx950")`` traces ``fn`` and lowers it for ROCm against an abstract
``gfx950`` device, without any GPU. That runs JAX's Triton lowering of every ``pallas_call`` in
``fn`` (power-of-two shapes, dot operand rules, fp8 casts, no scalar prefetch, ...) and returns the
StableHLO text, which holds one ``__gpu$xla.gpu.triton`` custom call per kernel. It stops before
XLA compiles the Triton IR to a GPU binary, so it proves legality for JAX's lowering, not that the
kernel runs on that hardware.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.extend

from pallas_kernels import backend

TRITON_CALL = "__gpu$xla.gpu.triton"


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs for every array leaf of ``tree`` (other leaves unchanged)."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x,
        tree)


def lowered(fn: Callable, *args: Any, arch: str = "gfx950", platform: str = "rocm") -> jax.stages.Lowered:
    """``jax.jit(fn)(*args)`` lowered for ``platform`` on an abstract ``arch`` device. ``args`` may
    be arrays or ShapeDtypeStructs (pytrees allowed)."""
    device = jax.sharding.AbstractDevice(arch, 1, platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with backend.quiet_triton_deprecation(), jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*abstract(args)).lower(lowering_platforms=(platform,))


def lower(fn: Callable, *args: Any, arch: str = "gfx950", platform: str = "rocm") -> str:
    """``lowered``'s StableHLO text."""
    return lowered(fn, *args, arch=arch, platform=platform).as_text()


def count_triton_calls(hlo_text: str) -> int:
    return hlo_text.count(TRITON_CALL)


def subjaxprs(value):
    """The jaxprs held by an equation's parameter (a jaxpr, a closed jaxpr, or a tuple of them)."""
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from subjaxprs(v)


def pallas_calls(jaxpr, inside: bool = False) -> list[tuple[str, bool]]:
    """(name, whether it runs inside a ``shard_map``) of every ``pallas_call`` of a jaxpr, nested
    ones included, in program order: the kernels a call of it launches (no loops hold any)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append((eqn.params["name"], inside))
        for v in eqn.params.values():
            for sub in subjaxprs(v):
                found += pallas_calls(sub, inside or eqn.primitive.name == "shard_map")
    return found
