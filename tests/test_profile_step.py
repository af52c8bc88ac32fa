"""The device profile's attribution (benchmarks/profile_step.py): every named component of the
round reaches the compiled program's metadata, and trace events are summed by component."""

import collections
import glob
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import profile_step
from benchmarks.profile_step import Attribution, KernelEvent, Scope, attribute, busy_ns, leaf_events, \
    round_spans_ns, scope_of, timeline, trace_events
from dspark_jax import SamplingParams
from dspark_jax.decoding.engine import Engine


def test_scope_of_reads_phase_layer_and_innermost_component():
    s = scope_of("jit(_round_impl)/verify/layer3/attention/indexer/compressor/dot_general")
    assert s == Scope("verify", "L3", "compressor")
    assert scope_of("jit(_round_impl)/draft/stage2/moe/jit(clip)/max") == Scope("draft", "S2", "moe")
    assert scope_of("jit(_round_impl)/accept_commit/context/add") == Scope("accept_commit", "", "context")
    assert scope_of("select_n") == Scope("other", "", "other")


def test_round_program_names_every_component(tiny_f32):
    """Each component of a DSpark round (and each layer and stage) owns launched instructions of the
    lowered program, and none is left without a scope."""
    eng = Engine(tiny_f32, gamma=tiny_f32.config.dspark.block_size)
    bs = eng.init_state([np.arange(3, 20)], [SamplingParams()], [0], 64)
    text = eng._round.lower(eng.params, bs, sampled=False, top_k=False, top_p=False).as_text(
        dialect="hlo", debug_info=True)
    counts = Attribution(text).static_kernels()
    named = {(s.phase, s.component) for s in counts}
    want = {("verify", c) for c in ("embed", "attention", "indexer", "compressor", "mhc", "moe", "head")}
    want |= {("draft", c) for c in ("embed", "attention", "mhc", "moe", "head", "markov", "confidence")}
    want |= {("accept_commit", "context"), ("accept_commit", "other")}
    assert want <= named, want - named
    cfg = tiny_f32.config
    layers = {s.layer for s in counts}
    assert {f"L{i}" for i in range(cfg.num_hidden_layers)} | {f"S{i}" for i in range(cfg.dspark.num_stages)} <= layers
    unnamed = sum(n for s, n in counts.items() if s.phase == "other")
    assert unnamed == 0, unnamed


_HLO = """HloModule jit_round, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_a (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %d = f32[4]{0} dot(%p0, %p0), lhs_contracting_dims={0}, metadata={op_name="jit(r)/verify/layer0/moe/dot_general"}
  ROOT %t = f32[4]{0} tanh(%d), metadata={op_name="jit(r)/verify/layer0/mhc/tanh"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0), metadata={op_name="x"}
  %fusion.1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a, metadata={op_name="jit(r)/verify/layer0/mhc/tanh"}
  %copy.2 = f32[4]{0} copy(%fusion.1)
  %custom-call.3 = f32[4]{0} custom-call(%copy.2), metadata={op_name="jit(r)/draft/stage1/attention/k"}
  ROOT %add.4 = f32[4]{0} add(%custom-call.3, %x), metadata={op_name="jit(r)/accept_commit/context/add"}
}
"""


