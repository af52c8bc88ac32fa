"""The whole pipeline under one wall-clock budget:

corpus -> tokenizer -> token windows -> target pretraining -> generation (the target continues
prompts cut from the corpus) -> drafter training (generated + corpus windows) -> held-out evaluation ->
simulated decoding rounds + STS -> official-layout export (+ load check) -> plots and a JSON log.

Output directory layout::

    <out>/model/        config.json, model*.safetensors[, index], tokenizer.json, sts.json
    <out>/train_log.json  losses, evaluations, timings, tokens/s, parameter counts, file sizes
    <out>/training.png    loss curves and held-out acceptance by draft position
    <work>/               tokenizer and token cache, generated sequences (generated.npz), orbax
                          checkpoints of both phases (resume); <out>/work unless given
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer
from tqdm import tqdm

from dspark_jax.model.common import Numerics
from dspark_jax.model.deepseek_v4 import DeepSeekV4
from dspark_jax.train import drafter as drafter_lib
from dspark_jax.train import generate as gen_lib
from dspark_jax.train import sts as sts_lib
from dspark_jax.train.ahead import UNTUNED, Programs, abstract
from dspark_jax.train.checkpointing import PhaseCheckpointer
from dspark_jax.train.config import RunConfig
from dspark_jax.train.corpus import WindowSampler, build_corpus, windows
from dspark_jax.train.export import export_model, round_to_checkpoint
from dspark_jax.train.loop import PhaseLog, run_phase, step_seconds
from dspark_jax.train.optim import cast_like, init_state, make_optimizer
from dspark_jax.train.target import init_hash_routes, make_target_eval, make_target_step
from dspark_jax.train.tokenizer import encode_documents, train_tokenizer


def _say(msg: str) -> None:
    tqdm.write(msg)


def prepare_data(cfg: RunConfig, work: str, *, resume: bool) -> tuple[Tokenizer, np.ndarray, np.ndarray, dict]:
    """Tokenizer and token windows (cached under ``work`` for resumed runs)."""
    tok_path, tokens_path = os.path.join(work, "tokenizer.json"), os.path.join(work, "tokens.npz")
    corpus = build_corpus(cfg.corpus)
    stats = corpus.stats()
    if resume and os.path.exists(tok_path) and os.path.exists(tokens_path):
        tok = Tokenizer.from_file(tok_path)
        with np.load(tokens_path) as z:
            train_stream, held_stream = z["train"], z["heldout"]
            if str(z["fingerprint"]) != stats["file_list_sha256"]:
                raise RuntimeError(f"{work} was prepared from a different corpus; use a new output directory")
    else:
        t0 = time.time()
        tok = train_tokenizer((text for _, text in corpus.train), cfg.model.vocab_size)
        stats["tokenizer_s"] = time.time() - t0
        t0 = time.time()
        train_stream = encode_documents(tok, [t for _, t in corpus.train])
        held_stream = encode_documents(tok, [t for _, t in corpus.heldout])
        stats["encode_s"] = time.time() - t0
        tok.save(tok_path)
        np.savez(tokens_path, train=train_stream, heldout=held_stream, fingerprint=stats["file_list_sha256"])
    if tok.get_vocab_size() > cfg.model.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > model vocab {cfg.model.vocab_size}")
    stats.update(train_tokens=int(len(train_stream)), heldout_tokens=int(len(held_stream)),
                 bytes_per_token=stats["train_bytes"] / max(len(train_stream), 1),
                 tokenizer_vocab=tok.get_vocab_size())
    return tok, windows(train_stream, cfg.seq_len), windows(held_stream, cfg.seq_len), stats


def _eval_batches(held: np.ndarray, cfg: RunConfig) -> list[np.ndarray]:
    n = min(len(held) // cfg.eval_windows, cfg.max_eval_batches)
    if n < 1:
        raise ValueError(f"held-out split has {len(held)} windows, fewer than eval_windows={cfg.eval_windows}")
    return [held[i * cfg.eval_windows:(i + 1) * cfg.eval_windows].astype(np.int32) for i in range(n)]


def _mean_metrics(items: list[dict]) -> dict:
    out = {}
    for k in items[0]:
        out[k] = np.mean([np.asarray(jax.device_get(m[k]), np.float64) for m in items], axis=0)
        out[k] = float(out[k]) if np.ndim(out[k]) == 0 else out[k].tolist()
    return out


def _restore(ckpt: PhaseCheckpointer, state, log: PhaseLog, sampler: WindowSampler, resume: bool):
    if not resume:
        return state, log
    got = ckpt.restore(state)
    if got is None:
        return state, log
    state, meta = got
    sampler.seek(int(meta["sampler"]["epoch"]), int(meta["sampler"]["cursor"]))
    _say(f"[{log.name}] resumed from step {meta['log']['steps']} (done={meta['log']['done']})")
    return state, PhaseLog.from_json(meta["log"])


# ---------------------------------------------------------------------------- programs
def _ids(rows: int, cols: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((rows, cols), jnp.int32)


def _dtypes(params: nnx.State):
    """The storage dtype of every parameter."""
    return jax.tree.map(lambda x: x.dtype, params)


def _eval_anchors(cfg: RunConfig) -> int:
    """Anchors per held-out window in the drafter's evaluation."""
    return min(cfg.draft_loss.num_anchors, cfg.seq_len - 1)


