"""Every kind of source, checked against the allowlists and made into a Media: something
PyAV can open (again, where the decoder needs a second pass), with what is known up front.

Local files are opened by Python, never by FFmpeg, so a path cannot smuggle in an FFmpeg
protocol ("concat:", "subfile:", ...). URLs are fetched by FFmpeg with only the protocols
their scheme needs, no redirects, and connect/read timeouts.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO

import av

from sparrow.errors import InvalidRequest, RequestAborted, SourceNotAllowed, VideoTimeout, VideoTooLarge, VideoUnreadable
from sparrow.video.growing_stream import LiveSnapshot, LiveSource
from sparrow.video.options import MiB, VideoOptions
from sparrow.video.policy import SourcePolicy, is_url, shown as _shown

# Demuxers we let FFmpeg pick from. Playlist/concat demuxers (hls, concat, ...) are left out
# on purpose: they open further files or URLs named inside an uploaded file.
ALLOWED_DEMUXERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv,ogg,mpeg,m4v,h264,hevc,asf,gif"

# The protocols each URL scheme needs, nested ones included (https = http over tls over tcp).
_PROTOCOLS = {"http": "http,tcp", "https": "https,tls,tcp", "rtsp": "rtsp,rtp,tcp,udp"}

# Non-seekable file objects are copied here first: in memory up to this size, then on disk.
_SPOOL_IN_MEMORY = 64 * MiB
_READ_CHUNK = 1 * MiB


class Deadline:
    """Wall-clock budget of one load, and its caller's cancellation (`cancelled`, e.g. the
    request's abort event): checked between packets and reads."""

    def __init__(self, seconds: float, cancelled: threading.Event | None = None):
        self.seconds, self.end, self.cancelled = seconds, time.monotonic() + seconds, cancelled

    def check(self) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise RequestAborted("the request ended while its video was being read")
        if time.monotonic() > self.end:
            raise VideoTimeout(f"reading the video took over {self.seconds:g} s (timeout_s); "
                               "send a shorter video or sample fewer frames")


@dataclass(frozen=True)
class Media:
    description: str  # names the source in error messages
    open: Callable[[], AbstractContextManager[av.container.InputContainer]]
    reopenable: bool  # a second open is cheap (a packet scan for a missing duration)
    streamed: bool  # size unknown up front: demuxed bytes are counted against max_bytes
    live: LiveSnapshot | None = None


def open_media(source: object, options: VideoOptions, policy: SourcePolicy | None, deadline: Deadline) -> Media:
    """Check `source` against `policy` (None: any local path, no URL) and wrap it."""
    if isinstance(source, LiveSource):
        snapshot = source.snapshot(options)
        return Media("live stream", lambda: _container(io.BytesIO(snapshot.data), options, format="mpegts"),
                     reopenable=False, streamed=False, live=snapshot)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _bytes_media(source, options)
    if is_url(source):
        if policy is None:
            raise SourceNotAllowed("URLs are read only with a SourcePolicy that allows their scheme and host")
        return _url_media(policy.resolve_url(source), options, policy)
    if isinstance(source, (str, os.PathLike)):
        return _path_media(policy.resolve_path(source) if policy else source, options, policy)
    if callable(getattr(source, "read", None)):
        return _file_media(source, options, deadline)
    raise InvalidRequest("video source must be a path, URL, bytes, a file object, a LiveSource or a "
                         f"uint8 array, got {type(source).__name__}")


@contextlib.contextmanager
def _container(file: object, options: VideoOptions, format: str | None = None,
               extra: dict[str, str] | None = None) -> Iterator[av.container.InputContainer]:
    av_options = {
        "format_whitelist": ALLOWED_DEMUXERS,
        # Codec option too: a decoder refuses frames over the bound before allocating them.
        "max_pixels": str(min(options.max_frame_pixels, 2**31 - 1)),
        **(extra or {}),
    }
    timeout = (options.open_timeout_s, options.read_timeout_s)
    started = time.monotonic()
    try:
        container = av.open(file, format=format, options=av_options, timeout=timeout)
    except av.error.FFmpegError as exc:
        # Interrupted protocols do not all say so: RTSP reports the interrupt as invalid data.
        if time.monotonic() - started >= options.open_timeout_s:
            raise VideoTimeout(f"the video source did not answer within {options.open_timeout_s:g} s "
                               "(open_timeout_s); check that it is reachable and streaming") from exc
        raise
    with container:
        yield container


def _check_size(size: int, what: str, options: VideoOptions) -> None:
    if size == 0:
        raise VideoUnreadable(f"{what} is empty (0 bytes)")
    if size > options.max_bytes:
        raise VideoTooLarge(f"video is {size} bytes, over the limit of {options.max_bytes}")


# ---------------------------------------------------------------- bytes, files, file objects


