"""Independent kernels in one launch (horizontal fusion).

At a batch-1 decode step a Flash layer runs a chain of small kernels, each a few microseconds of
fixed latency for a few KiB (docs/benchmarks.md: 20-30 launches per layer). Kernels that need
only the same producer's outputs can run as one launch: ``launch(parts)`` lays the parts' grids
end to end on one axis, and program p runs the part whose range holds p with that part's own
program ids. A part (``Part``) is a kernel body taking its program ids first, then the refs of its
inputs and outputs; its grid, inputs, output shapes and input-output aliases. A part alone is
launched on its own grid, exactly as it would be by itself.

The parts share the launch's ``num_warps`` / ``num_stages``, and must not read each other's
outputs (the programs of a launch run in any order). A layer's new rows at a one-token step use
it (``kv_rows.rows_part`` with ``compressor_pool.pool_write_part``, ``model.attention``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
from jax.experimental import pallas as pl

from pallas_kernels import backend


@dataclasses.dataclass(frozen=True)
class Part:
    """One kernel of a launch: ``body(ids, *input_refs, *output_refs)`` with ``ids`` its program
    ids on ``grid``; ``aliases`` maps the part's input indices to its output indices (written in
    place)."""

    body: Callable[..., None]
    grid: tuple[int, ...]
    inputs: tuple[Any, ...]
    out_shape: tuple[jax.ShapeDtypeStruct, ...]
    aliases: dict[int, int] = dataclasses.field(default_factory=dict)
    name: str = "kernel"


def _ids(local: jax.Array, grid: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """The program ids on ``grid`` of the row-major flat index ``local``."""
    return tuple((local // math.prod(grid[i + 1:])) % n for i, n in enumerate(grid))


def launch(parts: list[Part] | tuple[Part, ...], *, name: str | None = None, num_warps: int = 4,
           num_stages: int = 1, interpret: bool = False) -> list[tuple[jax.Array, ...]]:
    """Every part's outputs (a tuple per part) from one ``pallas_call``, named ``name`` (one part:
    its own name by default)."""
    parts = tuple(parts)
    if not parts:
        raise ValueError("a launch needs at least one part")
    in_base = [sum(len(p.inputs) for p in parts[:i]) for i in range(len(parts))]
    out_base = [sum(len(p.out_shape) for p in parts[:i]) for i in range(len(parts))]
    n_in = sum(len(p.inputs) for p in parts)
    aliases = {in_base[i] + a: out_base[i] + o for i, p in enumerate(parts) for a, o in p.aliases.items()}

    def run(i: int, ids: tuple, refs: tuple) -> None:
        p = parts[i]
        ins = refs[in_base[i]:in_base[i] + len(p.inputs)]
        outs = refs[n_in + out_base[i]:n_in + out_base[i] + len(p.out_shape)]
        p.body(ids, *ins, *outs)

    def kernel(*refs):
        if len(parts) == 1:
            run(0, tuple(pl.program_id(a) for a in range(len(parts[0].grid))), refs)
            return
        pid = pl.program_id(0)  # (read here: interpret mode has no program ids in branches)
        start = 0
        for i, p in enumerate(parts):
            size = math.prod(p.grid)
            ids = _ids(pid - start, p.grid)

            @pl.when((pid >= start) & (pid < start + size))
            def _(i=i, ids=ids):
                run(i, ids, refs)
            start += size

    grid = parts[0].grid if len(parts) == 1 else (sum(math.prod(p.grid) for p in parts),)
    with backend.quiet_triton_deprecation():
        flat = pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=tuple(s for p in parts for s in p.out_shape),
            input_output_aliases=aliases,
            compiler_params=backend.compiler_params(num_warps, num_stages),
            interpret=interpret,
            name=name or (parts[0].name if len(parts) == 1 else "_".join(p.name for p in parts)),
        )(*(x for p in parts for x in p.inputs))
    flat = flat if isinstance(flat, (tuple, list)) else (flat,)
    return [tuple(flat[out_base[i]:out_base[i] + len(p.out_shape)]) for i, p in enumerate(parts)]

