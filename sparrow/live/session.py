"""Live sessions: a video stream prefilled as it arrives; questions answered from its KV cache.

    frames (raw, or decoded from container chunks: LiveDecoder)
      -> sampled at `fps`, grouped in frame pairs (Qwen's temporal patch)
      -> each pair (a scheduler task between decode steps): vision tower, then the language
         model on top of the session's KV cache, at the pair's real-time rope positions
      -> a question: a copy of the session's KV (a VideoPrefix snapshot) + its own prefill + decode

The window (live_window.py): at most `window_s` seconds of pairs in one KV cache; the oldest
leave in steps of `evict_s`, and the kept ones are re-positioned so the window reads as a clip
that starts at time 0. Positions are real time, so a question asked now gets exactly the
positions of the same frames prefilled in one shot.

Time (source_health.py): stream seconds count from the first frame and stay continuous across
source timestamp resets and media switches (each an event); every frame also keeps its
source PTS and the wall-clock time it arrived, and answers carry those of their newest
frame. A source silent for `stale_after_s` is stale: an event, and answers marked stale.

Memory is bounded: the session's cache holds the text before the video + the window; drafts
whose context is text (sparrow) never see the video grow. The cache is a slot of the engine's
KV arena, taken at the first frame (when the window's size is known) like a request's: a
session that cannot get it is refused (LiveMemoryExhausted). Ingest that falls behind real
time (more than `max_lag_s` of pairs waiting) drops the oldest waiting pairs, counted in stats.

Fairness: a session's pairs are scheduler tasks keyed by the session, served round-robin
across sessions, so one session's backlog never delays another's frames; its questions are
bounded and queued per session (live_questions.py).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from sparrow.config import SamplingParams
from sparrow.engine import Generation
from sparrow.errors import InvalidRequest, NoFrames
from sparrow.live.events import LiveAnswer, LiveEvent, LiveMemoryExhausted, LiveStats
from sparrow.live.media_feed import MediaFeed
from sparrow.live.questions import LiveQuestions
from sparrow.live.rules import LiveAlerts
from sparrow.live.source_health import CameraTime, SilenceWatch, SourceClock
from sparrow.live.window import FramePair, LiveConfig, LiveWindow
from sparrow.models.prefill import FeatureNeeds
from sparrow.output import GenerationOutput, TokenDelta
from sparrow.video.processors import _resize_all

# Methods whose draft can start from a live snapshot (their context is text + target features).
# The SpecVLM-style draft prefills the video itself: its live questions decode without drafts.
_SNAPSHOT_METHODS = ("sparrow", "eagle-style", "eagle3")


@dataclass(slots=True)
class _Standing:
    question_id: str
    question: str
    every_s: float
    sampling: SamplingParams
    next_s: float


class LiveSession:
    """One live stream on an engine. Feed it `push_frames` (raw frames with stream times) or
    `feed` (container bytes: MPEG-TS or fragmented MP4, decoded on a thread); `ask` a
    question at any time; `add_standing` questions asked every N seconds of stream, whose
    answers arrive as LiveEvents. Thread-safe. `close()` frees the cache at once.
    max_questions: answers (asked, standing, alert checks) in flight at once (None: no bound);
    max_queued_questions: more wait up to this many, then a question is refused."""

    def __init__(self, engine, config: LiveConfig | None = None, *,
                 on_event: Callable[[LiveEvent], None] | None = None,
                 max_questions: int | None = None, max_queued_questions: int = 0):
        self.engine, self.config = engine, config or LiveConfig()
        self.on_event = on_event
        self._lock = threading.RLock()
        self._questions = LiveQuestions(self._lock, max_questions, max_queued_questions)
        self._ids = itertools.count(1)
        self._closed = False
        drafting = engine.proposer is not None and engine.spec.method in _SNAPSHOT_METHODS
        self._draft_k = None if drafting else 0
        self.needs: FeatureNeeds = engine.proposer.needs if drafting else FeatureNeeds()
        self._window = LiveWindow(engine.target, self.config, self.needs)
        self._frame_shape: tuple[int, int] | None = None      # the window's frame (H, W), set by the first frame
        self._source_shape: tuple[int, int] | None = None     # the newest frame's (H, W) as the source sent it
        # Sampling state
        self._clock = SourceClock(self.config.fps)
        self._last_slot = -1
        self._pending: tuple[np.ndarray, CameraTime, int] | None = None   # a sampled frame waiting for its partner
        self._waiting: deque[tuple[FramePair, Any]] = deque()       # pairs handed to the scheduler
        self._standing: dict[str, _Standing] = {}
        self._slot = None                          # the window's KV slot in the engine's arena
        self._refused: LiveMemoryExhausted | None = None
        self._counts = dict(received=0, sampled=0, dropped=0, prefilled=0, evicted=0)
        self._ingest_s = 0.0
        self._error: BaseException | None = None
        self._watch = SilenceWatch(self.config.stale_after_s, self._on_silence)
        self._media = MediaFeed(self._lock, self._check_open, self._clock.new_media, self._on_decoded,
                                self._on_decode_error, self._on_media_switch)
        # Alert rules (sparrow/live/alerts.py): add / replace / remove / list, checked like standing questions.
        self.alerts = LiveAlerts(self._lock, self.ask, self._window_end, self._check_open, engine.target.tokenizer,
                                 on_check=lambda check: self._emit(LiveEvent("check", check.rule_id, check.start_s,
                                                                             check.end_s, check=check)),
                                 on_error=lambda rule_id, exc: self._emit(LiveEvent("error", rule_id, error=exc)))

    # ----- feeding ----------------------------------------------------------------------------------
    def push_frames(self, frames: np.ndarray, timestamps) -> int:
        """RGB frames uint8 [T, H, W, 3] with the source's timestamps (seconds, increasing; a
        jump back of over RESET_S is a reset: an event, and stream time goes on). Frames are
        sampled at the session's fps; each complete pair is queued for prefill. Returns the
        pairs queued. Frames of another size than the first are resized to it (an event)."""
        frames = np.asarray(frames)
        times = np.asarray(timestamps, dtype=np.float64).reshape(-1)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] != times.shape[0]:
            raise InvalidRequest(f"frames must be uint8 [T, H, W, 3] with T timestamps, got {frames.dtype} "
                                 f"{frames.shape} and {times.shape[0]} timestamps")
        if frames.shape[0] and not np.all(np.isfinite(times)):
            raise InvalidRequest("timestamps must be finite")
        queued = 0
        with self._lock:
            self._check_open()
            for frame, t in zip(frames, times):
                queued += self._sample(frame, float(t))
        return queued

    def feed(self, chunk: bytes) -> None:
        """Container bytes (MPEG-TS or fragmented MP4), in order, split anywhere; decoded on a
        thread. An MPEG-TS chunk that breaks packet framing is refused whole (VideoUnreadable);
        a change of the program's video stream (codec or PID) starts a new media there (a
        "format_changed" event). A chunk the decoder cannot read ends that media with an
        "error" event; what was prefilled stays, and the next chunk starts a new media. A new
        media's stream time continues the old one's."""
        self._media.feed(chunk)

    def end_of_stream(self) -> None:
        """No more frames: the last odd frame is prefilled as a pair (repeated, as HF pads).
        Silence from now on is the end, not a stale source."""
        self._watch.stop()
        self._media.finish()
        with self._lock:
            if self._pending is not None:
                frame, camera, slot = self._pending
                self._pending = None
                self._queue_pair(frame, frame, camera, slot // 2)

    def wait_ingested(self, timeout: float | None = None) -> None:
        """Block until every frame fed so far is prefilled (or dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._media.drain(timeout)
        while True:
            with self._lock:
                futures = [f for _, f in self._waiting if not f.done()]
            if not futures:
                return
            for f in futures:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                try:
                    f.result(timeout=left)
                except Exception:  # noqa: BLE001 - reported through events, or a timeout: checked above
                    pass

    # ----- questions ---------------------------------------------------------------------------------
    def ask(self, question: str, sampling: SamplingParams | None = None, *, question_id: str | None = None,
            sink: Callable[[Any], None] | None = None, first_token_ids: tuple[int, ...] = ()) -> LiveAnswer:
        """Answer `question` about the window as it is now (what has been prefilled).
        first_token_ids: the output reports their first-position probabilities (Engine.submit);
        such a question decodes without drafts (an alert rule's check: one token)."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("question must be a non-empty string")
        sampling = sampling or SamplingParams()
        with self._lock:
            self._check_open()
            pairs = self._window.pairs
            if not pairs:
                raise NoFrames("the live session has no prefilled frame yet")
            entry = self._window.snapshot()
            start_s, end_s, camera = pairs[0].start_s, pairs[-1].end_s, pairs[-1].camera
            question_id = question_id or f"q{next(self._ids)}"
            gen = Generation()
            put = sink or gen.sink

            def deliver(item: Any) -> None:
                put(item)
                if not isinstance(item, TokenDelta):
                    # The answer's last item, handed on first: whoever sees running_answers
                    # reach 0 has been given every answer's last item.
                    self._questions.ended(gen)

            def submit() -> None:
                gen.request = self.engine.submit(None, question, sampling, prefix=entry,
                                                 num_draft_tokens=0 if first_token_ids else self._draft_k,
                                                 sink=deliver, first_token_ids=first_token_ids)

            self._questions.admit(question_id, gen, submit, put)     # now, queued, or ResourceExhausted
        return LiveAnswer(question_id, question, start_s, end_s, gen, camera, self._watch.stale)

    def add_standing(self, question: str, every_s: float, sampling: SamplingParams | None = None,
                     question_id: str | None = None) -> str:
        """Ask `question` every `every_s` seconds of stream time (first when the window reaches
        `every_s`); answers arrive as events tagged with the returned id."""
        if not (isinstance(every_s, (int, float)) and math.isfinite(every_s) and every_s > 0):
            raise InvalidRequest(f"every_s must be > 0, got {every_s!r}")
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("question must be a non-empty string")
        with self._lock:
            self._check_open()
            question_id = question_id or f"s{next(self._ids)}"
            if question_id in self._standing:
                raise InvalidRequest(f"standing question {question_id!r} exists already")
            pairs = self._window.pairs
            start = pairs[-1].end_s if pairs else 0.0
            self._standing[question_id] = _Standing(question_id, question, float(every_s),
                                                    sampling or SamplingParams(), start + every_s)
        return question_id

    def remove_standing(self, question_id: str) -> bool:
        with self._lock:
            return self._standing.pop(question_id, None) is not None

    # ----- state -------------------------------------------------------------------------------------
    @property
    def stats(self) -> LiveStats:
        with self._lock:
            c, window, pairs = self._counts, self._window, self._window.pairs
            start = pairs[0].start_s if pairs else 0.0
            end = pairs[-1].end_s if pairs else 0.0
            newest = self._clock.newest or CameraTime(0.0, 0.0, 0.0)
            return LiveStats(c["received"], c["sampled"], c["dropped"], c["prefilled"], c["evicted"], len(pairs),
                             len(pairs) * window.tpp, window.kv_bytes, start, end, newest.stream_s,
                             max(0.0, newest.stream_s - end) if pairs else newest.stream_s, window.shift,
                             self._ingest_s, newest.source_pts_s, newest.wall_time_s, self._watch.stale,
                             self._questions.queued, self._questions.refused)

    @property
    def newest(self) -> CameraTime | None:
        """The camera time of the newest frame received (None before the first)."""
        with self._lock:
            return self._clock.newest

    @property
    def kv_bytes(self) -> int:
        return self._window.kv_bytes

    @property
    def running_answers(self) -> int:
        """Answers (asked and standing) the engine is still producing."""
        with self._lock:
            return len(self._questions.answers)

    @property
    def error(self) -> BaseException | None:
        """The last ingest error (also sent as an event), if any."""
        return self._error

    def close(self) -> None:
        """End the session now: queued pairs are cancelled, running answers aborted, the cache freed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._watch.stop()
            decoder = self._media.detach()
            for _, future in self._waiting:
                future.cancel()
            self._waiting.clear()
            self._standing.clear()
            self.alerts.clear()
        if decoder is not None:
            decoder.abort()
        self._questions.close()
        with self._lock:              # after any running ingest task (it holds the lock)
            self._window.clear()
            slot, self._slot = self._slot, None
        if slot is not None:          # the arena is the scheduler thread's
            try:
                self.engine.call_soon(slot.release, key=self)
            except RuntimeError:      # the engine is closed: nothing else uses its arena
                slot.release()

    @property
    def closed(self) -> bool:
        return self._closed

    # ----- internals ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest("the live session is closed")
        if self._refused is not None:
            raise self._refused

    def _window_end(self) -> float:
        """Stream time the prefilled window reaches (0 before the first pair). Lock held."""
        pairs = self._window.pairs
        return pairs[-1].end_s if pairs else 0.0

    def _sample(self, frame: np.ndarray, pts: float) -> int:
        """Place the frame on the stream clock; keep the first frame of each 1/fps slot; pair
        slots (2j, 2j+1). Lock held."""
        self._counts["received"] += 1
        self._watch.frame()
        before = self._clock.newest
        camera, reset = self._clock.place(pts)
        if reset:
            self._emit(self._source_event("timestamp_reset", f"source timestamps went back from "
                                          f"{before.source_pts_s:.3f} s to {pts:.3f} s; stream time goes on "
                                          f"at {camera.stream_s:.3f} s"))
        shape = frame.shape[:2]
        if self._source_shape is not None and shape != self._source_shape:
            self._emit(self._source_event("format_changed", f"frame size changed from {self._source_shape[1]}x"
                                          f"{self._source_shape[0]} to {shape[1]}x{shape[0]}; frames are resized "
                                          "to the session's first size"))
        self._source_shape = shape
        if self._frame_shape is None:
            self._start(shape)
        elif shape != self._frame_shape:
            frame = _resize_all(frame[None], *self._frame_shape)[0]
        slot = int(math.floor(camera.stream_s * self.config.fps + 1e-6))
        if slot <= self._last_slot:
            return 0
        self._last_slot = slot
        self._counts["sampled"] += 1
        queued = 0
        if self._pending is not None:
            first, first_camera, first_slot = self._pending
            self._pending = None
            if slot == first_slot + 1:
                return self._queue_pair(first, frame, first_camera, first_slot // 2, camera)
            queued += self._queue_pair(first, first, first_camera, first_slot // 2)      # its partner never came
        if slot % 2 == 0:
            self._pending = (frame, camera, slot)
        else:                                                                        # a pair's first frame is missing
            queued += self._queue_pair(frame, frame, camera, slot // 2)
        return queued

    def _start(self, shape: tuple[int, int]) -> None:
        """The first frame fixes the frame size, the grid and the cache (a slot of the engine's
        KV arena); prefill the text before the video."""
        self._window.start(*shape)
        try:
            self.engine.call_soon(self._take_kv, key=self).result()
        except LiveMemoryExhausted as exc:
            self._refused = exc
            raise
        self._frame_shape = shape

    def _take_kv(self) -> None:
        """The scheduler thread (the arena is its own): the window's slot, then the text before the video."""
        window = self._window
        capacity = window.s + self.config.window_pairs * window.tpp
        if self._slot is not None:       # an earlier first frame whose text prefill failed
            self._slot.release()
            self._slot = window.kv = None
        slot = self.engine.claim_kv(capacity)
        if slot is None:
            free, total = self.engine.kv_tokens
            raise LiveMemoryExhausted(
                f"the live window needs {capacity} tokens of KV memory ({window.tpp} per frame pair x "
                f"{self.config.window_pairs} pairs + {window.s}); {free} of the engine's {total} "
                "are free; try again later, or a shorter window or smaller frames")
        self._slot, window.kv = slot, slot.cache
        window.prefill_text()

    def _queue_pair(self, a: np.ndarray, b: np.ndarray, camera_a: CameraTime, index: int,
                    camera_b: CameraTime | None = None) -> int:
        newest = camera_b or camera_a
        frames = np.stack([a, b])
        pair = FramePair(index, camera_a.stream_s, newest.stream_s + self.config.pair_s / 2, frames, camera=newest)
        future = self.engine.call_soon(lambda: self._ingest(pair), key=self)
        self._waiting.append((pair, future))
        self._drop_if_behind()
        return 1

    def _drop_if_behind(self) -> None:
        """More than max_lag_s of pairs waiting: cancel the oldest not yet started. Lock held."""
        limit = max(1, int(self.config.max_lag_s / self.config.pair_s))
        dropped = 0
        over = len(self._waiting) - limit
        if over > 0:
            kept: deque = deque()
            for pair, future in self._waiting:       # the oldest first; one already running stays
                if over > 0 and future.cancel():
                    over -= 1
                    dropped += 2
                else:
                    kept.append((pair, future))
            self._waiting = kept
        if dropped:
            self._counts["dropped"] += dropped
            self._emit(LiveEvent("dropped", dropped=dropped))

    # On the scheduler thread ------------------------------------------------------------------------
    def _ingest(self, pair: FramePair) -> None:
        with self._lock:
            if self._closed:
                return
            if self._waiting and self._waiting[0][0] is pair:
                self._waiting.popleft()
            else:
                self._waiting = deque(entry for entry in self._waiting if entry[0] is not pair)
            t0 = time.perf_counter()
            try:
                self._counts["evicted"] += self._window.evict()    # room for this pair first: the cache never grows
                self._window.append(pair)
            except Exception as exc:  # noqa: BLE001 - reported on the session; the window stays as it was
                self._error = exc
                self._emit(LiveEvent("error", error=exc))
                return
            finally:
                self._ingest_s += time.perf_counter() - t0
            self._counts["prefilled"] += 1
            due = [q for q in self._standing.values() if q.next_s <= pair.end_s + 1e-9]
            for q in due:
                while q.next_s <= pair.end_s + 1e-9:
                    q.next_s += q.every_s
            rules = self.alerts.due(pair.end_s)
        for q in due:
            self._ask_standing(q)
        self.alerts.run(rules)

    def _ask_standing(self, q: _Standing) -> None:
        with self._lock:
            if self._closed or q.question_id not in self._standing:
                return
        box: dict[str, LiveAnswer] = {}
        started = threading.Event()

        def sink(item: Any) -> None:
            started.wait()
            answer = box["answer"]
            tag = dict(camera=answer.camera, stale=answer.stale)
            if isinstance(item, TokenDelta):
                self._emit(LiveEvent("delta", answer.question_id, answer.start_s, answer.end_s, delta=item, **tag))
            else:
                self._questions.ended(answer.generation)
                if isinstance(item, GenerationOutput):
                    self._emit(LiveEvent("done", answer.question_id, answer.start_s, answer.end_s, output=item, **tag))
                else:
                    self._emit(LiveEvent("error", answer.question_id, answer.start_s, answer.end_s, error=item,
                                         **tag))

        try:
            box["answer"] = self.ask(q.question, q.sampling, question_id=q.question_id, sink=sink)
        except Exception as exc:  # noqa: BLE001 - e.g. the engine is full: the event says so
            self._emit(LiveEvent("error", q.question_id, error=exc))
            return
        finally:
            started.set()

    def _emit(self, event: LiveEvent) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 - a listener's failure must not stop ingest
                pass

    def _source_event(self, kind: str, message: str) -> LiveEvent:
        """An event about the source, at the newest frame so far."""
        newest = self._clock.newest
        return LiveEvent(kind, start_s=newest.stream_s if newest else 0.0, end_s=newest.stream_s if newest else 0.0,
                         camera=newest, message=message)

    def _on_silence(self, stale: bool, silent_s: float) -> None:
        """The silence watch's thread (stale), or a frame's arrival under the lock (resumed)."""
        if stale:
            message = f"no frame for {silent_s:.1f} s (stale_after_s {self.config.stale_after_s:g}): answers are stale"
        else:
            message = f"frames again after {silent_s:.1f} s of silence"
        self._emit(self._source_event("stale" if stale else "resumed", message))

    # Decoder callbacks (the decoder's thread) -------------------------------------------------------
    def _on_media_switch(self, what: str) -> None:
        self._emit(self._source_event("format_changed", f"the video stream changed: {what}; "
                                                        "a new media starts, stream time goes on"))

    def _on_decoded(self, frames: np.ndarray, times: np.ndarray) -> None:
        try:
            self.push_frames(frames, times)
        except InvalidRequest:
            if not self._closed:
                raise

    def _on_decode_error(self, exc: BaseException) -> None:
        with self._lock:
            self._error = exc
        self._emit(LiveEvent("error", error=exc))


__all__ = ["LiveSession", "LiveAnswer", "LiveEvent", "LiveStats", "LiveMemoryExhausted"]
