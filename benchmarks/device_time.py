"""Device time of a jitted call and registers / spills of its kernels (benchmark helpers).

- ``looped(call, n, name)``: one executable that chains ``n`` calls, each call's output being the
  next call's first input (nothing can be hoisted, nothing runs between the calls), the first
  call's output returned for checking;
- ``DeviceTimer.per_call``: (wall time of that executable - host dispatch time of a trivial
  jitted call) / n;
- ``enable_xla_dump`` + ``ptx_registers``: XLA dumps the modules whose name matches (the PTX it
  compiles them to), and ``ptxas -v`` reads registers and spill bytes of every kernel in them.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax


def enable_xla_dump(module_pattern: str) -> str:
    """Make XLA dump every module whose name contains ``module_pattern`` into a new temporary
    directory (returned). Call before JAX creates its backend (the flags are read then)."""
    path = tempfile.mkdtemp(prefix="dspark_xla_dump_")
    flags = f"--xla_dump_to={path} --xla_dump_hlo_module_re=.*{module_pattern}.*"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    return path


class DeviceTimer:
    """Per-call device time of a function run N times inside one jitted loop (module docstring)."""

    def __init__(self, reps: int = 5):
        self.reps = reps
        tiny = jax.jit(lambda x: x + 1)
        x = jnp.zeros((), jnp.float32)
        self.dispatch_s = self._median(tiny, (x,), reps=21)

    @staticmethod
    def _median(fn, args, reps):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def per_call(self, executable, args, n: int) -> float:
        total = self._median(executable, args, self.reps)
        return max(total - self.dispatch_s, 0.0) / n


def looped(call, n: int, name: str):
    """jit(q, *rest) -> (first output, last output) of n chained calls: q_{i+1} = call(q_i, *rest)."""
    def run(q, *rest):
        first = call(q, *rest)
        last = lax.fori_loop(1, n, lambda i, x: call(x, *rest), first)
        return first, last

    run.__name__ = run.__qualname__ = name
    return jax.jit(run)


def find_ptxas() -> str | None:
    found = shutil.which("ptxas")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *glob.glob("/usr/local/cuda-*")]
    roots += [os.path.join(p, "nvidia") for p in sys.path if p.endswith("site-packages")]
    for root in roots:
        hits = sorted(glob.glob(os.path.join(root, "**", "bin", "ptxas"), recursive=True)) if root else []
        if hits:
            return hits[-1]
    return None


def ptx_registers(dump_dir: str | None, probes: list[dict], wanted: set[str], budget_s: float) -> dict:
    """Registers / spills of the Pallas kernels in the PTX that XLA dumped for the ``wanted``
    probes (dicts with the module's function ``name``)."""
    if dump_dir is None:
        return dict(status="not dumped (--no-registers / --smoke)")
    ptxas = find_ptxas()
    if ptxas is None:
        return dict(status="no ptxas found (PATH, CUDA_HOME, /usr/local/cuda*, site-packages/nvidia)")
    out, start = dict(status="ok", ptxas=ptxas, kernels={}), time.time()
    out["dump_files"] = sorted(os.listdir(dump_dir))[:12]  # what XLA wrote, to diagnose a missing PTX
    for p in probes:
        if p["name"] not in wanted:
            continue
        if time.time() - start > budget_s:
            out["status"] = "stopped: time budget"
            break
        files = [f for f in glob.glob(os.path.join(dump_dir, f"*{p['name']}*.ptx"))
                 if re.search(re.escape(p["name"]) + r"(\D|$)", os.path.basename(f))]
        if not files:
            out["kernels"][p["name"]] = dict(p, error="no PTX dumped for this module")
            continue
        path = sorted(set(files))[-1]
        with open(path) as f:
            target = re.search(r"^\.target\s+(\S+)", f.read(), re.M)
        arch = target.group(1).rstrip(",") if target else "sm_90a"
        try:
            res = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", path, "-o", os.devnull], capture_output=True,
                                 text=True, timeout=120)
        except subprocess.TimeoutExpired:
            out["kernels"][p["name"]] = dict(p, error="ptxas timed out")
            continue
        funcs = {}
        for m in re.finditer(r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                             r"(\d+) bytes spill loads\n(?:.*\n)*?.*Used (\d+) registers", res.stderr + res.stdout):
            funcs[m.group(1)] = dict(stack=int(m.group(2)), spill_stores=int(m.group(3)),
                                     spill_loads=int(m.group(4)), registers=int(m.group(5)))
        ours = {k: v for k, v in funcs.items() if "ragged" in k}
        funcs = ours or funcs  # the Pallas kernels, if XLA kept their names
        out["kernels"][p["name"]] = dict(p, arch=arch, functions=funcs,
                                         error=None if funcs else (res.stderr + res.stdout)[-400:])
    return out
