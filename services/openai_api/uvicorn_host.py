"""uvicorn serving the HTTP API on the embedded server's own event loop, beside grpc.aio.

One loop for both front doors: the HTTP routes call the SparrowService directly, as the gRPC
handlers do. uvicorn's own signal handling is off: the host owns SIGINT/SIGTERM
(server.serve_forever) and stops this server with the gRPC one, within the stop's grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
STOP_GRACE_S = 1.0        # requests still streaming then are cancelled (their generations abort)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield             # the host's signal handlers stay in place


class HttpServer:
    """Started and stopped on the running event loop; port 0 picks a free one."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=STOP_GRACE_S, ws="none")
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="sparrow-http")
        loop_time = asyncio.get_running_loop().time
        until = loop_time() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()                 # raises why it could not start
                raise OSError(f"the HTTP server on {self.host}:{self.port} stopped before it started")
            if loop_time() > until:
                await self.stop()
                raise TimeoutError(f"the HTTP server did not start within {START_TIMEOUT_S} s")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stop listening, give open requests STOP_GRACE_S, then cancel them."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), STOP_GRACE_S + 2.0)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        except Exception:  # noqa: BLE001 - stopping anyway
            log.exception("the HTTP server failed while stopping")
        self._server = self._task = None


async def start_http(service, host: str, port: int, model_name: str) -> HttpServer:
    """The OpenAI-compatible API of the embedded `service`, served on this event loop."""
    from .backends import EmbeddedBackend
    from .routes import create_app

    server = HttpServer(create_app(EmbeddedBackend(service, model_name)), host, port)
    await server.start()
    return server
