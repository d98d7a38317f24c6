"""Frames to MPEG-TS bytes: what a live camera sends (tests, benchmarks and the tools that play a
clip into a live session encode through here)."""

from __future__ import annotations

import io

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