def submit_programs(programs: Programs, model: DeepSeekV4, cfg: RunConfig) -> dict[str, optax.GradientTransformation]:
    """Every jitted program of the run, submitted with the abstract arguments its phase calls it with
    (known from the model's structure and the config before any data exists; ``model`` may be
    abstract, from ``nnx.eval_shape``): the target's train step and evaluation at once, the later
    phases' programs once those two are compiled, in the background (while the target trains: a
    few at a time, at low priority, without autotuning unless ``cfg.background_autotune``).
    Returns the optimizers the train steps close over, by phase."""
    key = jax.eval_shape(lambda: jax.random.key(0))
    lr = jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)  # a Python float
    held = _ids(cfg.eval_windows, cfg.seq_len)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx_target = make_optimizer(cfg.target.optim, params)
    state = jax.eval_shape(lambda p: init_state(p, tx_target), params)
    programs.submit("target_step", make_target_step(graphdef, _dtypes(params), tx_target), state, abstract(rest),
                    _ids(cfg.target.batch_size, cfg.seq_len), lr)
    programs.submit("target_eval", make_target_eval(graphdef), abstract(params), abstract(rest), held)
    # The later phases' programs, in the order they are needed.
    later = dict(after=("target_step", "target_eval"), background=True,
                 options=None if cfg.background_autotune else UNTUNED)

    g = cfg.generate
    if g is not None:
        graphdef_all, everything = nnx.split(model)
        programs.submit("generate", gen_lib.make_generate(graphdef_all, g), abstract(everything),
                        _ids(g.batch_size, g.prefix_tokens), jax.ShapeDtypeStruct((g.batch_size,), jnp.float32), key,
                        **later)

    graphdef, draft, frozen, rest = nnx.split(model, drafter_lib.DRAFT_PARAMS, nnx.Param, ...)
    tx_drafter = make_optimizer(cfg.drafter.optim, draft)
    state = jax.eval_shape(lambda p: init_state(p, tx_drafter), draft)
    fixed = abstract(frozen), abstract(rest)
    windows, length, anchors, first_anchor = cfg.drafter_shape()
    step = drafter_lib.make_drafter_step(graphdef, _dtypes(draft), tx_drafter, cfg.draft_loss, num_anchors=anchors,
                                         first_anchor=first_anchor)
    programs.submit("drafter_step", step, state, *fixed, _ids(windows, length), key, lr, **later)
    programs.submit("drafter_eval", drafter_lib.make_drafter_eval(graphdef, cfg.draft_loss), abstract(draft), *fixed,
                    held, _ids(cfg.eval_windows, _eval_anchors(cfg)), **later)
    if g is not None:
        rows = min(cfg.eval_windows, g.heldout_sequences)  # simulate_rounds' chunks
        anchors = len(gen_lib.replay_anchors(g.length, g.prefix_tokens, cfg.model.dspark.block_size))
        programs.submit("free_drafts", drafter_lib.make_free_drafts(graphdef), abstract(draft), *fixed,
                        _ids(rows, g.length), _ids(rows, anchors), **later)
    return dict(target=tx_target, drafter=tx_drafter)


