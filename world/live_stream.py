"""A continuous synthetic live stream with known ground truth at every moment.

Shapes keep appearing, staying a few seconds (moving left or right, changing colour) and
leaving, one at a time with empty gaps between them, for as long as one asks: the stream is
a pure function of its seed, and any frame range renders on its own (nothing before it is
rendered). The world's legibility rules hold (`sparrow.world.scenes.WorldVideo`): 84 px
frames, shapes a seventh to a sixth of the side, rectangles twice as tall as wide against
circles, the palette and background of `sparrow.video.synthetic`, moves across a third of
the frame or more. Every state (a colour, a shape in view, a gap) lasts at least
`min_hold_s`, so a session sampling at 2 fps sees each one in two frames or more.

    stream = LiveStream(seed=7)
    stream.frames(0, 40)              uint8 [40, 84, 84, 3], frame i shown at i / fps seconds
    stream.view_at(3.2)               View(shape="circle", color="red") or None
    stream.events(0, 40)              [{"t", "frame", "kind", "shape", "color", ...}, ...]
    stream.encode_ts(0, 40)           MPEG-TS bytes (yuv420p, a keyframe every second)
    for chunk in stream.ts_chunks(0): an endless MPEG-TS byte stream, a few frames a chunk

Random access: time is cut into blocks of `block_s` (a minute); a block's shapes come from
(seed, block index) alone and never cross its end, so each block starts and ends with a gap.
"""

from __future__ import annotations

import bisect
import math
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache

import av
import numpy as np

from sparrow.errors import InvalidRequest
from sparrow.video.synthetic import BACKGROUND, PALETTE, SHAPES, draw_shape
from sparrow.video.encode import default_codec

LIVE_FPS = 4.0          # the stream's own frame rate
SESSION_FPS = 2.0       # what a live session samples (one frame pair a second)


@dataclass(frozen=True)
class View:
    """What is in view at one moment: one shape and its colour."""

    shape: str
    color: str
    episode: int = field(default=-1, compare=False)   # which appearance (global index), -1 if unknown

    @property
    def text(self) -> str:
        return f"{self.color} {self.shape}"


@dataclass(frozen=True)
class Episode:
    """One shape's visit, in stream frames: in view for frames [start, end)."""

    index: int                                  # global: block * EPISODES_PER_BLOCK + position in block
    shape: str
    start: int
    end: int
    radius: int
    half_height: int
    y: float
    path: tuple[tuple[int, float], ...]         # (frame, x) knots: x is linear between, constant outside
    colors: tuple[tuple[int, str], ...]         # (first frame, colour), the first at `start`

    def x_at(self, frame: int) -> float:
        frames = [f for f, _ in self.path]
        i = bisect.bisect_right(frames, frame)
        if i == 0:
            return self.path[0][1]
        if i == len(self.path):
            return self.path[-1][1]
        (f0, x0), (f1, x1) = self.path[i - 1], self.path[i]
        return x0 + (frame - f0) / (f1 - f0) * (x1 - x0)

    def color_at(self, frame: int) -> str:
        i = bisect.bisect_right([f for f, _ in self.colors], frame)
        return self.colors[max(0, i - 1)][1]

    def view(self, frame: int) -> View:
        return View(self.shape, self.color_at(frame), self.index)


# An upper bound on a block's episodes, so an episode's global index is unique.
EPISODES_PER_BLOCK = 1000


