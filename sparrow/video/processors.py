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

from sparrow.errors import InvalidRequest, VideoTooLarge, VideoUnsupported
from sparrow.video.options import Frames, VideoOptions
from sparrow.video.frame_sampling import pad_to_multiple, thin

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


@dataclass(frozen=True)
class VideoPlan:
    """What a processor will make of T frames of H x W under some options."""

    num_frames: int  # frames kept (fewer than offered when the token budget says so)
    height: int  # every kept frame is resized to height x width
    width: int
    num_visual_tokens: int  # <= options.max_visual_tokens, always


class VideoProcessor(abc.ABC):
    """Turns sampled frames into the inputs one family of HF video models expects, within
    the token budget of the options (those given, else those the frames were sampled with,
    else the defaults)."""

    @abc.abstractmethod
    def plan(self, num_frames: int, height: int, width: int, options: VideoOptions | None = None) -> VideoPlan:
        """Frame count and size for `num_frames` frames of height x width; pure arithmetic."""

    @abc.abstractmethod
    def process(self, frames: Frames, options: VideoOptions | None = None) -> ProcessedVideo: ...

    @classmethod
    @abc.abstractmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> VideoProcessor: ...

    @classmethod
    @abc.abstractmethod
    def hf_settings(cls, config: Any, hf: dict) -> dict[str, Any]:
        """This class's fields from an HF video (or image) processor dict, read the way the HF
        processor class reads it: HF's class defaults where the dict is silent."""

    @abc.abstractmethod
    def to_hf_dict(self) -> dict[str, Any]:
        """The HF video processor config (video_preprocessor_config.json) for these settings."""


def _processor_class(hf_config: Any) -> type[VideoProcessor]:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _PROCESSORS:
        raise InvalidRequest(f"no video processor for model_type {model_type!r}; supported: {sorted(_PROCESSORS)}")
    return _PROCESSORS[model_type]


def processor_for(hf_config: Any, **overrides: Any) -> VideoProcessor:
    """The processor matching an HF model config (dispatch on `config.model_type`)."""
    return _processor_class(hf_config).from_hf_config(hf_config, **overrides)


def processor_from_hf(hf_config: Any, hf: dict, **overrides: Any) -> VideoProcessor:
    """The processor a checkpoint's own HF processor config describes (see
    `sparrow.models.checkpoint.read_processor` for which file that is); `overrides` (Sparrow's
    additions, e.g. temporal_positions) go on top."""
    cls = _processor_class(hf_config)
    _check_hf_steps(hf)
    return cls.from_hf_config(hf_config, **{**cls.hf_settings(hf_config, hf), **overrides})


# HF resamples with PIL's enum values; ours is bicubic (3), the value every supported family ships.
_BICUBIC = 3


