"""benchmarks/decode.py without a device: slice configs, the depth extrapolation and the roofline
arithmetic on synthetic timings."""

import math

import numpy as np
import pytest

from benchmarks import decode
from dspark_jax import config, memory


@pytest.fixture(scope="module")
def flash_fp8_parts():
    return decode.weight_parts(config.flash(), "fp8")


def test_slices_keep_three_drafter_taps():
    full = config.flash()
    two = decode.sliced(full, 2)
    assert two.dspark.target_layer_ids == (0, 0, 1) and two.compress_ratios == (0, 0) and two.num_hash_layers == 2
    four = decode.sliced(full, 4)
    assert four == config.flash_slice(4)  # the slice the other benchmarks use
    assert decode.layer_kinds(full, range(2, 4)) == "2: C4 hash, 3: C128 learned"
    with pytest.raises(ValueError):
        decode.sliced(full, 44)


def test_extrapolation_of_a_linear_cost():
    """t(d) = 6 + 2 d: the per-layer cost is 2, the fixed part 6 and t(43) = 92, from any two depths."""
    assert decode.extrapolate({2: 10.0}, 43) is None
    for times in ({2: 10.0, 4: 14.0}, {1: 8.0, 3: 12.0, 2: 10.0}):
        e = decode.extrapolate(times, 43)
        assert e["per_layer_s"] == pytest.approx(2.0)
        assert e["fixed_s"] == pytest.approx(6.0)
        assert e["full_s"] == pytest.approx(92.0)


def test_summary_of_synthetic_timings(flash_fp8_parts):
    """Step 1 + 0.5 d ms, round 9 + 0.6 d ms, accept length 4.33: the 43-layer step is 22.5 ms, the
    round 34.8 ms, the speed-up 4.33 * 22.5 / 34.8; the roofline ratios are the step over bytes / the
    copy's and the large read's bandwidths."""
    full = config.flash()
    results = []
    for d in (2, 4):
        results.append({"weights": "fp8", "batch": 1, "context": 2048, "depth": d, "mode": "target",
                        "round_s": 1e-3 * (1 + 0.5 * d), "tokens_per_round": 1.0})
        results.append({"weights": "fp8", "batch": 1, "context": 2048, "depth": d, "mode": "dspark",
                        "round_s": 1e-3 * (9 + 0.6 * d), "tokens_per_round": 4.33})
    parts = {("fp8", 43): flash_fp8_parts, ("fp8", 4): decode.weight_parts(decode.sliced(full, 4), "fp8")}
    ceil = {"copy_GBps": 2000.0, "read_GBps": 3200.0, "bf16_matmul_TFLOPs": 600.0}
    (row,) = decode.summarize(results, full, parts, ceil, "bf16")
    f = row["full"]
    assert f["step_ms"] == pytest.approx(22.5) and f["round_ms"] == pytest.approx(34.8)
    assert f["speedup"] == pytest.approx(4.33 * 22.5 / 34.8)
    assert f["step_over_byte_roofline"] == pytest.approx(22.5e-3 / (f["step_bytes"] / 2000e9))
    assert f["step_over_read_roofline"] == pytest.approx(22.5e-3 / (f["step_bytes"] / 3200e9))
    assert row["measured"]["4"]["speedup"] == pytest.approx(4.33 * 3.0 / 11.4)
    four = row["measured"]["4"]
    assert four["step_over_byte_roofline"] == pytest.approx(3e-3 / (four["step_bytes"] / 2000e9))
    assert four["step_bytes"] < f["step_bytes"] / 5 and "step_bytes" not in row["measured"]["2"]
    assert "span_step_ms" not in f and "span_step_over_byte_roofline" not in decode.goals([row])[
        "fp8 batch 1 context 2048"]
    # device spans (``--spans``) 0.4 + 0.45 d and 8 + 0.5 d ms: extrapolated alike, beside the wall times
    for r in results:
        r["span_s"] = 1e-3 * ((0.4 + 0.45 * r["depth"]) if r["mode"] == "target" else (8 + 0.5 * r["depth"]))
    (row,) = decode.summarize(results, full, parts, ceil, "bf16")
    f = row["full"]
    assert f["step_ms"] == pytest.approx(22.5)  # the wall times' extrapolation unchanged
    assert f["span_step_ms"] == pytest.approx(19.75) and f["span_round_ms"] == pytest.approx(29.5)
    assert f["span_speedup"] == pytest.approx(4.33 * 19.75 / 29.5)
    assert f["span_step_over_byte_roofline"] == pytest.approx(19.75e-3 / (f["step_bytes"] / 2000e9))
    assert decode.goals([row])["fp8 batch 1 context 2048"]["span_speedup_with_profile"] == f["span_speedup"]
    assert "device spans" in decode.table([row])
    assert "| **43 (extrapolated)** |" in decode.table([row])
    # one request reads the non-expert weights, 6 experts per layer and its KV: a few GB at most
    assert 5e9 < f["step_bytes"] < 20e9


