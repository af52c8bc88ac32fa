"""Deviceless compilation of the Flash step's Pallas kernels (``benchmarks/kernel_resources.py``):
the Triton kernels found in a lowered program with their launch settings, ROCm's pipeline-depth
cap, and every kernel of a 4-layer Flash step compiled by the ``triton`` package for sm_90 and
gfx950 within shared memory / LDS, without spills (where the package is installed: Linux x86-64,
the test extra)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import kernel_resources as kr
from pallas_kernels import backend, lowering
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.gemv import gemv

SD = jax.ShapeDtypeStruct
MLIR_BYTECODE = b"ML\xefR"


@pytest.mark.parametrize("arch", sorted(kr.ARCHS))
def test_triton_kernels_are_found_with_their_settings(arch):
    x = SD((1, 1024), jnp.bfloat16)
    w = gm.Weights(SD((1, 4096, 1024), jnp.float8_e4m3fn), SD((1, 32, 8), jnp.uint8), "fp8")
    lowered = lowering.lowered(lambda x, w: gemv(gm.QuantRows(x), w, jnp.zeros((1,), jnp.int32), interpret=False),
                               x, w, arch=arch, platform=kr.ARCHS[arch])
    (k,) = kr.triton_kernels(lowered)
    assert (k.name, k.num_warps, k.num_stages) == ("gemv_fp8_q_split4", 4, 3)  # 128 tiles: K split in 4
    assert k.ir.startswith(MLIR_BYTECODE) and len(k.ir) > 1000


def test_rocm_caps_the_pipeline_depth():
    """The one-token routed SwiGLU's row tiles ask for 4 stages: kept on CUDA, 3 on ROCm."""
    depth = {arch: {k.name: k.num_stages for k in kr.lower_step(arch, depth=2, batch=1, tokens=1, context=256)}
             for arch in kr.ARCHS}
    name = "grouped_matmul_fp8_k128_a8_swiglu_split2"
    assert depth["NVIDIA H200"][name] == 4
    assert depth["gfx950"][name] == backend.ROCM_MAX_STAGES == 3
    assert max(depth["gfx950"].values()) <= backend.ROCM_MAX_STAGES


def test_sass_counts_instructions_barriers_and_shuffles():
    sass = """
        Function : gemv_fp8
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0e80*/              @!P0 LDG.E.128 R16, desc[UR6][R56.64] ;      /* 0x0000000638108981 */
        /*0f00*/                   SHFL.BFLY PT, R3, R2, 0x10, 0x1f ;      /* 0x0e001f0002037f89 */
        /*0f10*/               @P1 BAR.SYNC.DEFER_BLOCKING 0x0 ;           /* 0x0000000000001b1d */
        /*0f20*/                   SHFL.BFLY PT, R5, R4, 0x8, 0x1f ;       /* 0x0c001f0004057f89 */
        /*0f30*/                   EXIT ;                                  /* 0x000000000000794d */
    """
    assert kr.sass_counts(sass) == {"instructions": 6, "barriers": 1, "shuffles": 2}


@pytest.mark.parametrize("arch", sorted(kr.ARCHS))
def test_flash_step_kernels_compile_within_limits(arch, tmp_path):
    pytest.importorskip("triton")
    kernels = {k.key: k for k in kr.lower_step(arch, depth=4, batch=1, tokens=1, context=2048)}
    assert len(kernels) > 20
    for k in kernels.values():
        res = kr.compile_kernel(k, arch, str(tmp_path))
        assert not res["over_limit"], (k.name, res)
        if kr.ARCHS[arch] == "cuda":
            assert res["spilled_bytes"] == 0 and res["programs_per_sm"] >= 1, (k.name, res)
            assert res["instructions"] > res["barriers"] + res["shuffles"], (k.name, res)
        else:
            assert res["spilled_vgprs"] == 0, (k.name, res)
