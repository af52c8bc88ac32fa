"""A run's programs compiled ahead of time, in background threads, while the device is busy with
earlier phases.

``jax.jit(f).lower(*abstract_args).compile()`` builds the executable that the first call of ``f``
with arguments of those shapes and dtypes would build: the same program. XLA compiles without
holding the GIL, so the drafter's train step can compile while the target trains. A phase takes
its program with ``Programs.get``; the first call waits for the compilation if it is still
running. When compilation ahead is off, or failed (a logged warning), the first call lowers and
compiles in place with the concrete arguments. Calls with other shapes or dtypes than the
executable's (a batch halved after an out-of-memory error) go to the jitted function, which
compiles for them.

Programs submitted as ``background`` compile while an earlier phase trains on the device, and
must leave that phase alone: they compile on a small pool of threads at a lower OS priority, with
the compiler options ``UNTUNED`` (no autotuning: XLA's GPU autotuner times candidate kernels on the
device the phase trains on, and compiles every candidate on all cores).
A program's options apply however it compiles (ahead or in place), so both give the same program;
an option the installed XLA rejects is dropped (logged) and the program compiles without it.

The log (``Programs.to_json``) records per program whether it was compiled ahead, in the background
and with which options, its lowering + compilation seconds, how long its first call waited for it
and how much of the compilation was hidden behind other work (``overlapped_s``).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

import jax


# Compiler options of background programs: no autotuning (XLA GPU: each GEMM takes cuBLAS's
# heuristic algorithm instead of timing candidates on the device, no Triton GEMM fusions, whose
# untuned tiling is a fixed default) and no compilation thread pool of their own. Ignored by the
# CPU backend.
UNTUNED = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False, "xla_gpu_force_compilation_parallelism": 1}
BACKGROUND_NICE = 10  # OS priority increment of the background compilation threads (Linux)


def abstract(tree):
    """ShapeDtypeStructs of a tree of arrays (abstract arguments for ``jax.jit(f).lower``)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


@dataclass
class ProgramLog:
    ahead: bool  # compiled in a background thread (False: in place at the first call)
    background: bool = False  # compiled while an earlier phase trains (low-priority pool, options)
    options: dict | None = None  # compiler options it was submitted with, then those in effect
    options_error: str | None = None  # why options were dropped (it compiled without them)
    compile_s: float | None = None  # lowering + compilation
    started_s: float | None = None  # when its compilation started (seconds since the run's start)
    first_call_s: float | None = None  # when the phase first called it
    waited_s: float | None = None  # how long that first call waited for the executable
    overlapped_s: float | None = None  # compilation seconds hidden behind other work
    in_place_calls: int = 0  # calls with other shapes than compiled for (the jitted function compiled them)
    error: str | None = None  # why compiling ahead failed


class Program:
    """A jitted function with the executable of one signature (ahead of time or at the first call)."""

    def __init__(self, programs: "Programs", name: str):
        self._programs, self.name = programs, name
        self._fn: Callable = programs._fns[name]
        self._executable = None
        self._lock = threading.Lock()

    def _resolve(self, args: tuple) -> None:
        ps, log = self._programs, self._programs.logs[self.name]
        t = time.time()
        log.first_call_s = t - ps.t0
        future = ps._futures.get(self.name)
        if future is not None:
            try:
                self._executable, log.compile_s, log.options, log.options_error = future.result()
            except Exception as e:  # noqa: BLE001  (any failure: compile in place instead)
                log.ahead, log.error = False, f"{type(e).__name__}: {e}"
                ps.say(f"[compile] WARNING: compiling {self.name} ahead failed ({log.error}); compiling in place")
        if self._executable is None:
            log.started_s = time.time() - ps.t0
            self._executable, log.compile_s, log.options, log.options_error = _compile(
                self._fn, args, ps._options[self.name])
        log.waited_s = time.time() - t
        log.overlapped_s = max(log.compile_s - log.waited_s, 0.0)
        how = (f"compiled ahead in {log.compile_s:.1f} s, first call waited {log.waited_s:.1f} s" if log.ahead
               else f"compiled in place in {log.compile_s:.1f} s")
        ps.say(f"[compile] {self.name}: {how}")

    def __call__(self, *args):
        if self._executable is None:
            with self._lock:
                if self._executable is None:
                    self._resolve(args)
        try:
            return self._executable(*args)
        except TypeError:  # other shapes, dtypes or tree structure than compiled for (checked before running)
            log = self._programs.logs[self.name]
            if log.in_place_calls == 0:
                self._programs.say(f"[compile] {self.name}: called with other shapes than compiled for; "
                                   "the jitted function compiles for them")
            log.in_place_calls += 1
            return self._fn(*args)


