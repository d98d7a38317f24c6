"""Schedulers' threads stopped before the interpreter finalizes.

Every scheduler not yet collected, and every thread it started, is kept here: at interpreter
exit the schedulers are shut down and the threads joined (`_stop_all`) before Python
finalizes. A daemon thread still running then - deciding a step, or freeing a model's tensors
as it drops the last reference to its engine - is killed inside torch's C++ and aborts the
process.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

log = logging.getLogger(__name__)

EXIT_JOIN_S = 5.0      # at interpreter exit, how long each scheduler's threads get to stop

_SCHEDULERS: weakref.WeakSet = weakref.WeakSet()
_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def stopped_at_exit(scheduler, thread: threading.Thread) -> None:
    """`scheduler` (anything with shutdown()) is shut down, and `thread` joined, at exit."""
    _SCHEDULERS.add(scheduler)
    _THREADS.add(thread)


@atexit.register
def _stop_all() -> None:
    for scheduler in list(_SCHEDULERS):
        scheduler.shutdown()
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread in list(_THREADS):
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in _THREADS):
        log.warning("scheduler threads still running %.0f s into exit", EXIT_JOIN_S)
