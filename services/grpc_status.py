"""Every failure a caller can cause, as a gRPC status code. Both hosts (grpc.aio and Ray
Serve's proxy) map exceptions through `status_for`, so a client sees the same code from
either."""

from __future__ import annotations

import logging

import grpc

from sparrow.errors import (ContextOverflow, InvalidRequest, ResourceExhausted, SourceNotAllowed, SourceUnavailable,
                            SparrowError)


class VideoNotFound(InvalidRequest):
    """A video the service does not hold: a video_id never uploaded, expired or found damaged
    (and deleted), or a path with no file under the media root."""


class Overloaded(ResourceExhausted):
    """This server runs as many requests (or live sessions) as it may: retry later."""


class UploadLimit(ResourceExhausted):
    """Too many uploads in progress, or too many bytes in flight among them: retry later."""


class SourceChanged(SparrowError):
    """The video file was written to while this request read it: retry (ABORTED)."""


class DeadlineExceeded(SparrowError, TimeoutError):
    """The deadline the client gave (gRPC's own, or `sparrow-timeout-ms` metadata) passed."""


class UndecodableRequest(InvalidRequest):
    """A message gRPC could not parse as its type (corrupt bytes, invalid UTF-8 in a string)."""


class NotReady(SparrowError):
    """The service is starting or draining."""


class LiveUnsupported(SparrowError):
    """A live session asked of a server whose target cannot take one (its video positions are
    not real time): no option of the request can change that (FAILED_PRECONDITION)."""


# Status details travel in gRPC's trailing metadata (8 KiB by default, all headers together):
# a message quoting a long input is cut, whatever quoted it.
MAX_DETAILS_CHARS = 1024


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) for an exception. Order matters: some errors are several things at
    once (VideoTooLarge is a bad video and a budget; SourceNotAllowed is a bad argument)."""
    message = str(exc) or type(exc).__name__
    if len(message) > MAX_DETAILS_CHARS:
        message = message[:MAX_DETAILS_CHARS] + f"... ({len(message)} characters)"
    if isinstance(exc, SourceNotAllowed):
        return grpc.StatusCode.PERMISSION_DENIED, message
    if isinstance(exc, VideoNotFound):
        return grpc.StatusCode.NOT_FOUND, message
    if isinstance(exc, (ResourceExhausted, ContextOverflow)):    # a size, token or concurrency budget
        return grpc.StatusCode.RESOURCE_EXHAUSTED, message
    if isinstance(exc, TimeoutError):             # incl. VideoTimeout: the source or decoding took too long
        return grpc.StatusCode.DEADLINE_EXCEEDED, message
    if isinstance(exc, SourceUnavailable):        # a URL that could not be fetched: may work later
        return grpc.StatusCode.UNAVAILABLE, message
    if isinstance(exc, SourceChanged):            # a concurrent writer: the same request may work now
        return grpc.StatusCode.ABORTED, message
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, message
    if isinstance(exc, NotReady):
        return grpc.StatusCode.UNAVAILABLE, message
    if isinstance(exc, LiveUnsupported):
        return grpc.StatusCode.FAILED_PRECONDITION, message
    return grpc.StatusCode.INTERNAL, f"internal error: {message}"


def error_reason(exc: BaseException) -> str:
    """The reason label a failed call is counted under (services.prom): overloaded,
    upload_limit, deadline, or the status code's name in lower case (invalid_argument,
    permission_denied, not_found, resource_exhausted, unavailable, aborted, internal, ...)."""
    if isinstance(exc, Overloaded):
        return "overloaded"
    if isinstance(exc, UploadLimit):
        return "upload_limit"
    code = status_for(exc)[0]
    return "deadline" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name.lower()


def log_failure(log: logging.Logger, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) for exc, logged: a fault of ours (INTERNAL) at ERROR with its traceback;
    anything the caller caused at INFO, one plain line (a bad request is not an incident)."""
    code, details = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("request failed", exc_info=exc)
    else:
        log.info("request refused: %s: %s", code.name, details)
    return code, details


class ClientErrorsAtInfo(logging.Filter):
    """For loggers we do not own (Ray Serve's replica and proxy log every exception a method
    raises with its traceback): a record whose exception is the caller's fault becomes one
    INFO line without the traceback. A record of anything else passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        code = _client_code(exc)
        if code is not None:
            record.msg, record.args = f"{record.getMessage()} {code.name}: {exc}", ()
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def _client_code(exc: BaseException | None) -> grpc.StatusCode | None:
    """The status of an exception the caller caused (also when Serve wraps it with the code
    we set), or None for anything else."""
    if exc is None:
        return None
    wrapped_code = getattr(exc, "grpc_code", None)          # ray.serve.exceptions.gRPCStatusError
    if isinstance(wrapped_code, grpc.StatusCode):
        return wrapped_code if wrapped_code != grpc.StatusCode.INTERNAL else None
    if isinstance(exc, SparrowError):
        code = status_for(exc)[0]
        return code if code != grpc.StatusCode.INTERNAL else None
    return None


def quiet_client_errors(*names: str) -> None:
    """Install ClientErrorsAtInfo on the named loggers (once each)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ClientErrorsAtInfo) for f in logger.filters):
            logger.addFilter(ClientErrorsAtInfo())
