"""The embedded host: a grpc.aio server around the in-process engine (`sparrow serve`).

Serves sparrow.v1.Sparrow, grpc.health.v1 and server reflection. Nothing else is needed:
no Ray, no Redis (the state cache is in memory unless a Redis URL is given).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sparrow.services import prom, stopping
from sparrow.services.grpc_status import log_failure
from sparrow.services.handler import SparrowMethods
from sparrow.services.protos import SERVICE_NAME, pb_grpc
from sparrow.services.servicer import SparrowService, deadline_from_metadata
from sparrow.services.wire import add_sparrow_servicer, check_decoded, message_options

log = logging.getLogger(__name__)


# How far gRPC reads a client's stream ahead of the handler. Its default flow control grows a
# stream's window with the measured bandwidth-delay product (up to 1 GiB while memory looks
# free), so an upload sent faster than it is written to disk queued in this process: 4 x 128
# MiB at once peaked at +500 MiB. A fixed window bounds it per stream; the window still opens
# for whichever message the handler waits on, so chunks larger than it still arrive.
READ_AHEAD_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4 << 20)]


def request_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """time.monotonic() past which the client has given up: the earlier of gRPC's deadline
    and a `sparrow-timeout-ms` metadata one (which the Ray host needs, and so honours:
    a client gets the same outcome from either host)."""
    remaining = context.time_remaining()
    deadlines = [deadline_from_metadata(context.invocation_metadata())]
    if remaining is not None:
        deadlines.append(time.monotonic() + remaining)
    return min((d for d in deadlines if d is not None), default=None)


class GrpcSparrow(SparrowMethods, pb_grpc.SparrowServicer):
    """sparrow.v1.Sparrow on grpc.aio (services.handler). A client cancel or deadline
    cancels the handler's task; the CancelledError passes through and closes the service's
    generator, which aborts the generation (Live: closes the session, freeing its KV)."""

    def __init__(self, service: SparrowService):
        self.service = service

    def _deadline(self, grpc_context: grpc.aio.ServicerContext) -> float | None:
        return request_deadline(grpc_context)

    def _recorder(self) -> prom.Recorder:
        return prom.get_recorder()

    async def _set_status(self, grpc_context: grpc.aio.ServicerContext, exc: Exception) -> None:
        code, details = log_failure(log, exc)
        await grpc_context.abort(code, details)

    async def GetModelInfo(self, request, context):
        async with self._status_on_error(context, "GetModelInfo"):
            check_decoded(request)
            return self.service.model_info()


async def start_server(service: SparrowService, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the bound port (port 0 picks a free one)."""
    server = grpc.aio.server(options=message_options(service.config.max_message_bytes) + READ_AHEAD_OPTIONS)
    add_sparrow_servicer(GrpcSparrow(service), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


async def serve_forever(service: SparrowService, host: str, port: int | None,
                        stop_on: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM), *,
                        http_port: int | None = None, model_name: str = "") -> None:
    """Serve until the server terminates or one of `stop_on` arrives (Ctrl-C; SIGTERM, what
    Kubernetes sends to stop a pod). The signals are the event loop's own handlers, so a stop
    is an event the loop reads, not an exception raised wherever the main thread happens to be
    (inside gRPC's callbacks or holding a lock), which could leave the shutdown hanging.
    port None: no gRPC; http_port None: no HTTP (the OpenAI-compatible API, services.openai_api)."""
    from .openai_api.uvicorn_host import start_http

    server = bound = http = None
    if port is not None:
        server, bound = await start_server(service, host, port)
    try:
        if http_port is not None:
            http = await start_http(service, host, http_port, model_name)
    except BaseException:
        if server is not None:
            await server.stop(grace=None)
        raise
    loop, stop = asyncio.get_running_loop(), asyncio.Event()

    def on_signal() -> None:
        stopping.arm()          # the grace counts from the signal, however busy the loop is after it
        stop.set()
    for signum in stop_on:
        loop.add_signal_handler(signum, on_signal)
    if http is not None:          # first: the gRPC line ends the start-up (scripts wait for it)
        log.info("sparrow serving HTTP on %s:%d (embedded)", host, http.port)
        print(f"sparrow: serving the OpenAI-compatible API on http://{host}:{http.port}/v1 (embedded)", flush=True)
    if server is not None:
        log.info("sparrow serving on %s:%d (embedded)", host, bound)
        print(f"sparrow: serving sparrow.v1.Sparrow on {host}:{bound} (embedded)", flush=True)
    waits = [asyncio.ensure_future(stop.wait())]
    if server is not None:
        waits.append(asyncio.ensure_future(server.wait_for_termination()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for signum in stop_on:
            loop.remove_signal_handler(signum)
        waits[0].cancel()       # (not the termination wait: cancelling it cancels grpc's shutdown)
        service.close()
        stops = [] if server is None else [server.stop(grace=1)]       # inside the stop's grace (stopping.py)
        if http is not None:
            stops.append(http.stop())
        await asyncio.gather(*stops)


class BackgroundServer:
    """The embedded server on its own thread and event loop, for tests, benchmarks and
    programs that are not async themselves."""

    def __init__(self, service: SparrowService, host: str = "127.0.0.1", port: int = 0, *,
                 http_port: int | None = None, model_name: str = "sparrow"):
        self.service, self.host, self.port = service, host, port
        self.http_port, self.model_name = http_port, model_name       # http_port None: gRPC only
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sparrow-grpc", daemon=True)
        self._server: grpc.aio.Server | None = None
        self._http = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (what an OpenAI client takes as base_url)."""
        return f"http://{self.host}:{self.http_port}/v1"

    def start(self) -> "BackgroundServer":
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(start_server(self.service, self.host, self.port), self._loop)
        self._server, self.port = future.result(timeout=30)
        if self.http_port is not None:
            from .openai_api.uvicorn_host import start_http

            self._http = self.call(start_http(self.service, self.host, self.http_port, self.model_name), timeout=30)
            self.http_port = self._http.port
        return self

    def call(self, coro, timeout: float = 10.0):
        """Run a coroutine on the server's loop (to inspect service state without races)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        if self._server is not None:
            self.service.close()
            if self._http is not None:
                self.call(self._http.stop(), timeout=10)
            asyncio.run_coroutine_threadsafe(self._server.stop(grace=1), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