def _check_hf_steps(hf: dict) -> None:
    """Refuse a processor config that switches off a step we always do (resize, rescale by
    1/255, normalize, RGB) or resamples differently: its token counts or pixels would differ."""
    for step in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if hf.get(step) is False:
            raise InvalidRequest(f"the checkpoint's processor config sets {step}=false, which is not supported")
    if hf.get("resample", _BICUBIC) != _BICUBIC:
        raise InvalidRequest(f"the checkpoint's processor config resamples with {hf['resample']}; only bicubic "
                             f"({_BICUBIC}) is supported")
    if abs(float(hf.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-12:
        raise InvalidRequest(f"rescale_factor {hf['rescale_factor']} is not supported (only 1/255)")


def _hf_stats(hf: dict, mean: tuple[float, ...], std: tuple[float, ...]) -> dict[str, tuple[float, ...]]:
    return {"image_mean": tuple(hf.get("image_mean") or mean), "image_std": tuple(hf.get("image_std") or std)}


def _same_as_model(name: str, file_value: Any, model_value: Any) -> None:
    """A processor field the model's config also fixes (the vision tower's patch size...):
    a checkpoint whose two files disagree cannot be run as HF would; refuse it."""
    if file_value is not None and file_value != model_value:
        raise InvalidRequest(f"the checkpoint's processor config has {name}={file_value}, but its model "
                             f"config has {model_value}")


# ---------------------------------------------------------------- shared numpy steps


def _normalize_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """float32 [3, 256]: table[c, v] is what HF's rescale + normalize make of value v in channel c."""
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # [256]
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]  # [3, 1]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    return (scaled[None, :] - mean32) / std32


def _apply_table(table: np.ndarray, values: np.ndarray, channel_axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """Gather table values per channel: uint8 [..., 3 at channel_axis, ...] -> float32, same shape."""
    out = np.empty(values.shape, dtype=np.float32) if out is None else out
    for c in range(3):
        index = (slice(None),) * (channel_axis % values.ndim) + (c,)
        out[index] = table[c][values[index]]
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
        raise VideoUnsupported(f"video aspect ratio {width}x{height} is over 200:1")
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
    # Temporal rope positions: frame pair t of a video sits at floor(t * tokens_per_second *
    # seconds per pair). With `temporal_positions` set, a video that would span more positions
    # than that has its pairs spaced closer (several share a position), so every video spans
    # the range the model was trained on: time is read as a fraction of the video, and a model
    # trained on short videos sees long ones at familiar positions. None: real seconds (HF's).
    tokens_per_second: float = 2.0
    temporal_positions: int | None = None

    def __post_init__(self) -> None:
        if self.temporal_positions is not None and self.temporal_positions < 1:
            raise InvalidRequest(f"temporal_positions must be >= 1, got {self.temporal_positions}")
        if self.tokens_per_second <= 0:
            raise InvalidRequest(f"tokens_per_second must be > 0, got {self.tokens_per_second}")
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
            tokens_per_second=float(getattr(vision, "tokens_per_second", 2.0)),
        )
        return cls(**{**sizes, **overrides})

    # HF's Qwen2VLVideoProcessor: `size` {shortest_edge, longest_edge} (pixels per frame), which
    # top-level min_pixels / max_pixels override (the older layout, as Qwen2.5-VL-7B ships it).
    @classmethod
    def hf_settings(cls, config: Any, hf: dict) -> dict[str, Any]:
        vision = config.vision_config
        _same_as_model("patch_size", hf.get("patch_size"), vision.patch_size)
        _same_as_model("temporal_patch_size", hf.get("temporal_patch_size"), vision.temporal_patch_size)
        _same_as_model("merge_size", hf.get("merge_size"), vision.spatial_merge_size)
        size = dict(hf.get("size") or {})
        min_pixels = hf.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", cls.min_pixels)))
        max_pixels = hf.get("max_pixels", size.get("longest_edge", size.get("max_pixels", cls.max_pixels)))
        # HF caps the whole video only with cap_pixels_per_frame (its budget: max_video_tokens, default 128000).
        cap = hf.get("max_video_tokens", 128000) if hf.get("cap_pixels_per_frame") else None
        return {"min_pixels": int(min_pixels), "max_pixels": int(max_pixels), "max_video_tokens": cap,
                **_hf_stats(hf, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)}

    def to_hf_dict(self) -> dict[str, Any]:
        return {"video_processor_type": "Qwen2VLVideoProcessor",
                "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size, "image_mean": list(self.image_mean), "image_std": list(self.image_std),
                "resample": _BICUBIC, "do_resize": True, "do_rescale": True, "do_normalize": True,
                "do_convert_rgb": True, "cap_pixels_per_frame": self.max_video_tokens is not None,
                **({"max_video_tokens": self.max_video_tokens} if self.max_video_tokens is not None else {})}

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def _tokens(self, height: int, width: int) -> int:
        """Merged tokens per temporal patch of a height x width frame."""
        return (height // self.factor) * (width // self.factor)

    def _pixel_bounds(self, num_frames: int, options: VideoOptions) -> tuple[int, int]:
        """(min_pixels, max_pixels) per frame: the options' over the processor's, then HF's
        `max_video_tokens` cap (an even share of 90% of it per frame, floored at 1.05 * min)."""
        max_px = options.max_pixels or max(self.max_pixels, options.min_pixels or 0)
        min_px = min(options.min_pixels or self.min_pixels, max_px)
        if self.max_video_tokens is not None:
            total = int(self.max_video_tokens * self.factor * self.factor * 0.9)
            share = total * self.temporal_patch_size // num_frames
            max_px = max(min(max_px, share), int(min_px * 1.05))
        return min_px, max_px

    def _token_budget(self, options: VideoOptions) -> int:
        budget = min(options.max_visual_tokens, self.max_video_tokens or options.max_visual_tokens)
        if options.total_pixels is not None:  # pixels summed over temporal patches = tokens * factor**2
            budget = min(budget, options.total_pixels // self.factor**2)
        if budget < 1:
            raise VideoTooLarge(f"total_pixels={options.total_pixels} is below one {self.factor}x{self.factor} patch")
        return budget

    def plan(self, num_frames: int, height: int, width: int, options: VideoOptions | None = None) -> VideoPlan:
        """Frame count and size for `num_frames` frames of height x width.

        The budget B = min(options.max_visual_tokens, options.total_pixels / factor**2,
        self.max_video_tokens) is never exceeded:
        1. the frames make P = ceil(T / 2) temporal patches; if even the smallest allowed
           size (min_pixels) gives more than B tokens, P drops to B // tokens-at-min_pixels
           (at least 1) and T to 2P: frames go only when the resolution cannot;
        2. each patch may spend B // P tokens: HF's size (smart_resize within
           [min_pixels, max_pixels]) when it fits, else the largest smart_resize size that
           does (below min_pixels only when one patch at min_pixels is over B).
        Without a binding budget the size is exactly HF's, so outputs stay bit-identical.
        """
        options = options or VideoOptions()
        f, tp = self.factor, self.temporal_patch_size
        budget = self._token_budget(options)
        min_px, max_px = self._pixel_bounds(num_frames, options)
        patches = -(-num_frames // tp)
        size = smart_resize(height, width, f, min_px, max_px)
        # smart_resize floors each side at one factor, so at extreme aspect ratios the size
        # "at min_pixels" can hold more tokens than HF's own size: the smaller of the two counts.
        smallest = min(self._tokens(*smart_resize(height, width, f, min_px, min_px)), self._tokens(*size))
        patches = min(patches, max(1, budget // smallest))
        share = budget // patches
        if self._tokens(*size) > share:
            size = self._largest_size_within(height, width, min_px, share)
        kept = num_frames if patches * tp >= num_frames else patches * tp
        return VideoPlan(kept, *size, patches * self._tokens(*size))

    def _largest_size_within(self, height: int, width: int, min_pixels: int, max_tokens: int) -> tuple[int, int]:
        """smart_resize under a pixel cap of max_tokens patches; smart_resize may round over
        its cap (it floors each side at one factor), so lower the cap until the size fits.
        Ends: a cap of 1 pixel gives factor x factor, one token."""
        cap = max_tokens * self.factor**2
        while True:
            size = smart_resize(height, width, self.factor, min(min_pixels, cap), cap)
            if self._tokens(*size) <= max_tokens or cap == 1:
                return size
            cap = max(1, cap * 3 // 4)

    def process(self, frames: Frames, options: VideoOptions | None = None) -> ProcessedVideo:
        plan = self.plan(len(frames), *frames.frames.shape[1:3], options or frames.options)
        frames = thin(frames, plan.num_frames)
        resized = _resize_all(frames.frames, plan.height, plan.width)  # uint8 [T, h, w, 3]
        padded, times = pad_to_multiple(resized, frames.timestamps, self.temporal_patch_size)
        patches, grid = self._patchify(padded)
        grid_t, grid_h, grid_w = grid
        return ProcessedVideo(
            pixel_values_videos=torch.from_numpy(patches),
            num_visual_tokens=grid_t * grid_h * grid_w // self.merge_size**2,
            model_kwargs={
                "video_grid_thw": torch.tensor([grid], dtype=torch.long),
                # seconds per temporal patch; sets the spacing of the temporal rope positions
                "second_per_grid_ts": torch.tensor([self.seconds_per_grid(grid_t, frames.sample_fps)]),
            },
            timestamps=times,
        )

    def seconds_per_grid(self, grid_t: int, sample_fps: float) -> float:
        """The rope time step per frame pair: real seconds, or less when the video would span
        more than `temporal_positions` positions (then it spans exactly that many)."""
        seconds = self.temporal_patch_size / sample_fps
        if self.temporal_positions is not None and grid_t * seconds * self.tokens_per_second > self.temporal_positions:
            seconds = self.temporal_positions / (grid_t * self.tokens_per_second)
        return seconds

    def _patchify(self, video: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """uint8 [T, h, w, 3] -> float32 [grid_t*grid_h*grid_w, 3*tp*p*p] in HF's order:
        rows go (t, merged row, merged col, row in merge block, col in merge block); each row
        holds (channel, frame in temporal patch, pixel row, pixel col)."""
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        t, h, w, _ = video.shape
        grid = [t // tp, h // p, w // p]
        per_patch = grid[1] * grid[2]  # rows per temporal patch
        x = video.reshape(t // tp, tp, h // p // m, m, p, w // p // m, m, p, 3)
        table = _normalize_table(self.image_mean, self.image_std)
        out = np.empty((grid[0], per_patch, 3, tp * p * p), dtype=np.float32)
        for k in range(grid[0]):  # one temporal patch at a time keeps the working set in cache (5x faster)
            # [tp, h/p/m, m, p, w/p/m, m, p, 3] -> [h/p/m, w/p/m, m, m, 3, tp, p, p]: copies bytes, not floats
            block = x[k].transpose(1, 4, 2, 5, 7, 0, 3, 6).reshape(per_patch, 3, tp * p * p)
            _apply_table(table, block, channel_axis=1, out=out[k])
        return out.reshape(grid[0] * per_patch, -1), grid


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

    # HF's LlavaOnevisionVideoProcessor: `size` {height, width} (square here: the tower's
    # position embeddings are for one size), CLIP mean/std unless the file sets them.
    @classmethod
    def hf_settings(cls, config: Any, hf: dict) -> dict[str, Any]:
        size = dict(hf.get("size") or {"height": cls.image_size, "width": cls.image_size})
        side = size.get("height", size.get("shortest_edge"))
        if side is None or size.get("width", side) != side:
            raise InvalidRequest(f"LLaVA-OneVision frames must be resized to a square, got size {size}")
        _same_as_model("size", side, config.vision_config.image_size)
        return {"image_size": int(side), **_hf_stats(hf, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)}

    def to_hf_dict(self) -> dict[str, Any]:
        return {"video_processor_type": "LlavaOnevisionVideoProcessor",
                "size": {"height": self.image_size, "width": self.image_size},
                "image_mean": list(self.image_mean), "image_std": list(self.image_std), "resample": _BICUBIC,
                "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}

    def tokens_per_frame(self) -> int:
        # The model pools each frame's p x p features bilinearly to ceil(p/2) x ceil(p/2).
        pooled = math.ceil(self.image_size // self.patch_size / 2)
        return pooled * pooled

    def plan(self, num_frames: int, height: int, width: int, options: VideoOptions | None = None) -> VideoPlan:
        """Every frame is image_size x image_size and costs tokens_per_frame, plus one
        newline token per video: T <= (max_visual_tokens - 1) // tokens_per_frame, and
        T * image_size**2 <= total_pixels. min/max_pixels do not apply (one fixed size)."""
        options = options or VideoOptions()
        per_frame, size = self.tokens_per_frame(), self.image_size
        fits = (options.max_visual_tokens - 1) // per_frame
        if options.total_pixels is not None:
            fits = min(fits, options.total_pixels // size**2)
        if fits < 1:
            raise VideoTooLarge(f"max_visual_tokens={options.max_visual_tokens} / total_pixels="
                                f"{options.total_pixels} cannot hold one {size}x{size} frame "
                                f"({per_frame + 1} tokens)")
        kept = min(num_frames, fits)
        return VideoPlan(kept, size, size, kept * per_frame + 1)

    def process(self, frames: Frames, options: VideoOptions | None = None) -> ProcessedVideo:
        plan = self.plan(len(frames), *frames.frames.shape[1:3], options or frames.options)
        frames = thin(frames, plan.num_frames)
        resized = _resize_all(frames.frames, plan.height, plan.width)  # uint8 [T, S, S, 3]
        table = _normalize_table(self.image_mean, self.image_std)
        pixels = np.empty((len(resized), 3, plan.height, plan.width), dtype=np.float32)  # [T, 3, S, S]
        for k, frame in enumerate(resized):  # a frame at a time keeps the working set in cache
            _apply_table(table, frame.transpose(2, 0, 1), channel_axis=0, out=pixels[k])
        return ProcessedVideo(
            pixel_values_videos=torch.from_numpy(pixels[None]),  # [1, T, 3, S, S]
            num_visual_tokens=plan.num_visual_tokens,  # T * tokens_per_frame + one image_newline token
            model_kwargs={},
            timestamps=frames.timestamps,
        )


_PROCESSORS: dict[str, type[VideoProcessor]] = {
    "qwen2_5_vl": QwenVLVideoProcessor,
    "llava_onevision": LlavaOnevisionVideoProcessor,
}