def test_compiler_options_are_summarised_apart(flash_fp8_parts):
    """Rounds timed under two option sets give two rows, each extrapolated from its own timings."""
    full = config.flash()
    results = []
    for opt, scale in (("engine", 1.0), ("xla", 1.5)):
        for d in (2, 4):
            for mode, base, tau in (("target", 1.0, 1.0), ("dspark", 9.0, 4.0)):
                results.append({"weights": "fp8", "batch": 1, "context": 2048, "depth": d, "mode": mode,
                                "options": opt, "round_s": 1e-3 * scale * (base + 0.5 * d), "tokens_per_round": tau})
    parts = {("fp8", 43): flash_fp8_parts}
    ceil = {"copy_GBps": 2000.0, "read_GBps": 3200.0, "bf16_matmul_TFLOPs": 600.0}
    rows = decode.summarize(results, full, parts, ceil, "bf16")
    assert [r["options"] for r in rows] == ["engine", "xla"]
    assert rows[0]["full"]["step_ms"] == pytest.approx(22.5) and rows[1]["full"]["step_ms"] == pytest.approx(33.75)
    text = decode.table(rows)
    assert "| fp8 | 1 |" in text and "| fp8 (xla options) | 1 |" in text
    assert "host-bound" not in text  # no host times given
    for r in results:  # the steps' calls took 95 % of their time, the rounds' 2 ms (x1.5 without the options)
        r["host_s"] = 0.95 * r["round_s"] if r["mode"] == "target" else 2e-3 * (1.5 if r["options"] == "xla" else 1)
    rows = decode.summarize(results, full, parts, ceil, "bf16")
    # the 2-layer step (2 ms) took its calls' time, which is the fastest dispatch (1.9 ms): host-bound;
    # the 4-layer step (3 ms) is longer than any dispatch: its calls waited for the device
    assert rows[0]["measured"]["2"]["host_bound"] == ["target"] and rows[0]["measured"]["4"]["host_bound"] == []
    assert decode.table(rows).count("| 2 (measured; target host-bound) |") == 2
    assert set(decode.goals(rows)) == {"fp8 batch 1 context 2048", "fp8 (xla options) batch 1 context 2048"}


def test_weight_parts_add_up_to_the_model():
    cfg = config.tiny()
    parts = decode.weight_parts(cfg, "official")
    tables = (cfg.hidden_size + cfg.dspark.markov_rank) * cfg.vocab_size * 2  # embedding, markov_w1: rows only
    total = (sum(p["bytes"] + cfg.n_routed_experts * p["expert_bytes"] for p in parts["layers"])
             + parts["mtp"]["bytes"] + cfg.n_routed_experts * parts["mtp"]["expert_bytes"] + parts["head"]["bytes"])
    assert math.isclose(total + tables, sum(memory.weight_bytes(cfg, "official").values()))
    dense = decode.weight_parts(cfg, "dense")  # FLOPs count unpacked weights: the same in every format
    assert parts["layers"][3]["expert_weights"] == dense["layers"][3]["expert_weights"] == 3 * 128 * 128
    assert parts["layers"][3]["expert_bytes"] < dense["layers"][3]["expert_bytes"] / 3


def test_kv_read_bytes_per_layer_kind():
    cfg = config.flash()
    row = 2 * cfg.head_dim
    assert decode.kv_read_bytes(cfg, 1, 32768) == 128 * row  # window only
    c4 = decode.kv_read_bytes(cfg, 3, 32768) - decode.kv_read_bytes(cfg, 2, 32768)
    assert c4 == 128 * row + 512 * row + 8192 * cfg.index_head_dim * 2
    c128 = decode.kv_read_bytes(cfg, 4, 32768) - decode.kv_read_bytes(cfg, 3, 32768)
    assert c128 == 128 * row + 256 * row
    assert decode.distinct_experts(cfg, 1) == pytest.approx(6)
    assert 250 < decode.distinct_experts(cfg, 384) < 256


