"""``benchmarks/attention_tiles.py``: the sweep runs at decode and verify shapes (interpret mode,
the kernel checked against the XLA path with its query and output rotations), and the entries it
writes are the ones ``attention_configs.select`` picks for their shape: decode entries for one
token per request, the verify entries still for verify shapes."""

import dataclasses
import json

from benchmarks import attention_tiles
from pallas_kernels import attention_configs as ac


def test_the_sweep_runs_and_checks_every_candidate(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert attention_tiles.main(["--smoke", "--kinds", "swa,c4", "--layouts", "bf16"]) == 0
    out = json.loads((tmp_path / "attention_tiles.json").read_text())
    assert [c["kind"] for c in out["cases"]] == ["swa", "c4"] and out["cases"][0]["case"].endswith("-q1")
    assert attention_tiles.main(["--smoke", "--kinds", "c128", "--layouts", "fp8", "--q-len", "6", "--batch", "2"]) == 0
    verify = json.loads((tmp_path / "attention_tiles.json").read_text())["cases"]
    assert [c["case"] for c in verify] == ["c128-fp8-b2-0k-q6"]
    out["cases"] += verify
    for case in out["cases"]:
        assert case["results"][0]["table"] and len(case["results"]) == 3
        assert all(r["ok"] for r in case["results"])  # finite, within 2 % of the XLA path's largest value
        if case["layout"] == "bf16":  # fp8 pools: the keys' dequantisation and sums in another order
            assert all(r["max_abs_err"] < 1e-2 for r in case["results"])


def test_decode_entries_are_selected_at_one_token(tmp_path):
    with open(ac.TABLE_PATH) as f:
        table = json.load(f)
    table["entries"] = [e for e in table["entries"] if e["q_len"] != 1]  # the verify entries only
    (path := tmp_path / "verify.json").write_text(json.dumps(table))
    verify = ac.select(64, 6, 1, "window", False, path=str(path))
    mine = ac.BlockConfig(block_t=1, block_h=64, block_k=64, num_warps=8, num_stages=2, kv_splits=1, block_d=512)
    assert mine != verify
    env = dict(device="GPU", date="2026-12-04", commit="abc")
    winners = {("window", "bf16"): dict(config=dataclasses.asdict(mine), us=5.0)}
    new = attention_tiles.with_entries(table, winners, env, 64, 1, 1)
    assert len(new["entries"]) == len(table["entries"]) + 1
    again = attention_tiles.with_entries(new, dict(winners), env, 64, 1, 1)
    assert len(again["entries"]) == len(new["entries"])  # replaced, not added
    (path := tmp_path / "table.json").write_text(json.dumps(again))
    assert ac.select(64, 1, 1, "window", False, path=str(path), n_keys=144) == mine
    assert ac.select(64, 6, 1, "window", False, path=str(path)) == verify  # verify keeps its entry
    assert ac.select(64, 1, 1, "window", True, path=str(path)) == ac.select(64, 1, 1, "window", True,
                                                                             path=str(tmp_path / "verify.json"))
    # a verify winner replaces the verify entry of its shape
    replaced = attention_tiles.with_entries(table, winners, env, 64, 6, 1)
    assert len(replaced["entries"]) == len(table["entries"])
    (path := tmp_path / "replaced.json").write_text(json.dumps(replaced))
    assert ac.select(64, 6, 1, "window", False, path=str(path)) == mine
