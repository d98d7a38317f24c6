"""The synthetic world pair: target accuracy by video length, and the draft's held-out tau
against an untrained draft of the same shape, from short videos to ~25k visual tokens.

    python -m benchmarks.world_accuracy --out BENCHMARKS.md                      # the ladder, 5 videos each
    python -m benchmarks.world_accuracy --videos-at 84x8,168x28 --videos 10      # a subset

Every question is single-turn at temperature 0, exact match (the video's prefill is shared by
its questions); the caption column is exact match of the whole caption; tau is measured by the
engine on caption requests (k = 4, window 16, anchors 32, glimpse 0). Video seeds start at
4e9, clear of every training and test seed.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.report import write_section  # noqa: E402
from benchmarks.machine import machine  # noqa: E402
from sparrow.world.scenes import LADDER, QUESTION_KINDS, WorldVideo  # noqa: E402
from sparrow.world.draft_data import evaluate_world  # noqa: E402
from sparrow.world.target_model import world_sample  # noqa: E402

SEED = 4 * 10**9
SHORT = ((84, 8), (84, 16))


def ladder_ends(target, new_tokens: int, feature_layers=None, seed: int = 7):
    """(video, prefill) for a caption request on a video at each end of the ladder (the
    shortest and ~25k visual tokens), with room for new_tokens more."""
    for side, frames in (LADDER[0], LADDER[-1]):
        video, _ = world_sample(target, WorldVideo(num_frames=frames, size=side), seed)
        inputs = target.build_inputs(video, "describe the video .")
        yield video, target.prefill(inputs, inputs["input_ids"].shape[1] + new_tokens, feature_layers=feature_layers)


def table(report: dict) -> str:
    kinds = [k for k in QUESTION_KINDS]
    lines = ["| video (side px x frames) | visual tokens | QA accuracy | " + " | ".join(kinds)
             + " | caption exact | tau (trained) | tau (untrained) | seconds |",
             "|---|---|---|" + "---|" * len(kinds) + "---|---|---|---|"]
    for name, row in report.items():
        per = [f"{row['per_kind'].get(k, float('nan')):.2f}" for k in kinds]
        tau = f"{row['tau']:.2f}" if "tau" in row else "-"
        base = f"{row['tau_untrained']:.2f}" if "tau_untrained" in row else "-"
        lines.append(f"| {name} | {row['visual_tokens']:,} | **{row['accuracy']:.3f}** ({row['questions']} q) | "
                     + " | ".join(per) + f" | {row['caption_exact']:.2f} | {tau} | {base} | {row['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models/world")
    ap.add_argument("--videos-at", default=",".join(f"{s}x{f}" for s, f in SHORT + LADDER))
    ap.add_argument("--videos", type=int, default=5, help="fresh videos per length")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="BENCHMARKS.md to write the section into")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    videos_at = tuple(tuple(int(x) for x in part.split("x")) for part in args.videos_at.split(","))
    models = Path(args.models)
    if not (models / "target" / "config.json").is_file():
        print(f"no world target at {models / 'target'}", file=sys.stderr)
        return 2
    draft = models / "draft" if (models / "draft").is_dir() else None
    t0 = time.perf_counter()
    report = evaluate_world(models / "target", draft, videos_at, args.videos, SEED,
                            log=lambda line: print(line, flush=True))
    body = "\n".join([
        f"Machine: {machine()}. {args.videos} fresh videos per length, {time.perf_counter() - t0:.0f} s in all.",
        "", table(report), "",
        "QA: one question of each kind per video (two for `present`: a colour in the video and one not), "
        "single-turn, greedy, exact match. The target trains on 84 and 168 px videos of 8-32 frames, "
        "84 px videos of 64-512 frames and, in its last stage, 168 px videos of 128-512 frames (at most "
        "9,216 visual tokens; see models/world/MODEL_CARD.md); every video spans at most 8 temporal rope "
        "positions, so the longer rows are the same positions with more frame pairs on each. tau: "
        "`tau_rows`, k = 4 on every step (no policy), the trained draft against an untrained one of its shape."])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.out:
        write_section(args.out, "world", "The synthetic world pair: accuracy and tau by video length",
                      "python -m benchmarks.world_accuracy " + " ".join(argv if argv is not None else sys.argv[1:]), body)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
