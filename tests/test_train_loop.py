"""Training machinery: mixed-precision AdamW, the clock-bounded loop, orbax checkpoints, the
sharded official-layout export."""

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dspark_jax
from dspark_jax import config
from dspark_jax.checkpoint.hf import official_tensors
from dspark_jax.train.checkpointing import PhaseCheckpointer
from dspark_jax.train.corpus import WindowSampler
from dspark_jax.train.export import ExportError, export_model
from dspark_jax.train.loop import PhaseLog, run_phase, step_seconds
from dspark_jax.train.optim import OptimConfig, TrainState, apply_gradients, cast_like, decay_mask, init_state, \
    make_optimizer


def test_lr_schedule():
    opt = OptimConfig(peak_lr=1.0, warmup_fraction=0.1, min_lr_ratio=0.1)
    assert opt.lr(0.05) == pytest.approx(0.5)
    assert opt.lr(0.1) == pytest.approx(1.0)
    assert opt.lr(0.55) == pytest.approx(0.55)  # half way through the cosine
    assert opt.lr(1.0) == pytest.approx(0.1) and opt.lr(7.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="peak_lr"):
        OptimConfig(peak_lr=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        OptimConfig(peak_lr=1.0, weight_decay=-0.1)


def test_command_line_sets_the_target_phase(monkeypatch):
    """--target-weight-decay / --target-steps / --target-batch reach the run's config; the rest of
    the target's optimizer stays the preset's."""
    import dspark_jax.train.run as run_lib
    from dspark_jax.train.__main__ import main
    from dspark_jax.train.config import shipped

    seen = []

    def fake_train_all(out_dir, cfg, **kwargs):
        seen.append(cfg)
        return {"timings": {"total_s": 0.0}}

    monkeypatch.setattr(run_lib, "train_all", fake_train_all)
    assert main(["out", "--no-packages", "--target-weight-decay", "0.5", "--target-steps", "7"]) == 0
    assert main(["out", "--no-packages", "--target-batch", "4"]) == 0
    preset = shipped().target
    first, second = seen[0].target, seen[1].target
    assert first.optim == dataclasses.replace(preset.optim, weight_decay=0.5) and first.max_steps == 7
    assert first.batch_size == preset.batch_size
    assert second.optim == preset.optim and second.batch_size == 4 and second.max_steps == preset.max_steps


def test_decay_mask_and_casting_to_storage_dtypes():
    model = dspark_jax.init(config.tiny(), 0, dtype=jnp.bfloat16).module
    _, params, _ = nnx.split(model, nnx.Param, ...)
    flat = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(decay_mask(params))}
    assert flat["layers.0.attn.wq_a.weight"] is True and flat["head.weight"] is True
    assert flat["mtp.0.ffn.experts.w1"] is True
    assert flat["embed.weight"] is False and flat["layers.0.hc_attn_fn"] is False  # noise row, mHC
    assert flat["mtp.2.markov_head.markov_w1.weight"] is False and flat["norm.weight"] is False
    master = jax.tree.map(lambda x: jnp.array(x, jnp.float32) + 1e-3, params)
    cast = cast_like(master, jax.tree.map(lambda x: x.dtype, params))
    assert all(a.dtype == b.dtype for a, b in zip(jax.tree.leaves(cast), jax.tree.leaves(params)))
    assert {str(x.dtype) for x in jax.tree.leaves(cast)} == {"bfloat16", "float32"}


def test_adamw_on_the_fp32_master_matches_optax():
    rng = np.random.default_rng(0)
    params = {"embed": {"weight": jnp.asarray(rng.normal(size=(6, 4)), jnp.bfloat16)},
              "layers": {"0": {"wq_a": {"weight": jnp.asarray(rng.normal(size=(4, 4)), jnp.bfloat16)},
                               "norm": {"weight": jnp.ones((4,), jnp.float32)}}}}
    mask = decay_mask(params)
    assert mask == {"embed": {"weight": False}, "layers": {"0": {"wq_a": {"weight": True}, "norm": {"weight": False}}}}
    tx = make_optimizer(OptimConfig(peak_lr=1e-2, weight_decay=0.1, clip_norm=1.0), params)
    state = init_state(params, tx)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.master))
    ref_tx = optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask))
    ref_master, ref_opt = state.master, ref_tx.init(state.master)
    for i in range(3):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), state.master)
        state, gnorm = apply_gradients(state, grads, tx, 1e-2)
        updates, ref_opt = ref_tx.update(grads, ref_opt, ref_master)
        ref_master = optax.apply_updates(ref_master, updates)
    for a, b in zip(jax.tree.leaves(state.master), jax.tree.leaves(ref_master)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(state.step) == 3 and float(gnorm) == pytest.approx(
        float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads)))), rel=1e-6)


