"""`sparrow world make-data-v2`: world v2 videos, a JSONL manifest of questions and answers, and
each scene's ground truth.

    OUT/video_<seed>.mp4    one per scene (224 px, 2 fps by default; real mp4 through PyAV)
    OUT/manifest.jsonl      per video its narration request and `questions_per_video` other
                            questions: {"video", "prompt", "answer", "kind", "seed", "split",
                            "seconds", "visual_tokens"} (sparrow.training.data.load_samples reads it)
    OUT/scenes.jsonl        per video {"video", "seed", "seconds", "facts"}: what a narration must
                            say (narration.facts), for event recall

Seeds come from one split (splits_v2), so data for training, tests and the benchmark never share
a scene; lengths are drawn in turn from `seconds`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from sparrow.errors import InvalidRequest

from sparrow.world.v2.narration import facts
from sparrow.world.v2.questions_v2 import QUESTION_KINDS_V2, ask
from sparrow.world.v2.render_v2 import FPS, SIDE, make_video, visual_tokens
from sparrow.world.v2.splits_v2 import split_seeds


def make_data_v2(out: str | Path, split: str = "train", videos: int = 16, seconds: tuple[int, ...] = (8, 30),
                 first: int = 0, questions_per_video: int = 4, side: int = SIDE, fps: float = FPS,
                 kinds: tuple[str, ...] = QUESTION_KINDS_V2) -> Path:
    """Write the videos, manifest.jsonl and scenes.jsonl under `out`; returns the manifest."""
    if not seconds or any(not isinstance(s, int) or s < 4 for s in seconds):
        raise InvalidRequest(f"seconds must be whole lengths >= 4, got {seconds}")
    if questions_per_video < 0:
        raise InvalidRequest(f"questions_per_video must be >= 0, got {questions_per_video}")
    unknown = set(kinds) - set(QUESTION_KINDS_V2)
    if unknown:
        raise InvalidRequest(f"unknown question kinds {sorted(unknown)}; known: {', '.join(QUESTION_KINDS_V2)}")
    for s in set(seconds):
        visual_tokens(s, side, fps)                     # every length fits before anything is written
    seeds = split_seeds(split, videos, first)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows, truths = [], []
    others = tuple(k for k in kinds if k != "narrate")
    for i, seed in enumerate(seeds):
        length = seconds[i % len(seconds)]
        video = make_video(seed, length, out / f"video_{seed}.mp4", side, fps)
        rng = random.Random(f"sparrow-world-v2-questions:{seed}")
        meta = {"kind": None, "seed": seed, "split": split, "seconds": length, "visual_tokens": video.visual_tokens}
        asked = [("narrate", *ask(video.scene, "narrate", rng))] if "narrate" in kinds else []
        for kind in rng.sample(others, len(others)):    # kinds in a random order, until enough are asked
            qa = ask(video.scene, kind, rng) if len(asked) < questions_per_video + ("narrate" in kinds) else None
            asked += [(kind, *qa)] if qa is not None else []
        name = video.path.name
        rows += [{"video": name, "prompt": q, "answer": a, **meta, "kind": k} for k, q, a in asked]
        truths.append({"video": name, "seed": seed, "seconds": length, "facts": facts(video.scene)})
    (out / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "scenes.jsonl").write_text("".join(json.dumps(t) + "\n" for t in truths))
    return out / "manifest.jsonl"
