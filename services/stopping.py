"""A stop that always ends: after SIGTERM (what Kubernetes sends, then SIGKILL 30 s later) the
server stops gracefully (running calls end, the engine aborts its requests at the next step or
prefill slice, Serve shuts down), but never for longer than STOP_GRACE_S: a forward, a target-step
compile or a C++ build still running then does not hold the process. Past the grace the process
kills its kernel builders and exits at once (os._exit: no interpreter teardown, which would wait
on or kill threads inside torch)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

log = logging.getLogger(__name__)

STOP_GRACE_S = float(os.environ.get("SPARROW_STOP_GRACE_S", "2.5"))


def descendants(pid: int | None = None) -> list[int]:
    """Every process below `pid` (default: this one), each after its parent (Linux)."""
    from sparrow.kernels.native import processes
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for child, parent, _ in processes():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def exit_now(code: int = 0) -> NoReturn:
    """Kill the kernel builders and every process this one started (a local Ray cluster's
    included: none outlives it), flush what was written, and end the process now."""
    try:
        from sparrow.kernels import native
        native.kill_builders()
        for pid in descendants():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    finally:
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def arm(grace_s: float | None = None) -> threading.Thread:
    """Start the clock on a stop: if the process is still here `grace_s` from now, it exits (code
    0: the stop was asked for), with one log line saying so."""
    grace = STOP_GRACE_S if grace_s is None else grace_s
    start = time.monotonic()

    def watch() -> None:
        time.sleep(grace)
        log.warning("still stopping %.1f s after the signal: exiting now (a forward, compile or build was running)",
                    time.monotonic() - start)
        exit_now(0)
    # A daemon: a stop that finishes in time ends the process without waiting for it.
    thread = threading.Thread(target=watch, name="sparrow-stop-watch", daemon=True)
    thread.start()
    return thread