def _toy_state():
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones((3,), jnp.float32)}
    tx = optax.sgd(1.0)
    return TrainState(master=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32))


def _fake_step(calls):
    @jax.jit
    def step(state, batch, lr):
        return TrainState(master=jax.tree.map(lambda x: x - lr, state.master), opt_state=state.opt_state,
                          step=state.step + 1), dict(loss=jnp.mean(batch).astype(jnp.float32))

    def fn(state, batch, lr, i):
        calls.append((batch.shape[0], lr))
        if batch.shape[0] > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return step(state, jnp.asarray(batch), lr)
    return fn


def test_phase_stops_by_steps_halves_the_batch_on_oom_and_checkpoints(tmp_path):
    calls = []
    sampler = WindowSampler(np.arange(64).reshape(16, 4), batch_size=8, seed=0)
    ckpt = PhaseCheckpointer(str(tmp_path / "ckpt"))
    log = PhaseLog("toy")
    evals = []
    state = run_phase(log, _toy_state(), _fake_step(calls), sampler, OptimConfig(peak_lr=0.5, warmup_fraction=0.0),
                      deadline=time.time() + 600, max_steps=5,
                      eval_fn=lambda s: evals.append(1) or dict(loss=jnp.float32(len(evals))),
                      checkpointer=ckpt, save_meta=lambda: dict(sampler=dict(epoch=0, cursor=0)))
    assert [c[0] for c in calls[:3]] == [8, 4, 2] and sampler.batch_size == 2  # OOM retries
    assert log.steps == 5 and log.done and len(log.history) == 5 and log.batch_size == 2
    assert [e["step"] for e in log.evals] == [0, 5]  # before the first and after the last step
    lrs = [h["lr"] for h in log.history]
    assert lrs[0] == pytest.approx(0.5) and lrs == sorted(lrs, reverse=True) and lrs[-1] < 0.5
    assert int(state.step) == 5
    restored, meta = ckpt.restore(_toy_state())
    np.testing.assert_allclose(restored.master["w"], state.master["w"])
    assert meta["log"]["done"] and meta["log"]["steps"] == 5 and meta["sampler"] == dict(epoch=0, cursor=0)
    ckpt.close()


def test_phase_runs_one_step_even_past_the_deadline():
    log = PhaseLog("late")
    sampler = WindowSampler(np.arange(8).reshape(4, 2), batch_size=1)
    run_phase(log, _toy_state(), _fake_step([]), sampler, OptimConfig(peak_lr=0.1), deadline=time.time() - 1)
    assert log.steps == 1 and log.done


