"""Deviceless lowering of every kernel for a gfx950 (ROCm) target at DeepSeek-V4-Flash shapes.

This runs JAX's Triton lowering (the legality rules that interpret mode does not check) without a
GPU; it does not compile the Triton IR for the hardware. gfx950 is verified this way only.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from dspark_jax.model import moe
from pallas_kernels import attention_configs, backend, compressor_pool, kv_fp8, lowering
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import ragged_attention as ra
from pallas_kernels.attention_metadata import RaggedMeta

SD = jax.ShapeDtypeStruct
S, T, H, D, RING, N, K = 64, 64 * 6, 64, 512, 144, 512, 512  # Flash: 64 requests x 6 verify tokens


def _pool(rows: int, layout: str):
    if layout == "fp8":
        return kv_fp8.Fp8Rows(SD((S, rows, D), jnp.uint8), SD((S, rows, 64), jnp.bfloat16))
    return SD((S, rows, D), jnp.bfloat16)


def _meta(kind: str, max_q_len: int = 6, tokens: int = T, s: int = S, k: int = K):
    """Metadata of a layer kind: ``window`` (ring only), ``prefix`` (Cm), ``topk`` (C4, k picks)."""
    i32 = jnp.int32
    comp = dict(prefix=dict(comp_count=SD((tokens,), i32)), topk=dict(comp_topk=SD((tokens, k), i32))).get(kind, {})
    return RaggedMeta(SD((s + 1,), i32), SD((tokens,), i32), SD((tokens,), i32), SD((s,), i32), max_q_len=max_q_len,
                      **comp)


def _assert_attention_calls(text: str, config) -> None:
    """The attention kernel, plus the split merge kernel when the key tiles are split."""
    merges = text.count('"attention_merge_splits"')
    assert text.count('"ragged_sink_attention"') == 1 and merges <= 1
    if config is not None:
        assert merges == (config.kv_splits > 1)
    assert lowering.count_triton_calls(text) == 1 + merges


def _lower_attention(kind: str, layout: str, config, q_dtype=jnp.bfloat16) -> str:
    args = (SD((T, H, D), q_dtype), _pool(RING, layout), None if kind == "window" else _pool(N, layout),
            SD((H,), jnp.float32), _meta(kind))
    return lowering.lower(lambda q, w, e, s, m: ra.kernel(q, w, e, s, m, config=config, interpret=False), *args)


def test_fp8_write_lowers_for_gfx950():
    pool = kv_fp8.Fp8Rows(SD((S * RING, D), jnp.uint8), SD((S * RING, 64), jnp.bfloat16))
    text = lowering.lower(lambda p, s, x: kv_fp8.write_kernel(p, s, x, interpret=False),
                          pool, SD((T,), jnp.int32), SD((T, D), jnp.bfloat16))
    assert lowering.count_triton_calls(text) == 1


@pytest.mark.parametrize("layout", ["bf16", "fp8"])
@pytest.mark.parametrize("kind,config", [
    ("window", None),  # window-only layers and the drafter, the table's config for gfx950
    ("topk", None),  # C4: each token's top-512
    ("prefix", None),  # C128 at 64k context
    ("prefix", ra.BlockConfig(block_t=2, block_h=16, block_k=64, num_warps=4, num_stages=3, kv_splits=4)),
    ("topk", ra.BlockConfig(block_h=32, block_k=16, block_d=128, fp8_fold=True, kv_splits=3)),
])
def test_ragged_attention_lowers_for_gfx950(layout, kind, config):
    _assert_attention_calls(_lower_attention(kind, layout, config), config)


ENTRIES = attention_configs.table_entries()


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e['platform']}-{e['kind']}-{e['pool']}-b{e['batch']}"
                                                for e in ENTRIES])
def test_every_tuned_config_lowers_for_gfx950(entry):
    """Every configuration the engine may pick from the table (the CUDA ones too: their Triton
    legality does not depend on the target) at Flash shapes for its layer kind and pool."""
    _assert_attention_calls(_lower_attention(entry["kind"], entry["pool"], entry["config"]), entry["config"])


def test_decode_shape_lowers_for_gfx950():
    args = (SD((S, H, D), jnp.bfloat16), _pool(RING, "fp8"), None, SD((H,), jnp.float32),
            _meta("window", max_q_len=1, tokens=S))
    text = lowering.lower(lambda q, w, e, s, m: ra.kernel(q, w, e, s, m, interpret=False), *args)
    _assert_attention_calls(text, None)
    assert '"attention_merge_splits"' in text  # 4 requests x 1 token: the keys are split


@pytest.mark.parametrize("arch,platform", [("gfx950", "rocm"), ("NVIDIA H200", "cuda")])
@pytest.mark.parametrize("kind,layout,config", [
    ("window", "fp8", None),  # a decode step: split keys, the inverse RoPE in the merge
    ("topk", "bf16", ra.BlockConfig(block_h=32, block_k=16, block_d=128, kv_splits=1)),
    ("prefix", "fp8", ra.BlockConfig(block_t=2, block_h=16, block_k=64, fp8_fold=True, kv_splits=4)),
])
def test_queries_normed_and_rotated_in_the_kernel_lower(arch, platform, kind, layout, config):
    """``q_rope``: the queries' head norm + RoPE inside the attention kernel (no launch of its own)."""
    tokens = S if kind == "window" else T
    args = (SD((tokens, H, D), jnp.bfloat16), _pool(RING, layout), None if kind == "window" else _pool(N, layout),
            SD((H,), jnp.float32), _meta(kind, max_q_len=1 if kind == "window" else 6, tokens=tokens),
            SD((tokens,), jnp.int32), SD((32,), jnp.float32))
    text = lowering.lower(lambda q, w, e, s, m, pos, f: ra.kernel(q, w, e, s, m, config=config, out_rope=(pos, f),
                                                                  q_rope=(pos, f, 1e-6), interpret=False),
                          *args, arch=arch, platform=platform)
    assert text.count('"ragged_sink_attention"') == 1 and '"q_norm_rope"' not in text


