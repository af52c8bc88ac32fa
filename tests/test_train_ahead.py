"""Programs compiled ahead of time in background threads (``dspark_jax.train.ahead``), on small
jitted functions; a whole toy run with and without it is compared in ``test_train_e2e.py``."""

import functools
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.train.ahead import BACKGROUND_NICE, UNTUNED, Programs, abstract


@functools.partial(jax.jit, donate_argnums=0)
def _step(state, x, lr):
    return state - lr * jnp.tanh(x).T @ jnp.tanh(x @ state), jnp.sum(state)


def _args(rows=3):
    state = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(rows, 4)), jnp.float32)
    return state, x, 0.25  # a Python float: a weakly typed scalar


def _specs(rows=3):
    state, x, _ = _args(rows)
    return abstract(state), abstract(x), jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)


def test_the_executable_compiled_ahead_is_the_program_compiled_in_place():
    said = []
    with Programs(ahead=True, say=said.append) as ahead, Programs(ahead=False, say=said.append) as in_place:
        for p in (ahead, in_place):
            p.submit("step", _step, *_specs())
        state, x, lr = _args()
        got = ahead.get("step")(state, x, lr)
        state, x, lr = _args()
        want = in_place.get("step")(state, x, lr)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    a, i = ahead.to_json()["step"], in_place.to_json()["step"]
    assert a["ahead"] and a["compile_s"] > 0 and a["in_place_calls"] == 0 and a["error"] is None
    assert not i["ahead"] and i["compile_s"] > 0 and i["waited_s"] >= i["compile_s"] and i["overlapped_s"] == 0
    assert any("step: compiled ahead" in s for s in said) and any("step: compiled in place" in s for s in said)


def test_other_shapes_go_to_the_jitted_function_and_a_failed_compilation_compiles_in_place():
    said = []
    with Programs(ahead=True, say=said.append) as programs:
        programs.submit("step", _step, *_specs())
        # abstract arguments the function cannot trace: compiling ahead fails
        programs.submit("head", jax.jit(lambda x: x.reshape(3)), jax.ShapeDtypeStruct((2,), jnp.float32))
        step, head = programs.get("step"), programs.get("head")
        step(*_args())
        out, _ = step(*_args(rows=5))  # a halved / grown batch: not what was compiled ahead
        np.testing.assert_array_equal(np.asarray(out), np.asarray(_step(*_args(rows=5))[0]))
        np.testing.assert_array_equal(np.asarray(head(jnp.arange(3.0))), [0.0, 1.0, 2.0])
    log = programs.to_json()
    assert log["step"]["ahead"] and log["step"]["in_place_calls"] == 1
    assert not log["head"]["ahead"] and "TypeError" in log["head"]["error"] and log["head"]["compile_s"] > 0
    assert any("WARNING: compiling head ahead failed" in s for s in said)


def test_a_program_compiles_after_the_ones_it_waits_for():
    @jax.jit
    def slow(x):
        time.sleep(0.3)  # while tracing: the compilation takes at least this long
        return x + 1

    with Programs(ahead=True, say=lambda s: None) as programs:
        programs.submit("first", slow, jax.ShapeDtypeStruct((2,), jnp.float32))
        programs.submit("later", _step, *_specs(), after=("first",))
        programs.get("later")(*_args())
        log = programs.to_json()
        assert log["later"]["started_s"] >= log["first"]["started_s"] + log["first"]["compile_s"] - 1e-3
        with pytest.raises(ValueError, match="already submitted"):
            programs.submit("first", slow)
        with pytest.raises(ValueError, match="unknown programs"):
            programs.submit("other", slow, after=("missing",))
        with pytest.raises(KeyError, match="no program 'missing'"):
            programs.get("missing")


def test_background_programs_compile_with_their_options_at_low_priority():
    """A background program compiles with its compiler options ahead and in place alike (the same
    program); options the compiler rejects are dropped and logged; its thread has a raised nice value."""
    nice = {}

    def traced(name):
        @jax.jit
        def f(x):  # records the nice value of the thread that traces (lowers) it
            nice[name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            return jnp.tanh(x) * 2
        return f

    x = jnp.linspace(-1.0, 1.0, 8)
    spec = jax.ShapeDtypeStruct((8,), jnp.float32)
    results = {}
    for ahead in (True, False):
        with Programs(ahead=ahead, say=lambda s: None) as programs:
            programs.submit("first", traced(f"first{ahead}"), spec)
            programs.submit("bg", traced(f"bg{ahead}"), spec, after=("first",), background=True, options=UNTUNED)
            programs.submit("bad", traced(f"bad{ahead}"), spec, background=True,
                            options={"xla_no_such_option_anywhere": 1, "xla_gpu_autotune_level": 0})
            results[ahead] = [np.asarray(programs.get(n)(x)) for n in ("first", "bg", "bad")]
            log = programs.to_json()
        assert log["bg"]["background"] and log["bg"]["options"] == UNTUNED and log["bg"]["options_error"] is None
        assert not log["first"]["background"] and log["first"]["options"] is None
        assert "xla_no_such_option_anywhere" in log["bad"]["options_error"] and log["bad"]["error"] is None
        assert log["bad"]["options"] == {"xla_gpu_autotune_level": 0}  # the option it knows stays
        assert log["bad"]["ahead"] == ahead and log["bad"]["compile_s"] > 0
    for a, b in zip(*results.values()):
        np.testing.assert_array_equal(a, b)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert nice["bgTrue"] == nice["badTrue"] == min(base + BACKGROUND_NICE, 19)
    assert nice["firstTrue"] == nice["bgFalse"] == base  # the others: as the caller
