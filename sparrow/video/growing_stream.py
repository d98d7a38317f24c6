"""A container byte stream that grows while it plays, fed in chunks split anywhere: the one
home of ingesting one. It is read in one of two ways, by what the reader needs of the past:

    LiveSource   MPEG-TS, sampled later over any range it retains (a growing upload, a
                 `Source` of load_frames / prepare_video): each append demuxes the new bytes
                 to index its video packets (no decoding, on the caller's thread); the bytes
                 are kept for `retention_s` and decoded only when a range is sampled.
    LiveDecoder  any container PyAV reads as a stream (MPEG-TS, fragmented MP4), every frame
                 decoded once as the bytes arrive (a live session's media,
                 sparrow/live/media_feed.py): a thread decodes through a blocking pipe and
                 hands the frames on; nothing is retained.

One cannot stand in for the other: a LiveSource decodes nothing until asked and must answer
for past ranges (so it keeps bytes and an index, and owns no thread a caller could leak by
never closing it); a LiveDecoder must decode every frame once, in order, from containers a
re-scan of the new bytes cannot read (fragmented MP4), so it holds one demuxer open on a pipe.

LiveSource. A packet counts once the next one has started (or the stream is closed), so "now"
is the end of the newest complete frame. Memory stays bounded: bytes older than `retention_s`
before now are dropped, cut at a keyframe so what remains still decodes, and at most
`max_bytes` are kept. Sampling (`load_frames(live, options)`) copies the retained bytes from
the keyframe before the requested range, prefixed with the stream's first tables (PAT/PMT),
and decodes that snapshot like a file. Times are seconds since the stream's first video packet.

LiveDecoder. Frames go to a callback with their source PTS (seconds, as the container stamps
them), a batch at a time, decoded by the one frame loop (video/stream.py). The live session
checks MPEG-TS framing before feeding it (video/ts_framing.py) and maps the PTS to its stream
time (sparrow/live/source_health.py).
"""

from __future__ import annotations

import io
import math
import queue
import threading
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable

import av
import numpy as np

from sparrow.errors import InvalidRequest, NoFrames, NoVideoStream, VideoTooLarge, VideoUnreadable
from sparrow.video.options import MiB, VideoOptions
from sparrow.video.stream import decoded_frames, video_stream

# ----- LiveSource: an MPEG-TS stream indexed as it grows, sampled on demand -------------------------
# Demux options for indexing: streams come from the PMT, so no probing (and no decoding) is needed.
_SCAN_OPTIONS = {"probesize": "32", "analyzeduration": "0", "fpsprobesize": "0"}


@dataclass(frozen=True)
class _Packet:
    pos: int  # offset in LiveSource._data of the TS packet where this video packet starts
    t: float  # presentation time, seconds since the stream's first video packet
    end: float  # t + its duration
    key: bool


@dataclass(frozen=True)
class LiveSnapshot:
    """What one sampling call decodes: a self-contained MPEG-TS byte string and its range."""

    data: bytes  # stream tables + retained bytes from a keyframe at or before start_s
    origin_pts: int  # pts (in time_base) of stream time zero
    time_base: Fraction
    start_s: float  # [start_s, end_s): the range to sample, in stream seconds
    end_s: float


