"""A live session's questions in flight: bounded per session, the rest queued, then refused.

    ask -> in flight (< max_in_flight: submitted to the engine now)
        -> queued    (< max_queued: submitted, oldest first, as answers in flight end)
        -> refused   (ResourceExhausted; the session goes on)

Every answer the session asked (questions, standing questions, alert checks) counts. A queued
question keeps the snapshot of the window it was asked about; one aborted while it waits is
submitted and ended by the engine at once (its reader gets the "abort" output as usual).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

from sparrow.engine import Generation
from sparrow.errors import InvalidRequest, ResourceExhausted

Submit = Callable[[], None]          # hands the question to the engine (sets generation.request)
Sink = Callable[[Any], None]         # where the answer's items go (its error, if it never starts)


class LiveQuestions:
    def __init__(self, lock: threading.RLock, max_in_flight: int | None = None, max_queued: int = 0):
        if max_in_flight is not None and max_in_flight < 1:
            raise InvalidRequest(f"max_questions must be >= 1 (None: no bound), got {max_in_flight}")
        if max_queued < 0:
            raise InvalidRequest(f"max_queued_questions must be >= 0, got {max_queued}")
        self._lock = lock                              # the session's
        self.max_in_flight, self.max_queued = max_in_flight, max_queued
        self.answers: set[Generation] = set()          # in flight and queued
        self._queued: deque[tuple[Generation, Submit, Sink]] = deque()   # oldest first
        self.refused = 0
        self.closed = False

    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def in_flight(self) -> int:
        return len(self.answers) - len(self._queued)

    def admit(self, question_id: str, gen: Generation, submit: Submit, sink: Sink) -> None:
        """Submit now, queue, or refuse (ResourceExhausted). Lock held."""
        if self.max_in_flight is None or self.in_flight < self.max_in_flight:
            submit()
        elif len(self._queued) < self.max_queued:
            self._queued.append((gen, submit, sink))
        else:
            self.refused += 1
            raise ResourceExhausted(f"question {question_id!r} refused: {self.in_flight} questions of this live "
                                    f"session are being answered and {len(self._queued)} wait, its limits "
                                    f"({self.max_in_flight} and {self.max_queued}); ask again later")
        self.answers.add(gen)

    def ended(self, gen: Generation) -> None:
        """An answer handed on its last item: queued questions start while there is room.
        One the engine refuses gets its error as its last item."""
        with self._lock:
            self.answers.discard(gen)
        while True:
            with self._lock:
                if self.closed or not self._queued or self.in_flight >= self.max_in_flight:
                    return
                gen, submit, sink = self._queued.popleft()
                failed: BaseException | None = None
                try:
                    submit()
                except Exception as exc:  # noqa: BLE001 - e.g. the engine is full: the answer's error
                    self.answers.discard(gen)
                    failed = exc
                else:
                    if gen._aborted:          # aborted while it waited: the engine ends it at once
                        gen.request.abort()
            if failed is not None:
                sink(failed)

    def close(self) -> None:
        """Abort the answers in flight; queued ones end with an error without starting."""
        with self._lock:
            self.closed = True
            queued = list(self._queued)
            self._queued.clear()
            waiting = {id(gen) for gen, _, _ in queued}
            running = [gen for gen in self.answers if id(gen) not in waiting]
            self.answers.clear()
        for gen in running:
            gen.abort()
        for _, _, sink in queued:
            sink(InvalidRequest("the live session closed before this question started"))


__all__ = ["LiveQuestions"]
