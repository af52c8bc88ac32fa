"""Registers, shared memory and load pipelining of every Pallas kernel of a DeepSeek-V4-Flash step,
compiled without a GPU for an NVIDIA H100 / H200 (sm_90) and an AMD MI350X / MI355X (gfx950).

The step of ``benchmarks/launches.py`` (``abstract_step``: a ``--depth``-layer Flash slice, FP8
weights, abstract parameters and caches) is lowered for each target as the CI's legality check
lowers it (``pallas_kernels.lowering``); each distinct Triton kernel of the lowered program (its
Triton IR, warps and pipeline stages, as the custom call hands them to XLA) is then compiled by
the ``triton`` Python package (``pip install triton``; not a dependency of the library) down to
an sm_90 cubin or gfx950 code object, and its resources are read back:

- NVIDIA: registers per thread, spilled bytes (``cuobjdump -res-usage``), shared memory per
  program, programs per SM that those allow (65536 registers, 228 KB of shared memory and 64 warps
  per SM; 227 KB per program at most), whether any load was pipelined through shared memory
  (``async_copy`` / TMA ops in the compiled TritonGPU IR), and the SASS's instructions, barriers
  and shuffles (``sass_counts``).
- gfx950: VGPRs and AGPRs per lane, spills, LDS per program (160 KB per CU, the most a program
  may take).

What this is and is not: XLA compiles these kernels with the Triton inside jaxlib, whose version
is not the ``triton`` package's, so registers and shared memory can differ from what runs; the
numbers are an estimate made without a device. A kernel over a limit here is one to check on the
hardware before it ships; nothing here has run on AMD hardware.

    PYTHONPATH=. OUT=out python benchmarks/kernel_resources.py --depth 4 --batch 1 --tokens 1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings

import jax

from benchmarks.common import add_launch_options, apply_launch_options, source_commit, write_json
from benchmarks.launches import ARCHS, abstract_step
from pallas_kernels import lowering

# Per-program limits and per-SM / per-CU capacities
NVIDIA_SMEM_PER_PROGRAM = 227 * 1024
NVIDIA_SMEM_PER_SM = 228 * 1024
NVIDIA_REGS_PER_SM = 65536
NVIDIA_WARPS_PER_SM = 64
GFX950_LDS_PER_PROGRAM = 160 * 1024


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Triton custom call of a lowered program: its name, launch settings and IR (MLIR bytecode)."""

    name: str
    num_warps: int
    num_stages: int
    ir: bytes

    @property
    def key(self) -> str:
        return hashlib.sha1(self.ir + f"{self.num_warps},{self.num_stages}".encode()).hexdigest()[:12]


def triton_kernels(lowered) -> list[TritonKernel]:
    """Every Triton custom call of a ``jax.stages.Lowered`` program, in program order."""
    from jax._src.lib.mlir import ir as mlir

    found = []

    def visit(op):
        if op.name == "stablehlo.custom_call" and lowering.TRITON_CALL in str(op.attributes["call_target_name"]):
            cfg = op.attributes["mhlo.backend_config"]
            found.append(TritonKernel(mlir.StringAttr(cfg["name"]).value, mlir.IntegerAttr(cfg["num_warps"]).value,
                                      mlir.IntegerAttr(cfg["num_stages"]).value, mlir.StringAttr(cfg["ir"]).value_bytes))
        return mlir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return found


def lower_step(arch: str, **shape) -> list[TritonKernel]:
    """The Triton kernels of one Flash target step (``launches.abstract_step``) lowered for ``arch``."""
    fn, args = abstract_step(**shape)
    return triton_kernels(lowering.lowered(fn, *args, arch=arch, platform=ARCHS[arch]))


@contextlib.contextmanager
def native_stderr_to(path: str):
    """The process's file descriptor 2 (where the compiler's passes print, e.g. a failing pass's
    reproducer) written to ``path`` for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def triton_ir_text(bytecode: bytes) -> str:
    """A kernel's Triton IR (jaxlib's MLIR bytecode) as generic-form text, printed by jaxlib's own
    MLIR: the ``triton`` package's MLIR may be older than jaxlib's and refuse its bytecode
    ("reading newer builtin dialect version than supported", jax 0.12.1 against triton 3.9), while
    it reads the text."""
    from jax._src.lib.mlir import ir as jax_ir
    from jax._src.lib.triton import dialect as tt_dialect

    with jax_ir.Context() as ctx:
        tt_dialect.register_dialect(ctx)
        module = jax_ir.Module.parse(bytecode)
        return module.operation.get_asm(print_generic_op_form=True)


def sass_counts(sass: str) -> dict:
    """Of a kernel's SASS (``cuobjdump -sass``): its instructions, block-wide barriers and warp
    shuffles: where a kernel's reductions and layout changes through shared memory wait (a lead for
    a one-row kernel's latency, not a measure of it)."""
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", line)
        if m:
            ops.append(m.group(1))
    return {"instructions": len(ops), "barriers": ops.count("BAR"), "shuffles": ops.count("SHFL")}