def test_export_shards_reload_through_the_official_loader(tmp_path):
    model = dspark_jax.init(config.tiny(), 1, dtype=jnp.bfloat16).module
    sizes = export_model(model, str(tmp_path), sts={"temperatures": [1.0] * 5}, max_file_mib=4.0, max_total_mib=16.0)
    shards = [f for f in sizes if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in sizes and "sts.json" in sizes
    assert all(s <= 4 * 2**20 for s in sizes.values())
    with open(tmp_path / "model.safetensors.index.json") as f:
        assert set(json.load(f)["weight_map"].values()) == set(shards)
    loaded = dspark_jax.load(str(tmp_path), progress=False)
    assert loaded.config == model.cfg and loaded.config.dspark.num_stages == 3
    ours, theirs = dict(official_tensors(model)), dict(official_tensors(loaded.module))
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
    # re-exporting into the same directory with fewer shards removes the stale ones
    export_model(model, str(tmp_path), max_file_mib=16.0)
    assert sorted(f for f in os.listdir(tmp_path) if "safetensors" in f) == [
        "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    with pytest.raises(ExportError, match="MiB"):
        export_model(model, str(tmp_path / "small"), max_file_mib=16.0, max_total_mib=0.5)


class _Crash(Exception):
    pass


def test_an_interrupted_phase_resumes_from_its_last_checkpoint(tmp_path):
    from dspark_jax.train.run import _restore

    data = np.arange(64).reshape(16, 4)
    opt = OptimConfig(peak_lr=0.5, warmup_fraction=0.0)
    sampler = WindowSampler(data, batch_size=2, seed=0)
    ckpt = PhaseCheckpointer(str(tmp_path / "ckpt"))
    seen = []
    fake = _fake_step([])

    def crashing(state, batch, lr, i):
        if i == 3:
            raise _Crash()
        seen.append(batch.copy())
        return fake(state, batch, lr, i)

    meta = lambda: dict(sampler=dict(epoch=sampler.epoch, cursor=sampler.cursor))
    with pytest.raises(_Crash):
        run_phase(PhaseLog("p"), _toy_state(), crashing, sampler, opt, deadline=time.time() + 600, max_steps=6,
                  checkpointer=ckpt, ckpt_every_s=0.0, save_meta=meta)
    ckpt.close()

    sampler = WindowSampler(data, batch_size=2, seed=0)
    ckpt = PhaseCheckpointer(str(tmp_path / "ckpt"))
    state, log = _restore(ckpt, _toy_state(), PhaseLog("p"), sampler, resume=True)
    assert log.steps == 3 and not log.done and 0 < log.progress < 1 and int(state.step) == 3
    np.testing.assert_allclose(state.master["b"], 1 - sum(h["lr"] for h in log.history))
    state = run_phase(log, state, lambda s, b, lr, i: seen.append(b.copy()) or fake(s, b, lr, i), sampler, opt,
                      deadline=time.time() + 600, max_steps=6, checkpointer=ckpt, save_meta=meta)
    assert log.steps == 6 and [h["step"] for h in log.history] == list(range(6)) and int(state.step) == 6
    # the data continues where the interrupted run stopped: 12 distinct windows, no repeats
    firsts = [int(b[0, 0]) // 4 for b in seen]
    assert len(seen) == 6 and len(set(firsts)) == 6
    ckpt.close()


def test_a_failing_checkpointer_does_not_stop_training():
    class Broken:
        def save(self, *a, **k):
            raise OSError("disk full")

    log = PhaseLog("p")
    run_phase(log, _toy_state(), _fake_step([]), WindowSampler(np.arange(16).reshape(8, 2), batch_size=1),
              OptimConfig(peak_lr=0.1), deadline=time.time() + 600, max_steps=3, checkpointer=Broken(),
              ckpt_every_s=0.0)
    assert log.steps == 3 and log.done and "disk full" in log.checkpoint_error


def test_the_shipped_model_is_two_weight_files_within_the_size_limits(tmp_path):
    """The device run brings back at most 8 files: 2 weight files, index, config, tokenizer, sts,
    log and figure."""
    from dspark_jax.config import from_hf_config
    from dspark_jax.model.common import Numerics
    from dspark_jax.model.deepseek_v4 import DeepSeekV4
    from dspark_jax.train.config import shipped

    cfg = shipped().model
    assert from_hf_config(cfg.to_hf_dict()) == cfg
    assert {0, 4, 128} == set(cfg.compress_ratios) and 0 < cfg.num_hash_layers < cfg.num_hidden_layers
    assert cfg.max_position_embeddings >= 1024 and shipped().seq_len == cfg.max_position_embeddings
    model = DeepSeekV4(cfg, Numerics(), rngs=nnx.Rngs(0))
    sizes = export_model(model, str(tmp_path), sts={})
    assert sorted(sizes) == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                             "model.safetensors.index.json", "sts.json"]
    assert sum(sizes.values()) < 31.5 * 2**20  # + tokenizer.json (0.4 MiB) <= 32 MiB


def test_step_seconds_split_by_background_compilations():
    # step j ran from time_s[j] to time_s[j + 1]; step 0 (compiling) is left out
    hist = [dict(step=i, time_s=t) for i, t in enumerate([0.0, 10.0, 10.3, 10.6, 11.0, 11.3])]
    phase = dict(history=hist, started_at=100.0, first_step=0)
    st = step_seconds(phase, [(110.2, 110.5)])  # overlaps steps 1 (110.0-110.3) and 2 (110.3-110.6)
    assert st["steps_during_compiles"] == 2 and st["steps_other"] == 2
    assert st["median_during_compiles"] == pytest.approx(0.3) and st["median_other"] == pytest.approx(0.35)
    resumed = step_seconds(dict(phase, first_step=3), [])  # steps of this invocation only: 4
    assert resumed["steps_other"] == 1 and resumed["median_other"] == pytest.approx(0.3)
    assert step_seconds(dict(phase, started_at=None), [])["steps_other"] == 0
