"""Frames to video bytes, the one encoder of the synthetic videos: an mp4 file or buffer
(`encode_mp4`: the synthetic worlds) and an MPEG-TS stream (`encode_ts`: what a live camera
sends, for tests, benchmarks and the tools that play a clip into a live session)."""

from __future__ import annotations

import io
import pathlib
from collections.abc import Iterable
from fractions import Fraction

import av
import numpy as np


def encode_ts(frames: np.ndarray, fps: int, codec: str = "mpeg4", gop: int | None = None) -> bytes:
    """RGB frames (T, H, W, 3) uint8 as one MPEG-TS stream at `fps`, yuv420p, a keyframe every
    `gop` frames (default: every second)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mpegts") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.gop_size = gop or fps
        if codec == "libx264":
            stream.options = {"preset": "veryfast"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def default_codec() -> str:
    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def encode_mp4(
    target: io.BytesIO | pathlib.Path, frames: Iterable[np.ndarray], width: int, height: int, fps: float, codec: str
) -> None:
    rate = Fraction(fps).limit_denominator(1001)
    in_memory = isinstance(target, io.BytesIO)
    # Files get their index (moov) up front, as web video does; that needs a second pass
    # over the file, so in-memory mp4 keeps it at the end.
    faststart = not in_memory and target.suffix.lower() in (".mp4", ".mov", ".m4v")
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(target, mode="w", format="mp4" if in_memory else None, options=options) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = max(1, min(12, round(fps)))  # seeking lands near its target
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "crf": "18"}
        else:
            stream.codec_context.bit_rate = max(200_000, int(width * height * float(rate) * 2))
        for index, picture in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts = index  # in units of 1/rate, the codec's time base
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush delayed packets