def compile_kernel(kernel: TritonKernel, arch: str, workdir: str) -> dict:
    """Compile one kernel with the ``triton`` package for ``arch``; its resources. A failure is
    raised as a RuntimeError naming the failing pass (the compiler's last message)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the package's default (multiply-adds fused), stated
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32) if ARCHS[arch] == "cuda" else GPUTarget("hip", "gfx950", 64)
    base = os.path.join(workdir, f"{kernel.name}_{kernel.key}_{target.backend}")
    with open(base + ".ttir", "w") as f:  # the compiler takes Triton IR as text
        f.write(triton_ir_text(kernel.ir))
    try:
        with native_stderr_to(base + ".log"):
            compiled = triton.compile(base + ".ttir", target=target,
                                      options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    except Exception as e:
        with open(base + ".log") as f:
            notes = [line.strip() for line in f if "error" in line or "Pipeline failed" in line]
        raise RuntimeError(f"{type(e).__name__}: {e}; {' / '.join(notes[-2:])}") from e
    ttgir = compiled.asm["ttgir"]
    out = {"shared_bytes": int(compiled.metadata.shared),
           "pipelined_loads": ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy")}
    if target.backend == "cuda":
        with open(base + ".cubin", "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", base + ".cubin"], capture_output=True, text=True, check=True).stdout
        regs, local = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "LOCAL"))
        out.update(sass_counts(subprocess.run([tool, "-sass", base + ".cubin"], capture_output=True, text=True,
                                              check=True).stdout))
        threads = 32 * kernel.num_warps
        per_sm = min(NVIDIA_REGS_PER_SM // (-(-regs // 8) * 8 * threads),
                     NVIDIA_WARPS_PER_SM // kernel.num_warps,
                     NVIDIA_SMEM_PER_SM // max(out["shared_bytes"], 1))
        out.update(registers=regs, spilled_bytes=local, programs_per_sm=per_sm,
                   over_limit=out["shared_bytes"] > NVIDIA_SMEM_PER_PROGRAM)
    else:
        amd = compiled.asm["amdgcn"]

        def field(key):
            m = re.search(rf"\.{key}:\s+(\d+)", amd)
            return int(m.group(1)) if m else None

        out.update(vgprs=field("vgpr_count"), agprs=field("agpr_count"), sgprs=field("sgpr_count"),
                   spilled_vgprs=field("vgpr_spill_count"), lds_bytes=field("group_segment_fixed_size"),
                   over_limit=max(out["shared_bytes"], field("group_segment_fixed_size") or 0) > GFX950_LDS_PER_PROGRAM)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=4, help="layers of the Flash slice (4: a window, a C4 and a C128 layer)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1, help="tokens per request (1: a decode step; 6: a verify)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--archs", default=",".join(ARCHS), help=f"comma-separated, of {sorted(ARCHS)}")
    add_launch_options(ap)
    args = ap.parse_args(argv)
    try:
        import triton
    except ImportError as err:
        raise SystemExit("kernel_resources.py compiles the kernels with the triton package: pip install triton") from err
    start = time.perf_counter()
    launch_options = apply_launch_options(args)
    shape = dict(depth=args.depth, batch=args.batch, tokens=args.tokens, context=args.context)
    archs = args.archs.split(",")
    if set(archs) - set(ARCHS):
        raise SystemExit(f"--archs takes {sorted(ARCHS)}, got {archs}")

    out = {"args": vars(args), "commit": source_commit(), "date": time.strftime("%Y-%m-%d"),
           "triton_package": triton.__version__, "jax": jax.__version__, "launch_options": launch_options,
           "method": __doc__.split("\n\n")[1], "kernels": {}}
    with tempfile.TemporaryDirectory() as workdir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for arch in archs:
            kernels = lower_step(arch, **shape)
            seen, rows = {}, []
            for k in kernels:
                seen.setdefault(k.key, [k, 0])[1] += 1
            print(f"{arch}: {len(kernels)} Triton launches, {len(seen)} distinct kernels", flush=True)
            for key, (k, count) in seen.items():
                row = {"name": k.name, "num_warps": k.num_warps, "num_stages": k.num_stages, "launches": count}
                try:
                    row.update(compile_kernel(k, arch, workdir))
                except Exception as e:  # noqa: BLE001 (a kernel the package cannot compile is a result too)
                    row["error"] = str(e)[:500]
                rows.append(row)
                print("  " + "  ".join(f"{a}={b}" for a, b in row.items()), flush=True)
            out["kernels"][arch] = rows
    over = {arch: [r["name"] for r in rows if r.get("over_limit")] for arch, rows in out["kernels"].items()}
    out["over_limit"] = over
    print(f"over a limit: {over} ({time.perf_counter() - start:.1f} s) -> {write_json('kernel_resources.json', out)}")
    return out


if __name__ == "__main__":
    main()