def _double(x, *, interpret: bool):
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    return pl.pallas_call(body, out_shape=SD(x.shape, x.dtype), interpret=interpret,
                          compiler_params=backend.compiler_params(4, 1))(x)


def test_illegal_kernel_fails_lowering_but_passes_interpret_mode():
    """A 24-element block is not a power of two: interpret mode runs it, the gfx950 lowering refuses."""
    x = jnp.arange(24, dtype=jnp.float32)
    assert jnp.array_equal(_double(x, interpret=True), 2 * x)
    with pytest.raises(ValueError, match="power of 2"):
        lowering.lower(lambda x: _double(x, interpret=False), SD((24,), jnp.float32))
    # the same kernel over 32 elements is legal
    assert lowering.count_triton_calls(lowering.lower(lambda x: _double(x, interpret=False),
                                                      SD((32,), jnp.float32))) == 1


def test_tiny_model_shapes_lower_for_gfx950():
    """The CPU test model's sizes (4 heads x 128, 64 nope dims) go through the same kernels."""
    s, t, h, d = 2, 12, 4, 128
    i32 = jnp.int32
    meta = _meta("topk", tokens=t, s=s, k=3)
    fp8 = lambda n: kv_fp8.Fp8Rows(SD((s, n, d), jnp.uint8), SD((s, n, 64), jnp.bfloat16))  # noqa: E731
    text = lowering.lower(lambda q, w, e, k, m: ra.kernel(q, w, e, k, m, interpret=False),
                          SD((t, h, d), jnp.bfloat16), fp8(24), fp8(40), SD((h,), jnp.float32), meta)
    assert lowering.count_triton_calls(text) == 1
    pool = kv_fp8.Fp8Rows(SD((48, d), jnp.uint8), SD((48, 64), jnp.bfloat16))
    text = lowering.lower(lambda p, sl, x: kv_fp8.write_kernel(p, sl, x, interpret=False),
                          pool, SD((t,), i32), SD((t, d), jnp.bfloat16))
    assert lowering.count_triton_calls(text) == 1


@pytest.mark.parametrize("precision", [None, "highest"])
def test_float32_queries_lower_for_gfx950(precision):
    """An fp32 model sends fp32 queries; under matmul_precision="highest" (the library default) the
    kernel's dots become IEEE float32 dots, which must still lower."""
    s, t, h, d = 2, 12, 4, 128
    meta = _meta("prefix", tokens=t, s=s)
    with jax.default_matmul_precision(precision):
        text = lowering.lower(lambda q, w, e, k, m: ra.kernel(q, w, e, k, m, interpret=False),
                              SD((t, h, d), jnp.float32), SD((s, 24, d), jnp.bfloat16), SD((s, 40, d), jnp.bfloat16),
                              SD((h,), jnp.float32), meta)
    _assert_attention_calls(text, None)