@dataclass(frozen=True)
class LiveStream:
    """An endless synthetic stream, deterministic from `seed` (see the module docstring)."""

    seed: int = 0
    size: int = 84                              # frame side, px (even)
    fps: float = LIVE_FPS
    shape_size: tuple[float, float] = (1 / 7, 1 / 6)   # radius as a share of the side
    gap_s: tuple[float, float] = (1.0, 5.0)     # empty time between shapes
    stay_s: tuple[float, float] = (3.0, 12.0)   # how long a shape stays in view
    min_hold_s: float = 1.0                     # shortest colour / gap / move
    max_recolors: int = 2
    max_moves: int = 2
    block_s: float = 60.0

    def __post_init__(self) -> None:
        if self.size < 16 or self.size % 2:
            raise InvalidRequest(f"size must be even and >= 16, got {self.size}")
        if not self.fps > 0:
            raise InvalidRequest(f"fps must be > 0, got {self.fps}")
        if not 0 < self.shape_size[0] <= self.shape_size[1] < 0.25:
            raise InvalidRequest(f"shape_size must be 0 < min <= max < 0.25, got {self.shape_size}")
        if not (0 < self.min_hold_s <= self.gap_s[0] <= self.gap_s[1]
                and self.min_hold_s <= self.stay_s[0] <= self.stay_s[1]):
            raise InvalidRequest("need 0 < min_hold_s <= gap_s and min_hold_s <= stay_s, each (min, max) ordered")
        if self.block_s < self.stay_s[1] + 2 * self.gap_s[1]:
            raise InvalidRequest("block_s must hold a gap, the longest stay and a gap")

    # ----- time ------------------------------------------------------------------------------
    @property
    def block_frames(self) -> int:
        return round(self.block_s * self.fps)

    def frame_at(self, t: float) -> int:
        """The frame on screen at stream time t (frame i is shown during [i / fps, (i + 1) / fps))."""
        return math.floor(t * self.fps + 1e-9)

    def times(self, start: int, end: int) -> np.ndarray:
        """float64 [end - start]: when frames start..end-1 are shown, in stream seconds."""
        return np.arange(start, end, dtype=np.float64) / self.fps

    def session_frames(self, start_s: float, end_s: float, fps: float = SESSION_FPS) -> np.ndarray:
        """The stream frames a session sampling [start_s, end_s) at `fps` takes: `load_frames`'
        rule (bin centres start_s + (i + 0.5) / fps, each to the nearest frame, ties to the
        earlier), the count even. int64 [n]."""
        n = math.floor((end_s - start_s) * fps + 1e-6)
        n -= n % 2
        if n < 2:
            raise InvalidRequest(f"[{start_s}, {end_s}) holds no frame pair at {fps} fps")
        targets = start_s + (np.arange(n) + 0.5) / fps
        # nearest frame time i / self.fps; a tie (exactly halfway) goes to the earlier frame
        return np.ceil(targets * self.fps - 0.5 - 1e-6).astype(np.int64)

    # ----- the script ------------------------------------------------------------------------
    def episodes(self, start: int, end: int) -> list[Episode]:
        """Every episode in view at some frame of [start, end), in time order."""
        if end <= start:
            return []
        first, last = start // self.block_frames, (end - 1) // self.block_frames
        return [e for b in range(max(0, first), last + 1) for e in self._block(b) if e.end > start and e.start < end]

    def episode_at(self, frame: int) -> Episode | None:
        for e in self._block(frame // self.block_frames) if frame >= 0 else ():
            if e.start <= frame < e.end:
                return e
        return None

    def view(self, frame: int) -> View | None:
        """What is in view in `frame`: a shape and its colour, or None (nothing)."""
        e = self.episode_at(frame)
        return None if e is None else e.view(frame)

    def view_at(self, t: float) -> View | None:
        """What is in view at stream time t (seconds)."""
        return self.view(self.frame_at(t))

    def events(self, start: int, end: int) -> list[dict]:
        """Events at frames in [start, end), in time order: "appear" (color), "move" (direction,
        until_t), "color" (color, previous), "disappear" (color: the last one shown). Every
        event has "t" (seconds), "frame", "kind", "shape", "color" and "episode"."""
        out = []
        for e in self.episodes(start - 1, end + 1):
            def event(frame: int, kind: str, **extra: object) -> dict:
                return {"t": frame / self.fps, "frame": frame, "kind": kind, "shape": e.shape, "episode": e.index,
                        **extra}

            script = [event(e.start, "appear", color=e.colors[0][1])]
            for (f0, x0), (f1, x1) in zip(e.path, e.path[1:]):
                if x1 != x0:
                    script.append(event(f0, "move", color=e.color_at(f0), direction="right" if x1 > x0 else "left",
                                        until_t=f1 / self.fps))
            for (_, previous), (f, color) in zip(e.colors, e.colors[1:]):
                script.append(event(f, "color", color=color, previous=previous))
            script.append(event(e.end, "disappear", color=e.color_at(e.end - 1)))
            out += [ev for ev in script if start <= ev["frame"] < end]
        return sorted(out, key=lambda ev: (ev["frame"], ev["kind"]))

    def _block(self, block: int) -> tuple[Episode, ...]:
        return _block_episodes(self, block)

    # ----- pixels ----------------------------------------------------------------------------
    def frame(self, index: int) -> np.ndarray:
        """uint8 [size, size, 3] RGB of one frame."""
        canvas = np.empty((self.size, self.size, 3), dtype=np.uint8)
        canvas[:] = BACKGROUND
        e = self.episode_at(index)
        if e is not None:
            draw_shape(canvas, e.shape, e.x_at(index), e.y, e.radius, e.half_height, PALETTE[e.color_at(index)])
        return canvas

    def frames(self, start: int, end: int, step: int = 1) -> np.ndarray:
        """uint8 [T, size, size, 3]: frames start, start + step, ... before end."""
        if start < 0 or end <= start or step < 1:
            raise InvalidRequest(f"need 0 <= start < end and step >= 1, got {start}, {end}, {step}")
        return np.stack([self.frame(i) for i in range(start, end, step)])

    # ----- encoding --------------------------------------------------------------------------
    def ts_chunks(self, start: int = 0, end: int | None = None, chunk_frames: int = 4,
                  codec: str | None = None) -> Iterator[bytes]:
        """The stream from frame `start` (stream time 0 of the encoding) to `end` (None: for
        ever) as MPEG-TS bytes, yielded every `chunk_frames` frames as they are encoded
        (yuv420p, a keyframe every second, no B-frames, so each chunk is playable at once)."""
        if start < 0 or (end is not None and end <= start) or chunk_frames < 1:
            raise InvalidRequest(f"need 0 <= start < end and chunk_frames >= 1, got {start}, {end}, {chunk_frames}")
        sink = _Sink()
        codec = codec or default_codec()
        with av.open(sink, mode="w", format="mpegts") as container:
            stream = container.add_stream(codec, rate=Fraction(self.fps).limit_denominator(1001))
            stream.width, stream.height, stream.pix_fmt = self.size, self.size, "yuv420p"
            stream.codec_context.gop_size = max(1, round(self.fps))      # a keyframe every second
            if codec == "libx264":
                stream.options = {"preset": "ultrafast", "crf": "18", "tune": "zerolatency"}
            else:
                stream.codec_context.max_b_frames = 0
                stream.codec_context.bit_rate = max(200_000, int(self.size * self.size * self.fps * 2))
            index = start
            while end is None or index < end:
                picture = av.VideoFrame.from_ndarray(self.frame(index), format="rgb24")
                picture.pts = index - start
                container.mux(stream.encode(picture))
                index += 1
                if (index - start) % chunk_frames == 0 and sink.parts:
                    yield sink.take()
            container.mux(stream.encode())
        if sink.parts:
            yield sink.take()

    def encode_ts(self, start: int, end: int, path: str | pathlib.Path | None = None,
                  codec: str | None = None) -> bytes:
        """Frames [start, end) as one MPEG-TS (see ts_chunks); written to `path` too if given.
        Decoded, its frame i plays at i / fps seconds (frame start + i of the stream)."""
        data = b"".join(self.ts_chunks(start, end, chunk_frames=end - start, codec=codec))
        if path is not None:
            pathlib.Path(path).write_bytes(data)
        return data


class _Sink:
    """A write-only file object that hands out what was written since the last take()."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


@lru_cache(maxsize=256)
def _block_episodes(stream: LiveStream, block: int) -> tuple[Episode, ...]:
    """The episodes of one block, from (seed, block) alone."""
    rng = np.random.default_rng([stream.seed & 0xFFFFFFFF, stream.seed >> 32, block])
    fps, size = stream.fps, stream.size
    frames = lambda seconds: max(1, round(seconds * fps))   # noqa: E731
    hold = frames(stream.min_hold_s)
    begin, stop = block * stream.block_frames, (block + 1) * stream.block_frames
    out = []
    at = begin + frames(rng.uniform(*stream.gap_s))
    while True:
        stay = frames(rng.uniform(*stream.stay_s))
        room = stop - frames(stream.gap_s[0]) - at            # a gap must follow before the block ends
        if room < frames(stream.stay_s[0]):
            break
        stay = min(stay, room)
        out.append(_episode(rng, block * EPISODES_PER_BLOCK + len(out), at, at + stay, hold, stream, size))
        at += stay + frames(rng.uniform(*stream.gap_s))
    return tuple(out)


def _episode(rng: np.random.Generator, index: int, start: int, end: int, hold: int, stream: LiveStream,
             size: int) -> Episode:
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    low = max(2, int(size * stream.shape_size[0]))
    radius = int(rng.integers(low, max(low, int(size * stream.shape_size[1])) + 1))
    half_height = min(2 * radius, size // 2 - 1) if shape == "rectangle" else radius
    y = float(rng.uniform(half_height, size - half_height))
    # Colours: 0..max_recolors changes, each colour held `hold` frames or more.
    names = list(PALETTE)
    colors = [(start, names[int(rng.integers(len(names)))])]
    for at in _cuts(rng, start, end, hold, int(rng.integers(0, stream.max_recolors + 1))):
        others = [c for c in names if c != colors[-1][1]]
        colors.append((at, others[int(rng.integers(len(others)))]))
    # Moves: 0..max_moves, each left or right across a third of the frame or more, over 1-3 s.
    x = float(rng.uniform(radius, size - radius))
    path = [(start, x)]
    for at in _cuts(rng, start, end, 2 * hold, int(rng.integers(0, stream.max_moves + 1))):
        if at <= path[-1][0]:
            continue
        duration = min(int(rng.integers(hold, 3 * hold + 1)), end - 1 - at)   # done while still in view
        step = size / 3
        lo, hi = (min(x + step, size - radius), size - radius) if x < size / 2 else (radius, max(x - step, radius))
        new_x = float(rng.uniform(lo, hi))
        path += [(at, x), (at + duration, new_x)]
        x = new_x
    return Episode(index, shape, start, end, radius, half_height, y, tuple(path), tuple(colors))


def _cuts(rng: np.random.Generator, start: int, end: int, hold: int, count: int) -> list[int]:
    """Up to `count` increasing frames in (start, end) at least `hold` apart and from both ends."""
    cuts: list[int] = []
    for _ in range(count):
        lo = (cuts[-1] if cuts else start) + hold
        hi = end - hold
        if hi < lo:
            break
        cuts.append(int(rng.integers(lo, hi + 1)))
    return cuts
