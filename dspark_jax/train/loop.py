"""A training phase that stops by the clock: dispatch steps until the deadline (or a step limit),
with a wall-clock learning-rate schedule, periodic held-out evaluation, periodic orbax
checkpoints, a progress bar and a per-step history for the loss curves."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np
from tqdm import tqdm

from dspark_jax.train.checkpointing import PhaseCheckpointer
from dspark_jax.train.corpus import WindowSampler
from dspark_jax.train.optim import OptimConfig


@dataclass
class PhaseLog:
    name: str
    history: list[dict] = field(default_factory=list)  # one entry per step
    evals: list[dict] = field(default_factory=list)
    compile_s: float = 0.0  # first step of this invocation (one step; its compilation unless compiled ahead)
    train_s: float = 0.0  # wall time of all later steps (evaluations and checkpoints excluded)
    steps: int = 0
    tokens: int = 0
    progress: float = 0.0  # of the learning-rate schedule, 1 = finished
    done: bool = False
    batch_size: int = 0
    epochs: float = 0.0
    peak_memory_gib: float | None = None  # device memory after the first step (None on CPU)
    checkpoint_error: str | None = None  # checkpoints are only for resuming: a failure does not stop training
    started_at: float | None = None  # time.time() when this invocation of the phase started (time_s origin)
    first_step: int = 0  # the step this invocation started from (> 0: resumed from a checkpoint)

    @property
    def tokens_per_s(self) -> float:
        timed = max(self.steps - 1, 0)
        per_step = self.tokens / max(self.steps, 1)
        return timed * per_step / self.train_s if self.train_s > 0 else float("nan")

    def to_json(self) -> dict:
        return dict(name=self.name, steps=self.steps, tokens=self.tokens, compile_s=self.compile_s,
                    train_s=self.train_s, tokens_per_s=self.tokens_per_s, progress=self.progress, done=self.done,
                    batch_size=self.batch_size, epochs=self.epochs, peak_memory_gib=self.peak_memory_gib,
                    checkpoint_error=self.checkpoint_error, started_at=self.started_at, first_step=self.first_step,
                    history=self.history, evals=self.evals)

    @classmethod
    def from_json(cls, d: dict) -> "PhaseLog":
        keys = ("name", "history", "evals", "compile_s", "train_s", "steps", "tokens", "progress", "done",
                "batch_size", "epochs", "peak_memory_gib", "checkpoint_error", "started_at", "first_step")
        return cls(**{k: d[k] for k in keys if k in d})


def _to_host(metrics: dict) -> dict:
    out = {}
    for k, v in jax.device_get(metrics).items():
        v = np.asarray(v)
        out[k] = float(v) if v.ndim == 0 else v.astype(float).tolist()
    return out


def peak_memory_gib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def is_out_of_memory(e: Exception) -> bool:
    msg = str(e)
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()


StepFn = Callable[[Any, np.ndarray, float, int], tuple[Any, dict]]


def run_phase(log: PhaseLog, state, step_fn: StepFn, sampler: WindowSampler, opt: OptimConfig, *,
              deadline: float, max_steps: int | None = None, eval_fn: Callable[[Any], dict] | None = None,
              eval_every_s: float = 60.0, checkpointer: PhaseCheckpointer | None = None,
              ckpt_every_s: float = 120.0, save_meta: Callable[[], dict] = dict, retry_oom: bool = True):
    """Train until ``deadline`` (time.time()) or ``max_steps`` total steps; returns the final state.
    ``eval_fn(state)`` runs before the first step, every ``eval_every_s`` and after the last step.

    step_fn(state, batch, lr, step) -> (state, metrics) must donate ``state``. The schedule's
    progress continues from ``log.progress`` (resumed runs) and reaches 1 at the deadline. At
    least one step runs. On an out-of-memory error in the first step the batch is halved."""
    t_start = log.started_at = time.time()
    p0, step0 = log.progress, log.steps
    log.first_step = step0
    host_state = jax.device_get(state) if retry_oom else None
    t_ready = None  # end of the first (compiling) step
    paused = 0.0  # time spent in evaluations and checkpoints after the first step
    pending = None
    last_eval = last_ckpt = time.time()
    bar = tqdm(total=100, desc=log.name, unit="%", file=sys.stderr, mininterval=10.0, ascii=True,
               bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {elapsed} {postfix}")

    def progress() -> float:
        p_time = 0.0
        if t_ready is not None:
            p_time = (time.time() - t_ready) / max(deadline - t_ready, 1e-9)
        p_steps = (log.steps - step0) / (max_steps - step0) if max_steps else 0.0
        return min(1.0, p0 + (1 - p0) * max(p_time, p_steps))

    def record(item):
        step, t, lr, metrics = item
        entry = dict(step=step, time_s=t, lr=lr, **_to_host(metrics))
        log.history.append(entry)
        return entry

    def evaluate():
        log.evals.append(dict(step=log.steps, time_s=time.time() - t_start, **_to_host(eval_fn(state))))
        tqdm.write(f"[{log.name}] held-out eval at step {log.steps}: " + _fmt(log.evals[-1]))

    def flush():
        nonlocal pending
        if pending is not None:
            record(pending)
            pending = None

    def checkpoint(done: bool):
        flush()  # the saved history must include the step the saved state ends on
        if checkpointer is not None and log.checkpoint_error is None:
            log.done = done
            try:
                checkpointer.save(log.steps, state, dict(log=log.to_json(), **save_meta()))
            except Exception as e:  # noqa: BLE001
                log.checkpoint_error = f"{type(e).__name__}: {e}"
                tqdm.write(f"[{log.name}] checkpointing failed, training continues without it: {log.checkpoint_error}")

    if eval_fn is not None and log.steps == 0:
        evaluate()
    while log.steps < (max_steps or sys.maxsize) and (log.steps == step0 or progress() < 1.0):
        batch = sampler.next()
        lr = opt.lr(progress())
        if t_ready is None:
            while True:
                try:
                    state, metrics = step_fn(state, batch, lr, log.steps)
                    jax.block_until_ready(metrics)
                    break
                except Exception as e:  # noqa: BLE001  (XLA raises a generic runtime error)
                    if not (retry_oom and is_out_of_memory(e)) or sampler.batch_size == 1:
                        raise
                    sampler.batch_size //= 2
                    tqdm.write(f"[{log.name}] out of memory: retrying with batch {sampler.batch_size}")
                    state, batch = jax.device_put(host_state), sampler.next()
            host_state = None
            t_ready = time.time()
            log.compile_s = t_ready - t_start
            log.peak_memory_gib = peak_memory_gib()
            mem = "" if log.peak_memory_gib is None else f", device memory peak {log.peak_memory_gib:.1f} GiB"
            tqdm.write(f"[{log.name}] first step took {log.compile_s:.1f} s, batch {batch.shape}{mem}")
        else:
            state, metrics = step_fn(state, batch, lr, log.steps)
        flush()  # fetching the previous step's metrics keeps at most one step in flight
        pending = (log.steps, time.time() - t_start, lr, metrics)
        log.steps += 1
        log.tokens += int(batch.size)
        log.batch_size = int(batch.shape[0])
        log.epochs = sampler.epochs_done
        log.progress = progress()
        if log.history:
            h = log.history[-1]
            bar.set_postfix_str(f"step {h['step']} loss {h['loss']:.3f} lr {h['lr']:.1e}", refresh=False)
        bar.update(round(100 * log.progress) - bar.n)
        now = time.time()
        if eval_fn is not None and now - last_eval >= eval_every_s:
            evaluate()
            last_eval = time.time()
        if checkpointer is not None and now - last_ckpt >= ckpt_every_s:
            checkpoint(done=False)
            last_ckpt = time.time()
        paused += time.time() - now
    flush()
    jax.block_until_ready(state)
    log.train_s += time.time() - (t_ready or time.time()) - paused  # time in train steps only
    if eval_fn is not None and (not log.evals or log.evals[-1]["step"] != log.steps):
        evaluate()
    log.progress = 1.0
    bar.update(100 - bar.n)
    bar.close()
    checkpoint(done=True)
    log.done = True
    return state


def step_seconds(phase: dict, busy: list[tuple[float, float]]) -> dict:
    """Median seconds per step of a phase (``PhaseLog.to_json``) while any of the ``busy`` intervals
    (time.time() pairs: compilations in the background) ran, and while none did.

    A step's ``time_s`` is when the previous step's metrics arrived (one step in flight), so step j
    ran from time_s[j] to time_s[j + 1]; the invocation's first step (its compilation) and the steps
    of an earlier invocation (resumed phases: their times have another origin) are left out."""
    hist = [h for h in phase["history"] if h["step"] > phase.get("first_step", 0)]
    if phase.get("started_at") is None or len(hist) < 2:
        return dict(median_during_compiles=float("nan"), median_other=float("nan"), steps_during_compiles=0,
                    steps_other=0)
    t = phase["started_at"] + np.asarray([h["time_s"] for h in hist])
    start, end = t[:-1], t[1:]
    during = np.zeros(len(start), bool)
    for a, b in busy:
        during |= (start < b) & (end > a)
    dt = end - start
    med = lambda x: float(np.median(x)) if len(x) else float("nan")
    return dict(median_during_compiles=med(dt[during]), median_other=med(dt[~during]),
                steps_during_compiles=int(during.sum()), steps_other=int((~during).sum()))


def _fmt(d: dict) -> str:
    return " ".join(f"{k} {v:.4g}" for k, v in d.items() if isinstance(v, float) and k not in ("time_s",))
