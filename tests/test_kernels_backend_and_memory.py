"""The backend switch and the memory planner."""

import math

import pytest

from dspark_jax import config
from dspark_jax.memory import compare, plan
from pallas_kernels import backend


def test_backend_switch_order(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert backend.current() == "pallas"
    monkeypatch.setenv(backend.ENV_VAR, "XLA")
    assert backend.current() == "xla"
    with backend.use("pallas"):
        assert backend.current() == "pallas"
        with backend.use("xla"):
            assert backend.resolve(None) == "xla" and backend.resolve("pallas") == "pallas"
        assert backend.current() == "pallas"
    assert backend.current() == "xla"
    monkeypatch.setenv(backend.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=backend.ENV_VAR):
        backend.current()
    with pytest.raises(ValueError, match="implementation"):
        with backend.use("mosaic"):
            pass
    assert backend.interpret_mode() is True  # the test machine has no GPU
    with pytest.raises(ValueError, match="num_warps"):
        backend.compiler_params(3, 1)


def test_memory_plan_flash_figures():
    cfg = config.flash()
    budget = 64 << 30
    bf16, fp8 = plan(cfg, budget, "bf16"), plan(cfg, budget, "fp8")
    # per token of context: 21 C4 layers (row / 4 + indexer key / 4) + 20 C128 layers (row / 128);
    # indexer keys 256 B in bf16, 128 fp8 codes + 4 scale bytes in the fp8 layout
    assert bf16.bytes_per_token == 21 * (1024 / 4 + 256 / 4) + 20 * 1024 / 128 == 6880
    assert fp8.bytes_per_token == 21 * (640 / 4 + 132 / 4) + 20 * 640 / 128 == 4153
    # fixed per request: 43 window rings of 144 rows, fp32 compressor inputs, 3 bf16 draft rings
    assert bf16.breakdown["window_rings_per_request"] == 43 * 144 * 1024
    assert fp8.breakdown["window_rings_per_request"] == 43 * 144 * 640
    assert bf16.breakdown["draft_rings_per_request"] == fp8.breakdown["draft_rings_per_request"] == 3 * 144 * 1024
    per_req = bf16.bytes_per_request_fixed + sum(
        math.ceil(32768 / r) * (1024 + (256 if r == 4 else 0)) for r in cfg.compress_ratios if r)
    assert bf16.bytes_per_request == per_req and bf16.max_requests == budget // per_req
    assert bf16.max_tokens == bf16.max_requests * 32768
    assert 1.5 < fp8.max_tokens / bf16.max_tokens < 1.6  # 1.58x the slots at 32K tokens per request
    assert plan(cfg, budget, "bf16", gamma=0).breakdown["draft_rings_per_request"] == 0
    assert "fp8 / bf16" in compare(cfg, budget)
    with pytest.raises(ValueError, match="layout"):
        plan(cfg, budget, "fp4")
    with pytest.raises(ValueError, match="budget"):
        plan(cfg, 0)
