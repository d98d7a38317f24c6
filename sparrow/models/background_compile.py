"""Compiling a hot shape off the serving thread (SpecConfig.draft_step "auto" on a CPU).

A compiled draft step is ~2.5x faster than the eager static one on this project's CPU, but its
first call compiles for 3-10 s: paid on a request's path, that is a stall a user sees; paid at
start-up, every server start and every short-lived engine waits for shapes it may never run.
Here a shape runs eagerly until it has run `hot` times (a shape a service keeps running), then
one daemon thread compiles it by calling the compiled function once on copies of that call's
arguments, under the caller's grad / inference mode (so the guards it records hold on the
caller's thread), while the caller goes on eagerly. Once that call returns, the shape is ready
and the caller's next call runs compiled. Compiled and eager are the same function of the same
inputs (tests/test_draft_compiled.py), so a request that switches mid-answer is unaffected.

One worker for the process, one shape at a time: a compile is CPU-bound, and two at once on a
small machine would only slow each other and the serving thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

HOT_CALLS = 32     # eager calls of a shape before it is compiled in the background


def _detached(value: Any) -> Any:
    """The call's arguments with every tensor cloned (same shape, strides, dtype and device):
    the compile's call writes its own copies, never the caller's live buffers. Parameters are
    passed as they are (read, never written; a clone would be a plain tensor, and the compiled
    function's guards check the type)."""
    if isinstance(value, torch.nn.Parameter):
        return value
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):           # a NamedTuple
        return type(value)(*(_detached(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


class BackgroundCompiler:
    """Counts each shape's eager calls and compiles the hot ones on one daemon thread.

    `offer(key, compile_call, args)` after each eager call of shape `key`: at the `hot`-th, the
    worker runs compile_call(*copies of args) (the compiled function's first call, which
    compiles it) and then marks `key` ready. `ready(key)` is what a caller checks before
    choosing the compiled function. `on_compiled(key, seconds)`, when given, is called from
    the worker after each compile."""

    def __init__(self, hot: int = HOT_CALLS, on_compiled: Callable[[Any, float], None] | None = None):
        self.hot, self.on_compiled = hot, on_compiled
        self._calls: Counter = Counter()
        self._ready: set = set()
        self._queued: set = set()
        self._queue: deque = deque()
        self._failed: dict = {}
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()

    def ready(self, key) -> bool:
        return key in self._ready

    def failed(self, key) -> BaseException | None:
        """The error compiling `key` raised (it then stays eager), or None."""
        return self._failed.get(key)

    def offer(self, key, compile_call: Callable, args: tuple) -> None:
        if key in self._queued:
            return
        with self._lock:
            self._calls[key] += 1
            if key in self._queued or self._calls[key] < self.hot:
                return
            self._queued.add(key)
            modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            self._queue.append((key, compile_call, _detached(args), modes))
            self._idle.clear()
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="sparrow-compile", daemon=True)
                self._worker.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or compiling (tests, benchmarks); False on timeout."""
        return self._idle.wait(timeout)

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = None
                    self._idle.set()
                    return
                key, compile_call, args, (grad, inference) = self._queue.popleft()
            t0 = time.perf_counter()
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    compile_call(*args)
            except Exception as exc:            # the shape stays eager; the caller never waits on it
                self._failed[key] = exc
                log.warning("background compile of %s failed; it stays eager: %s", key[0], exc)
                continue
            self._ready.add(key)
            if self.on_compiled is not None:
                self.on_compiled(key, time.perf_counter() - t0)
