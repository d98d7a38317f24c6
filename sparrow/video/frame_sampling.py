"""Which frames to keep: pure functions shared by the decoder and the array path.

Sample times are bin centres: n samples over [start, end) sit at start + (i + 0.5) * D / n,
so the spacing is exactly D / n = 1 / sample_fps, the interval Qwen2.5-VL's
`second_per_grid_ts` assumes. Frames arrive as a time-ordered stream and each sample takes
the frame nearest to it, so only the chosen frames are ever held.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np

from sparrow.errors import VideoTooLarge
from sparrow.video.options import Frames, VideoOptions

Item = TypeVar("Item")
Kept = TypeVar("Kept")

# A target this close to halfway between two frames counts as a tie and takes the earlier
# frame. Without the slack, float noise in pts * time_base could send two neighbouring
# targets to the same frame (bin centres sit exactly halfway when every frame is sampled).
TIE_S = 1e-6

# Qwen2.5-VL folds 2 frames into one temporal patch; the loader keeps the count even so no
# frame is invented later (HF would pad an odd count by repeating the last frame).
FRAME_MULTIPLE = 2


def sample_count(duration_s: float, available: int | None, options: VideoOptions) -> int:
    """Number of frames to sample over a range of `duration_s` seconds holding about
    `available` frames (None when unknown). Always even and >= 2. Bounds (token budget,
    max_decoded_frames) are applied by the caller, after this count."""
    if options.num_frames is not None:
        # An explicit request is honoured, rounded *up* so nobody gets fewer than asked.
        return options.num_frames + options.num_frames % FRAME_MULTIPLE
    # The epsilon keeps 8 s * 2 fps from flooring to 15.
    n = math.floor(duration_s * options.fps + 1e-6)
    n = min(max(n, options.min_frames), options.max_frames)
    if available is not None:
        n = min(n, available)
    return max(n - n % FRAME_MULTIPLE, FRAME_MULTIPLE)


def check_kept(count: int, height: int, width: int, options: VideoOptions) -> None:
    """Refuse, before decoding, to keep more frames or frame bytes than the options allow."""
    if count > options.max_decoded_frames:
        raise VideoTooLarge(f"{count} frames requested, over the limit of {options.max_decoded_frames} per video")
    size = count * height * width * 3  # uint8 RGB
    if size > options.max_frame_bytes:
        raise VideoTooLarge(
            f"keeping {count} frames of {width}x{height} takes {size} bytes, over the limit of "
            f"{options.max_frame_bytes}; lower fps, num_frames or max_frames, or send a smaller video"
        )


def sample_times(start_s: float, end_s: float, count: int) -> np.ndarray:
    """Bin-centre sample times, float64 [count], strictly inside [start_s, end_s)."""
    step = (end_s - start_s) / count
    return start_s + (np.arange(count, dtype=np.float64) + 0.5) * step


def pick_nearest(
    items: Iterable[tuple[float, Item]],
    targets: np.ndarray,
    keep: Callable[[Item], Kept],
) -> list[tuple[float, Kept]]:
    """For each target time (float64 [n], increasing) pick the item nearest in time.

    `items` must come in increasing time. A frame nearest to several targets is kept once,
    so the result can be shorter than `targets`. `keep` converts an item when it is chosen
    (e.g. YUV frame -> RGB array), so unchosen items are never converted. Stops pulling
    items as soon as every target is resolved, which ends decoding early.
    """
    picks: list[tuple[float, Kept]] = []
    last_kept: object = None
    j, prev = 0, None

    def choose(item: tuple[float, Item]) -> None:
        nonlocal last_kept
        if item is not last_kept:
            picks.append((item[0], keep(item[1])))
            last_kept = item

    for item in items:
        while j < len(targets) and item[0] >= targets[j]:
            # targets[j] lies between prev and item: ties go to the earlier frame.
            prev_is_closer = prev is not None and targets[j] - prev[0] <= item[0] - targets[j] + TIE_S
            choose(prev if prev_is_closer else item)
            j += 1
        if j == len(targets):
            return picks
        prev = item
    if prev is not None and j < len(targets):
        choose(prev)  # targets past the last frame take the last frame
    return picks


def pad_to_multiple(
    frames: np.ndarray, times: np.ndarray, multiple: int = FRAME_MULTIPLE
) -> tuple[np.ndarray, np.ndarray]:
    """Repeat the last frame until T is a multiple of `multiple` (HF's padding rule).

    frames uint8 [T, H, W, 3], times float64 [T] -> [T', H, W, 3], [T']."""
    pad = -len(frames) % multiple
    if pad == 0:
        return frames, times
    frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    times = np.concatenate([times, np.repeat(times[-1:], pad)])
    return frames, times


def thin(frames: Frames, count: int) -> Frames:
    """Keep `count` of the frames, spread like bin centres (the sampling rule above), with
    their timestamps; the effective rate drops in proportion."""
    total = len(frames)
    if count >= total:
        return frames
    index = ((np.arange(count) + 0.5) * total / count).astype(np.int64)  # [count], increasing
    return Frames(frames.frames[index], frames.timestamps[index], frames.sample_fps * count / total, frames.options)
