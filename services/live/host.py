"""What a Live call needs of the server hosting it (services.servicer.SparrowService): its
limits, engine and source policy, the admission of sessions and its request checks; and the
errors and metrics a call shares with its host."""

from __future__ import annotations

from typing import Any, Protocol

from sparrow.config import SamplingParams
from sparrow.engine import Engine
from sparrow.errors import InvalidRequest, ResourceExhausted
from sparrow.live.events import LiveStats
from sparrow.live.session import LiveSession
from sparrow.services.config import ServiceConfig
from sparrow.services.protos import pb
from sparrow.video import SourcePolicy


class SessionLimit(ResourceExhausted):
    """A running session passed one of the service's limits: the stream ends with it."""


class LiveMetrics(Protocol):
    """One session's share of the live metrics (services.prom.LiveSessionMetrics)."""

    def update(self, stats: LiveStats) -> None: ...

    def end(self, reason: str) -> None: ...


class LiveHost(Protocol):
    """What a live call needs of the service hosting it (services.servicer.SparrowService):
    its limits, engine and source policy, the admission of sessions, and its request checks."""

    config: ServiceConfig
    engine: Engine
    policy: SourcePolicy
    ready: bool

    def live_refusal(self) -> str | None: ...

    def admit_live(self, call: Any) -> None: ...

    def release_live(self, call: Any) -> None: ...

    def sampling_params(self, s: pb.SamplingParams) -> SamplingParams: ...


def live_refusal(engine: Engine) -> str | None:
    """Why this engine's target cannot take a live session (the library's words), or None."""
    try:
        LiveSession(engine).close()
    except InvalidRequest as exc:
        return str(exc)
    return None

__all__ = ["LiveHost", "LiveMetrics", "SessionLimit", "live_refusal"]