# ---------------------------------------------------------------------------- phases
def train_target(model: DeepSeekV4, cfg: RunConfig, programs: Programs, tx: optax.GradientTransformation, train_w,
                 evals, work, deadline, resume) -> dict:
    _, params, rest = nnx.split(model, nnx.Param, ...)
    dtypes = _dtypes(params)
    state = init_state(params, tx)
    sampler = WindowSampler(train_w, cfg.target.batch_size, seed=cfg.seed)
    ckpt = PhaseCheckpointer(os.path.join(work, "ckpt_target"))
    state, log = _restore(ckpt, state, PhaseLog("target"), sampler, resume)
    step, evaluate = programs.get("target_step"), programs.get("target_eval")
    eval_ids = [jnp.asarray(b) for b in evals]

    def heldout_metrics(master):  # every held-out window (the first batch alone is far easier than the rest)
        params = cast_like(master, dtypes)
        return _mean_metrics([evaluate(params, rest, ids) for ids in eval_ids])

    if not log.done:
        state = run_phase(
            log, state, lambda s, b, lr, i: step(s, rest, jnp.asarray(b), lr), sampler, cfg.target.optim,
            deadline=deadline, max_steps=cfg.target.max_steps, eval_fn=lambda s: heldout_metrics(s.master),
            eval_every_s=cfg.target.eval_every_s, checkpointer=ckpt, ckpt_every_s=cfg.target.ckpt_every_s,
            save_meta=lambda: dict(sampler=dict(epoch=sampler.epoch, cursor=sampler.cursor)))
    ckpt.close()
    nnx.update(model, cast_like(state.master, dtypes))
    round_to_checkpoint(model)  # evaluate (and train the drafter against) exactly the shipped weights
    trained = nnx.state(model, nnx.Param)
    t0 = time.time()
    held = _mean_metrics([evaluate(trained, rest, jnp.asarray(b)) for b in evals])
    held.update(windows=len(evals) * cfg.eval_windows, eval_s=time.time() - t0)
    _say(f"[target] held-out loss {held['loss']:.4f} nats/token, accuracy {held['accuracy']:.4f}, "
         f"{log.tokens_per_s:,.0f} tokens/s")
    return dict(phase=log.to_json(), heldout=held)


