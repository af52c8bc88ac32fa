"""The command line as a user meets it (in its own processes): help, one-line errors with exit
status 2, the standard-input hint, convert keeping the tokenizer and STS temperatures."""

import argparse
import os
import pty
import select
import subprocess
import sys
import time

import pytest

import dspark_jax
from dspark_jax.decoding.generate import prompt_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", DSPARK_JAX_COMPILE_CACHE="off", COLUMNS="200")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "dspark_jax.cli", *args], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=timeout)


def test_help_describes_every_command_and_option():
    p = cli("--help")
    assert p.returncode == 0
    for cmd in ("generate", "bench", "convert", "train"):
        assert f"    {cmd}  " in p.stdout, p.stdout
    assert "``" not in p.stdout
    p = cli("generate", "--help")
    assert p.returncode == 0 and "--no-speculative" in p.stdout and "standard input" in p.stdout
    # every option of every command has help text
    from dspark_jax.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest for c in sub._choices_actions} == set(sub.choices)  # every command has a help line
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize("args, message", [
    (["generate", "--top-p", "0"], r"top_p must lie in (0, 1], got 0.0"),
    (["generate", "--prompt", "x", "--rounds-per-call", "0"], "rounds_per_call must be >= 1, got 0"),
    (["generate", "--prompt", "x", "--model", "/nonexistent"], "checkpoint directory '/nonexistent' does not exist"),
    (["convert", "/nonexistent", "/tmp/never-written"], "checkpoint directory '/nonexistent' does not exist"),
])
def test_user_errors_are_one_line(args, message):
    p = cli(*args)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"dspark-jax {args[0]}: error: {message}"


def test_empty_prompt_is_one_line(small_checkpoint):
    p = cli("generate", "--prompt", "", "--model", small_checkpoint)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == "dspark-jax generate: error: a prompt is empty"


def test_prompt_from_a_terminal_says_so():
    """generate without --prompt reads standard input; on a terminal it says so instead of waiting silently."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "dspark_jax.cli", "generate"], stdin=follower,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=ROOT)
    os.close(follower)
    err, deadline = b"", time.monotonic() + 30
    try:
        while b"Ctrl-D" not in err and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stderr], [], [], 1)[0]:
                err += os.read(proc.stderr.fileno(), 4096)
    finally:
        proc.kill()
        proc.wait()
        os.close(leader)
    assert b"reading the prompt from standard input; end it with Ctrl-D" in err, err


def test_convert_keeps_tokenizer_and_sts(small_checkpoint, tmp_path):
    dst = tmp_path / "converted"
    p = cli("convert", small_checkpoint, str(dst))
    assert p.returncode == 0, p.stderr
    for name in ("tokenizer.json", "sts.json"):
        with open(os.path.join(small_checkpoint, name), "rb") as a, open(dst / name, "rb") as b:
            assert a.read() == b.read(), name
    src_model = dspark_jax.load(small_checkpoint, progress=False)
    model = dspark_jax.load(dst, progress=False)
    assert model.sts_temperatures == src_model.sts_temperatures == (1.5, 1.0, 0.5)
    assert prompt_ids(model, "def f(x):").tolist() == prompt_ids(src_model, "def f(x):").tolist()
