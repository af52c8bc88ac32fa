"""``benchmarks/gemm_decode.py``: in interpret mode the sweep runs, ``--pipelines`` times the
sweep's fastest configurations again with each warps x stages pair given, ``--codes-only`` sweeps
FP8 weights with the rows as fp8 codes only, and every row kind gives the unsplit kernel's bits."""

import json

from benchmarks import gemm_decode


def test_pipelines_time_the_fastest_configs_again(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--smoke", "--only", "experts swiglu", "--codes-only", "--pipelines", "4x3,8x5"]
    assert gemm_decode.main(argv) == 0
    (shape,) = json.loads((tmp_path / "gemm_decode.json").read_text())["shapes"]
    timed = [c for c in shape["configs"] if "us" in c]
    assert len(timed) == len(shape["configs"])  # every config compiled and ran
    codes = [c for c in timed if c["rows"] == "fp8"]
    pipelines = {(c["config"]["num_warps"], c["config"]["num_stages"]) for c in codes}
    assert {(4, 3), (8, 5)} <= pipelines  # default_config's (4, 4) and both given pairs
    # codes only: the bf16 rows are timed for the picked and the unsplit config, not swept
    assert len([c for c in timed if c["rows"] == "bf16"]) <= 2
    assert shape["a8q_vs_a8_max_abs"] == 0.0 and shape["picked_vs_unsplit_max_rel"] < 1e-2
    assert shape["best_a8"]["us"] == min(c["us"] for c in codes)
