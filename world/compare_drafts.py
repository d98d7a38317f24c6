"""`sparrow world compare-drafts`: several drafts' tau on the same fresh world videos.

Each video is decoded and its prefix prefilled once (a prefix cache shared by every draft's
engine), then each draft answers the same caption request at each temperature, so the drafts
differ only in what they propose. tau per video (1 + accepted / steps, the engine's own count)
and pooled over the videos of a length (accepted and steps summed), min / median / max.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Callable

import torch

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.models.draft import SparrowDraft
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixCache

from sparrow.world.scenes import CAPTION_PROMPTS, WorldVideo
from sparrow.world.draft_data import WORLD_FPS


@torch.no_grad()
def compare_drafts(target_dir: str | Path, drafts: dict[str, str | Path], videos_at: tuple[tuple[int, int], ...],
                   videos: int, seed: int, temperatures: tuple[float, ...] = (0.0,), k: int = 4,
                   max_new_tokens: int = 96, log: Callable[[str], None] | None = None, dtype: str = "float32",
                   device: str = "cpu") -> dict:
    """{"SIDExFRAMES": {name: {"T=t": {per_video, min, median, max, pooled, steps}}}}; each
    draft runs with the geometry it was trained with, at a fixed k."""
    target = TargetModel.from_pretrained(target_dir, dtype=dtype, device=device)
    cache = PrefixCache(max_entries=1)
    engines = {}
    for name, path in drafts.items():
        draft = SparrowDraft.from_pretrained(path, target)
        engines[name] = Engine(target, draft, SpecConfig.as_trained(draft.trained_with, k, adaptive_k=False),
                               prefix_cache=cache)
    report = {}
    for size, frames in videos_at:
        world = WorldVideo(num_frames=frames, size=size, fps=WORLD_FPS)
        counts = {(name, t): [] for name in drafts for t in temperatures}      # (accepted, steps) per video
        for i in range(videos):
            video_seed = seed + 100_003 * i + 10 * frames + size
            video = world.make(video_seed)
            prompt = random.Random(video_seed).choice(CAPTION_PROMPTS)
            processed = next(iter(engines.values())).process_video(video.source, world.options())
            for t in temperatures:
                sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=t,
                                          seed=None if t == 0 else video_seed)
                for name, engine in engines.items():
                    m = engine.generate(processed, prompt, sampling, video_key=f"{size}x{frames}/{video_seed}").metrics
                    counts[(name, t)].append((m.accepted_tokens, m.steps))
            if log:
                log(f"{size}x{frames} video {i + 1}/{videos}: " + ", ".join(
                    f"{name} T={t} tau {_tau([c[-1]]):.2f}" for (name, t), c in counts.items()))
        row = report.setdefault(f"{size}x{frames}", {})
        for (name, t), c in counts.items():
            taus = [_tau([x]) for x in c if x[1]]
            row.setdefault(name, {})[f"T={t:g}"] = {
                "per_video": taus, "min": min(taus, default=None), "median": statistics.median(taus) if taus else None,
                "max": max(taus, default=None), "pooled": _tau(c), "steps": sum(s for _, s in c)}
    for engine in engines.values():
        engine.close()
    return report


def _tau(counts: list[tuple[int, int]]) -> float | None:
    steps = sum(s for _, s in counts)
    return 1.0 + sum(a for a, _ in counts) / steps if steps else None
