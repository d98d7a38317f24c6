"""Frames -> model inputs, reproducing the HF processors of each target in numpy.

torchvision (which the HF video processors need) cannot be installed here, so the pipelines
are rebuilt from the PIL image processors, whose arithmetic they copy step for step:
PIL bicubic resize of uint8 RGB, x.astype(float64) * (1/255) cast to float32, then
(x - mean) / std in float32. Those steps only ever see 256 values per channel, so they
are folded into a [3, 256] lookup table: bit-identical and one gather per element.
"""

from __future__ import annotations

import abc
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from sparrow.errors import InvalidRequest
from sparrow.video.options import Frames
from sparrow.video.sampling import pad_to_multiple

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)

# PIL releases the GIL while resampling, so frames resize in parallel threads.
_RESIZE_THREADS = 8


@dataclass(eq=False)  # holds tensors: == would be ambiguous
class ProcessedVideo:
    """Model-ready video tensors and the number of placeholder tokens the prompt needs."""

    pixel_values_videos: torch.Tensor
    num_visual_tokens: int
    model_kwargs: dict[str, torch.Tensor] = field(default_factory=dict)  # extra HF forward kwargs
    timestamps: np.ndarray = field(default_factory=lambda: np.zeros(0))  # float64 [T'] per frame used


class VideoProcessor(abc.ABC):
    """Turns sampled frames into the inputs one family of HF video models expects."""

    @abc.abstractmethod
    def process(self, frames: Frames) -> ProcessedVideo: ...

    @classmethod
    @abc.abstractmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> VideoProcessor: ...


def processor_for(hf_config: Any, **overrides: Any) -> VideoProcessor:
    """The processor matching an HF model config (dispatch on `config.model_type`)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _PROCESSORS:
        raise InvalidRequest(f"no video processor for model_type {model_type!r}; supported: {sorted(_PROCESSORS)}")
    return _PROCESSORS[model_type].from_hf_config(hf_config, **overrides)


# ---------------------------------------------------------------- shared numpy steps


def _normalize_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """float32 [3, 256]: table[c, v] is what HF's rescale + normalize make of value v in channel c."""
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # [256]
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]  # [3, 1]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    return (scaled[None, :] - mean32) / std32


def _apply_table(table: np.ndarray, values: np.ndarray, channel_axis: int) -> np.ndarray:
    """Gather table values per channel: uint8 [..., 3 at channel_axis, ...] -> float32, same shape."""
    out = np.empty(values.shape, dtype=np.float32)
    for c in range(3):
        index = (slice(None),) * (channel_axis % values.ndim) + (c,)
        np.take(table[c], values[index], out=out[index], mode="clip")  # uint8 never clips; "raise" would buffer
    return out


