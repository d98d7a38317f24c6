"""The limits and policies of one service, the same on every replica and host: what a
request, an upload and a live session may ask for (the `service:` block of the settings file,
or `sparrow serve --max-*`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparrow.services.live.webhook import WebhookPrefix

MiB = 1 << 20


@dataclass(frozen=True)
class ServiceConfig:
    """Limits and policies of one service (the same on every replica)."""

    default_max_new_tokens: int = 128
    max_new_tokens: int = 2048             # above: RESOURCE_EXHAUSTED
    max_visual_tokens: int = 24576        # per video; requests may ask for fewer
    max_frames: int = 768
    max_video_bytes: int = 2 << 30
    max_duration_s: float = 4 * 3600.0
    max_message_bytes: int = 64 * MiB      # gRPC messages, both directions (uploads go in chunks)
    max_prompt_chars: int = 16384          # the question and its earlier turns together
    max_history_turns: int = 64            # earlier turns of a conversation
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 512       # each stop string, UTF-8
    max_source_chars: int = 4096           # a video path or URL
    max_concurrent: int = 16               # running requests per replica; above: RESOURCE_EXHAUSTED
    # Per-frame pixel options a request may ask for (min_pixels, max_pixels). Qwen2.5-VL's
    # own ceiling for one image is 16384 merged tokens (12.8 M pixels); a floor above what
    # the request's token budget can hold for its frames is refused as contradictory.
    max_frame_pixels: int = 16384 * 28 * 28
    media_root: str | None = None          # paths are read only inside it (None: no paths)
    allowed_url_schemes: tuple[str, ...] = ()   # of http, https, rtsp (none: no URLs)
    allowed_url_hosts: tuple[str, ...] = ()     # see sparrow.video.SourcePolicy
    decode_timeout_s: float = 300.0
    video_ttl_s: float = 3600.0            # how long uploads stay stored
    # Uploads (UploadVideo) are written to disk chunk by chunk as they arrive (memory: one
    # chunk each), probed with PyAV, then stored: in the shared state cache when there is one
    # (Redis), else as files in upload_dir (None: a fresh temporary directory per server).
    max_uploads: int = 4                   # uploads in progress at once; above: RESOURCE_EXHAUSTED
    max_upload_bytes_in_flight: int = 4 << 30   # bytes received by the uploads in progress, together
    upload_dir: str | None = None
    max_stored_upload_bytes: int = 16 << 30     # upload_dir: the oldest uploads go first past this
    abort_poll_s: float = 0.2              # shared cache: how often a request looks for an Abort sent elsewhere
    # Live sessions (the Live RPC, services/live/call.py). A session passing a limit ends with
    # RESOURCE_EXHAUSTED; one asking for more is refused at open.
    max_live_sessions: int = 4             # open at once per server (replica); 0: no live sessions
    max_live_session_s: float = 4 * 3600.0  # wall seconds a session may stay open
    max_live_bytes: int = 16 << 30         # media and raw frame bytes a session may send
    max_live_window_s: float = 600.0       # the longest window a session may keep
    live_stats_every_s: float = 5.0        # default wall seconds between LiveStats messages
    # A session's answers (asked, standing, alert checks) in flight at once; more wait, up to
    # max_live_queued_questions, then a question is refused (RESOURCE_EXHAUSTED; the session goes on).
    max_live_questions: int = 4
    max_live_queued_questions: int = 8
    # URL prefixes a session's alert webhook (LiveOpen.webhook_url) may lie under, as
    # scheme://host[:port][/path] (services.webhook.WebhookPrefix: scheme, host and port match
    # exactly, the path segment by segment); none: no webhooks.
    live_webhook_prefixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens:
            raise ValueError("need 1 <= default_max_new_tokens <= max_new_tokens")
        if min(self.max_visual_tokens, self.max_frames, self.max_video_bytes, self.max_message_bytes,
               self.max_prompt_chars, self.max_concurrent, self.max_frame_pixels, self.max_stop_string_bytes,
               self.max_source_chars, self.max_upload_bytes_in_flight, self.max_stored_upload_bytes) < 1:
            raise ValueError("limits must be >= 1")
        if self.max_history_turns < 0:
            raise ValueError("max_history_turns must be >= 0 (0: no conversations)")
        if self.max_uploads < 0:
            raise ValueError("max_uploads must be >= 0 (0: no uploads)")
        if self.max_live_sessions < 0:
            raise ValueError("max_live_sessions must be >= 0 (0: no live sessions)")
        if self.max_live_bytes < 1:
            raise ValueError("max_live_bytes must be >= 1")
        if self.max_live_questions < 1 or self.max_live_queued_questions < 0:
            raise ValueError("need max_live_questions >= 1 and max_live_queued_questions >= 0")
        for prefix in self.live_webhook_prefixes:
            WebhookPrefix.parse(prefix)          # InvalidRequest (a ValueError) for a malformed one, now
        for name in ("max_live_session_s", "max_live_window_s", "live_stats_every_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
