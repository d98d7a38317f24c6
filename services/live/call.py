"""The Live RPC: one live video session per bidirectional stream (sparrow.v1.Sparrow/Live).

    client messages --reader task--> LiveSession (sparrow/live/session.py): feed, push_frames, ask,
                                     add_standing, remove_standing, end_of_stream
    answers and session events (engine, decoder and URL threads) --+
    stats and limits (a ticker task, timers) -----------------------+--> one asyncio queue
                                                                          --> the response stream

The session's KV cache lives in this process and cannot move: on Ray Serve a stream is one
call to one replica, on Kubernetes one HTTP/2 stream to one pod, so a session stays where it
opened. It ends when the client half-closes (what it sent is ingested, running answers
finish, a final LiveStats, then OK), when it cancels or goes away (the session is closed at
once: KV freed, answers aborted), when it passes a limit (RESOURCE_EXHAUSTED) or when its
deadline passes (DEADLINE_EXCEEDED). A session whose video the server reads from a URL also
ends when the source does: at its end a SOURCE_ENDED event, then as at a half-close (OK);
when it fails (unreachable: UNAVAILABLE; silent past its read timeout: DEADLINE_EXCEEDED;
undecodable: INVALID_ARGUMENT) a SOURCE_FAILED event, then the stream ends with that status.
Anything else a client gets wrong (a corrupt chunk, a question before the first frame, a bad
option on a question) is an event on the stream with its status code, and the session goes
on. The source's health (stale / resumed, timestamp resets, format changes) is told in events.

Every question that starts ends with exactly one LiveDone (finish reason ERROR when it
failed on the way); one refused before it started gets a LiveEvent with its id instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from sparrow.output import GenerationOutput, TokenDelta
from sparrow.errors import InvalidRequest, ResourceExhausted, SparrowError
from sparrow.live.events import LiveAnswer, LiveEvent, LiveMemoryExhausted
from sparrow.live.session import LiveSession
from sparrow.live.source_health import CameraTime
from sparrow.video import VideoOptions

from sparrow.services.completion import completion
from sparrow.services.grpc_status import DeadlineExceeded, LiveUnsupported, NotReady, status_for
from sparrow.services.live.host import LiveHost, LiveMetrics, SessionLimit
from sparrow.services.live.incidents import RULE_REQUESTS, LiveRules, check_webhook, rule_id_of
from sparrow.services.live.messages import error_event, live_config, source_event, stats_message
from sparrow.services.live.url_feed import UrlFeeder
from sparrow.services.protos import pb
from sparrow.services.live.webhook import WebhookSink
from sparrow.services.wire import Undecodable

log = logging.getLogger(__name__)

STATS_TICK_S = 1.0          # how often a session's metrics are updated (and stats sent, when due)
MAX_ID_CHARS = 128
_END = object()             # the response queue's last item: the stream ends OK


class LiveCall:
    """One Live stream: admits the session, runs it, and turns everything it does into
    LiveResponse messages. `run(requests)` is the response stream; closing it closes the session."""

    def __init__(self, service: LiveHost, deadline: float | None = None, *,
                 metrics: Callable[[], LiveMetrics] | None = None, cancelled: Callable[[], bool] | None = None):
        self.service, self.cfg = service, service.config
        self.deadline = deadline
        self.new_metrics = metrics
        self.cancelled = cancelled or (lambda: False)
        self.session_id = uuid.uuid4().hex
        self.session: LiveSession | None = None
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue = asyncio.Queue()
        self.opened_at = time.monotonic()
        self.bytes_received = 0
        self._ids = itertools.count(1)
        self._asked: dict[str, _Tag | None] = {}   # running asked questions -> what their answer saw, once known
        self._early: dict[str, list] = {}          # their items that came before that
        self._feeder: UrlFeeder | None = None
        self.rules: LiveRules | None = None        # the session's alert rules and their incidents
        self._finishing = False                    # the stream is draining to its end (half-close or source end)
        self._ending: asyncio.Future | None = None   # that drain, when the source's end started it
        self._bytes_lock = threading.Lock()
        # The session's blocking calls (a push waits out a pair's prefill, a drain waits for
        # ingest) run on threads of its own, so sessions never starve the loop's shared executor.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sparrow-live")
        self.end_reason = "error"         # how the stream ended: ok, cancelled, or a status code (metrics)

    # ----- the stream ----------------------------------------------------------------------------
    async def run(self, requests) -> AsyncIterator[pb.LiveResponse]:
        requests = aiter(requests)
        opening = await self._opening(requests)
        engine, cfg = self.service.engine, self.cfg
        config = live_config(opening, cfg)
        stats_every = opening.stats_every_s if opening.HasField("stats_every_s") else cfg.live_stats_every_s
        if not (math.isfinite(stats_every) and (stats_every == 0 or stats_every >= 0.1)):
            raise InvalidRequest(f"stats_every_s must be 0 (only the final stats) or >= 0.1, got {stats_every}")
        url = self.service.policy.resolve_url(opening.url) if opening.url else None   # INVALID_ARGUMENT / PERMISSION_DENIED
        if opening.webhook_url:
            check_webhook(opening.webhook_url, cfg)                               # the same
        self.service.admit_live(self)
        metrics, self.end_reason = None, "error"
        tasks: list[asyncio.Task] = []
        try:
            self.session = await asyncio.to_thread(LiveSession, engine, config, on_event=self._from_thread_event,
                                                   max_questions=cfg.max_live_questions,
                                                   max_queued_questions=cfg.max_live_queued_questions)
            standing_ids = [await self._add_standing(q) for q in opening.standing]
            self.rules = LiveRules(self.session, self.session_id, opening.url, cfg, self.out.put_nowait,
                                   WebhookSink(opening.webhook_url) if opening.webhook_url else None)
            rule_ids = [await self._run(self.rules.add, rule) for rule in opening.rules]
            metrics = self.new_metrics() if self.new_metrics else None
            yield pb.LiveResponse(opened=pb.LiveOpened(
                session_id=self.session_id, fps=config.fps, window_s=config.window_s,
                evict_s=config.evict_pairs * config.pair_s, max_lag_s=config.max_lag_s, pair_s=config.pair_s,
                window_pairs=config.window_pairs, max_visual_tokens=config.options.max_visual_tokens * config.window_pairs,
                standing_ids=standing_ids, max_duration_s=cfg.max_live_session_s, max_bytes=cfg.max_live_bytes,
                spec_method=engine.spec.method if engine.proposer is not None else "none",
                stale_after_s=config.stale_after_s, rule_ids=rule_ids))
            if url is not None:
                self._feeder = UrlFeeder(self.session, url, self._url_options(), self.service.policy,
                                         on_error=lambda exc: self._post(self._feeder_failed, exc),
                                         on_end=lambda: self._post(self._source_ended),
                                         count_bytes=self._count_bytes)
            tasks = [asyncio.create_task(self._read(requests)), asyncio.create_task(self._tick(stats_every, metrics)),
                     asyncio.create_task(self._expire())]
            while True:
                item = await self.out.get()
                if item is _END:
                    self.end_reason = "ok"
                    return
                if isinstance(item, asyncio.CancelledError):
                    raise item
                if isinstance(item, BaseException):
                    self.end_reason = status_for(item)[0].name.lower()
                    raise item
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            self.end_reason = "cancelled"
            raise
        finally:
            for task in tasks:
                task.cancel()
            # Released when the session is closed, even if this task is cancelled again while
            # it waits (gRPC may cancel a handler twice around a deadline).
            closing = asyncio.ensure_future(self._close())
            closing.add_done_callback(lambda _: self._released(metrics))
            await asyncio.shield(closing)

    def _released(self, metrics: LiveMetrics | None) -> None:
        if metrics is not None:
            metrics.end(self.end_reason)
        self.service.release_live(self)

    async def _opening(self, requests) -> pb.LiveOpen:
        first = await anext(requests, None)      # read first: a request stream never read warns at exit
        if not self.service.ready:
            raise NotReady("the service is not ready")
        refusal = self.service.live_refusal()
        if refusal is not None:
            raise LiveUnsupported(refusal)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise DeadlineExceeded("the session's deadline passed")
        if isinstance(first, Undecodable):
            raise first.error()
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidRequest("a live session's first message must be `open` (LiveOpen)")
        return first.open

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self.loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def _close(self) -> None:
        if self._feeder is not None:
            self._feeder.stop()
        if self.session is not None:
            # On a fresh thread: the session's own may be blocked, and close() releases them.
            await asyncio.to_thread(self.session.close)      # frees the KV now, aborts running answers
        if self.rules is not None:
            await asyncio.to_thread(self.rules.close)        # the webhook's queue is sent (bounded wait)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----- client messages -----------------------------------------------------------------------
    async def _read(self, requests) -> None:
        try:
            while True:
                try:
                    request = await anext(requests)
                except StopAsyncIteration:
                    break
                except Exception as exc:  # noqa: BLE001 - the client's stream itself failed: it is gone
                    # (Under Ray Serve the replica reads the stream from the proxy, which may have
                    # dropped a cancelled call before it says so.) An end like a cancel, never INTERNAL.
                    log.info("live session %s: the client's stream failed (%s: %s); closing it as cancelled",
                             self.session_id, type(exc).__name__, exc)
                    self.out.put_nowait(asyncio.CancelledError())
                    return
                await self._handle(request)
            if self.cancelled():             # Ray Serve ends a cancelled client's stream as if half-closed
                self.out.put_nowait(asyncio.CancelledError())
                return
            await self._finish()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - ends the stream with its status
            self.out.put_nowait(exc)

    async def _finish(self) -> None:
        """The video ended (the client half-closed, or the URL's source ended): drain, send
        the final stats, end OK. Once, whichever comes first."""
        if self._finishing:
            return
        self._finishing = True
        await self._drain()
        stats = await self._run(lambda: self.session.stats)
        self.out.put_nowait(pb.LiveResponse(stats=stats_message(
            stats, bytes_received=self.bytes_received, session_s=time.monotonic() - self.opened_at, final=True)))
        self.out.put_nowait(_END)

    async def _handle(self, request) -> None:
        if isinstance(request, Undecodable):
            self._emit_error(request.error())
            return
        kind, question_id = request.WhichOneof("kind"), ""
        try:
            if kind == "media":
                await self._media(request.media.data)
            elif kind == "frames":
                await self._frames(request.frames)
            elif kind == "question":
                question_id = request.question.question_id
                await self._ask(request.question)
            elif kind == "add_standing":
                question_id = request.add_standing.question_id
                await self._add_standing(request.add_standing)
            elif kind == "remove_standing":
                question_id = request.remove_standing.question_id
                if not await self._run(self.session.remove_standing, question_id):
                    raise InvalidRequest(f"no standing question {question_id!r}")
            elif kind in RULE_REQUESTS:               # alert rules: each answered with the rules now
                question_id = rule_id_of(request)
                self.out.put_nowait(await self._run(self.rules.handle, request))
            elif kind == "end":
                await self._run(self.session.end_of_stream)
            elif kind == "open":
                raise InvalidRequest("the session is open already: `open` comes once, first")
            else:
                raise InvalidRequest("an empty LiveRequest: set one of its fields")
        except SessionLimit:
            raise
        except LiveMemoryExhausted as exc:   # no KV memory for the window: the session cannot go on
            raise SessionLimit(str(exc)) from exc
        except SparrowError as exc:          # the client's mistake: said on the stream, the session goes on
            self._emit_error(exc, question_id)

    async def _media(self, data: bytes) -> None:
        if self._feeder is not None:
            raise InvalidRequest("this session reads its video from its URL: it takes no media")
        self._count_bytes(len(data))
        await self._run(self.session.feed, data)   # VideoUnreadable: a chunk that is not MPEG-TS

    async def _frames(self, f: pb.RawFrames) -> None:
        if self._feeder is not None:
            raise InvalidRequest("this session reads its video from its URL: it takes no frames")
        self._count_bytes(len(f.rgb))
        if not (f.count and f.width and f.height):
            raise InvalidRequest("raw frames need count, width and height > 0")
        if f.width * f.height > self.cfg.max_frame_pixels:
            raise InvalidRequest(f"frames of {f.width}x{f.height} are over the {self.cfg.max_frame_pixels} "
                                 "pixels a frame may have here")
        if len(f.rgb) != f.count * f.height * f.width * 3:
            raise InvalidRequest(f"{len(f.rgb)} bytes of rgb for {f.count} frames of {f.width}x{f.height} "
                                 f"(need count * height * width * 3 = {f.count * f.height * f.width * 3})")
        if len(f.timestamps) != f.count:
            raise InvalidRequest(f"{len(f.timestamps)} timestamps for {f.count} frames")
        frames = np.frombuffer(f.rgb, dtype=np.uint8).reshape(f.count, f.height, f.width, 3)
        await self._run(self.session.push_frames, frames, list(f.timestamps))

    async def _ask(self, q: pb.LiveQuestion) -> None:
        question_id = q.question_id or self._fresh_id("q")
        self._check_question(question_id, q.text)
        if question_id in self._asked:
            raise InvalidRequest(f"question {question_id!r} is still being answered; give each question its own id")
        sampling = self.service.sampling_params(q.sampling)
        self._asked[question_id], self._early[question_id] = None, []
        sink = lambda item: self._post(self._answer_item, question_id, item)   # noqa: E731 - engine threads
        try:
            answer = await self._run(self.session.ask, q.text, sampling, question_id=question_id, sink=sink)
        except BaseException:
            del self._asked[question_id], self._early[question_id]
            raise
        self._asked[question_id] = _Tag.of(answer)
        for item in self._early.pop(question_id):
            self._answer_item(question_id, item)

    async def _add_standing(self, q: pb.StandingQuestion) -> str:
        question_id = q.question_id or self._fresh_id("s")
        self._check_question(question_id, q.text)
        sampling = self.service.sampling_params(q.sampling)
        return await self._run(self.session.add_standing, q.text, q.every_s, sampling, question_id)

    def _check_question(self, question_id: str, text: str) -> None:
        if len(question_id) > MAX_ID_CHARS:
            raise InvalidRequest(f"question_id is longer than {MAX_ID_CHARS} characters")
        if len(text) > self.cfg.max_prompt_chars:
            raise ResourceExhausted(f"question is {len(text)} characters, over the limit of {self.cfg.max_prompt_chars}")

    def _fresh_id(self, prefix: str) -> str:
        while True:
            candidate = f"{prefix}{next(self._ids)}"
            if candidate not in self._asked:
                return candidate

    def _count_bytes(self, n: int) -> None:
        """From the loop or the URL thread."""
        with self._bytes_lock:
            self.bytes_received += n
            total = self.bytes_received
        if total > self.cfg.max_live_bytes:
            raise SessionLimit(f"the session sent {total} bytes of video, over the limit of {self.cfg.max_live_bytes}")

    def _url_options(self) -> VideoOptions:
        cfg = self.cfg
        return VideoOptions(max_bytes=cfg.max_live_bytes, max_duration_s=cfg.max_live_session_s,
                            timeout_s=cfg.max_live_session_s, max_frame_pixels=cfg.max_frame_pixels)

    # ----- the end --------------------------------------------------------------------------------
    async def _drain(self) -> None:
        """After the client half-closed: no more video; everything sent is ingested and every
        running answer (asked or standing) has sent its last message."""
        session = self.session
        if self._feeder is not None:
            self._feeder.stop()
            await self._run(self._feeder.join)
        await self._run(session.end_of_stream)
        await self._run(session.wait_ingested)
        # An ingest task already running when wait_ingested looked has left the session's
        # queue; the scheduler runs one task at a time, so once this one has run, that one has
        # finished too (and asked the standing questions it made due).
        await asyncio.wrap_future(self.service.engine.call_soon(_nothing))
        # Read off the loop: the answers' last items, posted before the count dropped, are
        # then ahead of this coroutine on the loop.
        while await self._run(lambda: session.running_answers):
            await asyncio.sleep(0.02)
        await asyncio.sleep(0)

    async def _tick(self, stats_every: float, metrics: LiveMetrics | None) -> None:
        """Metrics every STATS_TICK_S; a LiveStats message every stats_every (0: none)."""
        tick = min(STATS_TICK_S, stats_every) if stats_every else STATS_TICK_S
        next_stats = time.monotonic() + stats_every if stats_every else math.inf
        while True:
            await asyncio.sleep(tick)
            stats = await self._run(lambda: self.session.stats)
            if metrics is not None:
                metrics.update(stats)
            now = time.monotonic()
            if now >= next_stats:
                next_stats += stats_every * max(1, math.ceil((now - next_stats) / stats_every))
                self.out.put_nowait(pb.LiveResponse(stats=stats_message(
                    stats, bytes_received=self.bytes_received, session_s=now - self.opened_at)))

    async def _expire(self) -> None:
        """The session's duration limit, or the client's deadline if it comes first."""
        limit_at = self.opened_at + self.cfg.max_live_session_s
        if self.deadline is not None and self.deadline < limit_at:
            await asyncio.sleep(max(0.0, self.deadline - time.monotonic()))
            self.out.put_nowait(DeadlineExceeded("the session's deadline passed"))
        else:
            await asyncio.sleep(max(0.0, limit_at - time.monotonic()))
            self.out.put_nowait(SessionLimit(f"the session has been open {self.cfg.max_live_session_s:g} s, "
                                             "the limit of this server"))

    # ----- what the session reports (engine, decoder and URL threads) -----------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:          # the loop is gone: nobody is listening any more
            pass

    def _from_thread_event(self, event: LiveEvent) -> None:
        self._post(self._session_event, event)

    def _session_event(self, event: LiveEvent) -> None:
        kind, qid = event.kind, event.question_id or ""
        if kind == "check":
            if self.rules is not None:
                self.rules.on_check(event.check)
        elif kind == "delta":
            self._send_chunk(qid, _Tag.of(event), event.delta, standing=True)
        elif kind == "done":
            self._send_done(qid, _Tag.of(event), event.output, standing=True)
        elif kind == "error" and qid and event.end_s > 0:
            # A standing answer that failed after it started (one refused at the start has no range).
            self._send_done(qid, _Tag.of(event), event.error, standing=True)
        elif kind in _SOURCE_EVENTS:
            self.out.put_nowait(pb.LiveResponse(event=source_event(_SOURCE_EVENTS[kind], event.message, event.camera)))
        elif kind == "error" and isinstance(event.error, LiveMemoryExhausted):   # decoded media's first frame
            self.out.put_nowait(SessionLimit(str(event.error)))
        elif kind == "error":
            self._emit_error(event.error, qid)
        elif kind == "dropped":
            self.out.put_nowait(pb.LiveResponse(event=pb.LiveEvent(
                kind=pb.LIVE_EVENT_KIND_FRAMES_DROPPED, frames_dropped=event.dropped,
                message=f"ingest fell behind real time: {event.dropped} frames dropped")))

    def _answer_item(self, question_id: str, item) -> None:
        """An asked question's TokenDelta, GenerationOutput or exception, on the loop."""
        tag = self._asked.get(question_id)
        if tag is None:
            self._early[question_id].append(item)
            return
        if isinstance(item, TokenDelta):
            self._send_chunk(question_id, tag, item, standing=False)
        else:
            del self._asked[question_id]
            self._send_done(question_id, tag, item, standing=False)

    def _send_chunk(self, qid: str, tag: _Tag, delta: TokenDelta, standing: bool) -> None:
        self.out.put_nowait(pb.LiveResponse(chunk=pb.LiveChunk(
            question_id=qid, token_ids=delta.token_ids, text=delta.text, standing=standing, **tag.fields())))

    def _send_done(self, qid: str, tag: _Tag, result, standing: bool) -> None:
        if isinstance(result, GenerationOutput):
            done = completion(result)
        else:
            log.info("live answer %s failed: %s", qid, result)
            done = pb.Completion(finish_reason=pb.FINISH_REASON_ERROR, error=str(result) or type(result).__name__)
        self.out.put_nowait(pb.LiveResponse(done=pb.LiveDone(
            question_id=qid, completion=done, standing=standing, **tag.fields())))

    def _emit_error(self, exc: BaseException, question_id: str = "") -> None:
        event = error_event(exc, question_id)
        log.info("live session %s: %s: %s", self.session_id, status_for(exc)[0].name, event.message)
        self.out.put_nowait(pb.LiveResponse(event=event))

    def _feeder_failed(self, exc: BaseException) -> None:
        """The URL's source failed: said in a SOURCE_FAILED event, and the stream ends with its status."""
        if not isinstance(exc, SessionLimit):
            code, message = status_for(exc)
            log.info("live session %s: its source failed: %s: %s", self.session_id, code.name, message)
            event = source_event(pb.LIVE_EVENT_KIND_SOURCE_FAILED, f"the source failed: {message}",
                                 self.session.newest if self.session else None)
            event.code = code.value[0]
            self.out.put_nowait(pb.LiveResponse(event=event))
        self.out.put_nowait(exc)

    def _source_ended(self) -> None:
        """The URL's source ended: said in a SOURCE_ENDED event; the session drains and ends OK."""
        if self._finishing:
            return
        self.out.put_nowait(pb.LiveResponse(event=source_event(
            pb.LIVE_EVENT_KIND_SOURCE_ENDED, "the source ended", self.session.newest)))
        task = asyncio.ensure_future(self._finish())
        task.add_done_callback(self._finished)
        self._ending = task

    def _finished(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.out.put_nowait(task.exception())


@dataclasses.dataclass(frozen=True, slots=True)
class _Tag:
    """What an answer saw: its stream time range, the camera time of its newest frame, and
    whether the source was silent when it was asked."""

    start_s: float
    end_s: float
    camera: CameraTime | None
    stale: bool

    @classmethod
    def of(cls, answer: LiveAnswer | LiveEvent) -> _Tag:
        return cls(answer.start_s, answer.end_s, answer.camera, answer.stale)

    def fields(self) -> dict[str, Any]:
        camera = self.camera
        return dict(start_s=self.start_s, end_s=self.end_s, stale=self.stale,
                    source_pts_s=camera.source_pts_s if camera else 0.0,
                    wall_time_s=camera.wall_time_s if camera else 0.0)


# The session's events about its source, as LiveEvent kinds.
_SOURCE_EVENTS = {"stale": pb.LIVE_EVENT_KIND_STALE, "resumed": pb.LIVE_EVENT_KIND_RESUMED,
                  "timestamp_reset": pb.LIVE_EVENT_KIND_TIMESTAMP_RESET,
                  "format_changed": pb.LIVE_EVENT_KIND_FORMAT_CHANGED}


def _nothing() -> None:
    pass


__all__ = ["LiveCall"]
