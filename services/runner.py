"""Engine generations on worker threads, read from asyncio.

The engine is synchronous (a plain iterator of TokenDelta); a server is an event loop. Each
request's loop runs on its own thread and hands deltas to the loop through a queue, so a
slow step never blocks other requests' I/O. Leaving the async iteration early, however it
happens (client cancel, deadline, Abort, an error), aborts the generation and waits for its
thread to end: the request's KV cache and draft state are freed before the iterator is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sparrow.engine import Engine, Generation, GenerationOutput, TokenDelta


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


class RunningRequest:
    """One generation on a worker thread. Iterate (async) for TokenDelta items, then one
    GenerationOutput; `abort()` is safe from any thread."""

    def __init__(self, generation: Generation, runner: "EngineRunner"):
        self.generation = generation
        self._runner = runner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        # The worker thread runs in a copy of this context, so its log lines keep the request id.
        self._done = self._loop.run_in_executor(runner.pool, contextvars.copy_context().run, self._work)

    def _work(self) -> None:
        with self._runner.counting():
            try:
                for delta in self.generation:
                    self._send(delta)
                self._send(self.generation.output)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, raised there
                self._send(_Failed(exc))
            finally:
                self.generation.close()

    def _send(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:      # the loop is gone (shutdown): nobody is reading
            self.generation.abort()

    def abort(self) -> None:
        self.generation.abort()

    async def events(self) -> AsyncIterator[TokenDelta | GenerationOutput]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, _Failed):
                    raise item.error
                yield item
                if isinstance(item, GenerationOutput):
                    return
        finally:
            self.abort()
            await asyncio.shield(self._done)     # the thread has let go of the request's state


class EngineRunner:
    """Runs an Engine's requests on a bounded pool of threads."""

    def __init__(self, engine: Engine, max_concurrent: int):
        self.engine = engine
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="sparrow-request")
        self._active = 0
        self._lock = threading.Lock()

    @property
    def active(self) -> int:
        """Requests whose thread still holds state (for tests and metrics)."""
        return self._active

    @contextlib.contextmanager
    def counting(self):
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def start(self, video, prompt: str, sampling, options, *, video_key: str | None = None,
              num_draft_tokens: int | None = None) -> RunningRequest:
        generation = self.engine.stream(video, prompt, sampling, options, video_key=video_key,
                                        num_draft_tokens=num_draft_tokens)
        return RunningRequest(generation, self)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
