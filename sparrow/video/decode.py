"""Decode a video into sampled RGB frames with PyAV, streamed and bounded.

Only the sampled frames are converted to RGB and kept; decoding stops as soon as the last
sample is resolved. Every PyAV failure leaves this module as a typed VideoError.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import BinaryIO

import av
import numpy as np

from sparrow.errors import InvalidRequest, NoFrames, NoVideoStream, SparrowError, VideoTooLarge, VideoUnreadable
from sparrow.video.options import DEFAULT_ARRAY_FPS, Frames, VideoOptions
from sparrow.video.sampling import pad_to_multiple, pick_nearest, sample_count, sample_times

Source = str | os.PathLike | bytes | bytearray | memoryview | np.ndarray

# Demuxers we let FFmpeg pick from. Playlist/concat demuxers (hls, concat, ...) are left out
# on purpose: they open further files or URLs named inside an uploaded file.
ALLOWED_DEMUXERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv,ogg,mpeg,m4v,h264,hevc,asf,gif"

# A stream whose declared duration runs this far past its last decodable frame is truncated
# (plus two frame intervals, since the last frame starts one interval before the end).
_TRUNCATION_SLACK_S = 0.5


def load_frames(source: Source, options: VideoOptions | None = None) -> Frames:
    """Sampled frames of `source`: a file path, the bytes of a container file, or an
    already-decoded uint8 array [T, H, W, 3] (taken as a clip at `options.fps`, or 2 fps).

    The frame count is even (Qwen2.5-VL's temporal patch is 2 frames): the planned count is
    rounded to even up front, and if fewer distinct frames exist the last one is repeated.
    """
    options = options or VideoOptions()
    if isinstance(source, np.ndarray):
        return _frames_from_array(source, options)
    if isinstance(source, (bytes, bytearray, memoryview)):
        opener = _bytes_opener(source, options)
    elif isinstance(source, (str, os.PathLike)):
        opener = _path_opener(source, options)
    else:
        raise InvalidRequest(f"video source must be a path, bytes or a uint8 array, got {type(source).__name__}")
    with _pyav_errors():
        return _decode(opener, options)


# ---------------------------------------------------------------- sources

Opener = Callable[[], BinaryIO]


def _bytes_opener(data: bytes | bytearray | memoryview, options: VideoOptions) -> Opener:
    size = memoryview(data).nbytes
    if size == 0:
        raise VideoUnreadable("the video is empty (0 bytes)")
    _check_bytes(size, options)
    data = bytes(data)  # one immutable copy; BytesIO then shares it instead of copying again
    return lambda: io.BytesIO(data)


def _path_opener(path: str | os.PathLike, options: VideoOptions) -> Opener:
    # Python opens the file and PyAV reads it through that handle, so FFmpeg never parses the
    # path as a URL ("http:", "concat:" ...). Allowlisting paths is the caller's job.
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise VideoUnreadable(f"cannot read video file {os.fspath(path)!r}: {exc.strerror}") from exc
    if not os.path.isfile(path):
        raise VideoUnreadable(f"{os.fspath(path)!r} is not a regular file")
    if size == 0:
        raise VideoUnreadable(f"video file {os.fspath(path)!r} is empty")
    _check_bytes(size, options)
    return lambda: open(path, "rb")


def _check_bytes(size: int, options: VideoOptions) -> None:
    if size > options.max_bytes:
        raise VideoTooLarge(f"video is {size} bytes, over the limit of {options.max_bytes}")


@contextlib.contextmanager
def _pyav_errors() -> Iterator[None]:
    """Turn anything PyAV/FFmpeg raises into a VideoError a user can act on."""
    try:
        yield
    except SparrowError:
        raise
    except MemoryError as exc:
        raise VideoTooLarge("ran out of memory decoding the video; lower its resolution or frame count") from exc
    except Exception as exc:  # noqa: BLE001 - PyAV raises FFmpegError, OSError, IndexError, ...
        detail = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise VideoUnreadable(
            f"could not read the video ({detail}); send a complete, uncorrupted video file "
            "in a common container (mp4, mov, mkv, webm, avi, mpeg-ts, ...)"
        ) from exc


# ---------------------------------------------------------------- container facts


@dataclass
class _StreamInfo:
    """What the container says about its video stream. Times are seconds from the first
    frame: some files (e.g. AVI from x264) start their pts one frame after start_time, and
    a clip starts when its first picture does."""

    time_base: Fraction
    start_pts: int
    rate: float | None  # frames per second, when known
    declared_s: float | None  # length from the stream header (trusted for truncation checks)
    duration_s: float | None  # best known length: stream, else container, else a packet scan
    timestamped: bool = True  # False for raw elementary streams, whose frames carry no pts

    def seconds(self, pts: int) -> float:
        return float((pts - self.start_pts) * self.time_base)

    def frame_step(self, duration: int | None) -> float:
        """Length of a frame or packet with this `duration` (in time_base units), if known."""
        if duration:
            return float(duration * self.time_base)
        return 1.0 / self.rate if self.rate else 0.04


def _video_stream(container: av.container.InputContainer) -> av.VideoStream:
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise NoVideoStream(f"the file has no video stream (streams: {', '.join(kinds)})")
    return container.streams.video[0]


def _stream_info(container: av.container.InputContainer, stream: av.VideoStream, first: av.VideoFrame) -> _StreamInfo:
    time_base = stream.time_base or Fraction(1, av.time_base)
    # FFmpeg's guess weighs container and codec rates; the average can be off for raw streams.
    rate = stream.guessed_rate or stream.average_rate
    declared = float(stream.duration * time_base) if stream.duration else None
    from_container = container.duration / av.time_base if container.duration else None
    return _StreamInfo(
        time_base=time_base,
        start_pts=first.pts if first.pts is not None else 0,
        rate=float(rate) if rate else None,
        declared_s=declared,
        duration_s=declared or from_container,
        timestamped=first.pts is not None,
    )


def _scan_duration(opener: Opener, info: _StreamInfo, options: VideoOptions) -> float:
    """Length from packet timestamps, for containers that declare none. Demuxing without
    decoding is cheap, and max_bytes already bounds the work."""
    end = 0.0
    with opener() as file, av.open(file, options={"format_whitelist": ALLOWED_DEMUXERS}) as container:
        for packet in container.demux(_video_stream(container)):
            if packet.size == 0:
                continue  # the demuxer's end-of-stream marker
            if packet.pts is not None and info.timestamped:
                end = max(end, info.seconds(packet.pts) + info.frame_step(packet.duration))
            else:
                end += info.frame_step(packet.duration)  # untimed stream: add up frame lengths
            _check_duration(end, options)
    return end


def _check_duration(seconds: float, options: VideoOptions) -> None:
    if seconds > options.max_duration_s:
        raise VideoTooLarge(f"video lasts over {seconds:.1f} s, over the limit of {options.max_duration_s:.0f} s")


def _check_frame_size(width: int, height: int, options: VideoOptions) -> None:
    if width * height > options.max_frame_pixels:
        raise VideoTooLarge(f"frames are {width}x{height}, over the limit of {options.max_frame_pixels} pixels")


# ---------------------------------------------------------------- decoding


def _decode(opener: Opener, options: VideoOptions) -> Frames:
    with opener() as file, av.open(file, options={"format_whitelist": ALLOWED_DEMUXERS}) as container:
        stream = _video_stream(container)
        _check_frame_size(stream.codec_context.width, stream.codec_context.height, options)
        stream.thread_type = "AUTO"  # frame + slice threads: decoding dominates the cost
        decoded = container.decode(stream)
        first = next(decoded, None)  # its pts is time zero
        if first is None:
            raise NoFrames("the video stream holds no decodable frame")
        info = _stream_info(container, stream, first)
        if info.duration_s is None:
            info.duration_s = _scan_duration(opener, info, options)
        _check_duration(info.duration_s, options)

        start, end = options.start_s, min(options.end_s or math.inf, info.duration_s)
        if start >= end:
            raise NoFrames(f"start_s={start} is at or past the end of the video ({info.duration_s:.3f} s)")
        available = round((end - start) * info.rate) if info.rate else None
        targets = sample_times(start, end, sample_count(end - start, available, options))

        if start > 0 and info.timestamped and _seek(container, stream, info, start):
            decoded = container.decode(stream)
        else:
            decoded = itertools.chain([first], decoded)
        timed = _timed_frames(decoded, info, start, end, options)
        picks = pick_nearest(timed, targets, keep=_RgbConverter(options))
    return _assemble(picks, start, end)


def _seek(container: av.container.InputContainer, stream: av.VideoStream, info: _StreamInfo, start: float) -> bool:
    """Jump to the keyframe at or before `start` so a late range does not decode its prefix."""
    try:
        container.seek(info.start_pts + int(start / info.time_base), stream=stream, backward=True)
    except av.error.FFmpegError:
        return False  # unseekable input: decode from the top, skipping frames before start
    return True


def _timed_frames(
    frames: Iterator[av.VideoFrame], info: _StreamInfo, start: float, end: float, options: VideoOptions
) -> Iterator[tuple[float, av.VideoFrame]]:
    """(seconds, frame) for the frames in [start, end), in strictly increasing time."""
    last, clock = -math.inf, 0.0
    for frame in frames:
        if info.timestamped and frame.pts is not None:
            t = info.seconds(frame.pts)
        else:  # raw elementary streams carry no pts: add up frame lengths instead
            t, clock = clock, clock + info.frame_step(frame.duration)
        _check_duration(t, options)
        if t <= last or t < start:
            continue  # before the range, or a broken timestamp going backwards
        if t >= end:
            return
        last = t
        yield t, frame
    _check_not_truncated(last, end, info)


def _check_not_truncated(last: float, end: float, info: _StreamInfo) -> None:
    """The stream ran out of frames: if its header promised frames well past the last one
    decoded, the file was cut short. Answering about half a video would be wrong, so refuse."""
    if info.declared_s is None or last == -math.inf:
        return
    slack = _TRUNCATION_SLACK_S + (2.0 / info.rate if info.rate else 0.0)
    if last < min(end, info.declared_s) - slack:
        raise VideoUnreadable(
            f"the video stops at {last:.2f} s but declares {info.declared_s:.2f} s: the file is truncated"
        )


class _RgbConverter:
    """Converts a chosen frame to uint8 RGB [H, W, 3]. Frames keep the size of the first one
    kept, so a stream that changes resolution midway still stacks into one array."""

    def __init__(self, options: VideoOptions):
        self.options = options
        self.size: tuple[int, int] | None = None  # (width, height)

    def __call__(self, frame: av.VideoFrame) -> np.ndarray:
        _check_frame_size(frame.width, frame.height, self.options)
        if self.size is None:
            self.size = (frame.width, frame.height)
        width, height = self.size
        return frame.to_ndarray(format="rgb24", width=width, height=height)


def _assemble(picks: list[tuple[float, np.ndarray]], start: float, end: float) -> Frames:
    if not picks:
        raise NoFrames(f"no frame could be decoded between {start:.3f} s and {end:.3f} s")
    frames = np.stack([image for _, image in picks])  # uint8 [T, H, W, 3]
    times = np.array([t for t, _ in picks], dtype=np.float64)  # [T]
    sample_fps = len(picks) / (end - start)
    frames, times = pad_to_multiple(frames, times)
    return Frames(frames=frames, timestamps=times, sample_fps=sample_fps)


# ---------------------------------------------------------------- arrays


def _frames_from_array(array: np.ndarray, options: VideoOptions) -> Frames:
    """Sample an already-decoded clip; frame i is taken to be shown at i / fps seconds."""
    if array.ndim == 4 and array.shape[0] == 0:
        raise NoFrames("the frame array holds zero frames")
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3 or 0 in array.shape:
        raise InvalidRequest(f"a frame array must be uint8 [T, H, W, 3], got {array.dtype} {list(array.shape)}")
    _check_frame_size(array.shape[2], array.shape[1], options)
    rate = float(options.fps or DEFAULT_ARRAY_FPS)
    count = array.shape[0]
    start, end = options.start_s, min(options.end_s or math.inf, count / rate)
    if start >= end:
        raise NoFrames(f"start_s={start} is at or past the end of the clip ({count / rate:.3f} s)")
    # Indices of the frames whose times fall in [start, end).
    first, stop = math.ceil(start * rate - 1e-9), min(count, math.ceil(end * rate - 1e-9))
    targets = sample_times(start, end, sample_count(end - start, stop - first, options))
    timed = ((i / rate, i) for i in range(first, stop))
    picks = pick_nearest(timed, targets, keep=lambda i: array[i])
    return _assemble(picks, start, end)