def test_synthetic_events_are_attributed():
    attr = Attribution(_HLO)
    # the fusion goes where its heavy instruction (the dot) belongs, not to its root's metadata
    assert attr.scope("fusion.1") == Scope("verify", "L0", "moe")
    # an instruction without metadata takes the scope of the instruction it feeds
    assert attr.scope("copy.2") == Scope("draft", "S1", "attention") and "copy.2" in attr.inferred
    assert attr.scope("memset.9") is None
    line = "/device:GPU:0/Stream #1"
    events = []
    for r in range(2):  # two rounds, 1 ms apart
        t = r * 1e6
        events += [KernelEvent("fusion.1", t, 3000, line), KernelEvent("copy.2", t + 3000, 500, line),
                   KernelEvent("custom-call.3", t + 4000, 5000, line), KernelEvent("add.4", t + 9000, 1000, line),
                   KernelEvent("memset.9", t + 10000, 200, line)]
    # a loop-like event enclosing the first two kernels of round 0 is dropped, not counted twice
    wrapped = leaf_events(events + [KernelEvent("fusion.1", 0, 3500, line)])
    assert len(wrapped) == len(events)
    out = attribute(wrapped, attr, rounds=2)
    comps = out["components"]
    assert comps["verify/moe"] == {"ms": 3000 / 1e6, "launches": 1.0}
    assert comps["draft/attention"] == {"ms": 5500 / 1e6, "launches": 2.0}
    assert comps["accept_commit/context"] == {"ms": 1000 / 1e6, "launches": 1.0}
    assert comps["unattributed"]["launches"] == 1.0 and out["unattributed_ops"] == {"memset.9": 2}
    assert out["layers"]["L0"]["launches"] == 1.0 and out["layers"]["S1"]["launches"] == 2.0
    assert out["phases"]["draft"] == {"ms": 5500 / 1e6, "launches": 2.0}
    assert out["layer_components"]["S1"] == {"attention": {"ms": 5500 / 1e6, "launches": 2.0}}
    assert out["launches_scope_inferred"] == 1.0
    # spans without run ids: equal runs of the same kernels, even where a round's own gap is the widest
    gap = [KernelEvent("a", 0, 10), KernelEvent("b", 500, 10), KernelEvent("a", 520, 10), KernelEvent("b", 1020, 10)]
    assert round_spans_ns(gap, 2) == [510, 510]
    # runs of different kernels (a program with a branch): split at the widest gaps
    branch = [KernelEvent("a", 0, 10), KernelEvent("b", 500, 10), KernelEvent("a", 520, 10), KernelEvent("c", 530, 10)]
    assert round_spans_ns(branch, 2) == [10, 40]
    # device busy time is the union of intervals (overlaps counted once)
    assert busy_ns([KernelEvent("a", 0, 10), KernelEvent("b", 5, 10), KernelEvent("c", 30, 5)]) == 20


def test_timeline_of_one_round(monkeypatch):
    """``timeline``: the listed layers' kernels in the middle round, starts from the layer's first,
    span / busy / idle with overlapping kernels counted once; events that name no instruction of
    the program (a command buffer's kernels) give the whole round by their device names."""
    attr = Attribution(_HLO)
    monkeypatch.setattr(profile_step, "LISTED_LAYERS", ("L0",))
    line, other = "/device:GPU:0/Stream #1", "/device:GPU:0/Stream #2"
    events = []
    for r in range(3):  # three rounds, 1 ms apart; round 1's moe fusion later than the others
        t = r * 1e6 + (500 if r == 1 else 0)
        events += [KernelEvent("fusion.1", t, 3000, line, r, "k_fusion"),
                   KernelEvent("custom-call.3", t + 2000, 5000, other, r, "k_attention"),
                   KernelEvent("fusion.1", t + 9000, 1000, line, r, "k_fusion")]
    out = timeline(events, attr, rounds=3)
    assert set(out) == {"L0"}
    layer = out["L0"]
    assert [k[:3] for k in layer["kernels"]] == [["fusion.1", 0.0, 3.0], ["fusion.1", 9.0, 1.0]]
    assert (layer["span_us"], layer["busy_us"], layer["idle_us"]) == (10.0, 4.0, 6.0)
    named = [KernelEvent(e.hlo_op + "_cb", e.start_ns, e.dur_ns, e.line, e.run, e.kernel) for e in events]
    whole = timeline(named, attr, rounds=3)["round"]
    assert [k[4] for k in whole["kernels"]] == ["k_fusion", "k_attention", "k_fusion"]
    assert (whole["span_us"], whole["busy_us"], whole["idle_us"]) == (10.0, 8.0, 2.0)
    assert timeline([], attr, rounds=3) == {}


