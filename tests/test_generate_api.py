"""generate() as a user calls it: a checkpoint directory is loaded and compiled once, compile
time is reported apart from decoding, the progress bar shows compiling as a phase and never
overshoots, the greedy_exact flag, and bench's phases."""

import os
import re
import shutil
import time

import jax.numpy as jnp
import pytest

import dspark_jax
from dspark_jax import SamplingParams, config
from dspark_jax.cli import speed_comparison
from dspark_jax.decoding import generate as gen

SP = SamplingParams(max_new_tokens=4, ignore_eos=True)


def frames(err: str) -> list[tuple[str, int, int]]:
    """(phase, n, total) of every progress-bar frame written to stderr."""
    return [(m[1], int(m[2]), int(m[3])) for m in re.finditer(r"(\w+): +\d+%\|[^|]*\| (\d+)/(\d+)", err)]


def test_directory_is_loaded_and_compiled_once(small_checkpoint, tmp_path, monkeypatch, capsys):
    loads = []
    monkeypatch.setattr(gen, "load", lambda *a, **k: loads.append(a) or dspark_jax.load(*a, **k))
    t0 = time.perf_counter()
    first = dspark_jax.generate("def f(x):", model=small_checkpoint, sampling=SP, progress=True)[0]
    wall = time.perf_counter() - t0
    shown = frames(capsys.readouterr().err)
    second = dspark_jax.generate("def f(x):", model=small_checkpoint, sampling=SP)[0]
    assert len(loads) == 1 and first.tokens == second.tokens
    assert gen.resolve_model(small_checkpoint) is gen.resolve_model(os.path.join(small_checkpoint, ""))

    # compile time is its own number; prefill, decode and tokens/s exclude it
    s1, s2 = first.stats, second.stats
    # (parts of one call, so they cannot add up to more than its wall time; the load is outside them)
    assert s1["compile_s"] > 0 and s2["compile_s"] == 0.0
    assert min(s1["prefill_s"], s1["decode_s"]) > 0
    assert s1["compile_s"] + s1["prefill_s"] + s1["decode_s"] <= wall
    assert s1["tokens_per_s"] == pytest.approx(s1["new_tokens"] / s1["decode_s"])
    assert not s1["greedy_exact"]  # a directory loads in bf16 by default

    # the progress bar: a compiling phase, then decode to exactly the tokens generated
    phases = [p for p, _, _ in shown]
    assert "compiling" in phases and phases[-1] == "decode", shown
    assert shown[-1][1:] == (4, 4) and all(n <= total for _, n, total in shown)

    # a directory whose files changed is read again
    copy = shutil.copytree(small_checkpoint, tmp_path / "copy")
    kept = gen.resolve_model(copy)
    assert gen.resolve_model(copy) is kept and len(loads) == 2
    os.utime(copy / "sts.json", ns=(1, 1))
    assert gen.resolve_model(copy) is not kept and len(loads) == 3


def test_bench_shows_its_phases(small_checkpoint, capsys):
    model = gen.resolve_model(small_checkpoint)
    out = speed_comparison(model, ["def f(x):"], SP, repeats=1, progress=True)
    err = capsys.readouterr().err
    for text in ("target_only: first call (compiles unless cached)", "target_only: timed runs",
                 "dspark: first call (compiles unless cached)", "dspark: timed runs"):
        assert text in err, err
    assert out["greedy_exact"] is False and isinstance(out["outputs_identical"], bool)


def test_greedy_exact_flag():
    cfg = config.tiny(dspark=False).replace(num_hidden_layers=1, compress_ratios=(0,), num_hash_layers=0)
    f32 = dspark_jax.init(cfg, 0, dtype=jnp.float32)
    assert gen.greedy_exact(f32) and gen.greedy_exact(f32, "bf16")
    assert not gen.greedy_exact(f32, "fp8")
    assert not gen.greedy_exact(dspark_jax.init(cfg, 0, dtype=jnp.bfloat16))
    assert not gen.greedy_exact(dspark_jax.init(cfg, 0, dtype=jnp.float32, quant_sim=True))