def _resize_all(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """PIL bicubic resize of every frame, as HF's PIL backend does: uint8 [T, H, W, 3] -> [T, height, width, 3]."""
    if frames.shape[1:3] == (height, width):
        return frames  # PIL returns an unchanged copy at the same size

    def one(frame: np.ndarray) -> np.ndarray:
        return np.asarray(Image.fromarray(frame).resize((width, height), resample=Image.Resampling.BICUBIC))

    with ThreadPoolExecutor(min(_RESIZE_THREADS, len(frames))) as pool:
        return np.stack(list(pool.map(one, frames)))


def _check_stats(mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise InvalidRequest(f"mean/std need 3 values each and std > 0, got {mean} / {std}")


# ---------------------------------------------------------------- Qwen2.5-VL


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, area within
    [min_pixels, max_pixels], aspect ratio kept as well as possible (same rounding as HF)."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequest(f"video aspect ratio {width}x{height} is over 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLVideoProcessor(VideoProcessor):
    """Qwen2.5-VL video inputs, matching HF's Qwen2VL processing with the PIL resize.

    Defaults are HF's `Qwen2VLVideoProcessor` ones: 128 to 768 merged tokens per frame pair.
    `max_video_tokens` optionally caps the whole video like HF's `cap_pixels_per_frame=True`
    (each frame gets an even share of 90% of that budget, floored at 1.05 * min_pixels).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    max_video_tokens: int | None = None
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise InvalidRequest("patch_size, temporal_patch_size and merge_size must be >= 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise InvalidRequest(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}")
        if self.max_video_tokens is not None and self.max_video_tokens < 1:
            raise InvalidRequest(f"max_video_tokens must be >= 1, got {self.max_video_tokens}")
        _check_stats(self.image_mean, self.image_std)

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> QwenVLVideoProcessor:
        vision = config.vision_config
        sizes = dict(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
        )
        return cls(**{**sizes, **overrides})

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def target_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame is resized to."""
        max_pixels = self.max_pixels
        if self.max_video_tokens is not None:
            total = int(self.max_video_tokens * self.factor * self.factor * 0.9)
            share = total * self.temporal_patch_size // num_frames
            max_pixels = max(min(max_pixels, share), int(self.min_pixels * 1.05))
        return smart_resize(height, width, self.factor, self.min_pixels, max_pixels)

    def process(self, frames: Frames) -> ProcessedVideo:
        height, width = self.target_size(len(frames), *frames.frames.shape[1:3])
        resized = _resize_all(frames.frames, height, width)  # uint8 [T, h, w, 3]
        padded, times = pad_to_multiple(resized, frames.timestamps, self.temporal_patch_size)
        patches, grid = self._patchify(padded)
        grid_t, grid_h, grid_w = grid
        return ProcessedVideo(
            pixel_values_videos=torch.from_numpy(patches),
            num_visual_tokens=grid_t * grid_h * grid_w // self.merge_size**2,
            model_kwargs={
                "video_grid_thw": torch.tensor([grid], dtype=torch.long),
                # seconds per temporal patch; sets the spacing of the temporal rope positions
                "second_per_grid_ts": torch.tensor([self.temporal_patch_size / frames.sample_fps]),
            },
            timestamps=times,
        )

    def _patchify(self, video: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """uint8 [T, h, w, 3] -> float32 [grid_t*grid_h*grid_w, 3*tp*p*p] in HF's order:
        rows go (t, merged row, merged col, row in merge block, col in merge block); each row
        holds (channel, frame in temporal patch, pixel row, pixel col)."""
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        t, h, w, _ = video.shape
        grid = [t // tp, h // p, w // p]
        x = video.reshape(t // tp, tp, h // p // m, m, p, w // p // m, m, p, 3)
        # -> [gt, gh/m, gw/m, m, m, 3, tp, p, p]; the transpose copies bytes, not floats.
        x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7).reshape(-1, 3, tp * p * p)
        table = _normalize_table(self.image_mean, self.image_std)
        return _apply_table(table, x, channel_axis=1).reshape(len(x), -1), grid


# ---------------------------------------------------------------- LLaVA-OneVision


@dataclass(frozen=True)
class LlavaOnevisionVideoProcessor(VideoProcessor):
    """LLaVA-OneVision video inputs: every frame resized to image_size x image_size (bicubic).

    Mean/std default to 0.5, what the released llava-onevision checkpoints configure for
    their SigLIP tower (the HF class defaults to CLIP's, which those configs override).
    """

    image_size: int = 384
    patch_size: int = 14
    image_mean: tuple[float, ...] = SIGLIP_MEAN
    image_std: tuple[float, ...] = SIGLIP_STD

    def __post_init__(self) -> None:
        if not 1 <= self.patch_size <= self.image_size:
            raise InvalidRequest(f"need 1 <= patch_size <= image_size, got {self.patch_size}, {self.image_size}")
        _check_stats(self.image_mean, self.image_std)

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> LlavaOnevisionVideoProcessor:
        vision = config.vision_config
        return cls(**{"image_size": vision.image_size, "patch_size": vision.patch_size, **overrides})

    def tokens_per_frame(self) -> int:
        # The model pools each frame's p x p features bilinearly to ceil(p/2) x ceil(p/2).
        pooled = math.ceil(self.image_size // self.patch_size / 2)
        return pooled * pooled

    def process(self, frames: Frames) -> ProcessedVideo:
        size = self.image_size
        resized = _resize_all(frames.frames, size, size)  # uint8 [T, S, S, 3]
        table = _normalize_table(self.image_mean, self.image_std)
        pixels = _apply_table(table, resized.transpose(0, 3, 1, 2), channel_axis=1)  # float32 [T, 3, S, S]
        return ProcessedVideo(
            pixel_values_videos=torch.from_numpy(pixels[None]),  # [1, T, 3, S, S]
            num_visual_tokens=len(frames) * self.tokens_per_frame() + 1,  # + one image_newline token
            model_kwargs={},
            timestamps=frames.timestamps,
        )


_PROCESSORS: dict[str, type[VideoProcessor]] = {
    "qwen2_5_vl": QwenVLVideoProcessor,
    "llava_onevision": LlavaOnevisionVideoProcessor,
}
