"""Synthetic test videos: coloured shapes that appear, move, change colour and disappear at
known times, so a test or a training run can ask questions whose answers are known."""

from __future__ import annotations

import io
import os
import pathlib
from dataclasses import dataclass, field

import numpy as np

from sparrow.errors import InvalidRequest
from sparrow.video.encode import default_codec, encode_mp4

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (40, 80, 230),
    "yellow": (240, 220, 40),
    "magenta": (220, 50, 220),
    "cyan": (40, 220, 230),
    "white": (245, 245, 245),
    "orange": (245, 140, 30),
}
BACKGROUND = (24, 24, 24)
SHAPES = ("rectangle", "circle")


@dataclass(frozen=True)
class SyntheticVideo:
    """An encoded synthetic video and the script of what happens in it."""

    path: pathlib.Path | None  # set when written to a file
    data: bytes | None  # the container bytes when no path was given
    events: list[dict] = field(repr=False)  # time-ordered: {"t", "frame", "kind", "shape", "color", ...}
    fps: float
    num_frames: int
    width: int
    height: int

    @property
    def source(self) -> pathlib.Path | bytes:
        """What to hand to load_frames."""
        return self.path if self.path is not None else self.data

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps


@dataclass
class _Actor:
    """One shape's script, in frame indices; positions are centres in pixels."""

    shape: str
    color: str
    radius: int  # half the side for rectangles
    appear: int
    disappear: int  # first frame it is gone; num_frames if it stays
    move_start: int
    move_end: int
    origin: np.ndarray  # float [2] (x, y)
    destination: np.ndarray  # float [2]
    recolor_at: int
    new_color: str
    half_height: int = 0  # rectangles only; 0: the radius (a square)

    def center(self, frame: int) -> np.ndarray:
        span = max(self.move_end - self.move_start, 1)
        progress = np.clip((frame - self.move_start) / span, 0.0, 1.0)
        return self.origin + progress * (self.destination - self.origin)

    def color_at(self, frame: int) -> str:
        return self.new_color if frame >= self.recolor_at else self.color


def write_synthetic_video(
    path: str | os.PathLike | None,
    *,
    num_frames: int,
    width: int,
    height: int,
    fps: float,
    seed: int = 0,
    num_shapes: int = 3,
    codec: str | None = None,
    shape_size: tuple[float, float] | None = None,
    tall_rectangles: bool = False,
    horizontal_motion: bool = False,
) -> SyntheticVideo:
    """Render and encode a synthetic video (yuv420p, a keyframe at least every 12 frames).

    `path=None` returns the mp4 bytes instead of writing a file. The same arguments give the
    same script and the same pixels. `codec` defaults to libx264, else mpeg4. `shape_size` is
    the (min, max) radius as a share of the shorter side (default 1/16 to 1/7).
    `tall_rectangles` draws rectangles twice as tall as wide (a footprint unlike a circle's
    even at a coarse patch grid); `horizontal_motion` makes every move left or right, across
    at least a third of the width. Shapes may
    overlap (later ones are drawn on top), so an event's centre can be hidden by another shape.
    """
    _validate(num_frames, width, height, fps, num_shapes)
    if shape_size is not None and not 0 < shape_size[0] <= shape_size[1] < 0.5:
        raise InvalidRequest(f"shape_size must be 0 < min <= max < 0.5, got {shape_size}")
    rng = np.random.default_rng(seed)
    colors = rng.permutation(list(PALETTE))
    actors = [_make_actor(rng, i, colors, num_frames, width, height, shape_size, tall_rectangles, horizontal_motion)
              for i in range(num_shapes)]
    events = _events(actors, num_frames, fps)
    frames = (_render(actors, i, width, height) for i in range(num_frames))
    target = io.BytesIO() if path is None else pathlib.Path(path)
    encode_mp4(target, frames, width, height, fps, codec or default_codec())
    return SyntheticVideo(
        path=None if path is None else pathlib.Path(path),
        data=target.getvalue() if path is None else None,
        events=events,
        fps=float(fps),
        num_frames=num_frames,
        width=width,
        height=height,
    )


def _validate(num_frames: int, width: int, height: int, fps: float, num_shapes: int) -> None:
    if num_frames < 1 or fps <= 0:
        raise InvalidRequest(f"need num_frames >= 1 and fps > 0, got {num_frames}, {fps}")
    # yuv420p stores chroma at half resolution, so both sides must be even.
    if width < 16 or height < 16 or width % 2 or height % 2:
        raise InvalidRequest(f"width and height must be even and >= 16, got {width}x{height}")
    if not 1 <= num_shapes <= len(PALETTE) // 2:
        raise InvalidRequest(f"num_shapes must be in [1, {len(PALETTE) // 2}], got {num_shapes}")


