"""Every failure a caller can cause, as a gRPC status code. Both hosts (grpc.aio and Ray
Serve's proxy) map exceptions through `status_for`, so a client sees the same code from
either."""

from __future__ import annotations

import grpc

from sparrow.errors import (ContextOverflow, InvalidRequest, ResourceExhausted, SourceNotAllowed, SourceUnavailable,
                            SparrowError)


class VideoNotFound(InvalidRequest):
    """A video the service does not hold: a video_id never uploaded, expired or found damaged
    (and deleted), or a path with no file under the media root."""


class SourceChanged(SparrowError):
    """The video file was written to while this request read it: retry (ABORTED)."""


class DeadlineExceeded(SparrowError, TimeoutError):
    """The deadline the client gave (gRPC's own, or `sparrow-timeout-ms` metadata) passed."""


class UndecodableRequest(InvalidRequest):
    """A message gRPC could not parse as its type (corrupt bytes, invalid UTF-8 in a string)."""


class NotReady(SparrowError):
    """The service is starting or draining."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) for an exception. Order matters: some errors are several things at
    once (VideoTooLarge is a bad video and a budget; SourceNotAllowed is a bad argument)."""
    message = str(exc) or type(exc).__name__
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
    return grpc.StatusCode.INTERNAL, f"internal error: {message}"