def test_round_roofline_adds_the_drafter_once(flash_fp8_parts):
    """At a batch where every step touches every expert, a round reads what a step reads plus the
    drafter's weights (each stage's experts once), the head and the Markov matrix again, and its rings."""
    cfg = config.flash()
    parts = flash_fp8_parts
    batch = 4096
    r = decode.roofline(cfg, parts, batch, 2048, "bf16")
    m = parts["mtp"]
    drafter = m["bytes"] + cfg.n_routed_experts * m["expert_bytes"]
    extra = parts["head"]["bytes"] + 4 * parts["markov_w2_bytes"] + batch * 3 * 133 * 1024
    assert r["round_bytes"] - r["step_bytes"] == pytest.approx(drafter + extra, rel=1e-6)


def test_rounds_of_every_program_are_timed_in_turn():
    """``time_rounds``: after each program's warm-up, every repeat times each program's rounds in
    turn (a drift reaches all alike), each pass starting at the next program (each takes every
    place alike), carries each program's own state and returns its median (and every pass's time)
    and mean accept length."""
    import jax.numpy as jnp

    calls = []

    class Result:
        def __init__(self, n):
            self.n_new = jnp.asarray([n])

    def program(key, n):
        def run(params, state):
            calls.append(key)
            return state + 1, Result(n)
        return run

    progs = {"a": (program("a", 1), None, 0), "b": (program("b", 3), None, 10), "c": (program("c", 2), None, 20)}
    out = decode.time_rounds(progs, rounds=2, repeats=3, warmup=1)
    # (each pass: an untimed call ahead of the two timed ones)
    assert calls == ["a", "b", "c"] + ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["b"] * 3 + ["c"] * 3 + ["a"] * 3 \
        + ["c"] * 3 + ["a"] * 3 + ["b"] * 3
    assert out["a"][1] == 1.0 and out["b"][1] == 3.0 and out["c"][1] == 2.0
    assert out["a"][2] == 0 + 1 + 9 and out["b"][2] == 10 + 1 + 9 and out["c"][2] == 20 + 1 + 9
    unled = decode.time_rounds(progs, rounds=2, repeats=1, warmup=0, lead=False)  # (the method before)
    assert calls[-6:] == ["a", "a", "b", "b", "c", "c"] and unled["a"][2] == 0 + 2
    assert all(sec > 0 and len(each) == 3 and sec == sorted(each)[1] for sec, _, _, each, _ in out.values())
    # the calls themselves (here: the whole round, nothing runs behind them) are within the round's time
    assert all(0 < host <= max(each) for _, _, _, each, host in out.values())


def test_calls_of_several_rounds_are_timed_per_round():
    """``--rounds-per-call k``: a pass makes ceil(rounds / k) timed calls (after an untimed one), and
    a round's time and host time are a pass's / (calls x k): a host that sleeps 10 ms per call
    gives ~10 / k ms per round (host-bound: the dispatch's rate, the clock holding one call fewer)."""
    import time

    calls = []

    class Result:
        n_new = np.asarray([[2], [4]])  # [k, batch]: a call's rounds, stacked

    def run(params, state):
        calls.append(state)
        time.sleep(0.01)
        return state + 1, Result()

    (sec, tau, after, each, host), = decode.time_rounds({"a": (run, None, 0)}, rounds=3, repeats=2, warmup=1,
                                                        per_call=2).values()
    assert decode.calls_for(3, 2) == 2 and decode.calls_for(4, 2) == 2 and decode.calls_for(1, 4) == 1
    assert calls == [0, 1, 2, 3, 4, 5, 6] and after == 7
    assert tau == 3.0
    assert 0.005 <= host <= sec < 0.0075 and all(sec <= x for x in sorted(each)[1:])


