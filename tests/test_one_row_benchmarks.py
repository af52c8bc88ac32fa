"""``benchmarks/gemv.py`` and ``benchmarks/launch_floor.py`` in interpret mode: a launch of two
weights (a C4 layer's wq_b pair, scaled down) gives each weight's product, and a chain of dependent
kernels gives its reference's sums, with and without weights."""

import json

from benchmarks import gemv, launch_floor


def test_gemv_times_a_launch_of_two_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gemv.main(["--smoke", "--only", "two weights"]) == 0
    (row,) = json.loads((tmp_path / "gemv.json").read_text())["shapes"]
    assert row["n"] == 256 and row["bytes_per_call"] == (256 + 128) * 512 + (2 + 1) * 4  # values + scales
    checked = [v for v in row["variants"] if "max_rel" in v]
    assert len(checked) >= 3 and all(v["max_rel"] < 1e-6 for v in checked), checked


def test_launch_floor_chains_match_their_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert launch_floor.main(["--smoke", "--programs", "1,4", "--rows", "0,8,64"]) == 0
    rows = json.loads((tmp_path / "launch_floor.json").read_text())["rows"]
    assert [(r["programs"], r["rows"]) for r in rows] == [(p, r) for p in (1, 4) for r in (0, 8, 64)]
    for r in rows:
        assert r["max_abs_err"] <= 1e-4 * max(r["scale"], 1.0) and r["scale"] > 0
