"""``benchmarks/gemv.py`` and ``benchmarks/launch_floor.py`` in interpret mode: a launch of two
weights (a C4 layer's wq_b pair, scaled down) gives each weight's product, and a chain of dependent
kernels gives its reference's sums, with and without weights; ``--xla-pdl`` / ``--pdl`` set XLA's
programmatic dependent launch on top of the programs' compiler options."""

import json

from benchmarks import gemv, launch_floor
from benchmarks.common import with_pdl
from dspark_jax.compile_cache import COMPILER_OPTIONS


def test_gemv_times_a_launch_of_two_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gemv.main(["--smoke", "--only", "two weights"]) == 0
    (row,) = json.loads((tmp_path / "gemv.json").read_text())["shapes"]
    assert row["n"] == 256 and row["bytes_per_call"] == (256 + 128) * 512 + (2 + 1) * 4  # values + scales
    checked = [v for v in row["variants"] if "max_rel" in v]
    assert len(checked) >= 3 and all(v["max_rel"] < 1e-6 for v in checked), checked


def test_launch_floor_chains_match_their_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert launch_floor.main(["--smoke", "--programs", "1,4", "--rows", "0,8,64", "--pdl", "default,off"]) == 0
    rows = json.loads((tmp_path / "launch_floor.json").read_text())["rows"]
    assert [(r["xla_pdl"], r["programs"], r["rows"]) for r in rows] == [
        (o, p, r) for o in ("default", "off") for p in (1, 4) for r in (0, 8, 64)]
    for r in rows:
        assert r["max_abs_err"] <= 1e-4 * max(r["scale"], 1.0) and r["scale"] > 0


def test_pdl_on_top_of_the_options():
    assert with_pdl(None, "default") is None and with_pdl({}, "default") == {}
    assert with_pdl(None, "off") == {**COMPILER_OPTIONS, "xla_gpu_enable_pdl": False}
    assert with_pdl({"a": 1}, "on") == {"a": 1, "xla_gpu_enable_pdl": True}
    assert COMPILER_OPTIONS["xla_gpu_enable_pdl"] is True
