"""A container's video stream, read frame by frame: the one PyAV demux/decode loop.

Every reader of decoded frames goes through `decoded_frames`: a file sampled by
`load_frames` (video/decode.py), container chunks fed to a live session (video/growing_stream.py's LiveDecoder)
and a URL the server plays into one (services/live/call.py). What they need on top (a deadline, a
byte budget, a stop flag) is their `on_packet` check or their loop body; how they report a
failure is theirs (a request's error names its source).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from fractions import Fraction

import av

from sparrow.errors import NoVideoStream


def video_stream(container: av.container.InputContainer, what: str = "the file") -> av.VideoStream:
    """The container's first video stream; NoVideoStream (naming `what` and the streams it
    holds) when it has none."""
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise NoVideoStream(f"{what} has no video stream (streams: {', '.join(kinds)})")
    return container.streams.video[0]


def decoded_frames(container: av.container.InputContainer, stream: av.VideoStream, *,
                   origin_pts: int | None = None, on_packet: Callable[[int], None] | None = None,
                   ) -> Iterator[tuple[float | None, av.VideoFrame]]:
    """(seconds, frame) for each frame of `stream`, decoded packet by packet in stream order.

    seconds: the frame's pts from `origin_pts` (default: the pts of the first frame that has
    one), in the stream's time base; None for a frame without a pts (raw elementary streams).
    on_packet: called with each packet's size in bytes before it is decoded (a deadline, a
    byte budget); what it raises ends the iteration. The demuxer's closing empty packet is decoded too: it
    flushes the frames the decoder still holds.
    """
    time_base = stream.time_base or Fraction(1, av.time_base)
    origin = origin_pts
    for packet in container.demux(stream):
        if on_packet is not None:
            on_packet(packet.size)
        for frame in packet.decode():
            if frame.pts is None:
                yield None, frame
                continue
            origin = frame.pts if origin is None else origin
            yield float((frame.pts - origin) * time_base), frame


__all__ = ["decoded_frames", "video_stream"]
