"""World v2's pictures: a scene's frame at any time, and its video encoded to a real file.

Drawing and encoding are v1's (sparrow.video.synthetic: `draw_shape`, the PyAV mp4 encoder);
this module only says where each object is and what colour it has at a frame's time. A frame
is computed on its own from the scene, so a 13-minute video streams through the encoder
without holding its frames.

Visual tokens are counted as v1 counts them for the Qwen2.5-VL-shaped target (28 px of a frame
pair per token: 14 px patches merged 2x2, 2 frames a temporal patch): a 224 px frame pair is
8 x 8 = 64 tokens, so at 2 fps a second is 64 tokens and 784 s are 50,176.
"""

from __future__ import annotations

import functools
import io
import pathlib
from dataclasses import dataclass

import numpy as np

from sparrow.errors import InvalidRequest
from sparrow.video import VideoOptions
from sparrow.video.encode import default_codec, encode_mp4
from sparrow.video.synthetic import PALETTE, draw_shape
from sparrow.world.pair_demo import check_world_video

from sparrow.world.v2.scenes_v2 import Scene, make_scene

SIDE = 224                   # px: 8 x 8 visual tokens a frame pair; the smallest object is 1 token
FPS = 2.0                    # one temporal patch (2 frames) a second: events at whole seconds
LONGEST_TOKENS = 50_176      # 784 s at 224 px and 2 fps
# seconds at SIDE and FPS for ~0.5k, 1.5k, 8k, 25k and 50k visual tokens (512 ... 50,176)
LADDER_SECONDS = (8, 24, 125, 391, 784)
# The background is lit, not flat: red grows left to right and blue top to bottom by SPAN levels
# from BASE, green takes what they add, so R + G + B is the same everywhere (3 BASE + 2 SPAN, far
# below any palette colour's). A patch's place is in the background around it (world/v2/tower_v2.py).
BACKGROUND_BASE = 24
BACKGROUND_SPAN = 48


@functools.lru_cache(maxsize=8)
def background(side: int) -> np.ndarray:
    """uint8 (side, side, 3) RGB: the empty scene (read-only; render_frame copies it)."""
    x = (np.arange(side) + 0.5) / side
    xs, ys = np.meshgrid(x, x)                           # column, row fractions
    red = BACKGROUND_BASE + BACKGROUND_SPAN * xs
    blue = BACKGROUND_BASE + BACKGROUND_SPAN * ys
    green = 3 * BACKGROUND_BASE + 2 * BACKGROUND_SPAN - red - blue
    out = np.rint(np.stack([red, green, blue], axis=-1)).astype(np.uint8)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, slots=True)
class V2Video:
    """An encoded v2 video and its scene (the ground truth)."""

    scene: Scene
    path: pathlib.Path | None        # set when written to a file
    data: bytes | None               # the mp4 bytes when no path was given
    side: int
    fps: float
    num_frames: int
    visual_tokens: int

    @property
    def source(self) -> pathlib.Path | bytes:
        """What to hand to load_frames."""
        return self.path if self.path is not None else self.data

    def options(self) -> VideoOptions:
        """Read every frame (events are at whole seconds, one temporal patch each at 2 fps), under
        a budget that keeps the longest v2 video unshrunk."""
        return VideoOptions(fps=self.fps, max_frames=max(768, self.num_frames),
                            max_decoded_frames=max(1536, self.num_frames), max_visual_tokens=LONGEST_TOKENS)


def visual_tokens(seconds: int, side: int = SIDE, fps: float = FPS) -> int:
    """The target's visual tokens for a v2 video (InvalidRequest when the sizes do not fit the
    patch grid or the budget)."""
    frames = seconds * fps
    if frames != int(frames):
        raise InvalidRequest(f"{seconds} s at {fps} fps is not a whole number of frames")
    return check_world_video(int(frames), side, LONGEST_TOKENS)


def render_frame(scene: Scene, t: float, side: int = SIDE) -> np.ndarray:
    """uint8 (side, side, 3) RGB picture of the scene at `t` seconds, later objects on top."""
    canvas = background(side).copy()
    for o in scene.present(t):
        x, y = o.centre(t)
        hx, hy = o.half
        radius = max(1, round(hx * side))
        draw_shape(canvas, "circle" if o.shape == "circle" else "rectangle", x * side, y * side, radius,
                   max(1, round(hy * side)), PALETTE[o.colour(t)])
    return canvas


def write_video(scene: Scene, path: str | pathlib.Path | None, side: int = SIDE, fps: float = FPS,
                codec: str | None = None) -> V2Video:
    """Render and encode the whole scene (yuv420p mp4 through PyAV); `path=None` keeps the bytes."""
    tokens = visual_tokens(scene.seconds, side, fps)
    frames = int(scene.seconds * fps)
    target = io.BytesIO() if path is None else pathlib.Path(path)
    encode_mp4(target, (render_frame(scene, i / fps, side) for i in range(frames)), side, side, fps,
            codec or default_codec())
    return V2Video(scene, None if path is None else pathlib.Path(path), target.getvalue() if path is None else None,
                   side, float(fps), frames, tokens)


def make_video(seed: int, seconds: int, path: str | pathlib.Path | None = None, side: int = SIDE,
               fps: float = FPS) -> V2Video:
    """The scene of `seed`, rendered and encoded."""
    return write_video(make_scene(seed, seconds), path, side, fps)
