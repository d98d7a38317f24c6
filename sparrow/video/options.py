"""What to decode (VideoOptions) and what comes out of decoding (Frames)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sparrow.errors import InvalidRequest

GiB = 1 << 30

# Rate assumed for frames handed over as an array when the options carry no fps.
DEFAULT_ARRAY_FPS = 2.0


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequest(message)


def _is_int(value: object) -> bool:
    # bool is an int subclass; `num_frames=True` is a caller bug, not a count.
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_positive_number(value: object) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class VideoOptions:
    """How to sample a video, and the bounds that protect the service from a hostile one.

    `num_frames`, when set, overrides `fps`: that many frames spread uniformly over
    [start_s, end_s]. Otherwise `fps` frames per second are sampled, clamped to
    [min_frames, max_frames] and to the frames the range holds (as HF's Qwen2-VL sampler).
    """

    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    start_s: float = 0.0
    end_s: float | None = None
    max_bytes: int = 2 * GiB
    max_duration_s: float = 4 * 3600.0
    max_frame_pixels: int = 8192 * 8192
    max_decoded_frames: int = 1024

    def __post_init__(self) -> None:
        _require(self.fps is None or _is_positive_number(self.fps), f"fps must be > 0, got {self.fps!r}")
        _require(self.num_frames is None or (_is_int(self.num_frames) and self.num_frames >= 1),
                 f"num_frames must be an int >= 1, got {self.num_frames!r}")
        _require(self.fps is not None or self.num_frames is not None, "set fps or num_frames")
        _require(_is_int(self.min_frames) and self.min_frames >= 1,
                 f"min_frames must be an int >= 1, got {self.min_frames!r}")
        _require(_is_int(self.max_frames) and self.max_frames >= self.min_frames,
                 f"max_frames ({self.max_frames!r}) must be an int >= min_frames ({self.min_frames})")
        _require(isinstance(self.start_s, (int, float)) and math.isfinite(self.start_s) and self.start_s >= 0,
                 f"start_s must be >= 0, got {self.start_s!r}")
        _require(self.end_s is None or (_is_positive_number(self.end_s) and self.end_s > self.start_s),
                 f"end_s ({self.end_s!r}) must be after start_s ({self.start_s})")
        for name in ("max_bytes", "max_frame_pixels", "max_decoded_frames"):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0, f"{name} must be an int > 0, got {value!r}")
        _require(_is_positive_number(self.max_duration_s),
                 f"max_duration_s must be > 0, got {self.max_duration_s!r}")


@dataclass(frozen=True, eq=False)  # eq on arrays is ambiguous; compare fields explicitly
class Frames:
    """Sampled RGB frames with their presentation times.

    `sample_fps` is the effective sampling rate, frames / covered seconds; Qwen2.5-VL turns
    it into `second_per_grid_ts`, i.e. the temporal spacing of its 3-axis rope positions.
    """

    frames: np.ndarray  # uint8 [T, H, W, 3] RGB
    timestamps: np.ndarray  # float64 [T] seconds from the start of the video
    sample_fps: float

    def __post_init__(self) -> None:
        f, ts = self.frames, self.timestamps
        _require(isinstance(f, np.ndarray) and f.dtype == np.uint8 and f.ndim == 4 and f.shape[-1] == 3
                 and f.shape[0] >= 1, "frames must be a uint8 array [T>=1, H, W, 3]")
        _require(isinstance(ts, np.ndarray) and ts.shape == (f.shape[0],),
                 f"timestamps must have shape ({f.shape[0]},), got {getattr(ts, 'shape', None)}")
        _require(_is_positive_number(self.sample_fps), f"sample_fps must be > 0, got {self.sample_fps!r}")

    def __len__(self) -> int:
        return int(self.frames.shape[0])
