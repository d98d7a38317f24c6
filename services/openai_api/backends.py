"""What the HTTP routes call: a Backend answers in sparrow.v1 terms, whichever host runs it.

    EmbeddedBackend   the SparrowService of this process, on this event loop (`sparrow serve`)

Under Ray Serve the TargetDeployment is the HTTP ingress itself (services.ray_app): each replica
serves these routes over its own SparrowService, with its RaySink recorder, so an HTTP request
takes no extra hop and is routed, autoscaled and drained as a gRPC call is.

It raises the service's typed exceptions (services.errors), which the routes turn into HTTP
statuses; both count requests on the host's prom.Recorder as the gRPC handlers do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from .. import prom
from ..protos import pb
from ..servicer import SparrowService


class Backend(Protocol):
    model_name: str               # what /v1/models lists and a request's `model` must name
    max_video_bytes: int          # inline (data:) videos are refused past it before decoding
    max_body_bytes: int           # a request body larger than this is refused (413) unread

    def generate(self, request: pb.GenerateRequest, deadline: float | None) -> AsyncIterator[pb.GenerateResponse]:
        """The Generate stream of `request`; deadline: time.monotonic() of this process."""

    async def model_info(self) -> pb.ModelInfo: ...

    async def ready(self) -> bool: ...

    def recorder(self) -> prom.Recorder: ...

    def metrics_text(self) -> tuple[bytes, str] | None:
        """(body, content type) of the Prometheus exposition, or None where another process
        exports this host's metrics (Ray's metrics agent)."""

    def live_events(self, session_id: str) -> AsyncIterator[dict]:
        """A live session's incidents and standing answers as they happen (live_events.py)."""


def body_limit(max_message_bytes: int) -> int:
    """The largest chat request body: a gRPC message's bound, in base64 (a data: video), plus
    room for the JSON around it."""
    return max_message_bytes * 4 // 3 + (64 << 10)


class EmbeddedBackend:
    """The in-process service (the same object the grpc.aio server serves); recorder: where
    its metrics go (default: the process's, prom.get_recorder())."""

    def __init__(self, service: SparrowService, model_name: str, recorder: prom.Recorder | None = None):
        self.service, self.model_name, self._recorder = service, model_name, recorder
        self.max_video_bytes = service.config.max_video_bytes
        self.max_body_bytes = body_limit(service.config.max_message_bytes)

    def generate(self, request: pb.GenerateRequest, deadline: float | None) -> AsyncIterator[pb.GenerateResponse]:
        return prom.observe_stream(self.service.generate(request, deadline), self.recorder())

    async def model_info(self) -> pb.ModelInfo:
        return self.service.model_info()

    async def ready(self) -> bool:
        return self.service.ready

    def recorder(self) -> prom.Recorder:
        return self._recorder or prom.get_recorder()

    def metrics_text(self) -> tuple[bytes, str] | None:
        import prometheus_client as pc

        sink = self.recorder().sink
        if not isinstance(sink, prom.PrometheusSink):
            return None
        return pc.generate_latest(sink.registry), pc.CONTENT_TYPE_LATEST

    def live_events(self, session_id: str) -> AsyncIterator[dict]:
        from .live_events import session_events

        return session_events(self.service, session_id)
