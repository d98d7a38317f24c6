"""Serving steps and tuning runs take turns on the device.

The path tuner (sparrow.kernels.autotune) times candidates on the machine that serves, and on a 2-core CPU a
timing run beside a serving step slows both: measured on the world pair, a fresh server's first
25k-token answer had gaps of 0.3-0.4 s while its first shapes were timed, and an 8k-token question
arriving meanwhile waited 10.7 s for its first token against 8.2 s with the choices already on
disk (every new pod of a deployment starts that way). So the two never overlap:

- a scheduler wraps each loop turn (prefill slice, task, decode step) in `serving()`;
- the tuner wraps each timed call in `tuning()`: it waits for the running turns to end, new
  turns wait for its call (one call: milliseconds for decode shapes), then they go on;
- while serving is busy the tuner keeps to SHARE of the time: after each call it pauses
  (1 / SHARE - 1) times that call's length, so a steady stream loses at most about SHARE of its
  speed while shapes are timed, and each of its gaps grows by at most one call. An idle engine
  lets the tuner run at full speed.

Every wait is bounded (MAX_WAIT_S): a turn never waits on a tuner that is stuck, nor the tuner on
a turn that never ends. The timings are cleaner too: a call is timed with nothing else running.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

SHARE = 0.25            # the most of a busy engine's time timing runs take
MAX_WAIT_S = 2.0        # the longest either side waits for the other
RECENT_S = 0.05         # a turn that ended this recently means serving is busy


class TuningGate:
    def __init__(self, share: float = SHARE, max_wait_s: float = MAX_WAIT_S):
        self.share, self.max_wait_s = share, max_wait_s
        self._cv = threading.Condition()
        self._turns = 0                  # serving turns running now
        self._tuning = False             # a timed call running now
        self._asking = False             # the tuner waits for the running turns to end
        self._held = 0                   # turns waiting for a timed call
        self._serving_threads: set[int] = set()     # a timed call on one of these never waits on itself
        self._last_turn = float("-inf")  # when the last turn ended (perf_counter)
        self.stats = {"turns_waited": 0, "calls": 0, "paused_s": 0.0}

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """One scheduler loop turn: waits (bounded) while a timed call runs or is next."""
        with self._cv:
            if self._tuning or self._asking:
                self.stats["turns_waited"] += 1
                self._held += 1
                deadline = time.monotonic() + self.max_wait_s
                while (self._tuning or self._asking) and time.monotonic() < deadline:
                    self._cv.wait(deadline - time.monotonic())
                self._held -= 1
            self._turns += 1
            self._serving_threads.add(threading.get_ident())
        try:
            yield
        finally:
            with self._cv:
                self._serving_threads.discard(threading.get_ident())
                self._turns -= 1
                self._last_turn = time.perf_counter()
                self._cv.notify_all()

    @contextlib.contextmanager
    def tuning(self) -> Iterator[None]:
        """One timed call: after the running turns end (bounded), with none beside it; then a
        pause that keeps the tuner's share of a busy engine under SHARE. A call made inside a turn
        (a measurement asked for on the serving thread) just runs."""
        with self._cv:
            inside = threading.get_ident() in self._serving_threads
        if inside:
            yield
            return
        with self._cv:
            self._asking = True
            deadline = time.monotonic() + self.max_wait_s
            while self._turns and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
            self._asking, self._tuning = False, True
        start = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            with self._cv:
                self._tuning = False
                self.stats["calls"] += 1
                busy = self._turns > 0 or self._held > 0 or self._last_turn > start - RECENT_S
                self._cv.notify_all()
            if busy:
                pause = took * (1 / self.share - 1)
                self.stats["paused_s"] += pause
                time.sleep(pause)


GATE = TuningGate()