def train_drafter(model: DeepSeekV4, cfg: RunConfig, programs: Programs, tx: optax.GradientTransformation, train_w,
                  evals, work, deadline, resume):
    _, draft, frozen, rest = nnx.split(model, drafter_lib.DRAFT_PARAMS, nnx.Param, ...)
    dtypes = _dtypes(draft)
    state = init_state(draft, tx)
    windows, length, _, _ = cfg.drafter_shape()
    if train_w.shape[1] != length:
        raise ValueError(f"drafter windows of {train_w.shape[1]} tokens, the step is built for {length}")
    sampler = WindowSampler(train_w, windows, seed=cfg.seed + 1)
    ckpt = PhaseCheckpointer(os.path.join(work, "ckpt_drafter"))
    state, log = _restore(ckpt, state, PhaseLog("drafter"), sampler, resume)
    step, evaluate = programs.get("drafter_step"), programs.get("drafter_eval")
    a = _eval_anchors(cfg)
    anchors = np.asarray(drafter_lib.sample_anchors(jax.random.key(cfg.seed + 2), len(evals) * cfg.eval_windows,
                                                    cfg.seq_len, a)).reshape(len(evals), cfg.eval_windows, a)
    key = jax.random.key(cfg.seed + 3)
    if not log.done:
        state = run_phase(
            log, state,
            lambda s, b, lr, i: step(s, frozen, rest, jnp.asarray(b), jax.random.fold_in(key, i), lr),
            sampler, cfg.drafter.optim, deadline=deadline, max_steps=cfg.drafter.max_steps,
            eval_fn=lambda s: evaluate(cast_like(s.master, dtypes), frozen, rest, jnp.asarray(evals[0]),
                                       jnp.asarray(anchors[0]))[0],
            eval_every_s=cfg.drafter.eval_every_s, checkpointer=ckpt, ckpt_every_s=cfg.drafter.ckpt_every_s,
            save_meta=lambda: dict(sampler=dict(epoch=sampler.epoch, cursor=sampler.cursor)))
    ckpt.close()
    nnx.update(model, cast_like(state.master, dtypes))
    round_to_checkpoint(model)
    trained = nnx.state(model, drafter_lib.DRAFT_PARAMS)

    t0 = time.time()
    metrics, blocks = [], []
    for ids, anc in zip(evals, anchors):
        m, arrays = evaluate(trained, frozen, rest, jnp.asarray(ids), jnp.asarray(anc))
        metrics.append(m)
        blocks.append(jax.device_get(arrays))
    held = _mean_metrics(metrics)
    surv = np.asarray(held["survival_greedy"])
    held["conditional_accept_greedy"] = (surv / np.concatenate([[1.0], surv[:-1]]).clip(1e-9)).tolist()
    held.update(blocks=int(sum(b["valid"].shape[0] for b in blocks)), eval_s=time.time() - t0)
    _say(f"[drafter] held-out teacher-forced tau_greedy {held['tau_greedy']:.3f}, tau_prob {held['tau_prob']:.3f}, "
         f"{log.tokens_per_s:,.0f} tokens/s")
    return dict(phase=log.to_json(), heldout=held), blocks


def generate_phase(model: DeepSeekV4, cfg: RunConfig, programs: Programs, tok: Tokenizer, train_w, held_w,
                   corpus_stats: dict, work: str, deadline: float, resume: bool) -> tuple[np.ndarray, dict, dict]:
    """Sequences the trained target generates (cached in ``<work>/generated.npz``) and the
    drafter's training windows made of them and of corpus windows."""
    gcfg, m = cfg.generate, cfg.model
    fingerprint = dict(corpus=corpus_stats["content_sha256"], generate=dataclasses.asdict(gcfg), seed=cfg.seed,
                       frames=gen_lib.REQUEST_FRAMES,
                       model=m.to_hf_dict(), dtype=cfg.dtype)
    data = gen_lib.cached_generate(
        os.path.join(work, "generated.npz"), fingerprint,
        lambda: gen_lib.generate_data(programs.get("generate"), nnx.split(model)[1], gcfg, train_w.reshape(-1),
                                      held_w.reshape(-1), line_starts=gen_lib.line_start_tokens(tok, m.vocab_size),
                                      bos=m.bos_token_id, eos=m.eos_token_id, seed=cfg.seed, deadline=deadline,
                                      frames=gen_lib.encode_frames(tok),
                                      quotes=gen_lib.triple_quote_tokens(tok, m.vocab_size), say=_say),
        resume=resume)
    windows_, mix = gen_lib.drafter_windows(data["train"], train_w.reshape(-1), gcfg.corpus_fraction, m.bos_token_id,
                                            cfg.seed)
    stats = dict(data["stats"], **mix)
    _say(f"[generate] drafter data: {mix['generated_windows']} generated + {mix['corpus_windows']} corpus windows")
    return windows_, data, stats


