"""What a live session hands out: its stats, its answers, its events, and the error of a window
the engine has no memory for."""

from __future__ import annotations

from dataclasses import dataclass

from sparrow.engine import Generation
from sparrow.errors import ResourceExhausted
from sparrow.live.alerts import Check
from sparrow.live.source_health import CameraTime
from sparrow.output import GenerationOutput, TokenDelta


@dataclass(frozen=True, slots=True)
class LiveStats:
    frames_received: int
    frames_sampled: int
    frames_dropped: int          # sampled but never prefilled (ingest behind real time)
    pairs_prefilled: int
    pairs_evicted: int
    window_pairs: int            # pairs held now
    visual_tokens: int           # visual tokens held now
    kv_bytes: int                # the session cache's bytes (allocated)
    window_start_s: float        # stream time the window covers, [start, end)
    window_end_s: float
    newest_s: float              # the newest frame received
    lag_s: float                 # newest frame received - window end
    time_shift: int              # temporal rope positions the window was moved by
    ingest_seconds: float        # time spent prefilling pairs (vision tower + language model)
    newest_source_pts_s: float = 0.0   # camera time of the newest frame received
    newest_wall_time_s: float = 0.0
    stale: bool = False          # no frame for stale_after_s now
    questions_queued: int = 0    # questions waiting now for one in flight to end
    questions_refused: int = 0   # questions refused: in flight and queued were full


class LiveMemoryExhausted(ResourceExhausted):
    """The engine's KV arena has no room for the session's window: the session cannot go on."""


@dataclass(slots=True)
class LiveAnswer:
    """A question about the stream: iterate `generation` for deltas; `start_s`/`end_s` is the
    stream time range the answer saw, `camera` the camera time of its newest frame; `stale`:
    asked while the source was silent (the window is older than it looks)."""

    question_id: str
    question: str
    start_s: float
    end_s: float
    generation: Generation
    camera: CameraTime | None = None
    stale: bool = False


@dataclass(frozen=True, slots=True)
class LiveEvent:
    """What a session reports through its `on_event` callback (standing questions, errors):
    kind "delta" (text, token_ids), "done" (output), "error" (error), "dropped" (count),
    the source's health: "stale" / "resumed" (silence and its end), "timestamp_reset",
    "format_changed" (codec or frame size), each with a `message`; `camera`: an answer's
    newest frame, or for the source's events the newest frame when it happened;
    "check" (an alert rule's check: its P(yes) and, when it fired or cleared, its incident)."""

    kind: str
    question_id: str | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    delta: TokenDelta | None = None
    output: GenerationOutput | None = None
    error: BaseException | None = None
    dropped: int = 0
    camera: CameraTime | None = None
    stale: bool = False
    message: str = ""
    check: Check | None = None


__all__ = ["LiveAnswer", "LiveEvent", "LiveMemoryExhausted", "LiveStats"]
