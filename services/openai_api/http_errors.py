"""Every failure as an HTTP status and an OpenAI error object.

The typed exceptions are the gRPC path's (sparrow.errors, services.errors); their gRPC status
(services.errors.status_for) decides the HTTP one, so a client gets the same verdict from either
front door. Two refinements HTTP has words for: a request over one of this server's size limits
is 413 (RESOURCE_EXHAUSTED that is not a full replica), and a full replica (Overloaded, too
many uploads) is 429 with Retry-After.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": "invalid_argument"}}
"""

from __future__ import annotations

import logging

import grpc
from fastapi.responses import JSONResponse

from sparrow.errors import ContextOverflow

from sparrow.services.grpc_status import Overloaded, UploadLimit, error_reason, log_failure, status_for
from sparrow.services.openai_api.schemas import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1         # what a 429 or 503 asks a client to wait

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 413,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

ERROR_TYPE = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
              409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
              499: "cancelled", 500: "server_error", 503: "service_unavailable", 504: "timeout_error"}


def http_status(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, message, code) for an exception raised by the service."""
    if isinstance(exc, (Overloaded, UploadLimit)):
        return 429, str(exc), error_reason(exc)
    if isinstance(exc, ContextOverflow):
        return 400, str(exc), "context_length_exceeded"       # OpenAI's code for it
    code, message = status_for(exc)
    return HTTP_STATUS.get(code, 500), message, error_reason(exc)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPE.get(status, "server_error"),
                                         param=param, code=code)).model_dump()


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def exception_response(exc: BaseException) -> JSONResponse:
    """The response for a refused or failed request, logged as the gRPC host logs it."""
    log_failure(log, exc)
    status, message, code = http_status(exc)
    return error_response(status, message, code)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for Pydantic's errors of a request body: the first, with its place."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return (f"{where}: {first.get('msg')}" if where else str(first.get("msg"))) + more, where or None
