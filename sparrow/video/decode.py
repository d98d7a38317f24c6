"""Decode a video into sampled RGB frames with PyAV, streamed and bounded.

Only the sampled frames are converted to RGB and kept; decoding stops as soon as the last
sample is resolved, and jumps over long gaps between samples by seeking when that is
cheaper than decoding the gap. Every PyAV failure leaves this module as a typed VideoError.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, BinaryIO

import av
import numpy as np

from sparrow.errors import (InvalidRequest, NoFrames, SourceUnavailable, SparrowError, VideoTimeout, VideoTooLarge,
                            VideoUnreadable, VideoUnsupported)
from sparrow.video.growing_stream import LiveSnapshot, LiveSource
from sparrow.video.options import DEFAULT_ARRAY_FPS, Frames, VideoOptions
from sparrow.video.policy import SourcePolicy, is_url
from sparrow.video.frame_sampling import TIE_S, check_kept, pad_to_multiple, pick_nearest, sample_count, sample_times
from sparrow.video.sources import Deadline, Media, open_media
from sparrow.video.stream import decoded_frames, video_stream

if TYPE_CHECKING:
    from sparrow.video.processors import VideoProcessor

Source = str | os.PathLike | bytes | bytearray | memoryview | np.ndarray | BinaryIO | LiveSource

# A stream whose declared duration runs this far past its last decodable frame is truncated
# (plus two frame intervals, since the last frame starts one interval before the end).
_TRUNCATION_SLACK_S = 0.5

# Seek cost model. A seek lands on the keyframe before the target and decodes forward from
# there: at worst one keyframe interval of frames, plus a fixed cost (flushing the decoder,
# the keyframe itself being dearer than the frames after it) worth a few frames. Decoding
# through a gap costs the gap. Containers without an index (MPEG-TS, raw streams) seek by
# bisecting bytes and land after the target as often as not, so "auto" never seeks there.
_SEEK_COST_FRAMES = 4
_INDEX_ENTRIES_READ = 20_000  # enough to measure the interval, cheap for a long file

# Frames wider than tall (or the reverse) by more than this are refused (Qwen2-VL's rule).
MAX_ASPECT_RATIO = 200


def load_frames(
    source: Source,
    options: VideoOptions | None = None,
    *,
    policy: SourcePolicy | None = None,
    processor: VideoProcessor | None = None,
    cancelled: threading.Event | None = None,
) -> Frames:
    """Sampled frames of `source`, with their timestamps.

    source: a path; a URL (http, https, rtsp; only with a `policy` allowing it); the bytes
        of a container file; a file object (read from offset 0); a LiveSource; or decoded
        frames, uint8 [T, H, W, 3] (taken as a clip at `options.fps`, or 2 fps).
    policy: allowlists for paths and URLs. None is the permissive local default: any
        local path, no URL. A service always passes one.
    processor: when given, frames its token budget would drop are not decoded at all
        (`processor.process` would drop them anyway, so the result is the same, sooner).
    cancelled: set by the caller (a request's abort): the load stops at the next packet with
        RequestAborted.

    The frame count is even (Qwen2.5-VL's temporal patch is 2 frames): the planned count is
    rounded to even up front, and if fewer distinct frames exist the last one is repeated.
    """
    options = options or VideoOptions()
    if isinstance(source, np.ndarray):
        return _frames_from_array(source, options, processor)
    deadline = Deadline(options.timeout_s, cancelled)
    with pyav_errors(options, remote=is_url(source)):
        media = open_media(source, options, policy, deadline)
        return _decode(media, options, processor, deadline)


def probe_video(source: Source, options: VideoOptions | None = None, *, policy: SourcePolicy | None = None) -> None:
    """Check that `source` is a video this module can read, at the cost of its first frame:
    the container opens (with the allowed demuxers), has a video stream within the frame
    size bound, and its first frame decodes. A typed VideoError otherwise (random bytes:
    VideoUnreadable). For what is stored before anyone asks about it (an upload)."""
    options = options or VideoOptions()
    deadline = Deadline(options.timeout_s)
    with pyav_errors(options, remote=is_url(source)):
        media = open_media(source, options, policy, deadline)
        with media.open() as container:
            stream = video_stream(container)
            sized = _prepare_decoder(stream, options)
            with contextlib.closing(_Decoder(container, stream, deadline, None)) as decoder:
                _first_frame(decoder, sized, options)


@contextlib.contextmanager
def pyav_errors(options: VideoOptions, remote: bool) -> Iterator[None]:
    """Turn anything PyAV/FFmpeg raises into a VideoError a user can act on."""
    try:
        yield
    except SparrowError:
        raise
    except MemoryError as exc:
        raise VideoTooLarge("ran out of memory decoding the video; lower its resolution or frame count") from exc
    except (av.error.ExitError, TimeoutError) as exc:  # ExitError: PyAV's timeout interrupt fired
        raise VideoTimeout(
            f"the video source did not answer within {options.open_timeout_s:g} s (open_timeout_s) or stalled "
            f"for over {options.read_timeout_s:g} s (read_timeout_s); check that it is reachable and streaming"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - PyAV raises FFmpegError, OSError, IndexError, ...
        detail = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        if remote and isinstance(exc, (OSError, LookupError, av.error.HTTPError, av.error.HTTPClientError,
                                       av.error.HTTPServerError)):
            raise SourceUnavailable(
                f"could not fetch the video ({detail}); check the URL. Redirects are not followed: give the final URL"
            ) from exc
        raise VideoUnreadable(
            f"could not read the video ({detail}); send a complete, uncorrupted video file "
            "in a common container (mp4, mov, mkv, webm, avi, mpeg-ts, ...)"
        ) from exc


# ---------------------------------------------------------------- container facts


@dataclass
class _StreamInfo:
    """What the container says about its video stream. Times are seconds from the first
    frame: some files (e.g. AVI from x264) start their pts one frame after start_time, and
    a clip starts when its first picture does. Live streams count from their first packet."""

    time_base: Fraction
    start_pts: int
    rate: float | None  # frames per second, when known
    declared_s: float | None  # length from the stream header (trusted for truncation checks)
    duration_s: float | None  # best known length: stream, else container, else a packet scan
    timestamped: bool = True  # False for raw elementary streams, whose frames carry no pts

    def seconds(self, pts: int) -> float:
        return float((pts - self.start_pts) * self.time_base)

    def pts(self, seconds: float) -> int:
        return self.start_pts + math.floor(seconds / self.time_base)

    def frame_step(self, duration: int | None = None) -> float:
        """Length of a frame or packet with this `duration` (in time_base units), if known."""
        if duration:
            return float(duration * self.time_base)
        return 1.0 / self.rate if self.rate else 0.04


def _stream_info(container: av.container.InputContainer, stream: av.VideoStream, first: av.VideoFrame,
                 live: LiveSnapshot | None) -> _StreamInfo:
    time_base = stream.time_base or Fraction(1, av.time_base)
    # FFmpeg's guess weighs container and codec rates; the average can be off for raw streams.
    rate = stream.guessed_rate or stream.average_rate
    rate = float(rate) if rate else None
    if live is not None:  # times count from the stream's first packet; it lasts until now
        return _StreamInfo(live.time_base, live.origin_pts, rate, None, live.end_s)
    declared = float(stream.duration * time_base) if stream.duration else None
    from_container = container.duration / av.time_base if container.duration else None
    return _StreamInfo(
        time_base=time_base,
        start_pts=first.pts if first.pts is not None else 0,
        rate=rate,
        declared_s=declared,
        duration_s=declared or from_container,
        timestamped=first.pts is not None,
    )


def _scan_duration(media: Media, info: _StreamInfo, options: VideoOptions, deadline: Deadline) -> float:
    """Length from packet timestamps, for containers that declare none. Demuxing without
    decoding is cheap, and max_bytes already bounds the work."""
    end = 0.0
    with media.open() as container:
        for packet in container.demux(video_stream(container)):
            deadline.check()
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
    if width <= 0 or height <= 0:
        raise VideoUnreadable(f"the video stream declares no usable frame size ({width}x{height})")
    if width * height > options.max_frame_pixels:
        raise VideoTooLarge(f"frames are {width}x{height}, over the limit of {options.max_frame_pixels} pixels")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise VideoUnsupported(f"frames are {width}x{height}: an aspect ratio over {MAX_ASPECT_RATIO}:1 "
                               "is not supported")


def _keyframe_interval_s(stream: av.VideoStream) -> float | None:
    """Mean time between keyframes from the container's index (mp4: every frame; mkv: cues,
    which may skip keyframes and so overstate it); None without an index."""
    keys = [e.timestamp for e in itertools.islice(stream.index_entries, _INDEX_ENTRIES_READ) if e.is_keyframe]
    if len(keys) < 2 or keys[-1] <= keys[0]:
        return None
    return float((keys[-1] - keys[0]) * stream.time_base) / (len(keys) - 1)


def _jump_s(stream: av.VideoStream, info: _StreamInfo, options: VideoOptions) -> float | None:
    """Gap between samples beyond which seeking beats decoding through (None: never seek)."""
    if options.seek == "never" or not info.timestamped or not info.rate:
        return None
    if options.seek == "always":
        return 0.0
    interval = _keyframe_interval_s(stream)
    return None if interval is None else interval + _SEEK_COST_FRAMES / info.rate


# ---------------------------------------------------------------- decoding


def _decode(media: Media, options: VideoOptions, processor: VideoProcessor | None, deadline: Deadline) -> Frames:
    with media.open() as container:
        stream = video_stream(container)
        sized = _prepare_decoder(stream, options)
        decoder = _Decoder(container, stream, deadline, options.max_bytes if media.streamed else None)
        with contextlib.closing(decoder):
            first = _first_frame(decoder, sized, options)
            info = _stream_info(container, stream, first, media.live)
            start, end = _time_range(media, info, options, deadline)
            available = round((end - start) * info.rate) if info.rate else None
            count = _frame_count(end - start, available, first.height, first.width, options, processor)
            targets = sample_times(start, end, count)
            decoder.push_back(first)
            timed = _timed_frames(decoder, info, start, end, targets, _jump_s(stream, info, options), options)
            picks = pick_nearest(timed, targets, keep=_RgbConverter(options))
    return _assemble(picks, start, end, options)


def _prepare_decoder(stream: av.VideoStream, options: VideoOptions) -> bool:
    """Refuse an oversized stream from its header, before a frame is decoded, and have the
    decoder refuse frames over the bound should the size change midway. Returns whether
    the header gave a size: probing with that bound leaves oversized streams without one."""
    width, height = stream.codec_context.width, stream.codec_context.height
    if width and height:
        _check_frame_size(width, height, options)
    stream.codec_context.options = {"max_pixels": str(min(options.max_frame_pixels, 2**31 - 1))}
    stream.thread_type = "AUTO"  # frame + slice threads: decoding dominates the cost
    return bool(width and height)


def _first_frame(decoder: _Decoder, sized: bool, options: VideoOptions) -> av.VideoFrame:
    try:
        first = decoder.next()
    except av.error.FFmpegError as exc:
        if sized:
            raise
        raise VideoUnreadable(
            "could not decode the video stream: its frame size is unknown or over the limit of "
            f"{options.max_frame_pixels} pixels (max_frame_pixels)"
        ) from exc
    if first is None:
        raise NoFrames("the video stream holds no decodable frame")
    _check_frame_size(first.width, first.height, options)
    return first


def _time_range(media: Media, info: _StreamInfo, options: VideoOptions, deadline: Deadline) -> tuple[float, float]:
    """[start, end) to sample, in seconds; checks the duration bound."""
    if media.live is not None:  # the snapshot already clipped the range to what is retained
        _check_duration(media.live.end_s - media.live.start_s, options)
        return media.live.start_s, media.live.end_s
    if info.duration_s is None:
        if media.reopenable:
            info.duration_s = _scan_duration(media, info, options, deadline)
        elif options.end_s is not None:
            info.duration_s = options.end_s  # a stream of unknown length: trust the caller's end
        else:
            raise VideoUnsupported(f"{media.description} declares no duration; set end_s to say how much to read")
    _check_duration(info.duration_s, options)
    start, end = options.start_s, min(options.end_s or math.inf, info.duration_s)
    if options.last_s is not None:
        start = max(start, end - options.last_s)
    if start >= end:
        raise NoFrames(f"start_s={start} is at or past the end of the video ({info.duration_s:.3f} s)")
    return start, end


def _frame_count(duration_s: float, available: int | None, height: int, width: int, options: VideoOptions,
                 processor: VideoProcessor | None) -> int:
    """Frames to keep: the sampling rule, then the processor's token budget, then the bounds."""
    count = sample_count(duration_s, available, options)
    if processor is not None:
        count = processor.plan(count, height, width, options).num_frames
    check_kept(count, height, width, options)
    return count


class _Decoder:
    """Frames of one video stream, decoded packet by packet under the deadline and byte
    budget, with a seek that restarts decoding at a keyframe."""

    def __init__(self, container: av.container.InputContainer, stream: av.VideoStream, deadline: Deadline,
                 max_bytes: int | None):
        self.container, self.stream, self.deadline, self.max_bytes = container, stream, deadline, max_bytes
        self.bytes_read = 0
        self.frames_decoded = 0
        self._frames = self._decode()
        self._back: list[av.VideoFrame] = []

    def _decode(self) -> Iterator[av.VideoFrame]:
        # The frames' times are _timed_frames' (_StreamInfo: untimed streams, a live origin).
        for _, frame in decoded_frames(self.container, self.stream, on_packet=self._read):
            self.frames_decoded += 1
            yield frame

    def _read(self, size: int) -> None:
        self.deadline.check()
        self.bytes_read += size
        if self.max_bytes is not None and self.bytes_read > self.max_bytes:
            raise VideoTooLarge(f"the video stream sent over {self.max_bytes} bytes (max_bytes)")

    def next(self) -> av.VideoFrame | None:
        if self._back:
            return self._back.pop()
        return next(self._frames, None)

    def push_back(self, frame: av.VideoFrame) -> None:
        self._back.append(frame)

    def close(self) -> None:
        """End the frame generator: it refers back to this decoder, and that cycle would keep
        the codec context (and its decoding threads) alive until a cyclic garbage collection."""
        self._frames.close()
        self._back.clear()

    def seek(self, pts: int) -> bool:
        """Restart at the keyframe at or before `pts`; False (and decoding goes on where it
        was) if the container cannot seek."""
        try:
            self.container.seek(pts, stream=self.stream, backward=True)
        except av.error.FFmpegError:
            return False
        self._frames.close()  # its packets belong to the old position
        self._frames, self._back = self._decode(), []
        return True


def _timed_frames(decoder: _Decoder, info: _StreamInfo, start: float, end: float, targets: np.ndarray,
                  jump_s: float | None, options: VideoOptions) -> Iterator[tuple[float, av.VideoFrame]]:
    """(seconds, frame) for the frames in [start, end), in strictly increasing time.

    When the next target lies over `jump_s` past where decoding stands, seek to one frame
    before it (so both neighbours of the target are seen) instead of decoding the gap.
    Seeks land on a keyframe at or before the seek point; one that lands after it (an
    imprecise container) could hide the nearest frame, so decoding restarts from the top
    and goes straight through.
    """
    last, clock, position = -math.inf, 0.0, 0.0
    landing: float | None = None  # seek point, until the first frame after the seek arrives
    j, sought = 0, -1  # first target not yet passed; the last target sought to (once each)
    while True:
        while j < len(targets) and targets[j] <= last:
            j += 1
        if jump_s is not None and sought < j < len(targets) and targets[j] - max(position, last) > jump_s:
            point = max(targets[j] - info.frame_step(), 0.0)
            sought = j
            if decoder.seek(info.pts(point)):
                position, landing = point, point
            else:
                jump_s = None  # unseekable: decode through
        frame = decoder.next()
        if frame is None:
            break
        if info.timestamped and frame.pts is not None:
            t = info.seconds(frame.pts)
        else:  # raw elementary streams carry no pts: add up frame lengths instead
            t, clock = clock, clock + info.frame_step(frame.duration)
        if landing is not None:
            if t > landing + TIE_S:
                if not decoder.seek(info.start_pts):
                    raise VideoUnreadable("seeking in the video failed; retry with seek='never'")
                jump_s = None
                continue
            landing = None
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


def _assemble(picks: list[tuple[float, np.ndarray]], start: float, end: float, options: VideoOptions) -> Frames:
    if not picks:
        raise NoFrames(f"no frame could be decoded between {start:.3f} s and {end:.3f} s")
    frames = np.stack([image for _, image in picks])  # uint8 [T, H, W, 3]
    times = np.array([t for t, _ in picks], dtype=np.float64)  # [T]
    sample_fps = len(picks) / (end - start)
    frames, times = pad_to_multiple(frames, times)
    return Frames(frames=frames, timestamps=times, sample_fps=sample_fps, options=options)


# ---------------------------------------------------------------- arrays


def _frames_from_array(array: np.ndarray, options: VideoOptions, processor: VideoProcessor | None) -> Frames:
    """Sample an already-decoded clip; frame i is taken to be shown at i / fps seconds."""
    if array.ndim == 4 and array.shape[0] == 0:
        raise NoFrames("the frame array holds zero frames")
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3 or 0 in array.shape:
        raise InvalidRequest(f"a frame array must be uint8 [T, H, W, 3], got {array.dtype} {list(array.shape)}")
    _check_frame_size(array.shape[2], array.shape[1], options)
    rate = float(options.fps or DEFAULT_ARRAY_FPS)
    count = array.shape[0]
    start, end = options.start_s, min(options.end_s or math.inf, count / rate)
    if options.last_s is not None:
        start = max(start, end - options.last_s)
    if start >= end:
        raise NoFrames(f"start_s={start} is at or past the end of the clip ({count / rate:.3f} s)")
    # Indices of the frames whose times fall in [start, end).
    first, stop = math.ceil(start * rate - 1e-9), min(count, math.ceil(end * rate - 1e-9))
    n = _frame_count(end - start, stop - first, array.shape[1], array.shape[2], options, processor)
    targets = sample_times(start, end, n)
    timed = ((i / rate, i) for i in range(first, stop))
    picks = pick_nearest(timed, targets, keep=lambda i: array[i])
    return _assemble(picks, start, end, options)