@pytest.mark.parametrize("tokens,opt_ins", [(1, False), (6, False), (1, True), (6, True)])
def test_flash_step_lowers_for_gfx950(monkeypatch, tokens, opt_ins):
    """A whole target step of a 4-layer Flash slice (two window layers, a C4 layer with the indexer,
    a C128 layer; FP8 weights, 2k context) at batch 1, a decode step and a verify chunk, through
    JAX's Triton lowering for gfx950: every kernel the step launches at Flash's shapes. The
    dispatchers pick for the abstract device what they pick on a GPU (``Numerics`` "auto"): each
    compressor's pooling and its entries' write in a launch each. ``opt_ins``: the step with the
    launch merges that are off (not faster on an H100 / H200: a layer's new rows with its
    compressors' steps in one launch, ``new_rows_x2`` / ``x3``; at one token the routing in the
    routed SwiGLU, that SwiGLU unsplit)."""
    from benchmarks.launches import abstract_step

    if opt_ins:
        monkeypatch.setattr(gm, "ONE_TOKEN_SWIGLU_BLOCK_N", 32)
        monkeypatch.setattr(compressor_pool, "WRITE_IN_POOL", True)
    fn, args = abstract_step(4, batch=1, tokens=tokens, context=2048, moe_one_row="experts" if opt_ins else "")
    text = lowering.lower(fn, *args, arch="gfx950", platform="rocm")
    assert lowering.count_triton_calls(text) >= 20
    for name in ("ragged_sink_attention", "grouped_matmul", "index_scores", "top_k_rank"):
        assert name in text, name
    assert ("new_rows_x3" in text and "new_rows_x2" in text) == opt_ins
    assert opt_ins or "compressor_pool" in text
    if tokens == 1:
        assert ("router_select" in text) != opt_ins
        assert ("swiglu_quantise" in text) != opt_ins and ("_routed" in text) == opt_ins


def test_launch_count_script(tmp_path, monkeypatch):
    """``benchmarks/launches.py`` at a batch-1 decode step: the 4-layer slice holds the 2-layer
    slice's launches and a C4 + C128 pair's more (per layer the window's new row with q_norm in one
    launch, each compressor's pooling and its entries' write in one each; wq_a + wkv in one and the
    compressors' linears in another; the router's product alone and the shared expert's w1 + w3 in
    one), written to launches.json."""
    import json

    from benchmarks import launches

    monkeypatch.setenv("OUT", str(tmp_path))
    out = launches.main(["--batch", "1", "--tokens", "1", "--context", "512"])
    assert out["launches_4_layers"] == out["launches_2_layers"] + out["launches_c4_c128_pair"] > 0
    pair = out["pair_by_name"]
    assert pair["kv_rows_norm"] == pair["ragged_sink_attention"] == pair["router_select"] == 2, pair
    assert (pair["compressor_pool"], pair["kv_rows"], pair["key_rows"]) == (3, 2, 1), pair
    assert not [n for n in pair if n.startswith(("new_rows", "rms_norms"))], pair
    # wq_a + wkv and the shared expert's w1 + w3 (both quantised pairs of rows; the latter in the K split
    # moe.SHARED_SPLIT), the router alone
    shared = [n for n in pair if n.startswith("gemv_fp8_q_x2")]
    router = [n for n in pair if re.fullmatch(r"gemv_bf16(_split\d+)?", n)]
    assert sum(pair[n] for n in shared) == 4 and [pair[n] for n in router] == [2], pair
    split = f"_split{moe.SHARED_SPLIT}" if moe.SHARED_SPLIT > 1 else ""
    assert moe.SHARED_SPLIT != 8 and pair[f"gemv_fp8_q_x2{split}"] == pair["gemv_fp8_q_x2_split8"] == 2, pair
    compressors = sorted(n for n in pair if n.startswith("gemv_bf16_x"))  # the C4 layer's 5, the C128 layer's 2
    assert [n.split("_split")[0] for n in compressors] == ["gemv_bf16_x2", "gemv_bf16_x5"], pair
    assert json.loads((tmp_path / "launches.json").read_text())["launches_per_layer"] == out["launches_per_layer"]
