"""The one training command at toy scale: ``python -m dspark_jax.train <out> --toy``."""

import json
import os

import numpy as np
import optax
import pytest

import dspark_jax
from dspark_jax.train.__main__ import main
from dspark_jax.train.config import toy
from dspark_jax.train.report import summarize


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("toy_run"))
    work = str(tmp_path_factory.mktemp("toy_work"))
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
