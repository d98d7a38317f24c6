"""Fresh synthetic world videos for the benchmarks, every frame kept."""

from __future__ import annotations

import dataclasses
import time

from sparrow.models.target import TargetModel
from sparrow.video import ProcessedVideo, prepare_video


def world_video(side: int, frames: int, seed: int):
    """A fresh world video as mp4 bytes (a SyntheticVideo) and the options that keep every frame."""
    from sparrow.world.scenes import WorldVideo

    world = WorldVideo(num_frames=frames, size=side)
    return world.make(seed), dataclasses.replace(world.options(), max_visual_tokens=10**6)   # the ladder goes past 24,576


def make_video(target: TargetModel, side: int, frames: int, seed: int) -> tuple[ProcessedVideo, float]:
    """A fresh world video as mp4 bytes, decoded and patchified as serving does; every frame kept."""
    video, options = world_video(side, frames, seed)
    t0 = time.perf_counter()
    processed = prepare_video(video.source, target.processor, options)
    return processed, time.perf_counter() - t0