def _bytes_media(data: bytes | bytearray | memoryview, options: VideoOptions) -> Media:
    _check_size(memoryview(data).nbytes, "the video", options)
    data = bytes(data)  # one immutable copy; BytesIO then shares it instead of copying again
    return Media("video", lambda: _container(io.BytesIO(data), options), reopenable=True, streamed=False)


def _path_media(path: str | os.PathLike, options: VideoOptions, policy: SourcePolicy | None) -> Media:
    name = os.fspath(path)

    @contextlib.contextmanager
    def open_container() -> Iterator[av.container.InputContainer]:
        with open_regular_file(name, policy) as file, _container(file, options) as container:
            yield container

    with open_regular_file(name, policy) as file:  # fail early, with the file's own error
        _check_size(os.fstat(file.fileno()).st_size, f"video file {_shown(name)}", options)
    return Media(f"video file {_shown(name)}", open_container, reopenable=True, streamed=False)


def open_regular_file(path: str | os.PathLike, policy: SourcePolicy | None, shown: str | None = None) -> BinaryIO:
    """Open a regular file for reading. O_NONBLOCK: a FIFO must not block the open (it is
    then refused as not a regular file). With a policy, the final component may not be a
    symlink, and the file actually opened must lie in the media root (a path component
    swapped for a symlink after `resolve` is caught here). `shown`: how errors name the file
    (default the path; a server names only the file, not its own directories). A failed
    open is VideoUnreadable caused by the OSError (FileNotFoundError for a missing file).
    A file whose real path cannot be read back (moved or removed meanwhile) is refused as
    outside the root: never an unexpected error."""
    shown = _shown(os.fspath(path) if shown is None else shown)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (getattr(os, "O_NOFOLLOW", 0) if policy else 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise VideoUnreadable(f"cannot read video file {shown}: {exc.strerror}") from exc
    try:
        opened = f"/proc/self/fd/{fd}"
        if policy is not None and os.path.exists(opened) and not policy.contains(opened):
            raise SourceNotAllowed(f"{shown} is outside the allowed media directory")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise VideoUnreadable(f"{shown} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _file_media(file: BinaryIO, options: VideoOptions, deadline: Deadline) -> Media:
    """A file object: read in place when seekable, else copied to a spool file first (the
    demuxer seeks, and a second pass may be needed). Either way each container gets its own
    view with its own position, so two passes never move each other."""
    if not _seekable(file):
        file = _spool(file, options, deadline)
    size = file.seek(0, io.SEEK_END)
    _check_size(size, "the video file object", options)
    return Media("video file object", lambda: _container(_FileView(file, size), options),
                 reopenable=True, streamed=False)


def _seekable(file: BinaryIO) -> bool:
    try:
        return bool(file.seekable()) and callable(getattr(file, "seek", None))
    except (AttributeError, OSError, ValueError):
        return False


def _spool(file: BinaryIO, options: VideoOptions, deadline: Deadline) -> BinaryIO:
    spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY)
    total = 0
    while chunk := file.read(_READ_CHUNK):
        total += len(chunk)
        if total > options.max_bytes:
            raise VideoTooLarge(f"the video file object holds over {options.max_bytes} bytes (max_bytes)")
        spool.write(chunk)
        deadline.check()
    return spool


class _FileView(io.RawIOBase):
    """Read-only view of a shared seekable file with a position of its own."""

    def __init__(self, file: BinaryIO, size: int):
        self._file, self._size, self._pos = file, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:
        self._file.seek(self._pos)
        data = self._file.read(min(len(buffer), max(0, self._size - self._pos)))
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


# ---------------------------------------------------------------- URLs


def _url_media(url: str, options: VideoOptions, policy: SourcePolicy) -> Media:
    scheme = url.split(":", 1)[0]
    extra = {
        "protocol_whitelist": _PROTOCOLS[scheme],
        # A redirect could lead anywhere; FFmpeg cannot check it against the policy. The http
        # protocol's option: an FFmpeg without it would drop it silently (unknown options are),
        # so tests/test_edges.py serves a 302 to another port and checks that port gets nothing.
        # The RTSP demuxer follows a 3xx regardless (SourcePolicy's docstring).
        "max_redirects": "0",
        # Per-read socket timeout (µs): also bounds reads PyAV's interrupt does not cover (seeks).
        "rw_timeout": str(int(options.read_timeout_s * 1e6)),
        "tls_verify": "1",  # FFmpeg accepts any certificate unless told otherwise
    }
    if policy.tls_ca_file is not None:
        extra["ca_file"] = os.fspath(policy.tls_ca_file)
    if scheme == "rtsp":
        extra["rtsp_transport"] = "tcp"  # one connection; no UDP ports to open
        extra["format_whitelist"] = ALLOWED_DEMUXERS + ",rtsp"
    # Opened once: a second open would fetch the stream again.
    return Media(f"URL {url}", lambda: _container(url, options, extra=extra), reopenable=False, streamed=True)
