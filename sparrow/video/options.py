"""What to decode (VideoOptions) and what comes out of decoding (Frames)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sparrow.errors import InvalidRequest

MiB = 1 << 20
GiB = 1 << 30

# Rate assumed for frames handed over as an array when the options carry no fps.
DEFAULT_ARRAY_FPS = 2.0

# Qwen2.5-VL's ceiling on visual tokens per video (qwen-vl-utils' VIDEO_MAX_PIXELS default is
# 768 * 28 * 28 * 32 pixels = 24,576 merged tokens).
QWEN_MAX_VISUAL_TOKENS = 24576

SEEK_MODES = ("auto", "always", "never")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequest(message)


def _is_int(value: object) -> bool:
    # bool is an int subclass; `num_frames=True` is a caller bug, not a count.
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_positive_number(value: object) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def _positive_int_or_none(value: object) -> bool:
    return value is None or (_is_int(value) and value > 0)


@dataclass(frozen=True)
class VideoOptions:
    """How to sample a video, how large the result may be, and the bounds that protect the
    service from a hostile one. Names follow qwen-vl-utils / vLLM where they exist.

    Frames: `num_frames`, when set, overrides `fps`: that many frames spread uniformly over
    the range. Otherwise `fps` frames per second, clamped to [min_frames, max_frames] and to
    the frames the range holds (HF's Qwen2-VL rule). Counts are rounded to even (Qwen's
    temporal patch is 2 frames).

    Range: [start_s, end_s) in seconds of the video; `last_s` keeps only its last N seconds
    (for a live source: the last N seconds up to now).

    Size: `min_pixels` / `max_pixels` override the processor's per-frame pixel bounds and
    `total_pixels` caps the pixels of the whole video (Qwen: summed over temporal patches, so
    it is a token budget of total_pixels / 28**2). `max_visual_tokens` is a hard budget on the
    video's visual tokens: the processor shrinks the resolution, down to min_pixels, and
    then keeps fewer frames until the video fits (the rule: `QwenVLVideoProcessor.plan`).
    Pixel options do not apply to LLaVA-OneVision, whose frames have one fixed size.

    Bounds: `max_bytes` of input (for URLs and live streams: of demuxed packets),
    `max_duration_s`, `max_frame_pixels` per decoded frame, `max_decoded_frames` kept,
    `max_frame_bytes` of kept RGB frames (frames * H * W * 3, checked before decoding).

    Time: `open_timeout_s` to open a source (connect, headers, probe), `read_timeout_s` for
    any one read, `timeout_s` for the whole decode (checked between packets, so a decode
    ends within timeout_s + read_timeout_s). `seek`: "auto" seeks when the next sample is
    further away than a keyframe interval (cheaper than decoding the gap), "never" decodes
    straight through, "always" seeks before every sample; all three return the same frames.
    """

    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    start_s: float = 0.0
    end_s: float | None = None
    last_s: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    max_visual_tokens: int = QWEN_MAX_VISUAL_TOKENS
    max_bytes: int = 2 * GiB
    max_duration_s: float = 4 * 3600.0
    max_frame_pixels: int = 8192 * 8192
    max_decoded_frames: int = 1024
    max_frame_bytes: int = 4 * GiB
    open_timeout_s: float = 10.0
    read_timeout_s: float = 10.0
    timeout_s: float = 300.0
    seek: str = "auto"

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_size()
        self._check_bounds()

    def _check_sampling(self) -> None:
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
        _require(self.last_s is None or _is_positive_number(self.last_s), f"last_s must be > 0, got {self.last_s!r}")
        _require(self.seek in SEEK_MODES, f"seek must be one of {SEEK_MODES}, got {self.seek!r}")

    def _check_size(self) -> None:
        for name in ("min_pixels", "max_pixels", "total_pixels"):
            value = getattr(self, name)
            _require(_positive_int_or_none(value), f"{name} must be an int > 0 or None, got {value!r}")
        for name in ("min_pixels", "max_pixels"):
            # A per-frame pixel option over the decoded-frame bound could never be honoured,
            # only upscaled into: refused before anything is decoded.
            value = getattr(self, name)
            _require(value is None or not _is_int(self.max_frame_pixels) or value <= self.max_frame_pixels,
                     f"{name} ({value}) must be <= max_frame_pixels ({self.max_frame_pixels})")
        if self.min_pixels is not None and self.max_pixels is not None:
            _require(self.min_pixels <= self.max_pixels,
                     f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        _require(_is_int(self.max_visual_tokens) and self.max_visual_tokens >= 1,
                 f"max_visual_tokens must be an int >= 1, got {self.max_visual_tokens!r}")

    def _check_bounds(self) -> None:
        for name in ("max_bytes", "max_frame_pixels", "max_decoded_frames", "max_frame_bytes"):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0, f"{name} must be an int > 0, got {value!r}")
        for name in ("max_duration_s", "open_timeout_s", "read_timeout_s", "timeout_s"):
            value = getattr(self, name)
            _require(_is_positive_number(value), f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True, eq=False)  # eq on arrays is ambiguous; compare fields explicitly
class Frames:
    """Sampled RGB frames with their presentation times.

    `sample_fps` is the effective sampling rate, frames / covered seconds; Qwen2.5-VL turns
    it into `second_per_grid_ts`, i.e. the temporal spacing of its 3-axis rope positions.
    `options` are those the frames were sampled with: a processor reads its pixel bounds and
    token budget from them, so `processor.process(load_frames(video, options))` keeps the
    budget of `options` without being told twice.
    """

    frames: np.ndarray  # uint8 [T, H, W, 3] RGB
    timestamps: np.ndarray  # float64 [T] seconds from the start of the video (live: of the stream)
    sample_fps: float
    options: VideoOptions | None = None

    def __post_init__(self) -> None:
        f, ts = self.frames, self.timestamps
        _require(isinstance(f, np.ndarray) and f.dtype == np.uint8 and f.ndim == 4 and f.shape[-1] == 3
                 and f.shape[0] >= 1, "frames must be a uint8 array [T>=1, H, W, 3]")
        _require(isinstance(ts, np.ndarray) and ts.shape == (f.shape[0],),
                 f"timestamps must have shape ({f.shape[0]},), got {getattr(ts, 'shape', None)}")
        _require(_is_positive_number(self.sample_fps), f"sample_fps must be > 0, got {self.sample_fps!r}")

    def __len__(self) -> int:
        return int(self.frames.shape[0])
