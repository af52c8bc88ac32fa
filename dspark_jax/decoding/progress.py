"""Compile time and the progress bar of ``generate``.

JAX reports through ``jax.monitoring`` when it traces a function, lowers it and compiles it (or
reads the compiled program from the persistent cache): a scalar event when each step starts and a
time span when it ends. ``CompileWatch`` listens while a ``generate`` call runs, so the call can
report compile time apart from prefill and decode time, and its progress bar can show compiling
as a phase of its own instead of sitting at 0 %.
"""

from __future__ import annotations

import time

import jax
from tqdm.auto import tqdm

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileWatch:
    """Collects the time spans this process spends compiling between ``__enter__`` and
    ``__exit__`` (on the ``time.perf_counter`` clock); ``on_start()`` is called when a compile step
    begins."""

    def __init__(self, on_start=None):
        self.spans: list[tuple[float, float]] = []
        self.on_start = on_start

    def _started(self, event: str, value, **kwargs) -> None:
        if event in COMPILE_EVENTS and self.on_start is not None:
            self.on_start()

    def _ended(self, event: str, start: float, end: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:  # reported on the wall clock: place the span on perf_counter's
            now = time.perf_counter()
            self.spans.append((now - (end - start), now))

    def __enter__(self) -> "CompileWatch":
        jax.monitoring.register_scalar_listener(self._started)
        jax.monitoring.register_event_time_span_listener(self._ended)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_scalar_listener(self._started)
        jax.monitoring.unregister_event_time_span_listener(self._ended)

    def seconds(self, t0: float = float("-inf"), t1: float = float("inf")) -> float:
        """Compile time within [t0, t1] (nested steps, e.g. tracing inside tracing, counted once)."""
        total, reach = 0.0, t0
        for a, b in sorted(self.spans):
            a, b = max(a, reach), min(b, t1)
            if b > a:
                total += b - a
                reach = b
        return total


class TokenBar:
    """The token progress bar of one ``generate`` call: the tokens kept so far out of the tokens
    still possible (a request that stops early gives back the rest of its budget, so the bar ends
    full and never overshoots), the phase ("prefill", "compiling", "decode"), the compile time and
    the decode speed without it."""

    def __init__(self, budgets: list[int], watch: CompileWatch, enabled: bool):
        self.budgets, self.watch, self.t0 = list(budgets), watch, time.perf_counter()
        self.phase = "prefill"
        self.bar = tqdm(total=sum(budgets), unit="tok", desc="prefill", disable=not enabled, dynamic_ncols=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def compiling(self) -> None:
        if self.phase != "compiling":
            self.phase = "compiling"
            self.bar.set_description_str(self.phase, refresh=True)

    def show(self, phase: str, kept: list[int], done: list[bool]) -> None:
        """kept: tokens each request holds now; done: whether it has finished."""
        if self.bar.disable:
            return
        self.bar.total = sum(n if d else b for n, b, d in zip(kept, self.budgets, done))
        self.phase = phase
        self.bar.set_description_str(phase, refresh=False)
        compile_s = self.watch.seconds(self.t0)
        rate = sum(kept) / max(time.perf_counter() - self.t0 - compile_s, 1e-9)
        self.bar.set_postfix_str(f"compile {compile_s:.1f} s, {rate:.1f} tok/s", refresh=False)
        self.bar.update(sum(kept) - self.bar.n)  # redraws at most every 0.1 s

    def close(self) -> None:
        self.bar.close()
