"""`sparrow world eval-v2`: a v2 target's held-out scores, per question kind and per video length.

Each held-out video (seeds of one split, never trained on: splits_v2) is rendered to mp4, decoded
as serving does and asked one question of every kind (a random wording) through the engine at
temperature 0; a video's questions share its prefill (the prefix cache). A short answer counts
when it is exactly the truth; a narration is scored by event recall (narration.event_recall: the
share of the scene's facts, each event with its time, that it states exactly) and by exact match.

The report (JSON) holds the accuracy over the short kinds (`accuracy`), per kind, per length and
both, the narrations' mean event recall per length, and what was measured; `card_section` writes
it as the model card's held-out section.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixCache
from sparrow.video import load_frames

from sparrow.world.v2.narration import event_recall
from sparrow.world.v2.questions_v2 import QUESTION_KINDS_V2, ask
from sparrow.world.v2.render_v2 import FPS, make_video

NARRATION_TOKENS = 400            # most narrations are 60-270 tokens (docs/world-v2.md)
CARD_BEGIN, CARD_END = "<!-- eval-v2 begin -->", "<!-- eval-v2 end -->"


def _share(right: int, total: int) -> float | None:
    return right / total if total else None


@torch.no_grad()
def v2_accuracy(target: TargetModel, seeds, seconds: tuple[int, ...] = (8, 30), side: int = 112,
                kinds: tuple[str, ...] = QUESTION_KINDS_V2, engine: Engine | None = None,
                on_video: Callable[[str], None] | None = None) -> dict:
    """Held-out scores of `target` on the scenes of `seeds`, each at every length in `seconds`
    (side px, 2 fps). on_video: called with a progress line after each video."""
    engine = engine or Engine(target, spec=SpecConfig(method="none"), prefix_cache=PrefixCache(max_entries=1))
    tok = target.tokenizer
    right: dict[tuple[int, str], int] = {}
    total: dict[tuple[int, str], int] = {}
    recall: dict[int, list[float]] = {}
    tokens: dict[int, int] = {}
    samples = []
    for seed in seeds:
        for length in seconds:
            video = make_video(seed, length, None, side, FPS)
            processed = target.processor.process(load_frames(video.source, video.options()))
            tokens[length] = processed.num_visual_tokens
            rng = random.Random(f"sparrow-world-v2-eval:{seed}:{length}")
            for kind in kinds:
                qa = ask(video.scene, kind, rng)
                if qa is None:
                    continue
                q, a = qa
                budget = NARRATION_TOKENS if kind == "narrate" else len(tok(a, add_special_tokens=False)["input_ids"]) + 8
                got = engine.generate(processed, q, SamplingParams(max_new_tokens=budget),
                                      video_key=f"world-v2-eval/{seed}/{length}/{side}").text.strip()
                right[length, kind] = right.get((length, kind), 0) + (got == a)
                total[length, kind] = total.get((length, kind), 0) + 1
                if kind == "narrate":
                    recall.setdefault(length, []).append(event_recall(got, video.scene))
                if len(samples) < 12:
                    samples.append({"seed": seed, "seconds": length, "kind": kind, "question": q, "answer": a, "got": got})
            if on_video:
                on_video(f"seed {seed} at {length} s: {sum(right.values())}/{sum(total.values())} right so far")

    def share(keys) -> float | None:
        keys = [k for k in keys if total.get(k)]
        return _share(sum(right[k] for k in keys), sum(total[k] for k in keys))

    short = [k for k in kinds if k != "narrate"]
    per_kind = {k: share([(n, k) for n in seconds]) for k in kinds if share([(n, k) for n in seconds]) is not None}
    return {"accuracy": share([(n, k) for n in seconds for k in short]), "per_kind": per_kind,
            "per_seconds": {str(n): share([(n, k) for k in short]) for n in seconds},
            "per_seconds_kind": {str(n): {k: share([(n, k)]) for k in kinds if total.get((n, k))} for n in seconds},
            "event_recall": (sum(sum(r) for r in recall.values()) / sum(len(r) for r in recall.values())
                             if recall else None),
            "event_recall_per_seconds": {str(n): sum(r) / len(r) for n, r in sorted(recall.items())},
            "visual_tokens": {str(n): t for n, t in sorted(tokens.items())},
            "questions": sum(total.values()), "videos": len(seeds) * len(seconds), "scenes": len(seeds),
            "side": side, "samples": samples}


def card_section(report: dict, command: str) -> str:
    """The model card's held-out section (markdown) for an eval-v2 report."""
    acc = report["accuracy"]
    lines = [CARD_BEGIN, f"Measured by `{command}` ({report['scenes']} {report['split']} scenes, "
             f"{report['videos']} videos at {report['side']} px, {report['questions']} questions, greedy; "
             f"{report['eval_seconds']:.0f} s, load {report['load']}).", "",
             f"- Short answers, exact match: **{acc:.3f}**" if acc is not None else "- Short answers: none asked",
             f"- Narration event recall: **{report['event_recall']:.3f}**" if report["event_recall"] is not None
             else "- Narration event recall: no narrations asked", "",
             "| kind | " + " | ".join(f"{n} s ({report['visual_tokens'][n]:,} tokens)" for n in report["per_seconds"])
             + " | all |", "|---" * (len(report["per_seconds"]) + 2) + "|"]

    def cell(v) -> str:
        return "-" if v is None else f"{v:.2f}"

    kinds = sorted({k for row in report["per_seconds_kind"].values() for k in row})
    for k in kinds:
        lines.append(f"| {k} | " + " | ".join(cell(report["per_seconds_kind"][n].get(k)) for n in report["per_seconds"])
                     + f" | {cell(report['per_kind'].get(k))} |")
    lines.append("| short kinds | " + " | ".join(cell(v) for v in report["per_seconds"].values()) + f" | {cell(acc)} |")
    if report["event_recall_per_seconds"]:
        lines.append("| narration recall | " + " | ".join(cell(report["event_recall_per_seconds"].get(n))
                                                         for n in report["per_seconds"])
                     + f" | {cell(report['event_recall'])} |")
    return "\n".join([*lines, CARD_END])


def write_card_section(card: str | Path, section: str) -> None:
    """Put `section` into the card between its markers (appended when the card has none)."""
    card = Path(card)
    text = card.read_text() if card.is_file() else ""
    if CARD_BEGIN in text and CARD_END in text:
        head, rest = text.split(CARD_BEGIN, 1)
        text = head + section + rest.split(CARD_END, 1)[1]
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + "\n## Held-out scores (eval-v2)\n\n" + section + "\n"
    card.parent.mkdir(parents=True, exist_ok=True)
    card.write_text(text)


def evaluate_v2(target_dir: str | Path, split: str = "test", scenes: int = 5, seconds: tuple[int, ...] = (8, 30),
                side: int = 112, kinds: tuple[str, ...] = QUESTION_KINDS_V2, first: int = 0,
                log: Callable[[str], None] | None = None) -> dict:
    """eval-v2's report for the target saved in `target_dir` (seeds from `split`, from its `first`)."""
    from sparrow.world.v2.splits_v2 import split_seeds

    target = TargetModel.from_pretrained(target_dir)
    t0 = time.perf_counter()
    report = v2_accuracy(target, split_seeds(split, scenes, first), seconds, side, kinds, on_video=log)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return {**report, "split": split, "first": first, "target": str(target_dir),
            "eval_seconds": time.perf_counter() - t0, "load": load}