def test_spans_of_traced_rounds():
    """``--spans``: a compiled round-like program (params, state) -> (state, outputs) run under the
    profiler (on the CPU its host thunks stand for kernels): the state comes back advanced by the
    traced rounds, with a span and busy time for them."""
    import collections

    import jax
    import jax.numpy as jnp

    Out = collections.namedtuple("Out", "tokens n_new")

    @jax.jit
    def round_(params, state):
        y = jnp.tanh(state @ params) @ params
        return state + 1.0, Out(jnp.argmax(y, axis=-1), jnp.sum(y > 0))

    params, state = jnp.ones((96, 96)) / 96, jnp.zeros((8, 96))
    compiled = round_.lower(params, state).compile()
    (span, busy, after), = decode.trace_spans({"k": (compiled, params, state)}, rounds=3).values()
    assert float(after[0, 0]) == 3.0
    assert span > 0 and busy > 0

    # two rounds per call (a scan, as ``Engine.rounds``): 3 rounds take 2 calls, 4 rounds on
    @jax.jit
    def rounds_(params, state):
        return jax.lax.scan(lambda s, _: round_(params, s), state, None, length=2)

    compiled = rounds_.lower(params, state).compile()
    (span2, busy2, after), = decode.trace_spans({"k": (compiled, params, state)}, rounds=3, per_call=2).values()
    assert float(after[0, 0]) == 4.0
    assert span2 > 0 and busy2 > 0


def test_ceilings_take_the_fastest_call_after_warming_up():
    """``common.best_time``: calls for at least ``warm_s`` first (untimed), then the fastest and the
    median of ``repeat`` timed calls: a slow start (clocks rising) is left out of both."""
    import time

    from benchmarks import common

    calls = []

    def fn():
        calls.append(time.perf_counter())
        time.sleep(0.03 if len(calls) <= 2 else 0.002 * (1 + len(calls) % 3))
        return np.zeros(1)

    fastest, median = common.best_time(fn, repeat=6, warm_s=0.05)
    assert len(calls) >= 2 + 6 and calls[len(calls) - 6] - calls[0] >= 0.05
    assert 0.002 <= fastest <= median < 0.0075
    ceil = common.ceilings(copy_gib=1 / 4096, matmul_n=64)
    assert all(ceil[k] > 0 and ceil[k] >= ceil[f"{k}_median"] for k in ("copy_GBps", "read_GBps", "bf16_matmul_TFLOPs"))


def test_launch_variants_and_step_only_rows(flash_fp8_parts):
    """``--variants``: each set parsed on top of the command's switches, labelled by its flags; a
    target-only run (``--modes target``) gives one row per variant with the step's values only."""
    import argparse

    from benchmarks.common import add_launch_options, launch_variants

    ap = argparse.ArgumentParser()
    add_launch_options(ap)
    ap.add_argument("--moe-one-row", default="")
    args = ap.parse_args(["--compressor-launches", "1"])
    (base, a), (apart, b), (select, c) = launch_variants("|--wq-b-apart| --moe-one-row select", args)
    assert (base, apart, select) == ("base", "--wq-b-apart", "--moe-one-row select")
    assert not a.wq_b_apart and b.wq_b_apart and not c.wq_b_apart and c.moe_one_row == "select"
    assert a.compressor_launches == b.compressor_launches == c.compressor_launches == 1  # the command's
    assert not args.wq_b_apart  # the command's own switches untouched
    with pytest.raises(ValueError, match="--no-such-switch"):
        launch_variants("|--no-such-switch", args)
    with pytest.raises(ValueError, match="twice"):
        launch_variants("--wq-b-apart|--wq-b-apart", args)

    full = config.flash()
    results = [{"weights": "fp8", "batch": 1, "context": 2048, "depth": d, "mode": "target", "variant": v,
                "round_s": 1e-3 * (1 + s * d), "tokens_per_round": 1.0}
               for v, s in (("base", 0.5), ("--wq-b-apart", 0.25)) for d in (2, 4)]
    rows = decode.summarize(results, full, {("fp8", 43): flash_fp8_parts}, {"copy_GBps": 2000.0,
                            "read_GBps": 3200.0, "bf16_matmul_TFLOPs": 600.0}, "bf16")
    steps = {r["variant"]: r["full"]["step_ms"] for r in rows}
    assert steps == {"base": pytest.approx(22.5), "--wq-b-apart": pytest.approx(11.75)}
    assert all("round_ms" not in r["full"] and "round_ms" not in r["measured"]["4"] for r in rows)
    text = decode.table(rows)
    assert "| fp8 [--wq-b-apart] | 1 | 2048 | **43 (extrapolated)** | 11.75 | - |" in text
    assert set(decode.goals(rows)["fp8 [base] batch 1 context 2048"]) == {
        "step_over_byte_roofline", "step_over_read_roofline", "step_over_roofline"}


