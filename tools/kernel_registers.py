"""Registers, spills and shared memory of the ragged attention kernel without a GPU.

The Pallas Triton lowering turns the kernel into Triton IR; this tool captures that IR at
DeepSeek-V4-Flash shapes (64 heads x 512, 64 requests x 6 verify tokens, ring 144, 512 entries)
and compiles it with the ``triton`` package in a side environment, for an NVIDIA target (PTX, then
``ptxas -v`` from the package: registers and spill bytes) or an AMD one (AMDGCN: VGPRs, AGPRs,
VGPR spills, scratch). Triton from PyPI is not the Triton that XLA bundles, so the numbers are
estimates, good for ranking tile configurations before a GPU run.

    python3 -m venv /tmp/tritonenv && /tmp/tritonenv/bin/pip install triton==3.9.0
    PYTHONPATH=. .venv/bin/python tools/kernel_registers.py --triton-python /tmp/tritonenv/bin/python \\
        --kind prefix --pool fp8 --target sm90 --config '{"block_k": 32, "block_d": 256}'
    # --target gfx950 for AMD; --from-table prints every entry of pallas_kernels/attention_configs.json

The Triton IR passes that XLA runs first (canonicalise, combine dot + add, CSE, ...) are run here
too; without them the accumulator update is not fused into the dot and the counts are wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: E402

from pallas_kernels import attention_configs, kv_fp8, lowering  # noqa: E402
from pallas_kernels import ragged_attention as ra  # noqa: E402
from pallas_kernels.attention_metadata import RaggedMeta  # noqa: E402

SD = jax.ShapeDtypeStruct
S, T, H, D, RING, N, K = 64, 64 * 6, 64, 512, 144, 512, 512

COMPILE = r'''
import json, os, re, subprocess, sys, tempfile
import triton
from triton._C.libtriton import ir, passes
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

path, target, warps, stages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tgt = GPUTarget("cuda", int(target[2:]), 32) if target.startswith("sm") else GPUTarget("hip", target, 64)
backend = make_backend(tgt)
ctx = ir.context(); ir.load_dialects(ctx); backend.load_dialects(ctx)
mod = ir.parse_mlir_module(path, ctx)
pm = ir.pass_manager(ctx)
for add in (passes.common.add_inliner, passes.common.add_canonicalizer, passes.ttir.add_combine,
            passes.ttir.add_reorder_broadcast, passes.common.add_cse, passes.common.add_symbol_dce,
            passes.ttir.add_loop_unroll):
    add(pm)
pm.run(mod, "make_ttir")
opt = path.replace(".ttir", ".opt.ttir")
with open(opt, "w") as f:
    f.write(mod.str())
k = triton.compile(opt, target=tgt, options=dict(num_warps=warps, num_stages=stages))
res = {"shared_bytes": k.metadata.shared}
if tgt.backend == "cuda":
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = max((os.path.join(bindir, n) for n in os.listdir(bindir) if n.startswith("ptxas")), key=len)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    arch = "sm_90a" if tgt.arch == 90 else f"sm_{tgt.arch}"
    out = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", f.name, "-o", os.devnull], capture_output=True, text=True)
    txt = out.stderr + out.stdout
    m = re.search(r"Used (\d+) registers", txt)
    s = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
    res.update(registers=int(m.group(1)) if m else txt[-300:], spill_stores=int(s.group(1)) if s else None,
               spill_loads=int(s.group(2)) if s else None, wgmma=k.asm["ptx"].count("wgmma.mma_async"),
               mma_sync=k.asm["ptx"].count("mma.sync"))
else:
    asm = k.asm["amdgcn"]
    for key in ("vgpr_count", "agpr_count", "vgpr_spill_count", "sgpr_spill_count"):
        m = re.search(r"\." + key + r":\s+(\d+)", asm)
        res[key] = int(m.group(1)) if m else None
    m = re.search(r"ScratchSize: (\d+)", asm)
    res["scratch_bytes"] = int(m.group(1)) if m else None
print(json.dumps(res))
'''


def triton_ir(kind: str, pool: str, config: ra.BlockConfig, platform: str) -> str:
    """The Triton IR (generic MLIR text) of the kernel at Flash shapes."""
    captured = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(print_generic_op_form=True))
        return result

    def rows(n):
        if pool == "fp8":
            return kv_fp8.Fp8Rows(SD((S, n, D), jnp.uint8), SD((S, n, 64), jnp.bfloat16))
        return SD((S, n, D), jnp.bfloat16)

    i32 = jnp.int32
    comp = dict(prefix=dict(comp_count=SD((T,), i32)), topk=dict(comp_topk=SD((T, K), i32))).get(kind, {})
    meta = RaggedMeta(SD((S + 1,), i32), SD((T,), i32), SD((T,), i32), SD((S,), i32), max_q_len=6, **comp)
    args = (SD((T, H, D), jnp.bfloat16), rows(RING), None if kind == "window" else rows(N), SD((H,), jnp.float32),
            meta)
    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        arch = "gfx950" if platform == "rocm" else "NVIDIA H200"
        lowering.lower(lambda q, w, e, s, m: ra.kernel(q, w, e, s, m, config=config, interpret=False), *args,
                       arch=arch, platform=platform)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
    return captured[-1]


def measure(triton_python: str, kind: str, pool: str, config: ra.BlockConfig, target: str) -> dict:
    platform = "cuda" if target.startswith("sm") else "rocm"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(triton_ir(kind, pool, config, platform))
        res = subprocess.run([triton_python, "-c", COMPILE, path, target, str(config.num_warps),
                              str(config.num_stages)], capture_output=True, text=True)
    if res.returncode:
        return dict(error=res.stderr[-600:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton-python", required=True, help="python of an environment with the triton package")
    ap.add_argument("--kind", choices=attention_configs.KINDS, default="prefix")
    ap.add_argument("--pool", choices=attention_configs.POOLS, default="bf16")
    ap.add_argument("--target", default="sm90", help="sm90, sm100, ... or an AMD arch such as gfx950")
    ap.add_argument("--config", default="{}", help="BlockConfig fields as JSON (defaults for the rest)")
    ap.add_argument("--from-table", action="store_true", help="every entry of the tuned table instead")
    args = ap.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    if args.from_table:
        jobs = [(e["kind"], e["pool"], e["config"], "sm90" if e["platform"] == "cuda" else "gfx950")
                for e in attention_configs.table_entries()]
    else:
        jobs = [(args.kind, args.pool, ra.BlockConfig(**json.loads(args.config)), args.target)]
    for kind, pool, config, target in jobs:
        print(json.dumps(dict(kind=kind, pool=pool, target=target, config=config.to_dict(),
                              **measure(args.triton_python, kind, pool, config, target))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
