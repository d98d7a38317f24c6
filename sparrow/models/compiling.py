"""torch.compile, kept per shape for the process: what the draft's static levels
(draft_compile.py) and the target's compiled steps (step_graph.py) both compile through; and
GATE, which keeps compiles and model forwards apart.

Dynamo keeps graphs, and counts recompiles against its limit, per code object: so each shape
compiles its own copy of the function, shapes never evict one another, and callers of one
shape share its graph.

Why compiles and forwards must not overlap: for the whole of a compile (seconds) torch sets
one process-wide flag, `torch.compiler.is_compiling()`, and transformers reads it in eager
code on every thread. Its output capture (the hidden states a prefill collects for the draft)
then keeps its collector in one global instead of a context variable; two eager forwards on
two threads (a prefill chunk and a vision tower) overwrite each other's and a prefill
collects nothing: "tuple index out of range" at a feature layer. A compiled target step runs
under dynamo's process-wide "fail_on_recompile" stance, which would fail any compile beside it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import types
from typing import Callable, Iterator

import torch

log = logging.getLogger(__name__)

_COMPILED: dict[tuple, Callable] = {}

# A background compile starts only when no long forward (a prefill chunk, a vision tower) ended
# within this many seconds: a prefill runs a slice every scheduler turn or so (at most a few
# tenths of a second apart: scheduler.STARVED_SLICES), so a prefill under way is never held up
# mid-way by a compile; it waits at most for one compile that began before it.
QUIET_S = 1.0


class ModelGate:
    """Model forwards (shared: any number at once, on any threads) against compiles (one at a
    time, with no forward running). Every eager forward of a served model, and every compiled
    step, runs inside `forward()`; every compile (a compiled function's first call) inside
    `compile()`.

    A forward waits only while a compile runs (or a firm compile waits to start): at most one
    compile. A firm compile (`compile()`: warm-up, a draft level compiled in line) waits for the
    forwards running now and keeps new ones out meanwhile; a polite one (`compile(polite=True)`:
    the target's background compiles) waits until nothing runs and no long forward ended within
    QUIET_S, and gives way to firm ones. Reentrant: a forward inside a forward, or on the thread
    that compiles (its own eager warm-up), passes straight through."""

    def __init__(self, quiet_s: float = QUIET_S):
        self.quiet_s = quiet_s
        self._cv = threading.Condition(threading.Lock())
        self._forwards = 0              # forwards running now
        self._long = 0                  # of them long (prefill chunks, vision towers)
        self._long_end = float("-inf")  # monotonic time the last long forward ended
        self._firm = 0                  # firm compiles waiting to start
        self._owner: int | None = None  # the thread compiling now
        self._depth = 0
        self._local = threading.local()
        self.waited_s = 0.0             # seconds forwards spent waiting for compiles (all threads)

    @contextlib.contextmanager
    def forward(self, long: bool = False) -> Iterator[None]:
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth or self._owner == threading.get_ident():
            local.depth = depth + 1
            try:
                yield
            finally:
                local.depth = depth
            return
        with self._cv:
            if self._owner is not None or self._firm:
                t0 = time.perf_counter()
                while self._owner is not None or self._firm:
                    self._cv.wait()
                waited = time.perf_counter() - t0
                self.waited_s += waited
                if waited > 1.0:
                    log.info("a model forward waited %.1f s for a compile on another thread", waited)
            self._forwards += 1
            self._long += long
        local.depth = 1
        try:
            yield
        finally:
            local.depth = 0
            with self._cv:
                self._forwards -= 1
                if long:
                    self._long -= 1
                    self._long_end = time.monotonic()
                self._cv.notify_all()

    @contextlib.contextmanager
    def compile(self, polite: bool = False) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        if getattr(self._local, "depth", 0):
            raise RuntimeError("a compile cannot start inside a model forward on the same thread (it would wait "
                               "for itself)")
        with self._cv:
            self._firm += not polite
            try:
                while not self._may_start(polite):
                    idle = time.monotonic() - self._long_end
                    quiet = polite and not self._forwards and not self._firm and self._owner is None
                    self._cv.wait(self.quiet_s - idle if quiet else None)
            finally:
                self._firm -= not polite
            self._owner, self._depth = me, 1
        try:
            yield
        finally:
            with self._cv:
                self._owner, self._depth = None, 0
                self._cv.notify_all()

    def _may_start(self, polite: bool) -> bool:
        if self._owner is not None or self._forwards:
            return False
        if not polite:
            return True
        return not self._firm and time.monotonic() - self._long_end >= self.quiet_s

    @property
    def compiling(self) -> bool:
        return self._owner is not None


GATE = ModelGate()

# Inductor on a CPU: a small model's step is kernels of microseconds, so the generated
# wrapper's own cost is a large share of a call: its shape checks go (shapes are fixed per
# compiled copy), and the wrapper is C++ (cpp_wrapper) rather than Python (~25% of a k = 4
# draft propose at batch 1).
CPU_OPTIONS = {"cpp_wrapper": True, "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def compiled(fn: Callable, key: tuple, tag: str, device: torch.device, options: dict | None = None,
             cuda_graphs: bool = True) -> Callable:
    """fn compiled for one shape `key` (everything that fixes its shapes), its copy named
    fn.__name__ + tag. On a CPU inductor with `options` (CPU_OPTIONS when None); on CUDA, CUDA
    graphs ("reduce-overhead") where `cuda_graphs`, else inductor's kernels alone."""
    compiled_fn = _COMPILED.get(key)
    if compiled_fn is None:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
        copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        if device.type == "cuda":
            how = {"mode": "reduce-overhead"} if cuda_graphs else {}
        else:
            how = {"options": options or CPU_OPTIONS}
        compiled_fn = _COMPILED[key] = torch.compile(copy, fullgraph=True, dynamic=False, **how)
    return compiled_fn
