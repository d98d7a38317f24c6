"""World data for the draft (a JSONL manifest, so `world train-draft` is `train-draft`) and the
world's evaluation: target accuracy by video length, and held-out tau of a draft."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable, TextIO

import torch

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.models.draft import SparrowDraft
from sparrow.models.target import TargetModel
from sparrow.progress import ProgressLine

from sparrow.training.config import TrainConfig
from sparrow.training.data import Sample, write_manifest
from sparrow.training.evaluate import held_out_tau
from sparrow.world.scenes import CAPTION_PROMPTS, WorldVideo, caption, questions
from sparrow.world.target_model import world_accuracy

WORLD_FPS = 4.0


def world_draft_config(**overrides) -> TrainConfig:
    """The world draft's recipe. The draft is 1 layer with a narrow MLP, so it stays under a
    sixth of the target's language-model parameters."""
    base = dict(steps=1200, grad_accum=4, lr=2e-3, warmup=40, unroll=4, bridge_tokens=16, window=16, anchors=32,
                glimpse=0, draft_intermediate=64, max_new_tokens=80, fps=WORLD_FPS, eval_every=300,
                eval_samples=8, save_every=300, log_every=50)
    return TrainConfig(**{**base, **overrides})


def make_world_data(out: str | Path, videos: int, frames: tuple[int, ...] = (8,), seed: int = 0,
                    questions_per_video: int = 1) -> Path:
    """Write `videos` synthetic mp4s and a manifest: per video a caption prompt (long answers:
    where a draft pays off) and a few of its questions, each with the true answer."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    samples = []
    for i in range(videos):
        rng = random.Random(seed * 7919 + i)
        world = WorldVideo(num_frames=rng.choice(frames), fps=WORLD_FPS)
        video = world.make(seed * 7919 + i, out / f"video_{i:05d}.mp4")
        samples.append(Sample(video.path.name, rng.choice(CAPTION_PROMPTS), caption(video.events)))
        qa = questions(video.events, rng)
        samples += [Sample(video.path.name, q, a) for _, q, a in rng.sample(qa, min(questions_per_video, len(qa)))]
    write_manifest(out / "manifest.jsonl", samples)
    return out / "manifest.jsonl"


def make_world_ladder(out: str | Path, ladder: dict[tuple[int, int], int], seed: int = 0,
                      questions_per_video: int = 2) -> Path:
    """Like make_world_data over a ladder of video lengths: `ladder[(side px, frames)]` videos of
    each size (a 168 px x 1392-frame video is 25,056 visual tokens), one manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    samples, i = [], 0
    for (size, frames), count in ladder.items():
        for _ in range(count):
            rng = random.Random(seed * 7919 + i)
            video = WorldVideo(num_frames=frames, size=size, fps=WORLD_FPS).make(seed * 7919 + i, out / f"video_{i:05d}.mp4")
            samples.append(Sample(video.path.name, rng.choice(CAPTION_PROMPTS), caption(video.events)))
            qa = questions(video.events, rng)
            samples += [Sample(video.path.name, q, a) for _, q, a in rng.sample(qa, min(questions_per_video, len(qa)))]
            i += 1
    write_manifest(out / "manifest.jsonl", samples)
    return out / "manifest.jsonl"


def caption_samples(world: WorldVideo, seeds: list[int]) -> list[Sample]:
    """In-memory caption requests (long answers: where drafting pays) on fresh videos."""
    out = []
    for seed in seeds:
        video = world.make(seed)
        out.append(Sample(video.source, random.Random(seed).choice(CAPTION_PROMPTS), caption(video.events)))
    return out


