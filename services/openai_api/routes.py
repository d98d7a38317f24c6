"""The OpenAI-compatible HTTP API as a FastAPI app over a Backend (backends.py):

    POST /v1/chat/completions          streamed (server-sent events, `data: [DONE]`) or not
    GET  /v1/models                    the one model this server serves
    GET  /health                       200 once the models are loaded and until the stop; else 503
    GET  /metrics                      Prometheus (embedded host)
    GET  /v1/live/{session_id}/events  a live session's incidents and standing answers (SSE)

A client that goes away aborts its request within one engine step: before its first token
through `until_disconnected`, while streaming through Starlette, which cancels the response's
stream when the connection drops. `X-Request-Timeout` (seconds) is the request's deadline, as
gRPC's deadline is: past it the generation is aborted and the client gets 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparrow.errors import InvalidRequest

from sparrow.services.grpc_status import DeadlineExceeded, VideoNotFound, error_reason
from sparrow.services.openai_api.asgi_guards import Guards
from sparrow.services.openai_api.backends import Backend
from sparrow.services.openai_api.chat_request import to_generate_request
from sparrow.services.openai_api.chat_response import chunks, collect
from sparrow.services.openai_api.http_errors import error_body, error_response, exception_response, http_status, validation_message
from sparrow.services.openai_api.schemas import ChatCompletionRequest, ModelCard, ModelList

TIMEOUT_HEADER = "x-request-timeout"       # seconds, as a decimal number
METHOD = "ChatCompletions"                 # the method label of request_errors


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


def create_app(backend: Backend) -> FastAPI:
    app = FastAPI(title="Sparrow", description="OpenAI-compatible chat completions with video", docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.backend = backend

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        backend.recorder().record_error(METHOD, "invalid_argument")
        return error_response(400, message, "invalid_argument", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            deadline = _deadline(request.headers.get(TIMEOUT_HEADER))
            if body.model and body.model != backend.model_name:
                raise _ModelNotFound(f"model {body.model!r} is not served here (GET /v1/models)")
            completion_id = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
            generate = to_generate_request(body, backend.max_video_bytes, completion_id)
            responses = backend.generate(generate, deadline)
            if not body.stream:
                answer = await until_disconnected(request, collect(responses, completion_id, backend.model_name))
                return JSONResponse(answer.model_dump())
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            stream = chunks(responses, completion_id, backend.model_name, include_usage)
            first = await until_disconnected(request, anext(stream))      # refusals still get their status
            return StreamingResponse(_events(first, stream, backend), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        except ClientGone:
            backend.recorder().record_error(METHOD, "cancelled")
            return Response(status_code=499)          # nobody reads it: the connection is gone
        except Exception as exc:  # noqa: BLE001 - every refusal becomes an OpenAI error object
            backend.recorder().record_error(METHOD, error_reason(exc))
            return exception_response(exc)

    @app.get("/v1/models")
    async def models():
        info = await backend.model_info()
        card = ModelCard(id=backend.model_name, created=int(time.time()), max_model_len=info.max_context,
                         speculative={"method": info.spec_method, "num_draft_tokens": info.num_draft_tokens,
                                      "draft_placement": info.draft_placement})
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health():
        if await backend.ready():
            return JSONResponse({"status": "ok"})
        return error_response(503, "the server is starting or stopping", "unavailable")

    @app.get("/metrics")
    async def metrics():
        exposition = backend.metrics_text()
        if exposition is None:
            return error_response(404, "this host's metrics are exported by Ray's metrics agent", "not_found")
        return Response(exposition[0], media_type=exposition[1])

    @app.get("/v1/live/{session_id}/events")
    async def live_events(session_id: str, request: Request):
        from sparrow.services.openai_api.live_events import sse_events

        try:
            events = backend.live_events(session_id)
            first = await until_disconnected(request, anext(events))
        except ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001
            return exception_response(exc)
        return StreamingResponse(sse_events(first, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return Guards(app, lambda: backend.max_body_bytes, backend.recorder)


class _ModelNotFound(VideoNotFound):
    """A request naming a model this server does not serve (404, as the video not found is)."""


def _deadline(header: str | None) -> float | None:
    """time.monotonic() past which the client has given up, from X-Request-Timeout."""
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        raise InvalidRequest(f"X-Request-Timeout must be a number of seconds, got {header!r}") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidRequest(f"X-Request-Timeout must be a non-negative number of seconds, got {header!r}")
    if seconds == 0:
        raise DeadlineExceeded("the request's deadline passed")
    return time.monotonic() + seconds


async def until_disconnected(request: Request, work: Awaitable):
    """work's result, or ClientGone as soon as the client closes its connection (work is then
    cancelled, and with it the generation it waits on)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the server reports the client gone. The body was read already, so the
    server's next message for this request is its disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(first, stream: AsyncIterator, backend: Backend) -> AsyncIterator[str]:
    """Server-sent events: each chunk as `data: <json>`, then `data: [DONE]`. A failure once
    the stream has begun (the status line is sent) is an error object event, as vLLM sends it."""
    try:
        yield f"data: {first.model_dump_json()}\n\n"
        async for chunk in stream:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except Exception as exc:  # noqa: BLE001 - the client reads it in the stream
        backend.recorder().record_error(METHOD, error_reason(exc))
        status, message, code = http_status(exc)
        yield f"data: {json.dumps(error_body(status, message, code))}\n\n"
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"
