"""The Sparrow service, whatever hosts it: protobuf requests in, protobuf responses out,
typed errors (sparrow.errors, services.errors) for everything a caller can get wrong.

One servicer, two hosts: services.server (a grpc.aio server, the embedded default) and
services.ray_app (Ray Serve's gRPC proxy in front of the TargetDeployment). Hosts only move
messages and turn exceptions into status codes with `status_for`, both through services.handler.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from sparrow.chat import Message, Prompt, with_history
from sparrow.config import SamplingParams
from sparrow.engine import Engine
from sparrow.output import GenerationOutput
from sparrow.errors import InvalidRequest, ResourceExhausted, VideoTooLarge
from sparrow.services.state_cache import StateCache
from sparrow.video import SourcePolicy, VideoOptions, prepare_video

from sparrow.services import logs
from sparrow.services.completion import completion
from sparrow.services.config import ServiceConfig
from sparrow.services.grpc_status import DeadlineExceeded, NotReady, Overloaded, VideoNotFound
from sparrow.services.live.call import LiveCall
from sparrow.services.live.host import live_refusal
from sparrow.services.openai_api.live_events import LiveEventHub
from sparrow.services.protos import pb
from sparrow.services.async_requests import AsyncRequests, RunningRequest
from sparrow.services.video_store import HashedFile, VideoStore, content_id
from sparrow.services.uploads import UploadLimits, receive_upload

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Job:
    """A validated request, ready for the engine."""

    prompt: Prompt
    sampling: SamplingParams
    options: VideoOptions
    num_draft_tokens: int | None
    video: object          # zero-argument callable -> ProcessedVideo, called only on a prefix-cache miss
    video_key: str | None
    close: Callable[[], None]   # frees what the source holds (an open file), once the request is done


class SparrowService:
    def __init__(self, engine: Engine, cache: StateCache, config: ServiceConfig | None = None, *,
                 host: str = "embedded", draft_placement: str = "colocated"):
        self.engine, self.cache = engine, cache
        self.config = config or ServiceConfig()
        self.host, self.draft_placement = host, draft_placement
        self.requests = AsyncRequests(engine, self.config.max_concurrent)
        self.videos = VideoStore(cache, self.config.video_ttl_s, self.config.upload_dir,
                                 self.config.max_stored_upload_bytes)
        self.uploads = UploadLimits(self.config.max_uploads, self.config.max_upload_bytes_in_flight)
        self.policy = SourcePolicy(self.config.media_root, self.config.allowed_url_schemes,
                                   self.config.allowed_url_hosts)
        self.live: dict[str, RunningRequest | None] = {}     # None: admitted, still preparing
        self.live_sessions: dict[str, LiveCall] = {}          # Live streams open, by session id
        self.live_ended: collections.Counter[str] = collections.Counter()   # sessions closed, by how they ended
        self._live_refusal: list[str | None] = []             # why the target cannot go live; computed once
        self.live_events = LiveEventHub()                     # incidents / standing answers by session id (HTTP SSE)
        self.last_released = 0.0
        self.ready = True

    # ----- Generate ------------------------------------------------------------------------------
    async def generate(self, request: pb.GenerateRequest,
                       deadline: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """deadline: time.monotonic() past which the client has given up; the generation
        is aborted then, whether or not the host noticed the client go."""
        request_id = request.request_id or uuid.uuid4().hex
        logs.request_id_var.set(request_id)      # log lines of this request carry its id
        _check_deadline(deadline)
        self._admit(request_id)
        job = None
        try:
            job = await self._job(request)
            _check_deadline(deadline)
            running = self.requests.start(job.video, job.prompt, job.sampling, job.options,
                                        video_key=job.video_key, num_draft_tokens=job.num_draft_tokens,
                                        deadline=deadline)
            self.live[request_id] = running
            # aclosing: however this generator ends, the nested ones end now, not at GC time
            async with contextlib.aclosing(self._respond(request_id, running, deadline)) as responses:
                async for response in responses:
                    if response.HasField("completion") and response.completion.finish_reason == pb.FINISH_REASON_ABORT:
                        _check_deadline(deadline)      # aborted by the deadline: say so, on every host
                        if not self.ready:             # aborted by a stopping server: retry elsewhere
                            raise NotReady("the server is stopping; the request was not finished")
                    yield response
        finally:
            if job is not None:
                job.close()
            self.live.pop(request_id, None)
            self.last_released = time.monotonic()     # the request's thread and state are gone

    def _admit(self, request_id: str) -> None:
        # No await between the checks and the insert: atomic on the event loop.
        if not self.ready:
            raise NotReady("the service is not ready")
        if len(request_id) > 128:
            raise InvalidRequest("request_id is longer than 128 characters")
        if request_id in self.live:
            raise InvalidRequest(f"request_id {request_id!r} is already running")
        if len(self.live) >= self.config.max_concurrent:
            raise Overloaded(f"{len(self.live)} requests running, the limit of this replica; retry later")
        self.live[request_id] = None

    async def _respond(self, request_id: str, running: RunningRequest,
                       deadline: float | None) -> AsyncIterator[pb.GenerateResponse]:
        watchers = [asyncio.create_task(self._watch_abort(request_id, running))] if self.cache.shared else []
        if deadline is not None:
            watchers.append(asyncio.create_task(_abort_at(deadline, running)))
        sent = False
        try:
            async with contextlib.aclosing(running.events()) as events:
                async for item in events:
                    if isinstance(item, GenerationOutput):
                        yield pb.GenerateResponse(request_id=request_id, completion=completion(item))
                    else:
                        sent = True
                        yield pb.GenerateResponse(request_id=request_id,
                                                  chunk=pb.Chunk(token_ids=item.token_ids, text=item.text))
        except Exception as exc:
            if not sent:
                raise                       # nothing streamed yet: the caller gets a status code
            log.exception("request %s failed after streaming began", request_id)
            yield pb.GenerateResponse(request_id=request_id, completion=pb.Completion(
                finish_reason=pb.FINISH_REASON_ERROR, error=str(exc) or type(exc).__name__))
        finally:
            for watcher in watchers:
                watcher.cancel()

    async def _watch_abort(self, request_id: str, running: RunningRequest) -> None:
        """With a shared cache, Abort may reach another replica: it leaves a mark there."""
        await asyncio.to_thread(self.cache.delete, _abort_key(request_id))   # a mark left for an earlier use of the id
        while True:
            await asyncio.sleep(self.config.abort_poll_s)
            if await asyncio.to_thread(self.cache.contains, _abort_key(request_id)):
                running.abort()
                return

    # ----- request -> job -----------------------------------------------------------------------
    async def _job(self, request: pb.GenerateRequest) -> _Job:
        prompt = self._prompt(request)
        sampling = self.sampling_params(request.sampling)
        options = self._video_options(request.video_options)
        draft_tokens = self._draft_tokens(request.spec)
        # Last: the source may hold an open file, released by the job's close().
        source, content, check, close = await self._source(request.video)
        processor, policy = self.engine.target.processor, self.policy

        def decode(cancelled):
            video = prepare_video(source(), processor, options, policy=policy, cancelled=cancelled)
            check()        # a file written to while it was read is refused, never cached under its old hash
            return video

        # The prefix cache key: the video's content and everything that shapes its tokens.
        key = None if content is None else hashlib.sha256(f"{content}|{options!r}".encode()).hexdigest()
        return _Job(prompt, sampling, options, draft_tokens, decode, key, close)

    def _prompt(self, request: pb.GenerateRequest) -> Prompt:
        """The question, or with earlier turns the whole conversation; its characters (all
        turns together) within max_prompt_chars."""
        cfg = self.config
        if not request.prompt.strip():
            raise InvalidRequest("prompt must be a non-empty string")
        if len(request.history) > cfg.max_history_turns:
            raise ResourceExhausted(f"{len(request.history)} earlier turns, over the limit of {cfg.max_history_turns}")
        chars = len(request.prompt) + sum(len(m.text) for m in request.history)
        if chars > cfg.max_prompt_chars:
            raise ResourceExhausted(f"prompt is {chars} characters, over the limit of {cfg.max_prompt_chars}")
        if not request.history:
            return request.prompt
        return with_history([Message(m.role, m.text) for m in request.history], request.prompt)

    def sampling_params(self, s: pb.SamplingParams) -> SamplingParams:
        cfg = self.config
        max_new = s.max_new_tokens or cfg.default_max_new_tokens
        if max_new > cfg.max_new_tokens:
            raise ResourceExhausted(f"max_new_tokens {max_new} is over the limit of {cfg.max_new_tokens}")
        if len(s.stop) > cfg.max_stop_strings:
            raise InvalidRequest(f"at most {cfg.max_stop_strings} stop strings")
        longest = max((len(stop.encode()) for stop in s.stop), default=0)
        if longest > cfg.max_stop_string_bytes:
            raise InvalidRequest(f"a stop string is {longest} bytes, over the limit of {cfg.max_stop_string_bytes}")
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(s, name)):
                raise InvalidRequest(f"{name} must be a finite number, got {getattr(s, name)}")
        return SamplingParams(max_new_tokens=max_new, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p or 1.0, seed=s.seed if s.HasField("seed") else None,
                              stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)

    def _video_options(self, v: pb.VideoOptions) -> VideoOptions:
        """The request's video options, refused (before anything is decoded) when over this
        service's limits or contradicting each other."""
        cfg = self.config
        for name, limit in (("num_frames", cfg.max_frames), ("max_frames", cfg.max_frames),
                            ("max_visual_tokens", cfg.max_visual_tokens)):
            if v.HasField(name) and getattr(v, name) > limit:
                raise ResourceExhausted(f"{name} {getattr(v, name)} is over the limit of {limit}")
        for name in ("min_pixels", "max_pixels"):
            if v.HasField(name) and getattr(v, name) > cfg.max_frame_pixels:
                raise InvalidRequest(f"{name} {getattr(v, name)} is over the {cfg.max_frame_pixels} pixels "
                                     "a frame may have here")
        if v.HasField("num_frames") and v.HasField("max_frames") and v.num_frames > v.max_frames:
            raise InvalidRequest(f"num_frames {v.num_frames} is over the max_frames {v.max_frames} of the same request")
        given = {name: getattr(v, name) for name in ("fps", "num_frames", "start_s", "end_s", "min_pixels",
                                                      "max_pixels") if v.HasField(name)}
        options = VideoOptions(**given, max_frames=v.max_frames if v.HasField("max_frames") else cfg.max_frames,
                               min_frames=min(4, cfg.max_frames),
                               max_visual_tokens=v.max_visual_tokens or cfg.max_visual_tokens,
                               max_bytes=cfg.max_video_bytes, max_duration_s=cfg.max_duration_s,
                               timeout_s=cfg.decode_timeout_s)
        if options.min_pixels is not None:
            self._check_pixel_floor(options)
        return options

    def _check_pixel_floor(self, options: VideoOptions) -> None:
        """min_pixels is a floor on each frame's resolution: the processor's plan for the
        fewest frames the request can get (num_frames, else min_frames) at that floor must
        keep them all within the token budget. If it must drop frames instead, the floor and
        the budget contradict each other (and a tiny clip would be upscaled to fill the
        budget). The plan is pure arithmetic on a 1x1 frame, which min_pixels scales up."""
        frames, processor = options.num_frames or options.min_frames, self.engine.target.processor
        # Compared with the plan without the floor: a small budget alone may drop frames too.
        unfloored = processor.plan(frames, 1, 1, dataclasses.replace(options, min_pixels=None)).num_frames
        if processor.plan(frames, 1, 1, options).num_frames < unfloored:
            raise InvalidRequest(f"min_pixels {options.min_pixels} leaves no room for {frames} frames within "
                                 f"max_visual_tokens {options.max_visual_tokens}; lower min_pixels")

    def _draft_tokens(self, spec: pb.SpecOptions) -> int | None:
        if spec.HasField("enabled") and not spec.enabled:
            return 0
        if spec.HasField("num_draft_tokens"):
            return spec.num_draft_tokens
        if spec.HasField("enabled") and self.engine.proposer is None:
            raise InvalidRequest("this server has no draft model: speculative decoding cannot be enabled")
        return None

    async def _source(self, video: pb.VideoSource):
        """(zero-argument loader of the video, content id or None, check after decoding,
        close) for the request's video. Nothing is decoded here; loading waits for a
        prefix-cache miss. The content id is the SHA-256 of the video's bytes however it
        came, so a cached prefill is only ever reused for the same bytes. URLs get none
        (their bytes are not known before decoding), so their prefill is not reused."""
        cfg, which = self.config, video.WhichOneof("source")
        if which == "video_id":
            video_id = video.video_id
            if not await asyncio.to_thread(self.videos.contains, video_id):
                raise VideoNotFound(f"no video with id {video_id}: upload it (again) first")
            if not self.videos.on_disk:
                return (lambda: self.videos.get(video_id)), video_id, _nothing, _nothing
            load, check, close = self.videos.reader(video_id)      # opened, hashed, when the decode needs it
            return load, video_id, check, close
        if which == "data":
            data = video.data
            if len(data) > cfg.max_video_bytes:
                raise VideoTooLarge(f"video is {len(data)} bytes, over the limit of {cfg.max_video_bytes}")
            return (lambda: data), await asyncio.to_thread(content_id, data), _nothing, _nothing
        if which in ("path", "url") and len(getattr(video, which)) > cfg.max_source_chars:
            raise InvalidRequest(f"the video {which} is {len(getattr(video, which))} characters, over the limit of "
                                 f"{cfg.max_source_chars}")
        if which == "path":
            path = self.policy.resolve_path(video.path)      # SourceNotAllowed outside the media root
            # Hashed through the file it opens, and decoded from that same open file.
            opened = await asyncio.to_thread(HashedFile, path, self.policy, cfg.max_video_bytes)
            return opened.reader, opened.content_id, opened.check_unchanged, opened.close
        if which == "url":
            url = self.policy.resolve_url(video.url)         # InvalidRequest scheme-less; SourceNotAllowed off the allowlists
            return (lambda: url), None, _nothing, _nothing
        raise InvalidRequest("the request names no video (set video_id, path, url or data)")

    # ----- Live ----------------------------------------------------------------------------------
    def live_stream(self, requests: AsyncIterator[pb.LiveRequest], deadline: float | None = None, *,
                    metrics=None, cancelled: Callable[[], bool] | None = None) -> AsyncIterator[pb.LiveResponse]:
        """One Live call's response stream (services/live/call.py). metrics: a zero-argument callable
        giving the session's LiveMetrics (prom.Recorder.live_session); cancelled: tells, once
        the request stream has ended, whether the client cancelled rather than half-closed
        (Ray Serve ends both alike)."""
        return self.live_events.tee(LiveCall(self, deadline, metrics=metrics, cancelled=cancelled).run(requests))

    def live_refusal(self) -> str | None:
        """Why this server's target cannot take a live session, or None (asked once)."""
        if not self._live_refusal:
            self._live_refusal.append(live_refusal(self.engine))
        return self._live_refusal[0]

    def admit_live(self, call: LiveCall) -> None:
        # No await between the check and the insert: atomic on the event loop.
        if len(self.live_sessions) >= self.config.max_live_sessions:
            raise Overloaded(f"{len(self.live_sessions)} live sessions open, the limit of this server "
                                    f"({self.config.max_live_sessions}); retry later")
        self.live_sessions[call.session_id] = call

    def release_live(self, call: LiveCall) -> None:
        self.live_sessions.pop(call.session_id, None)
        self.live_ended[call.end_reason] += 1     # ok (drained), cancelled, or a status code
        self.last_released = time.monotonic()

    # ----- the other calls -----------------------------------------------------------------------
    async def upload_video(self, chunks: AsyncIterator[pb.VideoChunk]) -> pb.VideoRef:
        """Received to disk chunk by chunk, probed, then stored (services.uploads)."""
        cfg = self.config
        probe_options = VideoOptions(max_bytes=cfg.max_video_bytes, max_frame_pixels=cfg.max_frame_pixels,
                                     timeout_s=cfg.decode_timeout_s)
        return await receive_upload(chunks, self.videos, self.uploads, cfg.max_video_bytes, probe_options)

    async def abort(self, request: pb.AbortRequest) -> pb.AbortResponse:
        running = self.live.get(request.request_id)
        if running is not None:
            running.abort()
            return pb.AbortResponse(found=True)
        if self.cache.shared:       # it may be running on another replica
            await asyncio.to_thread(self.cache.put, _abort_key(request.request_id), {}, 60.0)
        return pb.AbortResponse(found=False)

    def model_info(self) -> pb.ModelInfo:
        engine, target, cfg = self.engine, self.engine.target, self.config
        speculative = engine.proposer is not None
        return pb.ModelInfo(
            target_model_type=target.family.model_type, target_layers=target.num_layers,
            vocab_size=target.vocab_size, max_context=target.max_context,
            spec_method=engine.spec.method if speculative else "none",
            num_draft_tokens=engine.spec.num_draft_tokens if speculative else 0,
            draft_placement=self.draft_placement if speculative else "none", host=self.host,
            max_new_tokens=cfg.max_new_tokens, max_visual_tokens=cfg.max_visual_tokens,
            max_video_bytes=cfg.max_video_bytes, max_message_bytes=cfg.max_message_bytes,
            live_sessions=self.live_refusal() is None, max_live_sessions=cfg.max_live_sessions)

    def held(self) -> dict[str, int]:
        """What this service holds now: requests admitted (its slots), generations the engine
        has not let go of, requests the engine's scheduler runs (live answers included), live
        sessions open."""
        return {"requests": len(self.live), "threads": self.requests.active,
                "engine_requests": self.engine.scheduler.num_running, "live_sessions": len(self.live_sessions)}

    async def wait_idle(self, until: float) -> dict[str, int | bool]:
        """held() as soon as it is all zero, or when time.monotonic() reaches `until` if it
        never is before; "idle" says which. Asked here, where the state is, so the answer does
        not wait on the asker's polling."""
        while any((held := self.held()).values()) and time.monotonic() < until:
            await asyncio.sleep(0.01)
        return {**held, "idle": not any(held.values())}

    def close(self) -> None:
        self.ready = False
        for running in list(self.live.values()):
            if running is not None:
                running.abort()
        self.requests.shutdown()
        self.videos.close()


def _abort_key(request_id: str) -> str:
    return f"abort:{request_id}"


def _nothing() -> None:
    pass


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded("the request's deadline passed")


async def _abort_at(deadline: float, running: RunningRequest) -> None:
    """Abort at the deadline itself: a deadline the host does not see (`sparrow-timeout-ms`
    metadata alone, behind a proxy) ends the call when a gRPC deadline would; where the host
    does see it, both end the call DEADLINE_EXCEEDED (the generate loop says so)."""
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    running.abort()


def deadline_from_metadata(metadata, key: str = "sparrow-timeout-ms") -> float | None:
    """A deadline a client sent as metadata (for hosts that do not see the gRPC deadline)."""
    for name, value in metadata or ():
        if name == key:
            try:
                return time.monotonic() + max(0, int(value)) / 1000
            except ValueError:
                raise InvalidRequest(f"{key} must be an integer number of milliseconds") from None
    return None