class LiveSource:
    """A live MPEG-TS stream fed by `append(chunk)` from any thread; `close()` ends it.

    Pass it to `load_frames` / `prepare_video` like any source: options' start_s/end_s are
    stream times, and `last_s=N` samples the last N seconds up to now. Frames older than
    the retention window are gone (start_s before `first_s` is clamped to it).
    """

    def __init__(self, retention_s: float = 60.0, max_bytes: int = 256 * MiB, probe_bytes: int = 4 * MiB):
        if not (math.isfinite(retention_s) and retention_s > 0) or max_bytes < 1 or probe_bytes < 1:
            raise InvalidRequest("retention_s, max_bytes and probe_bytes must be > 0")
        self.retention_s, self.max_bytes, self.probe_bytes = float(retention_s), int(max_bytes), int(probe_bytes)
        self._lock = threading.Lock()
        self._header = b""  # bytes before the first video packet (PAT/PMT), prefixed to every snapshot
        self._data = bytearray()  # retained stream bytes, from a keyframe on
        self._packets: list[_Packet] = []  # complete video packets in _data, in stream order
        self._pending = 0  # offset in _data of the first byte not yet indexed
        self._origin: int | None = None  # pts of the first video packet
        self._time_base: Fraction | None = None
        self._started = False  # the header has been split off
        self._closed = False

    # ----- feeding

    def append(self, chunk: bytes | bytearray | memoryview) -> None:
        """Add the next bytes of the stream. Raises VideoUnreadable if the stream shows no
        MPEG-TS video after `probe_bytes`, VideoTooLarge if max_bytes holds no keyframe."""
        with self._lock:
            if self._closed:
                raise InvalidRequest("the live stream is closed")
            self._data += chunk
            self._index()
            self._trim()

    def close(self) -> None:
        """End of stream: the newest packet counts as complete."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._index()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def now_s(self) -> float:
        """Stream time up to which frames are complete (0.0 before the first one)."""
        with self._lock:
            return self._packets[-1].end if self._packets else 0.0

    @property
    def first_s(self) -> float:
        """Stream time of the oldest retained frame."""
        with self._lock:
            return self._packets[0].t if self._packets else 0.0

    @property
    def nbytes(self) -> int:
        """Bytes held: the retained stream plus its tables."""
        with self._lock:
            return len(self._data) + len(self._header)

    # ----- sampling

    def snapshot(self, options: VideoOptions) -> LiveSnapshot:
        """The bytes to decode for the options' range, clipped to what is retained and complete."""
        with self._lock:
            if not self._packets:
                raise NoFrames("the live stream has no complete frame yet")
            first, now = self._packets[0].t, self._packets[-1].end
            end = min(options.end_s or math.inf, now)
            start = max(options.start_s, first)
            if options.last_s is not None:
                start = max(start, end - options.last_s)
            if start >= end:
                raise NoFrames(f"nothing to sample between {start:.3f} s and {end:.3f} s "
                               f"(the stream holds {first:.3f} s to {now:.3f} s)")
            key = max((p for p in self._packets if p.key and p.t <= start), key=lambda p: p.t, default=self._packets[0])
            stop = len(self._data) if self._closed else self._pending
            data = self._header + bytes(self._data[key.pos:stop])
            return LiveSnapshot(data, self._origin, self._time_base, start, end)

    # ----- internals (called with the lock held)

    def _index(self) -> None:
        """Index the video packets that start in the unindexed bytes."""
        head = len(self._header)
        found = self._scan(self._header + bytes(self._data[self._pending:]))
        # scan offsets -> offsets in _data
        found = [(pos - head + self._pending, *rest) for pos, *rest in found]
        if not found:
            return
        if not self._started:  # first packets ever: split off the tables before them
            self._started = True
            first = found[0][0]
            self._header = bytes(self._data[:first])
            del self._data[:first]
            found = [(pos - first, *rest) for pos, *rest in found]
        complete = found if self._closed else found[:-1]  # the newest may still be arriving
        for pos, pts, duration, key in complete:
            self._commit(pos, pts, duration, key)
        self._pending = found[-1][0] if len(found) > len(complete) else len(self._data)

    def _scan(self, buf: bytes) -> list[tuple[int, int, int, bool]]:
        """(offset, pts, duration, keyframe) of each video packet starting in an MPEG-TS buffer."""
        try:
            with av.open(io.BytesIO(buf), format="mpegts", options=_SCAN_OPTIONS) as container:
                if not container.streams.video:
                    self._check_probe(NoVideoStream, "the live stream shows no video stream")
                    return []
                stream = container.streams.video[0]
                self._time_base = self._time_base or stream.time_base
                return [(p.pos, p.pts if p.pts is not None else p.dts, p.duration or 0, p.is_keyframe)
                        for p in container.demux(stream) if p.size and p.pos is not None
                        and (p.pts is not None or p.dts is not None)]
        except av.error.FFmpegError:
            self._check_probe(VideoUnreadable, "the live stream is not MPEG-TS video")
            return []

    def _check_probe(self, error: type[Exception], message: str) -> None:
        if not self._started and len(self._data) > self.probe_bytes:
            raise error(f"{message} after {len(self._data)} bytes")

    def _commit(self, pos: int, pts: int, duration: int, key: bool) -> None:
        if self._origin is None:
            self._origin = pts
        t = float((pts - self._origin) * self._time_base)
        # A frame lasts until the next one: MPEG-TS often leaves the newest packet's duration
        # unknown (FFmpeg then says 1 tick), so take the spacing of the last two frames.
        previous = self._packets[-1].t if self._packets else None
        step = t - previous if previous is not None and t > previous else float(duration * self._time_base)
        self._packets.append(_Packet(pos, t, t + step, key))

    def _trim(self) -> None:
        """Cut at the newest keyframe that still leaves retention_s before now, then, if the
        bytes are still over max_bytes, at the oldest keyframe after which they fit."""
        if self._packets:
            cutoff = self._packets[-1].end - self.retention_s
            old = [i for i, p in enumerate(self._packets) if p.key and p.t <= cutoff]
            if old:
                self._cut(old[-1])
        if len(self._data) > self.max_bytes:
            fits = [i for i, p in enumerate(self._packets) if p.key and len(self._data) - p.pos <= self.max_bytes]
            if not fits:
                raise VideoTooLarge(f"the live stream holds {len(self._data)} bytes with no keyframe to cut at "
                                    f"under max_bytes={self.max_bytes}; send keyframes more often")
            self._cut(fits[0])

    def _cut(self, index: int) -> None:
        offset = self._packets[index].pos
        if offset == 0:
            return
        del self._data[:offset]
        self._packets = [replace(p, pos=p.pos - offset) for p in self._packets[index:]]
        self._pending -= offset