def decoding_rounds(model: DeepSeekV4, cfg: RunConfig, programs: Programs, heldout_sequences: np.ndarray
                    ) -> tuple[dict, dict]:
    """Greedy speculative decoding replayed on the greedy continuations of held-out prefixes."""
    _, draft, frozen, rest = nnx.split(model, drafter_lib.DRAFT_PARAMS, nnx.Param, ...)
    t0 = time.time()
    rounds = gen_lib.simulate_rounds(programs.get("free_drafts"), draft, frozen, rest, heldout_sequences,
                                     cfg.generate.prefix_tokens, cfg.model.dspark.block_size, cfg.eval_windows)
    metrics = dict(gen_lib.decoding_metrics(rounds, cfg.model.dspark.block_size),
                   sequences=len(heldout_sequences), eval_s=time.time() - t0)
    _say(f"[drafter] held-out decoding (simulated greedy rounds): accept length {metrics['mean_accept_length']:.3f} "
         f"over {metrics['rounds']} rounds")
    return rounds, metrics


# ---------------------------------------------------------------------------- pipeline
def training_numerics(dtype, **changes) -> Numerics:
    """How both phases compute: unquantised, every expert densely, Sinkhorn as a loop (unrolled,
    its backward doubles the optimised program of the train step: benchmarks/compile_probe.py)."""
    num = Numerics(dtype=dtype, param_dtype=dtype, quant_sim=False, moe_impl="dense", sinkhorn="loop")
    return dataclasses.replace(num, **changes)


def new_model(cfg: RunConfig) -> DeepSeekV4:
    """The untrained pair (seeded)."""
    model = DeepSeekV4(cfg.model, training_numerics(cfg.dtype), rngs=nnx.Rngs(cfg.seed))
    init_hash_routes(model, jax.random.key(cfg.seed))
    return model


