"""Fresh synthetic world videos for the benchmarks, every frame kept, and the prompts that ask
for their long answers: world v1 (a caption of one shape's events, ~20 tokens) or world v2
(`sparrow.world.v2`: 1-4 objects, a timed narration of 60-270 tokens)."""

from __future__ import annotations

import dataclasses
import time

from sparrow.models.target import TargetModel
from sparrow.video import ProcessedVideo, prepare_video

WORLDS = ("v1", "v2")


def world_video(side: int, length: int, seed: int, world: str = "v1"):
    """A fresh world video as mp4 bytes (its `.source`) and the options that keep every frame.
    length: frames (v1) or seconds (v2, at its 2 fps)."""
    if world == "v2":
        from sparrow.world.v2.render_v2 import make_video as render

        video = render(seed, length, None, side)
        options = video.options()
    elif world == "v1":
        from sparrow.world.scenes import WorldVideo

        made = WorldVideo(num_frames=length, size=side)
        video, options = made.make(seed), made.options()
    else:
        raise ValueError(f"unknown world {world!r}; choose from {WORLDS}")
    return video, dataclasses.replace(options, max_visual_tokens=10**6)     # the ladders go past 24,576


def make_video(target: TargetModel, side: int, length: int, seed: int, world: str = "v1") -> tuple[ProcessedVideo, float]:
    """A fresh world video as mp4 bytes, decoded and patchified as serving does; every frame kept."""
    video, options = world_video(side, length, seed, world)
    t0 = time.perf_counter()
    processed = prepare_video(video.source, target.processor, options)
    return processed, time.perf_counter() - t0


def world_prompts(world: str = "v1") -> tuple[str, ...]:
    """The prompts a benchmark asks in turn: v1's caption prompts, v2's narration wordings."""
    if world == "v2":
        from sparrow.world.v2.questions_v2 import QUESTIONS_V2

        return QUESTIONS_V2["narrate"]
    from sparrow.world.scenes import CAPTION_PROMPTS

    return CAPTION_PROMPTS


# each world's benchmark pair (DIR/world/{target,draft}, DIR/bench/ baselines), a benchmark's default --models
WORLD_MODELS = {"v1": "models", "v2": "models/world-v2/pair-long"}
DEFAULT_WORLD = "v2"     # the benchmark's default: narrations of real length, where tau is not at its ceiling


def world_ladder(world: str = "v1") -> tuple[tuple[int, int], ...]:
    """The benchmark's lengths, (side px, frames) for v1 or (side px, seconds) for v2: 504 ...
    25,056 visual tokens (v1), 512 ... 25,024 (v2 at 224 px; its 784 s, 50k, by --videos)."""
    if world == "v2":
        from sparrow.world.v2.render_v2 import LADDER_SECONDS, SIDE

        return tuple((SIDE, s) for s in LADDER_SECONDS[:4])
    from sparrow.world.scenes import LADDER

    return LADDER


def visual_tokens(side: int, length: int, world: str = "v1") -> int:
    """A world video's visual tokens with the world target (28 px patches merged 2x2, 2 frames a
    temporal patch): `length` frames (v1) or seconds at 2 fps (v2)."""
    return (side // 28) ** 2 * (length if world == "v2" else length // 2)


def world_short_questions(world: str = "v1") -> tuple[str, ...]:
    """Questions about a video with short answers, that fit any video of the world (no template
    to fill): v1's, but for its presence question; v2's counts, orders, yes/no and the like."""
    if world == "v2":
        from sparrow.world.v2.questions_v2 import QUESTIONS_V2

        return tuple(q for kind, qs in QUESTIONS_V2.items() if kind != "narrate" for q in qs if "{" not in q)
    from sparrow.world.scenes import QUESTIONS

    return tuple(q for kind, qs in QUESTIONS.items() if kind != "present" for q in qs)