# ----- LiveDecoder: a media decoded as it is fed ---------------------------------------------------
# Little probing: frames should flow from the first bytes of a live stream.
_OPEN_OPTIONS = {"probesize": "4096", "analyzeduration": "0"}


class LiveDecoder:
    """Decodes a container stream fed in chunks (MPEG-TS, fragmented MP4) on its own thread and
    hands RGB frames uint8 [T, H, W, 3] with their PTS (seconds in the stream's time base) to
    `on_frames`; a decode failure goes to `on_error` and ends this media."""

    def __init__(self, on_frames: Callable[[np.ndarray, np.ndarray], None],
                 on_error: Callable[[BaseException], None], batch: int = 1):
        self._pipe = _Pipe()
        self._on_frames, self._on_error = on_frames, on_error
        self._batch = batch
        self._done = threading.Event()
        self._aborted = False
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sparrow-live-decode", daemon=True)
        self._thread.start()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def feed(self, chunk: bytes) -> None:
        """The media's next bytes, split anywhere."""
        if chunk:
            self._pipe.write_chunk(chunk)

    def close(self) -> None:
        self._pipe.write_chunk(None)

    def abort(self) -> None:
        self._aborted = True
        self._pipe.write_chunk(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until the decoder has read every chunk fed so far (or finished)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._progress:
            while not self._done.is_set() and self._pipe.waiting > 0:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._progress.wait(timeout=0.05 if left is None else min(0.05, left))

    def _run(self) -> None:
        frames, times = [], []
        try:
            with av.open(self._pipe, mode="r", options=_OPEN_OPTIONS) as container:
                stream = video_stream(container, "the live media")
                stream.thread_type = "AUTO"
                for t, frame in decoded_frames(container, stream, origin_pts=0):
                    if self._aborted:
                        return
                    if t is None:
                        continue
                    frames.append(frame.to_ndarray(format="rgb24"))
                    times.append(t)
                    if len(frames) >= self._batch:
                        self._flush(frames, times)
                    with self._progress:
                        self._progress.notify_all()
            self._flush(frames, times)
        except _SinkError as exc:             # the session refused the frames: its own error, as is
            if not self._aborted:
                self._on_error(exc.error)
        except (av.error.FFmpegError, VideoUnreadable, ValueError) as exc:
            try:
                self._flush(frames, times)
            except _SinkError:
                pass
            if not self._aborted:
                error = exc if isinstance(exc, VideoUnreadable) else VideoUnreadable(
                    f"the live media could not be decoded: {exc}")
                self._on_error(error)
        except BaseException as exc:  # noqa: BLE001 - e.g. the session closed under it
            if not self._aborted:
                self._on_error(exc)
        finally:
            self._done.set()
            with self._progress:
                self._progress.notify_all()

    def _flush(self, frames: list, times: list) -> None:
        if frames:
            batch, stamps = np.stack(frames), np.array(times)
            frames.clear()
            times.clear()
            try:
                self._on_frames(batch, stamps)
            except Exception as exc:  # noqa: BLE001 - told apart from a decode failure above
                raise _SinkError(exc) from exc


class _Pipe(io.RawIOBase):
    """A blocking byte pipe: `write_chunk` from the feeding thread, `read` from the decoder's."""

    def __init__(self):
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._buf = b""
        self._eof = False

    def readable(self) -> bool:
        return True

    @property
    def waiting(self) -> int:
        """Chunks written and not yet read."""
        return self._chunks.qsize()

    def write_chunk(self, data: bytes | None) -> None:
        self._chunks.put(data)

    def readinto(self, b) -> int:
        while not self._buf and not self._eof:
            chunk = self._chunks.get()
            if chunk is None:
                self._eof = True
            else:
                self._buf = bytes(chunk)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


class _SinkError(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error

