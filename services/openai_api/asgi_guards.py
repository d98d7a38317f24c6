"""Around every HTTP request: a bound on its body (413 before it is read, 411 when its size is
not declared) and a count of it by route and status on the host's prom.Recorder, beside the
gRPC calls. Plain ASGI middleware: the server (uvicorn) parses HTTP; this reads its headers."""

from __future__ import annotations

import json
from collections.abc import Callable

from .. import prom

ROUTES = ("/v1/chat/completions", "/v1/models", "/health", "/metrics", "/v1/live/")   # bounded label values


def route_label(path: str) -> str:
    return next((r.rstrip("/") for r in ROUTES if path == r or (r.endswith("/") and path.startswith(r))), "other")


class Guards:
    def __init__(self, app, max_body_bytes: Callable[[], int], recorder: Callable[[], prom.Recorder]):
        self.app, self.max_body_bytes, self.recorder = app, max_body_bytes, recorder

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await _send_error(counted_send, *refusal)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            self.recorder().record_http(route_label(scope["path"]), status[0] or 499)

    def _refusal(self, scope) -> tuple[int, str, str] | None:
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is None:
            return 411, "a request body needs a Content-Length", "length_required"
        limit = self.max_body_bytes()
        if not length.isdigit() or int(length) > limit:
            return 413, f"the request body is {length.decode(errors='replace')} bytes, over the limit of {limit}", \
                "request_too_large"
        return None


async def _send_error(send, status: int, message: str, code: str) -> None:
    from .http_errors import error_body

    body = json.dumps(error_body(status, message, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