def test_hc_config_switch_sets_the_mhc_tiles_per_variant():
    """``--hc-config``: the mHC kernels' settings (``hc_fused.CONFIG``) as name=value pairs on top of
    the library's defaults, set per variant (a variant without it gets the defaults back); an
    unknown field or a missing value is named."""
    import argparse

    from benchmarks.common import add_launch_options, apply_launch_options, hc_config, launch_variants
    from pallas_kernels import hc_fused

    assert hc_config("") == hc_fused.HcConfig()
    assert hc_config("one_block_k=64, collapse_warps=2") == hc_fused.HcConfig(one_block_k=64, collapse_warps=2)
    for bad in ("no_such=1", "one_block_k"):
        with pytest.raises(ValueError, match="name=value pairs"):
            hc_config(bad)
    ap = argparse.ArgumentParser()
    add_launch_options(ap)
    ap.add_argument("--moe-one-row", default="")
    (_, base), (_, tiles) = launch_variants("|--hc-config one_block_k=128", ap.parse_args([]))
    try:
        assert apply_launch_options(tiles)["hc_config"]["one_block_k"] == 128
        assert hc_fused.CONFIG == hc_fused.HcConfig(one_block_k=128)
        apply_launch_options(base)
        assert hc_fused.CONFIG == hc_fused.HcConfig()
    finally:
        hc_fused.CONFIG = hc_fused.HcConfig()


def test_paired_differences_of_variants():
    """``--variants``: each set's passes minus the base's of the same pass, per depth and mode, in
    microseconds (median, quartiles, share of passes faster); rows without a base are left out."""
    base = [1e-3, 2e-3, 1.5e-3, 1e-3, 3e-3]
    faster = [b + d * 1e-6 for b, d in zip(base, (-4.0, -1.0, -2.0, 1.0, -3.0))]
    common = {"weights": "fp8", "batch": 1, "context": 2048, "mode": "target"}
    results = [{**common, "depth": 2, "variant": "base", "round_s_passes": base},
               {**common, "depth": 2, "variant": "--x", "round_s_passes": faster},
               {**common, "depth": 6, "variant": "--x", "round_s_passes": base}]  # no base at 6 layers
    (d,) = decode.paired_differences(results)
    assert (d["variant"], d["depth"], d["passes"]) == ("--x", 2, 5)
    assert d["median_us"] == pytest.approx(-2.0) and d["quartiles_us"] == pytest.approx([-3.0, -1.0])
    assert d["faster_share"] == pytest.approx(0.8)
    assert decode.paired_differences([{**r, "variant": ""} for r in results]) == []


def test_ceilings_are_the_faster_of_start_and_end():
    """The roofline's ceilings: the faster of the run's two measures of each, both kept."""
    ceil = {"copy_GBps": 2500.0, "read_GBps": 3100.0, "bf16_matmul_TFLOPs": 700.0, "copy_GBps_median": 2100.0}
    again = {"copy_GBps": 2950.0, "read_GBps": 3000.0, "bf16_matmul_TFLOPs": 690.0, "copy_GBps_median": 2800.0}
    start, end = decode.stricter_ceilings(ceil, again)
    assert ceil == {"copy_GBps": 2950.0, "read_GBps": 3100.0, "bf16_matmul_TFLOPs": 700.0, "copy_GBps_median": 2100.0}
    assert start["copy_GBps"] == 2500.0 and end is again


def test_compile_group_traces_each_program_under_its_switches():
    """``compile_group(prepare=...)`` lowers each program after its variant's switches are set (the
    model reads them when it is traced): the value each lowering saw is the one its key set."""
    from dspark_jax.model import attention

    seen = {}

    class Program:
        def compile(self):
            return "compiled"

    class Round:
        def __init__(self, key):
            self.key = key

        def lower(self, *args, **kwargs):
            seen[self.key] = attention.WQ_B_TOGETHER
            return Program()

    class FakeEngine:
        def __init__(self, key):
            self._round, self.params = Round(key), None

    before = attention.WQ_B_TOGETHER
    jobs = {k: (FakeEngine(k), None) for k in ("a", "b", "c")}
    together = {"a": True, "b": False, "c": True}
    try:
        out = decode.compile_group(jobs, 2, prepare=lambda k: setattr(attention, "WQ_B_TOGETHER", together[k]))
    finally:
        attention.WQ_B_TOGETHER = before
    assert seen == together and {k: v[0] for k, v in out.items()} == dict.fromkeys(jobs, "compiled")
