"""A video file played into a live session as if it were live (`sparrow live`).

The file's video stream is remuxed to MPEG-TS with PyAV, packet by packet and without
re-encoding, and each packet's bytes are sent when its decode time comes round (real time,
or `speed` times faster). Codecs MPEG-TS cannot carry are refused with the command that
converts the file.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import av

from sparrow.errors import InvalidRequest, NoVideoStream

# Video codecs FFmpeg's MPEG-TS muxer carries (and the live decoder reads back).
TS_CODECS = frozenset({"h264", "hevc", "mpeg4", "mpeg2video", "mpeg1video"})


def ts_packets(path: str | Path) -> Iterator[tuple[float, bytes]]:
    """(decode time in seconds from the first packet, the MPEG-TS bytes it made) for each
    packet of the file's first video stream; the muxer's trailing bytes come last."""
    with av.open(str(path)) as source:
        if not source.streams.video:
            raise NoVideoStream(f"{path} has no video stream")
        stream = source.streams.video[0]
        codec = stream.codec_context.name
        if codec not in TS_CODECS:
            raise InvalidRequest(f"{path}: {codec} video cannot be remuxed into MPEG-TS without re-encoding; "
                                 f"convert it first: ffmpeg -i {path} -c:v libx264 out.mp4")
        buf = io.BytesIO()
        out = av.open(buf, "w", format="mpegts")
        closed, origin, t = False, None, 0.0
        try:
            out_stream = out.add_stream_from_template(stream)
            for packet in source.demux(stream):
                if packet.dts is None:              # the demuxer's closing empty packet
                    continue
                t = float(packet.dts * stream.time_base)
                origin = t if origin is None else origin
                packet.stream = out_stream
                out.mux(packet)
                yield t - origin, _take(buf)
            out.close()
            closed = True
            if tail := _take(buf):
                yield t - (origin or 0.0), tail
        finally:
            if not closed:
                out.close()


def _take(buf: io.BytesIO) -> bytes:
    data = buf.getvalue()
    buf.seek(0)
    buf.truncate()
    return data


def play(path: str | Path, send: Callable[[bytes], None], *, speed: float = 1.0, duration_s: float | None = None,
         at: Sequence[tuple[float, Callable[[float], None]]] = (), stopped: Callable[[], bool] = lambda: False,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
         ) -> tuple[float, list[tuple[float, Callable[[float], None]]]]:
    """Send the file's MPEG-TS bytes at `speed` x real time; call each `at` action with its
    time when the stream reaches it. Returns (stream seconds played, the actions whose time
    the stream never reached)."""
    if not speed > 0:
        raise InvalidRequest(f"speed must be > 0, got {speed}")
    actions = sorted(at, key=lambda a: a[0])
    start, played = clock(), 0.0

    def wait_until(t: float) -> None:
        delay = start + t / speed - clock()
        if delay > 0:
            sleep(delay)

    for t, data in ts_packets(path):
        if stopped() or (duration_s is not None and t > duration_s):
            break
        while actions and actions[0][0] <= t:
            when, action = actions.pop(0)
            wait_until(when)
            action(when)
        wait_until(t)
        if data:
            send(data)
        played = t
    return played, actions


__all__ = ["TS_CODECS", "play", "ts_packets"]
