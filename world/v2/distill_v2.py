"""A v2 VLM trained on a feature store's answers: the SpecVLM-style small VLM given the data that
Sparrow's and the EAGLE-style drafts are trained on (issue 47: every draft trained the same way).
The store (training/feature_store.py) keeps each prompt's video, the prompt, and the target's
own answers to it (greedy and sampled); here those answers are the labels, read by the VLM
through its own frozen tower from the same mp4s, with the target's training loss (its token
mean, target_data.pooled_loss's at weighting "token", answers at the engine's decode positions),
one answer's graph at a time (accumulate_step).

    sparrow world distill-v2 --student DIR --store STORE --out DIR [--steps 800 --batch 4]
"""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sparrow.models.target import TargetModel
from sparrow.training.feature_store import FeatureStore
from sparrow.video import VideoOptions, load_frames
from sparrow.world.target_data import PooledVideo, pooled_logits

SUMMARY_FILE = "distill_v2.json"


@dataclass(frozen=True, slots=True)
class DistillConfig:
    steps: int = 800           # the drafts' step budget (train-draft --steps 800)
    batch: int = 4             # answers a step (the drafts: 4 accumulated)
    draw: str = "answers"      # "answers": each uniformly, as train-draft draws a store's (at --length-balance 0);
                               # "lengths": a video length uniformly, then its answers (before 2026-12-01)
    lr: float = 2e-3
    warmup: int = 40
    min_lr_share: float = 0.1  # the lr falls linearly to this share of its peak
    grad_clip: float = 1.0
    seed: int = 0


def store_answers(store: FeatureStore) -> list[tuple[Path, str, str]]:
    """(video file, prompt, answer text) for every response a store keeps. A context's video path
    is as the store's builder was given it: absolute, or relative to the directory it ran in (the
    current one, or one above the store)."""
    out = []
    for r in store.responses:
        ctx = store.contexts[r["context"]]
        out.append((_video_file(ctx["video"], store.path), ctx["prompt"], r["text"]))
    return out


def accumulate_step(vlm: TargetModel, picked: list[tuple[PooledVideo, str, str]], params: list) -> float:
    """Gradients of the step's mean token loss into `params`, one answer's forward and backward at
    a time: a padded batch passes an attention mask that SDPA materialises (four 25k answers ran
    out of 24 GiB), one answer passes none. Each answer's summed loss is backed, then the gradients
    are divided by the step's token count: the padded batch's token mean (tested equal). Returns
    that mean."""
    total, tokens = 0.0, 0
    for video, question, answer in picked:
        logits, ids, pick = pooled_logits(vlm, [video], [[(question, answer)]], decode=True)
        loss = F.cross_entropy(logits.float(), ids[:, 1:][pick], reduction="sum")
        loss.backward()
        total, tokens = total + float(loss.detach()), tokens + int(pick.sum())
    for p in params:
        if p.grad is not None:
            p.grad /= max(1, tokens)
    return total / max(1, tokens)


def _video_file(video: str, store: Path) -> Path:
    for base in (Path.cwd(), *store.resolve().parents):
        if (base / video).is_file():
            return base / video
    raise FileNotFoundError(f"the store's video {video} is not under the current directory or above {store}")


@torch.no_grad()
def _pooled(vlm: TargetModel, video: Path, options: VideoOptions) -> PooledVideo:
    """The video's visual tokens from the VLM's own tower, its frames read as the store's builder read them."""
    processed = vlm.processor.process(load_frames(video.read_bytes(), options))
    embeds = vlm.hf.model.visual(processed.pixel_values_videos, grid_thw=processed.model_kwargs["video_grid_thw"])
    embeds = embeds if torch.is_tensor(embeds) else embeds.pooler_output
    return PooledVideo(embeds, dict(processed.model_kwargs), [])


def distill_v2(student: str | Path, store: str | Path, out: str | Path, c: DistillConfig = DistillConfig(),
               log: Callable[[str], None] = print) -> dict:
    """Train `student` (a v2 VLM) on the store's answers for c.steps steps; save it to `out` with
    a summary (SUMMARY_FILE). Each step takes c.batch answers, drawn as c.draw says."""
    if c.draw not in ("answers", "lengths"):
        raise ValueError(f"draw must be 'answers' or 'lengths', got {c.draw!r}")
    t0 = time.perf_counter()
    vlm = TargetModel.from_pretrained(student)
    feature_store = FeatureStore(store)
    answers = store_answers(feature_store)
    pooled = {path: _pooled(vlm, path, feature_store.video_options) for path in dict.fromkeys(p for p, _, _ in answers)}
    by_length = defaultdict(list)
    for i, (path, _, _) in enumerate(answers):
        by_length[pooled[path].embeds.shape[0]].append(i)
    log(f"{len(answers)} answers about {len(pooled)} videos ({time.perf_counter() - t0:.0f} s to read them)")
    rng = random.Random(c.seed)
    torch.manual_seed(c.seed)
    hf = vlm.hf.train()
    hf.model.visual.requires_grad_(False)
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(1, c.warmup)) * (
        1 - (1 - c.min_lr_share) * max(0, i - c.warmup) / max(1, c.steps - c.warmup)))
    groups = list(by_length.values()) if c.draw == "lengths" else [list(range(len(answers)))]
    history = []
    for step in range(1, c.steps + 1):
        group = rng.choice(groups)
        picked = [answers[rng.choice(group)] for _ in range(c.batch)]
        opt.zero_grad(set_to_none=True)
        loss = accumulate_step(vlm, [(pooled[p], q, a) for p, q, a in picked], params)
        torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
        opt.step()
        sched.step()
        history.append(loss)
        if step % 50 == 0 or step == c.steps:
            log(f"step {step}/{c.steps} loss {sum(history[-50:]) / len(history[-50:]):.4f} "
                f"lr {sched.get_last_lr()[0]:.2e} {time.perf_counter() - t0:.0f}s")
    hf.eval()
    vlm.save_pretrained(out)
    summary = {"student": str(student), "store": str(store), "answers": len(answers), "videos": len(pooled),
               "config": asdict(c), "first_loss": history[0], "final_loss": sum(history[-50:]) / len(history[-50:]),
               "seconds": time.perf_counter() - t0}
    (Path(out) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
