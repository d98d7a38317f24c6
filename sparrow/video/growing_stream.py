"""A live MPEG-TS stream, fed in chunks while it plays and sampled up to "now".

Chunks may split the stream anywhere. Each append demuxes only the bytes not yet indexed
(no decoding) to learn where video packets start and when they play. A packet counts once
the next one has started (or the stream is closed), so "now" is the end of the newest
complete frame. Memory stays bounded: bytes older than `retention_s` before now are dropped,
cut at a keyframe so what remains still decodes, and at most `max_bytes` are kept.

Sampling (`load_frames(live, options)`) copies the retained bytes from the keyframe before
the requested range, prefixed with the stream's first tables (PAT/PMT), and decodes that
snapshot like a file. Times are seconds since the stream's first video packet.
"""

from __future__ import annotations

import io
import math
import threading
from dataclasses import dataclass, replace
from fractions import Fraction

import av

from sparrow.errors import InvalidRequest, NoFrames, NoVideoStream, VideoTooLarge, VideoUnreadable
from sparrow.video.options import MiB, VideoOptions

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
