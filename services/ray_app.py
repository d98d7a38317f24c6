"""The Ray host (`sparrow serve --ray`): a Ray Serve application behind Serve's gRPC and HTTP proxies.

    gRPC client -> Serve gRPC proxy -> TargetDeployment (ingress: the servicer + engine)
    HTTP client -> Serve HTTP proxy ---^  (the OpenAI-compatible API, services.openai_api)
                                            |  one call per step for all its requests (client affinity)
                                            v
                                       DraftDeployment (draft replicas, no video, no target)

TargetDeployment owns the target, runs each request's loop in its own process (the KV cache
never moves) and keeps recent video prefills in its prefix cache. DraftDeployment replicas
rebuild a request's draft context from the state cache (Redis when there is more than one
replica) the first time they see it. Both scale from their deployment options.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections.abc import Callable

import ray
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig, gRPCOptions

from sparrow.services.state_cache import open_cache

from sparrow.services import prom
from sparrow.services.draft_service import DraftBatch, DraftReply, DraftSessions, DraftWorker, RemoteDraftProposer, RemoteDraftStats
from sparrow.services.grpc_status import log_failure, quiet_client_errors
from sparrow.services.handler import SparrowMethods
from sparrow.services.models import load_draft, load_heads
from sparrow.services.servicer import SparrowService, deadline_from_metadata
from sparrow.services.settings import AppSettings, build_engine, warmed_proposer

log = logging.getLogger(__name__)

APP_NAME = "sparrow"
VIDEO_ROUTER = "sparrow.services.routing.VideoAffinityRouter"
SERVICER_FUNCTIONS = [
    # sparrow.v1.Sparrow with undecodable requests answered INVALID_ARGUMENT (services.wire)
    "sparrow.services.wire.add_sparrow_servicer_to_serve_proxy",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


@serve.deployment(name="TargetDeployment")
@serve.ingress()            # HTTP: the OpenAI-compatible API (services.openai_api) on the replica's own service
class TargetDeployment(SparrowMethods):
    def __init__(self, settings: AppSettings, draft=None):
        quiet_client_errors("ray.serve")     # Serve logs what a method raises with a traceback
        client = RayDraftClient(draft) if draft is not None else None
        engine, cache = build_engine(settings, client)
        placement = "remote" if client is not None else settings.placement
        self.service = SparrowService(engine, cache, settings.service, host="ray", draft_placement=placement)
        self.metrics = prom.Recorder(prom.RaySink(), model_name=settings.target)
        self.model_name = settings.model_name

    def __serve_build_asgi_app__(self):
        """What Serve's HTTP proxy reaches: the routes of the embedded host over this replica's
        service (its requests are the gRPC calls' neighbours in its slots and metrics)."""
        from .openai_api.backends import EmbeddedBackend
        from .openai_api.routes import create_app

        return create_app(EmbeddedBackend(self.service, self.model_name, self.metrics))

    def _deadline(self, grpc_context) -> float | None:
        # Serve's proxy passes no gRPC deadline on: ours (services.ray_proxy) adds it to the
        # metadata as `sparrow-timeout-ms`, beside one a client sent itself, enforced here.
        return deadline_from_metadata(grpc_context.invocation_metadata())

    def _recorder(self) -> prom.Recorder:
        return self.metrics

    async def _set_status(self, grpc_context, exc: Exception) -> None:
        """Serve's proxy sends the code set here when the method then raises. A caller's error
        is logged once, at INFO, without a traceback (here and, through ClientErrorsAtInfo on
        Serve's logger, by Serve itself)."""
        code, details = log_failure(log, exc)
        grpc_context.set_code(code)
        grpc_context.set_details(details)

    def _cancelled(self, request_stream) -> Callable[[], bool] | None:
        # A bidi stream is one call to this replica: the session and its KV cache stay here.
        # Serve ends a cancelled client's request stream as if it had half-closed; the stream
        # says which (gRPCInputStream.is_cancelled), so the session is closed, not drained.
        return getattr(request_stream, "is_cancelled", None)

    async def GetModelInfo(self, request):
        return self.service.model_info()

    # grpc.health.v1 (the proxy routes it here, to the application's ingress)
    async def Check(self, request):
        serving = health_pb2.HealthCheckResponse.SERVING if self.service.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=serving)

    async def Watch(self, request):
        yield await self.Check(request)

    async def wait_idle(self, until: float) -> dict:
        """SparrowService.wait_idle: what this replica holds once it holds nothing, or at
        `until` (time.monotonic(), the same clock host-wide)."""
        return await self.service.wait_idle(until)

    def stats(self) -> dict:
        """This replica's requests and generation threads, and how its remote draft has fared."""
        engine = self.service.engine
        draft = engine.proposer.stats() if isinstance(engine.proposer, RemoteDraftProposer) else RemoteDraftStats()
        return {"replica": ray.get_runtime_context().get_actor_name() or "",
                "videos": len(engine.prefix_cache) if engine.prefix_cache is not None else 0,
                **self.service.held(),          # requests, threads, engine_requests, live_sessions
                "live_ended": dict(self.service.live_ended),
                "last_released": self.service.last_released,        # time.monotonic(), same clock host-wide
                "draft_failovers": draft.failovers, "draft_timeouts": draft.timeouts, "draft_fallbacks": draft.fallbacks,
                "draft_rebuilds": draft.rebuilds, "draft_sessions": list(draft.sessions)}