def _make_actor(rng: np.random.Generator, index: int, colors: np.ndarray, n: int, w: int, h: int,
                shape_size: tuple[float, float] | None, tall: bool = False, horizontal: bool = False) -> _Actor:
    if shape_size is None:
        radius = int(rng.integers(max(2, min(w, h) // 16), max(3, min(w, h) // 7) + 1))
    else:
        low = max(2, int(min(w, h) * shape_size[0]))
        radius = int(rng.integers(low, max(low, int(min(w, h) * shape_size[1])) + 1))

    # The first shape is there from frame 0, so no frame is empty.
    appear = 0 if index == 0 else int(rng.integers(0, max(1, n // 2)))
    disappear = int(rng.integers(appear + max(1, n // 4), n + 1)) if rng.random() < 0.5 else n
    move_start = int(rng.integers(appear, max(appear + 1, disappear - 1)))
    move_end = min(disappear, move_start + max(1, n // 4))
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    half_height = min(2 * radius, h // 2 - 1) if tall and shape == "rectangle" else radius

    def spot() -> np.ndarray:  # a centre that keeps the whole shape inside the frame
        return np.array([rng.uniform(radius, w - radius), rng.uniform(half_height, h - half_height)])

    origin = spot()
    destination = _across(rng, origin, radius, w) if horizontal else spot()
    # Colours come in disjoint pairs per actor, so a colour names one shape at any time.
    return _Actor(
        shape=shape,
        color=str(colors[2 * index]),
        radius=radius,
        appear=appear,
        disappear=disappear,
        move_start=move_start,
        move_end=move_end,
        origin=origin,
        destination=destination,
        # n means "never"; a recolour needs a visible frame before and after it.
        recolor_at=int(rng.integers(appear + 1, disappear)) if disappear > appear + 1 else n,
        new_color=str(colors[2 * index + 1]),
        half_height=half_height,
    )


def _across(rng: np.random.Generator, origin: np.ndarray, radius: int, w: int) -> np.ndarray:
    """A destination on the same row, at least a third of the width away (towards the side
    with more room), so the move is plainly left or right."""
    x, step = float(origin[0]), w / 3
    if x < w / 2:
        lo, hi = min(x + step, w - radius), w - radius
    else:
        lo, hi = radius, max(x - step, radius)
    return np.array([rng.uniform(lo, hi), origin[1]])


def _events(actors: list[_Actor], n: int, fps: float) -> list[dict]:
    events = [event for actor in actors for event in _actor_events(actor, n, fps)]
    return sorted(events, key=lambda e: (e["frame"], e["kind"], e["color"]))


def _actor_events(actor: _Actor, n: int, fps: float) -> list[dict]:
    def event(frame: int, kind: str, **extra: object) -> dict:
        # where the shape is at `frame` (for "disappear": where it was last seen)
        center = _xy(actor.center(min(frame, actor.disappear - 1)))
        return {"t": frame / fps, "frame": frame, "kind": kind, "shape": actor.shape, "center": center, **extra}

    script = [
        event(actor.appear, "appear", color=actor.color),
        event(actor.move_start, "move", color=actor.color_at(actor.move_start), direction=_direction(actor),
              start=_xy(actor.origin), end=_xy(actor.destination), until_t=actor.move_end / fps),
        event(actor.recolor_at, "color", color=actor.new_color, previous=actor.color),
        event(actor.disappear, "disappear", color=actor.color_at(actor.disappear - 1)),
    ]
    return [e for e in script if e["frame"] < n]  # changes scripted past the end never show


def _xy(point: np.ndarray) -> tuple[int, int]:
    return int(round(point[0])), int(round(point[1]))


def _direction(actor: _Actor) -> str:
    dx, dy = actor.destination - actor.origin
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def _render(actors: list[_Actor], frame: int, w: int, h: int) -> np.ndarray:
    """uint8 [h, w, 3] RGB picture of every visible actor, later actors on top."""
    canvas = np.empty((h, w, 3), dtype=np.uint8)
    canvas[:] = BACKGROUND
    for actor in actors:
        if not actor.appear <= frame < actor.disappear:
            continue
        cx, cy = actor.center(frame)
        draw_shape(canvas, actor.shape, cx, cy, actor.radius, actor.half_height, PALETTE[actor.color_at(frame)])
    return canvas


def draw_shape(canvas: np.ndarray, shape: str, cx: float, cy: float, radius: int, half_height: int,
               rgb: tuple[int, int, int]) -> None:
    """Paint one shape into a uint8 [h, w, 3] canvas in place: a circle of `radius`, or a
    rectangle `radius` wide on each side and `half_height` (0: radius) tall on each side,
    centred at (cx, cy) and clipped to the canvas."""
    h, w = canvas.shape[:2]
    r = radius
    ry = half_height or r if shape == "rectangle" else r
    x0, x1 = max(0, int(cx - r)), min(w, int(cx + r) + 1)
    y0, y1 = max(0, int(cy - ry)), min(h, int(cy + ry) + 1)
    box = canvas[y0:y1, x0:x1]  # view into the canvas
    if shape == "circle":
        ys, xs = np.ogrid[y0:y1, x0:x1]
        box[(xs - cx) ** 2 + (ys - cy) ** 2 <= r * r] = rgb
    else:
        box[:] = rgb