def _compile(fn, args: tuple, options: dict | None = None):
    """(executable, lowering + compilation seconds, the options in effect, why options were dropped
    or None). An error that names an option drops that option and compiles again; any other error
    drops them all."""
    t = time.time()
    lowered = fn.lower(*args)
    options, errors = dict(options or {}), []
    while True:
        try:
            executable = lowered.compile(compiler_options=options) if options else lowered.compile()
            break
        except Exception as e:  # noqa: BLE001  (XLA raises a generic runtime error)
            if not options:
                raise
            errors.append(f"{type(e).__name__}: {e}")
            named = [k for k in options if repr(k) in str(e) or f'"{k}"' in str(e)]
            options = {k: v for k, v in options.items() if k not in named} if named else {}
    return executable, time.time() - t, options or None, "; ".join(errors) or None


def _lower_priority() -> None:
    """Raise the calling thread's nice value (Linux applies setpriority to one thread); best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


class Programs:
    """Jitted programs by name, compiled ahead in background threads when ``ahead``.

    ``submit(name, fn, *abstract_args, after=names, background=False, options=None)``: compile
    ``fn`` (a ``jax.jit`` function) for those arguments, with the compiler ``options``, once the
    programs named in ``after`` are compiled (the first phase's programs compile first, on an
    otherwise idle host). ``background`` programs compile on ``background_workers`` threads of
    lower OS priority, in the order submitted (the others each on a thread of their own).
    ``get(name)``: the program to call."""

    def __init__(self, *, ahead: bool, say: Callable[[str], None] = print, t0: float | None = None,
                 max_workers: int = 8, background_workers: int = 2):
        self.ahead, self.say = ahead, say
        self.t0 = time.time() if t0 is None else t0
        self.logs: dict[str, ProgramLog] = {}
        self._fns: dict[str, Callable] = {}
        self._options: dict[str, dict | None] = {}
        self._futures: dict[str, Future] = {}
        self._programs: dict[str, Program] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="compile") if ahead else None
        # First in, first out, and a program waits only for programs submitted before it: a waiting
        # task never holds the thread that the task it waits for needs.
        self._background = (ThreadPoolExecutor(max_workers=background_workers, thread_name_prefix="compile-bg",
                                               initializer=_lower_priority) if ahead else None)
        self._max_workers = max_workers
        self._closed = threading.Event()

    def submit(self, name: str, fn, *abstract_args, after: tuple[str, ...] = (), background: bool = False,
               options: dict | None = None) -> None:
        if name in self._fns:
            raise ValueError(f"program {name!r} was already submitted")
        if unknown := [a for a in after if a not in self._fns]:
            raise ValueError(f"program {name!r} waits for unknown programs {unknown}")
        self._fns[name] = fn
        self._options[name] = dict(options) if options else None
        self.logs[name] = ProgramLog(ahead=self.ahead, background=background, options=self._options[name])
        if not self.ahead:
            return
        foreground = sum(not self.logs[n].background for n in self._futures)
        if not background and foreground >= self._max_workers:  # a waiting task holds its thread
            raise ValueError(f"more than {self._max_workers} programs to compile ahead")
        waits = [self._futures[a] for a in after]

        def work():
            for w in waits:
                w.exception()  # wait; a failed dependency does not stop this compilation
            if self._closed.is_set():
                raise CancelledError(f"{name}: the run ended before its compilation started")
            self.logs[name].started_s = time.time() - self.t0
            return _compile(fn, abstract_args, self._options[name])

        self._futures[name] = (self._background if background else self._pool).submit(work)

    def get(self, name: str) -> Program:
        if name not in self._fns:
            raise KeyError(f"no program {name!r}; submitted: {sorted(self._fns)}")
        if name not in self._programs:
            self._programs[name] = Program(self, name)
        return self._programs[name]

    def to_json(self) -> dict:
        for name, future in self._futures.items():  # compiled ahead, never called (a phase resumed as done)
            log = self.logs[name]
            if log.compile_s is None and future.done() and not future.cancelled() and future.exception() is None:
                log.compile_s, log.options, log.options_error = future.result()[1:]
        return {name: asdict(log) for name, log in self.logs.items()}

    def close(self) -> None:
        """Start no further compilation (a compilation under way runs to its end in its thread)."""
        self._closed.set()
        for pool in (self._pool, self._background):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Programs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