def train_all(out_dir: str, cfg: RunConfig, *, work_dir: str | None = None, resume: bool = True) -> dict:
    """Run everything within ``cfg.minutes``; returns the log written to ``<out>/train_log.json``.

    ``work_dir`` (default ``<out>/work``) holds the tokenized corpus and the orbax checkpoints."""
    t_start = time.time()
    deadline = t_start + 60.0 * cfg.minutes
    work, model_dir = work_dir or os.path.join(out_dir, "work"), os.path.join(out_dir, "model")
    os.makedirs(work, exist_ok=True)
    dev = jax.devices()[0]
    log: dict = dict(device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__, minutes=cfg.minutes,
                     seq_len=cfg.seq_len, dtype=cfg.dtype, model_config=cfg.model.to_hf_dict(), timings={})
    _say(f"[run] device {log['device']}, budget {cfg.minutes:.2f} min, output {out_dir}")

    with Programs(ahead=cfg.compile_ahead, say=_say, t0=t_start) as programs:
        # The programs need only the model's structure: the target's compile in background
        # threads while the model is initialised and the data prepared, the later phases' while
        # the target trains.
        optimizers = submit_programs(programs, nnx.eval_shape(lambda: new_model(cfg)), cfg)
        t0 = time.time()
        model = new_model(cfg)
        log["parameters"] = count_parameters(model)
        log["timings"]["init_s"] = time.time() - t0

        t0 = time.time()
        tok, train_w, held_w, log["corpus"] = prepare_data(cfg, work, resume=resume)
        evals = _eval_batches(held_w, cfg)
        log["timings"]["data_s"] = time.time() - t0
        c = log["corpus"]
        _say(f"[data] {c['train_files']} train / {c['heldout_files']} held-out files, {c['train_tokens']:,} train "
             f"tokens ({c['bytes_per_token']:.2f} bytes/token), {len(train_w)} windows of {cfg.seq_len}")

        train_time = deadline - cfg.reserve_s - time.time()
        if train_time <= 0:
            raise RuntimeError(f"no time left for training after data preparation ({cfg.minutes} min budget)")
        t0 = time.time()
        log["target"] = train_target(model, cfg, programs, optimizers["target"], train_w, evals, work,
                                     t0 + cfg.target_share * train_time, resume)
        log["timings"]["target_s"] = time.time() - t0
        drafter_w, generated = train_w, None
        if cfg.generate is not None:
            t0 = time.time()
            gen_deadline = t0 + cfg.generate.share * (deadline - cfg.reserve_s - t0)
            drafter_w, generated, log["generate"] = generate_phase(model, cfg, programs, tok, train_w, held_w,
                                                                   log["corpus"], work, gen_deadline, resume)
            log["timings"]["generate_s"] = time.time() - t0
        t0 = time.time()
        # The drafter's programs compiled while the target trained: the phase spends its time on steps.
        log["drafter"], blocks = train_drafter(model, cfg, programs, optimizers["drafter"], drafter_w, evals, work,
                                               deadline - cfg.reserve_s, resume)
        log["timings"]["drafter_s"] = time.time() - t0

        t0 = time.time()
        if generated is not None:
            rounds, log["drafter"]["decoding"] = decoding_rounds(model, cfg, programs, generated["heldout"])
            sts_json, test = sts_lib.calibrate_rounds(rounds, cfg.model.dspark.block_size)
        else:
            sts_json, test = sts_lib.calibrate_blocks(blocks)
        log["compile"] = programs.to_json()
    busy = [(t_start + p["started_s"], t_start + p["started_s"] + p["compile_s"]) for p in log["compile"].values()
            if p["background"] and p["ahead"] and p["started_s"] is not None and p["compile_s"] is not None]
    log["target"]["step_s"] = step_seconds(log["target"]["phase"], busy)
    st = log["target"]["step_s"]
    _say(f"[target] median step time {st['median_during_compiles']:.3f} s over {st['steps_during_compiles']} steps "
         f"while programs compiled in the background, {st['median_other']:.3f} s over {st['steps_other']} others")
    log["sts"] = dict(test, temperatures=sts_json["temperatures"], fit_blocks=sts_json["fit_blocks"],
                      fit_ece_before=sts_json["ece_before"], fit_ece_after=sts_json["ece_after"],
                      labels=sts_json["labels"])
    _say(f"[sts] temperatures {np.round(sts_json['temperatures'], 3).tolist()}, held-out ECE "
         f"{log['sts']['ece_before']:.4f} -> {log['sts']['ece_after']:.4f}")
    log["files"] = export_model(model, model_dir, tokenizer=tok, sts=sts_json, max_file_mib=cfg.max_file_mib,
                                max_total_mib=cfg.max_total_mib)
    log["total_mib"] = sum(log["files"].values()) / 2**20
    log["export_check"] = check_export(model, model_dir)
    log["timings"]["finish_s"] = time.time() - t0
    log["timings"]["total_s"] = time.time() - t_start
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    try:
        from dspark_jax.train.plots import plot_training
        plot_training(log, os.path.join(out_dir, "training.png"))
    except ImportError as e:  # the figure can be redrawn later from train_log.json
        _say(f"[run] no plot ({e}): python -m dspark_jax.train.plots {out_dir}/train_log.json training.png")
    _say(f"[run] wrote {model_dir} ({log['total_mib']:.2f} MiB in {len(log['files'])} files) in "
         f"{time.time() - t_start:.0f} s")
    return log


def count_parameters(model: DeepSeekV4) -> dict:
    n = {"target": 0, "drafter": 0}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        n["drafter" if path[0] == "mtp" else "target"] += int(np.prod(var.shape))
    n["total"] = n["target"] + n["drafter"]
    return n


def check_export(model: DeepSeekV4, path: str) -> dict:
    """Reload the directory through the official-layout loader and compare every tensor."""
    import dspark_jax
    from dspark_jax.checkpoint.hf import official_tensors

    loaded = dspark_jax.load(path, dtype=model.num.dtype)
    if loaded.config != model.cfg:
        raise RuntimeError("the exported config.json does not reload to the trained config")
    if loaded.tokenizer is None:
        raise RuntimeError("the exported directory has no tokenizer.json")
    ours = dict(official_tensors(model))
    theirs = dict(official_tensors(loaded.module))
    bad = [k for k in ours if not np.array_equal(np.asarray(ours[k]), np.asarray(theirs[k]))]
    if bad or set(ours) != set(theirs):
        raise RuntimeError(f"exported tensors differ after reloading: {bad[:10]}")
    return dict(tensors=len(ours), identical=True)
