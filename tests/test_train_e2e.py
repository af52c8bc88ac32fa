"""The one training command at toy scale: ``python -m dspark_jax.train <out> --toy``."""

import contextlib
import json
import os

import jax
import numpy as np
import optax
import pytest
from jax.experimental.compilation_cache import compilation_cache

import dspark_jax
from dspark_jax.train.__main__ import main
from dspark_jax.train.config import toy
from dspark_jax.train.report import summarize

_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes")


@contextlib.contextmanager
def _compile_cache(path: str):
    """JAX's persistent compilation cache in ``path`` for every program (process-wide configuration,
    restored afterwards)."""
    old = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
    compilation_cache.reset_cache()
    for name, value in zip(_CACHE_OPTIONS, (path, 0.0, 0)):
        jax.config.update(name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("toy_compile_cache"))


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache):
    out = str(tmp_path_factory.mktemp("toy_run"))
    work = str(tmp_path_factory.mktemp("toy_work"))
    with _compile_cache(cache):  # for the run without compilation ahead (the last test)
        assert main([out, "--toy", "--no-resume", "--work-dir", work]) == 0
    # what a device run brings back: the model directory, the log and one figure
    assert sorted(os.listdir(out)) == ["model", "train_log.json", "training.png"]
    with open(os.path.join(out, "train_log.json")) as f:
        return out, work, json.load(f)


@pytest.mark.parametrize("phase", ["target", "drafter"])
def test_a_few_steps_reduce_the_held_out_loss(run, phase):
    _, _, log = run
    p = log[phase]["phase"]
    assert p["steps"] == toy().target.max_steps and p["done"]
    first, last = p["evals"][0], p["evals"][-1]  # the same held-out batch before / after training
    assert first["step"] == 0 and last["step"] == p["steps"]
    assert last["loss"] < first["loss"] - 0.02
    assert p["tokens_per_s"] > 0 and len(p["history"]) == p["steps"]


def test_outputs_are_an_official_layout_directory_within_limits(run):
    out, _, log = run
    model_dir = os.path.join(out, "model")
    names = set(os.listdir(model_dir))
    assert {"config.json", "tokenizer.json", "sts.json"} <= names
    assert "model.safetensors" in names or "model.safetensors.index.json" in names
    assert all(os.path.getsize(os.path.join(model_dir, n)) <= 16 * 2**20 for n in names)
    assert log["total_mib"] <= 32 and log["export_check"]["identical"]
    assert os.path.getsize(os.path.join(out, "training.png")) > 20_000
    with open(os.path.join(model_dir, "sts.json")) as f:
        sts = json.load(f)
    assert len(sts["temperatures"]) == 5 and all(t > 0 for t in sts["temperatures"])
    assert sts["ece_after"] <= sts["ece_before"] + 1e-12  # the fit can always keep T = 1
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["dspark_noise_token_id"]) == (0, 1, 2)
    assert log["parameters"]["drafter"] > 0 and log["parameters"]["target"] > log["parameters"]["drafter"]
    assert log["timings"]["total_s"] < 60 * toy().minutes
    text = summarize(log)
    assert "tau_greedy" in text and f"{log['drafter']['heldout']['tau_greedy']:.3f}" in text


def test_the_trained_pair_loads_and_scores_like_in_training(run):
    out, work, log = run
    model = dspark_jax.load(os.path.join(out, "model"), dtype=np.float32)
    assert model.config.dspark is not None and len(model.module.mtp) == toy().model.dspark.num_stages
    assert model.tokenizer.token_to_id("<|noise|>") == model.config.dspark.noise_token_id
    routes = np.asarray(model.module.layers[0].ffn.gate.tid2eid[...])  # hash layer: distinct experts per token
    assert routes.shape == (model.config.vocab_size, 2) and (routes[:, 0] != routes[:, 1]).all()
    text = "def add(a, b):\n    return a + b\n"
    assert model.tokenizer.decode(model.tokenizer.encode(text).ids) == text
    # held-out loss through the public API equals the one measured by the training code
    cfg = toy()
    with np.load(os.path.join(work, "tokens.npz")) as z:
        held = z["heldout"]
    n = log["target"]["heldout"]["windows"]
    ids = held[:n * cfg.seq_len].reshape(n, cfg.seq_len).astype(np.int32)
    logits = np.asarray(model.logits(ids))
    ce = float(np.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])))
    assert ce == pytest.approx(log["target"]["heldout"]["loss"], rel=1e-4)


def test_compiling_ahead_compiles_the_same_programs_and_gives_the_same_losses(run, cache, tmp_path):
    """The same run with every program compiled in place at its first call. Its programs come from
    the persistent compilation cache the first run filled: a program whose in-place lowering
    differed from the one compiled ahead would miss the cache and be written as a new entry."""
    _, _, log = run
    assert set(log["compile"]) == {"target_step", "target_eval", "drafter_step", "drafter_eval"}
    for name, p in log["compile"].items():
        assert p["ahead"] and p["error"] is None and p["in_place_calls"] == 0 and p["compile_s"] > 0, name
        assert p["waited_s"] >= 0 and p["overlapped_s"] == pytest.approx(max(p["compile_s"] - p["waited_s"], 0))
    assert log["compile"]["drafter_step"]["overlapped_s"] > 0  # compiled while the target phase ran

    def run_programs():
        return {f for f in os.listdir(cache) if f.startswith(("jit_step-", "jit_evaluate-"))}

    compiled = run_programs()
    assert len(compiled) == 4
    out = str(tmp_path / "out")
    with _compile_cache(cache):
        assert main([out, "--toy", "--no-resume", "--no-compile-ahead", "--work-dir", str(tmp_path / "work")]) == 0
    assert run_programs() == compiled
    with open(os.path.join(out, "train_log.json")) as f:
        in_place = json.load(f)
    assert all(not p["ahead"] for p in in_place["compile"].values())
    for phase in ("target", "drafter"):
        for key in ("history", "evals"):
            got = [{k: v for k, v in h.items() if k != "time_s"} for h in log[phase]["phase"][key]]
            want = [{k: v for k, v in h.items() if k != "time_s"} for h in in_place[phase]["phase"][key]]
            assert got == want, (phase, key)
        assert log[phase]["heldout"]["loss"] == in_place[phase]["heldout"]["loss"]
