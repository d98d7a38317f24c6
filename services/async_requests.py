"""Engine requests read from asyncio.

The engine's scheduler batches every running request on its own thread and pushes each
request's events (TokenDelta, then GenerationOutput or an exception) to a callback; here
that callback hands them to the event loop through a queue, so no thread is held per
request. A scheduler phase's events for every request (a decode step's, a prefill slice's) go
over in one wake-up of the loop (AsyncRequests' outbox, handed over as each phase ends: waking a
loop from another thread is a socket write, ~0.1 ms, paid once a step, not once a request), and a reader that has fallen behind gets
the deltas waiting for it as one (its tokens in order, its text joined): under load, fewer
messages, nothing lost. Leaving the async iteration early, however it happens (client cancel,
deadline, Abort, an error), aborts the request and waits until the scheduler has let it go: the
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
        self._runner._post(self._loop, self, item)

    def _lost(self, item) -> None:
        """The loop is gone (shutdown): nobody is reading."""
        self.request.abort()
        if not isinstance(item, TokenDelta):
            self._runner._ended()

    def _deliver(self, item) -> None:
        self._queue.put_nowait(item)
        if not isinstance(item, TokenDelta):
            self._runner._ended()
            self._ended.set()

    def abort(self) -> None:
        self.request.abort()

    async def events(self) -> AsyncIterator[TokenDelta | GenerationOutput]:
        held = None                              # an item taken while joining deltas, yielded next
        try:
            while True:
                item, held = held if held is not None else await self._queue.get(), None
                while isinstance(item, TokenDelta) and not self._queue.empty():
                    after = self._queue.get_nowait()
                    if not isinstance(after, TokenDelta):
                        held = after
                        break
                    item = TokenDelta(item.token_ids + after.token_ids, item.text + after.text)
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
        # Per loop: (request, item) posted and not yet handed over; and the loops woken for them.
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._woken: set[asyncio.AbstractEventLoop] = set()
        engine.after_each_turn(self._wake_all)

    def _post(self, loop: asyncio.AbstractEventLoop, request: RunningRequest, item) -> None:
        """From the engine's threads: `item` for `request`, whose reader runs on `loop`. Posted
        inside a scheduler turn, it waits for its phase's end (_wake_all: one wake-up a loop for
        the phase's events); from another thread (a preparation's error), it goes at once."""
        with self._lock:
            self._outbox.setdefault(loop, []).append((request, item))
        if not self.engine.on_scheduler_thread():
            self._wake(loop)

    def _wake_all(self) -> None:
        with self._lock:
            loops = list(self._outbox)
        for loop in loops:
            self._wake(loop)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake `loop` to hand its items over, unless it was woken for them already."""
        with self._lock:
            if loop in self._woken or not self._outbox.get(loop):
                return
            self._woken.add(loop)
        try:
            loop.call_soon_threadsafe(self._hand_over, loop)
        except RuntimeError:      # the loop is gone (shutdown)
            with self._lock:
                self._woken.discard(loop)
                lost = self._outbox.pop(loop, [])
            for waiting, was in lost:
                waiting._lost(was)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: every item posted since the wake-up, to its request's queue, in order."""
        with self._lock:
            self._woken.discard(loop)
            box = self._outbox.pop(loop, [])
        for request, item in box:
            request._deliver(item)

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