def test_trace_of_a_jitted_call_is_attributed(tmp_path):
    """A real profiler trace on this backend: its XLA op events map to the scopes of the program."""
    @jax.jit
    def f(x):
        with jax.named_scope("verify"), jax.named_scope("layer0"):
            with jax.named_scope("moe"):
                y = jnp.sort(x @ x, axis=-1)
            with jax.named_scope("attention"):
                return jax.lax.top_k(jnp.tanh(y) @ x, 4)[0].sum()

    x = jnp.ones((64, 64))
    compiled = f.lower(x).compile()
    text = compiled.as_text()
    compiled(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            compiled(x).block_until_ready()
    path = sorted(glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True))[-1]
    events, _ = trace_events(path, text.split(",")[0].split()[-1])
    out = attribute(events, Attribution(text), rounds=2)
    assert out["components"]["verify/moe"]["ms"] > 0
    assert out["components"]["verify/attention"]["ms"] > 0
    assert "unattributed" not in out["components"]


def test_roofline_bytes_at_flash_dims():
    """The roofline's bytes of a 1-layer Flash slice (abstract shapes, nothing allocated): no draft
    work in target-only decoding; one token reads exactly k routed experts; the Markov loop reads
    markov_w2 once per drafted token; the draft's base logits read the lm_head again."""
    from flax import nnx

    from benchmarks.profile_step import roofline
    from dspark_jax import config
    from dspark_jax.cache import init_cache
    from dspark_jax.model.common import Numerics
    from dspark_jax.model.deepseek_v4 import DeepSeekV4
    from dspark_jax.model.dspark import init_draft_cache

    cfg = config.flash_slice(1)
    num = Numerics(quant_sim=True, weight_format="fp8")
    params = nnx.state(nnx.eval_shape(lambda: DeepSeekV4(cfg, num, rngs=nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 1024))
    draft = jax.eval_shape(lambda: init_draft_cache(cfg, 1))
    ceil = {"copy_GBps": 1000.0, "bf16_matmul_TFLOPs": 500.0}
    target = roofline(cfg, params, cache, draft, 0, 512, ceil)
    spec = roofline(cfg, params, cache, draft, cfg.dspark.block_size, 512, ceil)
    assert not any(k.startswith("draft/") or k == "accept_commit/context" for k in target)

    leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}

    def layer_bytes(*parts, without=()):
        return sum(x.size * x.dtype.itemsize for p, x in leaves.items()
                   if p.startswith("['layers'][0]") and all(s in p for s in parts) and not any(s in p for s in without))

    experts = layer_bytes("'experts'")
    other_moe = layer_bytes("'ffn'", without=("'experts'", "tid2eid")) + layer_bytes("'ffn_norm'")
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    hash_rows = k * 4  # one token's row of the hash routing table (int32)
    assert target["verify/moe"]["MB"] * 1e6 == pytest.approx(experts * k / e + other_moe + hash_rows, rel=1e-9)
    assert spec["verify/moe"]["MB"] > target["verify/moe"]["MB"]

    g, v, r = cfg.dspark.block_size, cfg.vocab_size, cfg.dspark.markov_rank
    assert spec["draft/markov"]["MB"] * 1e6 == pytest.approx(g * v * r * 2 + g * r * 2, rel=1e-9)
    lm_head = cfg.vocab_size * cfg.hidden_size * 2
    assert lm_head < spec["draft/head"]["MB"] * 1e6 < lm_head * 1.01
    assert spec["draft/head"]["GFLOP"] * 1e9 >= 2 * g * lm_head / 2


def test_script_writes_the_compiled_program_it_attributed(tmp_path, monkeypatch):
    """``--hlo``: each mode's compiled HLO lands beside the JSON, and it is the program whose
    kernel-launching instructions the JSON counted (the attribution read from the written text
    finds the same counts)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    profile_step.main(["--smoke", "--hlo", "--modes", "target", "--name", "p", "--rounds", "2", "--warmup", "1"])
    result = json.loads((tmp_path / "p.json").read_text())["results"][0]
    text = (tmp_path / "p.target.hlo.txt").read_text()
    assert "ENTRY" in text
    counted = collections.Counter()
    for s, n in Attribution(text).static_kernels().items():
        counted[f"{s.phase}/{s.component}"] += n
    assert dict(counted) == result["static_kernels"] and sum(counted.values()) > 0
