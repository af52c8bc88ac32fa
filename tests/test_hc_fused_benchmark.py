"""benchmarks/hc_fused.py without a device: the parameter copies its timed calls cycle through."""

import jax.numpy as jnp

from benchmarks.hc_fused import cold_copies


def test_cold_copies_are_distinct_buffers_beyond_the_l2():
    """Parameters of 256 KiB or more get distinct buffers (equal values), together about the budget;
    small arguments are shared; a call without large parameters keeps its one set."""
    x, fn, w = jnp.arange(8.0), jnp.arange(24 * 16384, dtype=jnp.float32).reshape(24, 16384), jnp.ones((4096,))
    sets = cold_copies((x, fn, w), budget=32 << 20)
    assert len(sets) == (32 << 20) // fn.nbytes == 21
    assert all(a is b for a, b in zip(sets[0], (x, fn, w)))  # the first set: the arguments themselves
    pointers = {s[1].unsafe_buffer_pointer() for s in sets}
    assert len(pointers) == len(sets)
    assert all(s[0] is x and s[2] is w and bool((s[1] == fn).all()) for s in sets)
    (only,) = cold_copies((x, w))
    assert only[0] is x and only[1] is w
