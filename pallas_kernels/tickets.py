"""Dependent work in one launch: programs take tickets, count themselves done and wait for counts.

A launch whose later programs consume what its earlier programs write (``gemv_chain``,
``grouped_chain``) cannot rely on program ids: the GPU may start program ids in any order, and a
program that waits for one not yet started could wait forever. Instead every program takes a
ticket, an atomic count in a zeroed int32 buffer, when it starts (``take``), and the ticket says
what it computes: producers get the first tickets. A producer stores its results, then counts
itself done (``count_done``: a barrier, so that every warp's stores come first, then an atomic add
with release semantics at device scope). A consumer waits for its producers' count to reach their
number (``wait_for``: polling by atomic adds of 0, with acquire semantics, then a barrier). A
program waits only for programs holding smaller tickets, which have started and run to their end
whatever the GPU schedules next: every wait ends.

The buffer comes in zeroed and is aliased to an output of the launch (``pallas_call``'s
``input_output_aliases``). Interpret mode runs the programs one after the other, so tickets follow
the grid and every wait is already over (barriers are left out there).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array


def take(count_ref, slot: int) -> Array:
    """This program's ticket: the count at ``slot`` before this program added 1."""
    return pltriton.atomic_add(count_ref, (jnp.int32(slot),), jnp.int32(1))


def count_done(count_ref, slot, interpret: bool) -> None:
    """Counts this program done at ``slot`` (a traced int32) after every warp's stores."""
    if not interpret:
        pltriton.debug_barrier()
    pltriton.atomic_add(count_ref, (slot,), jnp.int32(1))


def wait_for(count_ref, slot, target: int, interpret: bool) -> None:
    """Waits until the count at ``slot`` (a traced int32) reaches ``target``."""
    poll = lambda c: pltriton.atomic_add(count_ref, (slot,), c - c)  # noqa: E731  (adds 0: a traced one)
    lax.while_loop(lambda c: c < target, poll, poll(jnp.asarray(slot, jnp.int32)))
    if not interpret:
        pltriton.debug_barrier()
