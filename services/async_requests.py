"""Engine requests read from asyncio.

The engine's scheduler batches every running request on its own thread and pushes each
request's events (TokenDelta, then GenerationOutput or an exception) to a callback; here
that callback hands them to the event loop through a queue, so no thread is held per
request. Leaving the async iteration early, however it happens (client cancel, deadline,
Abort, an error), aborts the request and waits until the scheduler has let it go: the
request's KV slot and draft state are freed before the iterator is done.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from sparrow.engine import Engine
from sparrow.output import GenerationOutput, TokenDelta


class RunningRequest:
    """One request in the engine. Iterate (async) for TokenDelta items, then one
    GenerationOutput; `abort()` is safe from any thread."""

    def __init__(self, engine: Engine, runner: "AsyncRequests", video, prompt: str, sampling, options, *,
                 video_key: str | None, num_draft_tokens: int | None, deadline: float | None = None):
        self._runner = runner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._ended = asyncio.Event()
        runner._started()
        try:
            self.request = engine.submit(video, prompt, sampling, options, video_key=video_key,
                                         num_draft_tokens=num_draft_tokens, sink=self._send, deadline=deadline)
        except BaseException:
            runner._ended()
            raise

    def _send(self, item) -> None:
        """From the engine's threads. The last item (output or error) also marks the end."""
        last = not isinstance(item, TokenDelta)
        try:
            self._loop.call_soon_threadsafe(self._deliver, item, last)
        except RuntimeError:      # the loop is gone (shutdown): nobody is reading
            self.request.abort()
            if last:
                self._runner._ended()

    def _deliver(self, item, last: bool) -> None:
        self._queue.put_nowait(item)
        if last:
            self._runner._ended()
            self._ended.set()

    def abort(self) -> None:
        self.request.abort()

    async def events(self) -> AsyncIterator[TokenDelta | GenerationOutput]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, GenerationOutput):
                    return
        finally:
            self.abort()
            await asyncio.shield(self._ended.wait())     # the scheduler has let go of the request


class AsyncRequests:
    """Starts requests on an Engine and counts those the engine still holds."""

    def __init__(self, engine: Engine, max_concurrent: int):
        self.engine = engine
        self.max_concurrent = max_concurrent
        self._active = 0
        self._lock = threading.Lock()

    @property
    def active(self) -> int:
        """Requests whose state the engine still holds (for tests and metrics)."""
        return self._active

    def _started(self) -> None:
        with self._lock:
            self._active += 1

    def _ended(self) -> None:
        with self._lock:
            self._active -= 1

    def start(self, video, prompt: str, sampling, options, *, video_key: str | None = None,
              num_draft_tokens: int | None = None, deadline: float | None = None) -> RunningRequest:
        """deadline: time.monotonic() at which the engine aborts the request itself (the
        event loop's backstop, servicer._abort_at, may run late when the loop is busy)."""
        return RunningRequest(self.engine, self, video, prompt, sampling, options, video_key=video_key,
                              num_draft_tokens=num_draft_tokens, deadline=deadline)

    def shutdown(self) -> None:
        self.engine.shutdown()
