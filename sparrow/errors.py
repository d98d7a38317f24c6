"""Typed errors. Every failure a caller can cause has a class here, so transports can map
them to status codes (gRPC: see sparrow.services) without parsing messages."""


class SparrowError(Exception):
    """Base of every error the library raises on purpose."""


class InvalidRequest(SparrowError, ValueError):
    """The request itself is malformed: empty prompt, bad sampling parameters, ..."""


class ContextOverflow(InvalidRequest):
    """Prompt + video + max_new_tokens do not fit the model's context. Never truncated silently."""


class ResourceExhausted(SparrowError):
    """A size or token budget was exceeded (bytes, frames, visual tokens)."""


class VideoError(InvalidRequest):
    """The video could not be turned into frames. Subclasses say why."""


class VideoUnreadable(VideoError):
    """Not a video container PyAV can open, or the file is truncated/corrupt."""


class NoVideoStream(VideoError):
    """The container has no video stream (e.g. audio only)."""


class NoFrames(VideoError):
    """The container or the selected time range holds zero decodable frames."""


class VideoTooLarge(VideoError, ResourceExhausted):
    """Over a configured bound: bytes, duration, frame size or decoded frames."""


class VideoTimeout(VideoError, TimeoutError):
    """The source did not answer, stalled, or decoding ran past the configured timeouts."""


class SourceUnavailable(VideoError):
    """A URL could not be fetched: connection refused, HTTP error, redirect (never followed)."""


class VideoUnsupported(VideoError):
    """A readable video this service will not process, e.g. an aspect ratio over 200:1."""


class SourceNotAllowed(InvalidRequest, PermissionError):
    """A path or URL outside the configured allowlists."""


class RequestAborted(SparrowError):
    """The request was aborted by the caller while generating."""