# A target replica's draft calls go to one draft replica, chosen by rendezvous hashing of its
# client id (routing.py; the same rule as videos to targets). Serve's own multiplex routing
# learns where an id was "loaded" only eventually: measured, a 20-token request's calls
# bounced between two replicas 1-7 times, each bounce a rebuild of every session.
@serve.deployment(name="DraftDeployment", max_ongoing_requests=128,
                  request_router_config=RequestRouterConfig(request_router_class=VIDEO_ROUTER))
class DraftDeployment:
    """Draft replicas. A call is one step of one target replica, carrying its client id as
    the multiplexed model id: all of its requests' sessions live together on the replica the
    id ranks first, and when that replica dies the id moves to the next, where the sessions
    rebuild from the state cache. The multiplexing LRU bounds the target replicas a draft
    replica serves at once."""

    def __init__(self, settings: AppSettings):
        draft = load_draft(settings.draft, load_heads(settings.target, settings.dtype, settings.device),
                           settings.draft_arch)
        self.worker = DraftWorker(warmed_proposer(draft, settings.spec_for(draft), settings), open_cache(settings.cache))
        self.replica = ray.get_runtime_context().get_actor_name() or ""
        self.clients: weakref.WeakValueDictionary[str, DraftSessions] = weakref.WeakValueDictionary()
        self.idle_s, self._swept = settings.draft_session_idle_s, 0.0

    @serve.multiplexed(max_num_models_per_replica=64)
    async def sessions(self, client_id: str) -> DraftSessions:
        sessions = DraftSessions(client_id)
        self.clients[client_id] = sessions
        return sessions

    async def step(self, batch: DraftBatch) -> list[DraftReply]:
        sessions = await self.sessions(serve.get_multiplexed_model_id())
        replies = await asyncio.to_thread(self.worker.step, sessions, batch)
        self._drop_idle()
        return replies

    def _drop_idle(self) -> None:
        """Free sessions no step has touched for a while. `end` is routed by affinity, which
        is best effort, and a session may have been rebuilt on several replicas: this bounds
        the time their state outlives the request."""
        now = time.monotonic()
        if now - self._swept < 1.0:
            return
        self._swept = now
        for sessions in list(self.clients.values()):
            sessions.drop_idle(now, self.idle_s)

    async def end(self, client_id: str, session_id: str) -> None:
        sessions = self.clients.get(client_id)
        if sessions is not None:
            sessions.end(session_id)

    def describe(self) -> dict:
        """This replica's actor name, process id, and the sessions it holds state for (all target
        replicas'), with the seconds since each was last used."""
        now = time.monotonic()
        live = {}
        for sessions in list(self.clients.values()):
            live.update(sessions.live(now))
        return {"replica": self.replica, "pid": os.getpid(), "sessions": live}


class RayDraftClient:
    """DraftDeployment calls from the target's scheduler thread (blocking there is fine: it
    is not the replica's event loop). A batch goes where its client id is routed. A call
    that times out is cancelled: with no live replica Serve queues it until one starts, and
    the step has drafted in the target's process by then."""

    def __init__(self, handle):
        self.handle = handle

    def step(self, batch: DraftBatch, timeout_s: float) -> list[DraftReply]:
        call = self.handle.options(multiplexed_model_id=batch.client).step.remote(batch)
        try:
            return call.result(timeout_s=timeout_s)
        except TimeoutError:
            call.cancel()
            raise

    def end(self, client_id: str, session: str) -> None:
        self.handle.options(multiplexed_model_id=client_id).end.remote(client_id, session)      # not awaited


def build_app(settings: AppSettings):
    draft = None
    if settings.draft is not None and settings.draft_placement == "remote":
        draft = DraftDeployment.options(**settings.draft_deployment).bind(settings)
    # Serve queues generations past a replica's limit (rather than the service refusing
    # them), leaving headroom for Abort, uploads and health checks. A live session is one
    # request for its whole life.
    # Questions about one video go to the replica holding its prefill (routing.py).
    target = {"max_ongoing_requests": settings.service.max_concurrent + settings.service.max_live_sessions + 16,
              "request_router_config": RequestRouterConfig(request_router_class=VIDEO_ROUTER),
              **settings.target_deployment}
    return TargetDeployment.options(**target).bind(settings, draft)


def start(settings: AppSettings, *, grpc_port: int, http_host: str = "127.0.0.1", http_port: int = 8000,
          name: str = APP_NAME, proxy_location: str | None = None):
    """Start Serve's proxies and deploy the app on the connected Ray cluster; returns the
    ingress handle. HTTP listens on http_host; Serve's gRPC proxy on all interfaces, unless the job's
    runtime_env is ray_bind.runtime_env(host) (as `sparrow serve --ray` makes it). proxy_location:
    Serve's (None: its default, a proxy on every node; "HeadOnly" where several nodes share a host).
    The HTTP proxy serves the OpenAI-compatible API (services.openai_api) of the TargetDeployment."""
    where = {} if proxy_location is None else {"proxy_location": proxy_location}
    serve.start(grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS),
                http_options=HTTPOptions(host=http_host, port=http_port), **where)
    # The OpenAI-compatible API at the HTTP proxy's root (/v1/...) for the default application.
    return serve.run(build_app(settings), name=name, route_prefix="/" if name == APP_NAME else f"/{name}")
