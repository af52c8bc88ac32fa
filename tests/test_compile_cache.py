"""enable_compile_cache: compiled programs land on disk and load from there (own processes:
the cache directory is process-wide JAX configuration)."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys, jax, jax.numpy as jnp
import dspark_jax
where = dspark_jax.enable_compile_cache(sys.argv[1] if len(sys.argv) > 1 else None, min_compile_s=0)
print("DIR", where, jax.config.jax_compilation_cache_dir)
print("OUT", jax.jit(lambda x: jnp.sin(x) * 2 + 1)(jnp.arange(4.0)).tolist())
"""


def _run(args, env_extra=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if " " in ln}


def test_programs_are_written_and_reused(tmp_path):
    first = _run([str(tmp_path / "c")])
    assert first["DIR"].split()[0] == str(tmp_path / "c")
    def entries():
        return {f: os.stat(tmp_path / "c" / f).st_mtime_ns for f in os.listdir(tmp_path / "c")}

    written = entries()
    assert written, "nothing was cached"
    again = _run([str(tmp_path / "c")])
    assert again["OUT"] == first["OUT"]
    assert entries() == written  # read back, not compiled and written anew


@pytest.mark.parametrize("setting", ["off", "dir"])
def test_environment_variable(tmp_path, setting):
    target = "off" if setting == "off" else str(tmp_path / "env")
    out = _run([], {"DSPARK_JAX_COMPILE_CACHE": target})
    if setting == "off":
        assert out["DIR"].startswith("None")
    else:
        assert out["DIR"].split()[0] == target and os.listdir(target)


def test_unwritable_directory_warns_and_leaves_the_cache_off(tmp_path):
    from dspark_jax.compile_cache import enable_compile_cache

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(UserWarning, match="compilation cache disabled"):
        assert enable_compile_cache(blocker / "cache") is None
