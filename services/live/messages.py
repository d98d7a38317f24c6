"""The Live RPC's messages and the library's live types, each way: a LiveOpen as the session's
LiveConfig (within the service's limits), and the session's stats and errors as messages."""

from __future__ import annotations

import math

from sparrow.errors import InvalidRequest, ResourceExhausted
from sparrow.live.events import LiveStats
from sparrow.live.source_health import CameraTime
from sparrow.live.window import LiveConfig
from sparrow.video import VideoOptions

from sparrow.services.config import ServiceConfig
from sparrow.services.grpc_status import status_for
from sparrow.services.protos import pb


def live_config(opening: pb.LiveOpen, cfg: ServiceConfig) -> LiveConfig:
    """The session's LiveConfig from its LiveOpen, within the service's limits. The window's
    visual tokens are bounded by max_visual_tokens: each frame pair may spend its share of
    them (the processor shrinks frames that would spend more)."""
    defaults = LiveConfig()
    given = {name: getattr(opening, name) for name in ("fps", "window_s", "evict_s", "max_lag_s", "stale_after_s")
             if opening.HasField(name)}
    for name in ("min_pixels", "max_pixels"):
        if opening.HasField(name) and getattr(opening, name) > cfg.max_frame_pixels:
            raise InvalidRequest(f"{name} {getattr(opening, name)} is over the {cfg.max_frame_pixels} pixels "
                                 "a frame may have here")
    window_s = given.get("window_s", defaults.window_s)
    if isinstance(window_s, float) and math.isfinite(window_s) and window_s > cfg.max_live_window_s:
        raise ResourceExhausted(f"window_s {window_s:g} is over the limit of {cfg.max_live_window_s:g} s")
    probe = LiveConfig(**given, evict_mode=opening.evict_mode or "shift")   # InvalidRequest for a bad value
    share = cfg.max_visual_tokens // probe.window_pairs
    if share < 1:
        raise ResourceExhausted(f"a window of {probe.window_pairs} frame pairs ({window_s:g} s at {probe.fps:g} fps) "
                                f"cannot fit the {cfg.max_visual_tokens} visual tokens a session may hold; "
                                "use a shorter window or a lower fps")
    if opening.evict_mode:
        given["evict_mode"] = opening.evict_mode
    pixels = {name: getattr(opening, name) for name in ("min_pixels", "max_pixels") if opening.HasField(name)}
    options = VideoOptions(**pixels, max_visual_tokens=share, max_frame_pixels=cfg.max_frame_pixels)
    return LiveConfig(**given, options=options)


def stats_message(stats: LiveStats, *, bytes_received: int, session_s: float, final: bool = False) -> pb.LiveStats:
    return pb.LiveStats(
        frames_received=stats.frames_received, frames_sampled=stats.frames_sampled,
        frames_dropped=stats.frames_dropped, pairs_prefilled=stats.pairs_prefilled,
        pairs_evicted=stats.pairs_evicted, window_pairs=stats.window_pairs, visual_tokens=stats.visual_tokens,
        tokens_per_pair=stats.visual_tokens // stats.window_pairs if stats.window_pairs else 0,
        kv_bytes=stats.kv_bytes, window_start_s=stats.window_start_s, window_end_s=stats.window_end_s,
        newest_s=stats.newest_s, lag_s=stats.lag_s, ingest_seconds=stats.ingest_seconds,
        bytes_received=bytes_received, session_seconds=session_s, final=final,
        newest_source_pts_s=stats.newest_source_pts_s, newest_wall_time_s=stats.newest_wall_time_s, stale=stats.stale,
        questions_queued=stats.questions_queued, questions_refused=stats.questions_refused)


def source_event(kind: int, message: str, camera: CameraTime | None) -> pb.LiveEvent:
    """An event about the session's source, at the camera time of the newest frame (if any)."""
    event = pb.LiveEvent(kind=kind, message=message)
    if camera is not None:
        event.stream_s, event.source_pts_s, event.wall_time_s = camera.stream_s, camera.source_pts_s, camera.wall_time_s
    return event


def error_event(exc: BaseException, question_id: str = "") -> pb.LiveEvent:
    code, message = status_for(exc)
    return pb.LiveEvent(kind=pb.LIVE_EVENT_KIND_ERROR, code=code.value[0], message=message, question_id=question_id)