def evaluate_world(target_dir: str | Path, draft_dir: str | Path | None, videos_at: tuple[tuple[int, int], ...],
                   videos: int, seed: int, draft_tokens: int = 4, log=None, dtype: str = "float32",
                   device: str = "cpu", progress: TextIO | None = None) -> dict:
    """Per video (side px, frames): visual tokens, QA accuracy, caption exact match, and (with
    a draft) held-out tau of the draft and of an untrained draft of the same shape.
    progress: a stream for a progress line per size (videos done, time left)."""
    target = TargetModel.from_pretrained(target_dir, dtype=dtype, device=device)
    draft = SparrowDraft.from_pretrained(draft_dir, target) if draft_dir else None
    report = {}
    for size, n in videos_at:
        world = WorldVideo(num_frames=n, size=size, fps=WORLD_FPS)
        seeds = list(range(seed, seed + videos))
        t0 = time.perf_counter()
        # Each video is asked its questions, then its caption (and with a draft twice more, for tau).
        passes = 4 if draft is not None else 2
        line = ProgressLine(f"{size}x{n}", passes * len(seeds), " video passes", progress) if progress else None
        done = iter(range(1, passes * len(seeds) + 1))
        step = (lambda: line.update(next(done))) if line else None
        row = {"size": size, "frames": n, **world_accuracy(target, world, seeds, on_video=step),
               **caption_match(target, world, seeds, on_video=step)}
        if draft is not None:
            row.update(tau_rows(target, draft, world, seeds, draft_tokens, on_video=step))
        row["seconds"] = time.perf_counter() - t0
        report[f"{size}x{n}"] = row
        if line:
            line.finish(f"done in {row['seconds']:.1f} s")
        if log:
            tau = "" if row.get("tau") is None else f", tau {row['tau']:.2f}"
            log(f"{size}x{n}: {row['visual_tokens']} visual tokens, accuracy {row['accuracy']:.3f}, "
                f"caption exact {row['caption_exact']:.3f}" + tau)
    return report


@torch.no_grad()
def caption_match(target: TargetModel, world: WorldVideo, seeds: list[int],
                  on_video: Callable[[], None] | None = None) -> dict:
    engine = Engine(target, spec=SpecConfig(method="none"))
    right = tokens = 0
    for s in caption_samples(world, seeds):
        out = engine.generate(s.video, s.prompt, SamplingParams(max_new_tokens=96), world.options())
        right += out.text.strip() == s.answer
        tokens = out.metrics.visual_tokens
        if on_video:
            on_video()
    return {"caption_exact": right / max(1, len(seeds)), "visual_tokens": tokens}


def untrained_like(draft: SparrowDraft, target: TargetModel, seed: int = 12345) -> SparrowDraft:
    """A randomly initialised draft of the same shape: the floor a trained draft must clear."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = SparrowDraft(draft.config)
    return fresh.to(target.device, target.hf.dtype).bind(target).eval()


def tau_rows(target: TargetModel, draft: SparrowDraft, world: WorldVideo, seeds: list[int], k: int,
             on_video: Callable[[], None] | None = None) -> dict:
    """Greedy tau at k on every step (no policy) of the draft, run with the geometry it was
    trained with (window, anchors, glimpse: SparrowDraft.trained_with), and of an untrained
    draft of its shape run the same way."""
    spec = SpecConfig.as_trained(draft.trained_with, k, adaptive_k=False)
    samples = caption_samples(world, seeds)
    untrained = untrained_like(draft, target)
    trained = held_out_tau(target, draft, samples, spec, 96, world.options(), on_sample=on_video)
    baseline = held_out_tau(target, untrained, samples, spec, 96, world.options(), on_sample=on_video)
    return {"tau": trained.mean_acceptance_length, "accepted_per_step": trained.accepted_per_step,
            "per_position": trained.acceptance_rate_per_position, "tau_untrained": baseline.mean_acceptance_length}


# ----- baselines and ablations ----------------------------------------------------------------------
# Drafts trained with the world draft's recipe and budget, changing only what is named. Sparrow
# is all three ideas: text-anchored window attention ("text" context), multi-token unrolling
# (MTP) and the bridging prefix. "all" is the EAGLE-on-a-VLM setting: the draft attends to every
# prompt position, visual ones included, so its cost grows with the video.
VARIANTS = {
    "eagle": {"context": "all", "bridge_tokens": 0},                     # EAGLE-style baseline (MTP, full attention)
    "none": {"context": "all", "unroll": 1, "bridge_tokens": 0},         # ablation: none of the three
    "window": {"unroll": 1, "bridge_tokens": 0},                         # window attention only
    "mtp": {"bridge_tokens": 0},                                         # window + MTP
    "bridge": {"context": "all", "unroll": 1},                           # bridging without window
}
# where `sparrow world train-baselines` puts each, under its --out (the benchmark's layout)
VARIANT_DIRS = {"eagle": "draft-eagle", **{k: f"ablation/{k}" for k in ("none", "window", "mtp", "bridge")}}
