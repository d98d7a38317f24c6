"""`sparrow world train-live-target`: a tiny Qwen2.5-VL that answers about a live stream "now".

The world target (world/target_model.py) reads every video as 8 temporal positions (time as
a fraction of the video), which a stream that keeps growing cannot use. This one keeps real
time: `temporal_positions=None`, 2 rope steps a second, videos sampled at 2 fps, so frame
pair t of a clip sits at temporal position start + 2t, and the text after the clip starts at
start + 3 (84 px frames: HF numbers it from the frame grid's side, whatever the clip's length).
A live session holds a window of the stream's latest pairs and asks about it; a window that
dropped its oldest pairs is re-positioned to start at 0 again, so training clips always start
at temporal position 0, 1 to 32 pairs (1-32 s) long.

The machinery is the world target's: the same model config, frozen "readable" vision tower,
pool of pre-encoded visual tokens, one-shot prefill of a single-turn chat per clip, loss on
the answer, staged training (`train_world_target` with a `LiveData`). The pool holds long
stretches of streams (MPEG-TS encoded and decoded at 2 fps, as a session samples them); the
tower sees a frame pair at a time, so any run of a pooled stretch's pairs is exactly the
visual tokens of that clip, and a step draws clips of one length anywhere in the pool.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixCache
from sparrow.video import VideoOptions, load_frames
from sparrow.world.live_stream import LiveStream

from sparrow.world.live_words import (LIVE_CAPTION_PROMPTS, LIVE_KINDS, STANDING_KINDS, Clip, clip_frames, live_caption,
                         live_questions, live_tokenizer, presence_contrast)
from sparrow.world.target_model import EVAL_SEED, WORLD_TARGET_HELP, WorldTargetConfig, lm_parameters, new_world_target
from sparrow.world.target_data import PooledVideo, Stage, pooled_loss
from sparrow.world.target_train import train_world_target


@dataclass(frozen=True, slots=True)
class LiveTargetConfig(WorldTargetConfig):
    """WorldTargetConfig's model and schedule fields, with the live world's defaults and data."""

    temporal_positions: int | None = None      # real time: a stream cannot be a fraction of itself
    mrope_section: tuple[int, ...] = (8, 4, 4)
    kinds: tuple[str, ...] = LIVE_KINDS
    caption_prob: float = 0.3                  # share of chats that ask for the clip's story (live_caption)
    steps: int = 3500
    batch: int = 12
    # Presence ("is a red shape in view ?") has no first-order signal and stays at chance in
    # the mix; asked alone on top of the first stage it is learned, and kept when the last
    # stage keeps asking it on 40% of the steps (training/RESULTS.md, "The live target").
    stages: tuple[str, ...] = ("present_now@1:1500", "present_now@0.4:1000")
    stage_lr: float = 1e-3
    pool: int = 160                            # pooled stream stretches
    stream_s: int = 120                        # seconds of each (a frame pair a second at 2 fps)
    pairs: tuple[int, ...] = (1, 32)           # clip lengths in frame pairs (= seconds at 2 fps), min and max
    # Curriculum: the longest clip grows from pairs[0] to pairs[1] over the first ramp_steps
    # steps (a step's length is drawn uniformly up to it).
    ramp_steps: int = 1000
    short_tokens: int = 8 * 9                  # a ":short" stage's clips: at most 8 pairs of 3x3 tokens
    # A focus step on presence alone asks each clip both its questions: the colour in view now
    # ("yes") and one that is not ("no"), side by side in the batch. The frames are the same, so
    # only reading the named colour against the frame lowers the loss (asked one at a time, the
    # model sat at chance for 1,000+ steps).
    contrast: bool = True
    contrast_negatives: int = 1                # "no" colours asked per clip on such a step
    eval_every: int = 500
    eval_videos: int = 8                       # held-out streams per periodic check (3 clip lengths each)
    log_every: int = 50
    save_every: int = 0


# Fields of WorldTargetConfig that the live world does not read (not offered on its command line).
LIVE_UNUSED = ("frames", "sizes", "long_frames", "long_prob", "max_turns", "warm_steps", "warm_kinds",
               "short_only_kinds", "length_batches", "loss_weighting")

LIVE_TARGET_HELP = {
    **WORLD_TARGET_HELP,
    "temporal_positions": "temporal rope positions every clip spans (unset: real time, as a live stream needs)",
    "kinds": f"question kinds trained on, comma-separated, among {','.join(LIVE_KINDS)} (repeat one to weigh it more)",
    "stages": "later stages, comma-separated KINDS@SHARE:STEPS[:short] or mix:STEPS items (:short: clips of at "
              "most short_tokens visual tokens)",
    "short_tokens": "most visual tokens of a :short stage's clips (9 a frame pair)",
    "caption_prob": "share of chats (focus steps aside) that ask for the clip's story, first frame to now",
    "stage_caption_prob": "caption share of the later stages' mixed steps (default: caption_prob)",
    "eval_videos": "held-out streams per periodic accuracy check (clips of 4, 16 and 32 pairs each)",
    "pool": "stream stretches encoded once (their clips are drawn with fresh questions)",
    "stream_s": "seconds of each pooled stretch (one frame pair a second)",
    "pairs": "shortest and longest training clip, in frame pairs (seconds), comma-separated",
    "ramp_steps": "steps over which the longest training clip grows from the shortest to the longest (0: no ramp)",
    "contrast": "presence-only focus steps ask each clip both its yes and its no question (true/false)",
    "contrast_negatives": "colours not in view asked about per clip on a contrasted presence step",
}


# ----- the pool -----------------------------------------------------------------------------------
def session_options(seconds: float) -> VideoOptions:
    """How a live session samples: 2 fps, every frame pair kept."""
    frames = int(2 * seconds) + 2
    return VideoOptions(fps=2.0, min_frames=2, max_frames=max(768, frames), max_decoded_frames=max(1024, frames))


@dataclass(slots=True)
class PooledStream:
    """A stretch of a stream as the frozen tower sees it at 2 fps, and what each sampled frame shows."""

    embeds: torch.Tensor          # (pairs * per_pair, H)
    per_pair: int                 # visual tokens a frame pair
    grid_hw: tuple[int, int]      # patches of a frame (rows, columns)
    clip: Clip                    # the stretch's sampled stream frames and their views

    @property
    def pairs(self) -> int:
        return self.clip.pairs

    def sub(self, first: int, pairs: int) -> tuple[PooledVideo, Clip]:
        """Pairs [first, first + pairs) as a clip that starts at temporal position 0."""
        embeds = self.embeds[first * self.per_pair:(first + pairs) * self.per_pair]
        kwargs = {"video_grid_thw": torch.tensor([[pairs, *self.grid_hw]]),
                  "second_per_grid_ts": torch.tensor([1.0])}          # 2 frames at 2 fps
        clip = Clip(self.clip.frames[2 * first:2 * (first + pairs)], self.clip.views[2 * first:2 * (first + pairs)])
        return PooledVideo(embeds, kwargs, []), clip


def encoded_clip(stream: LiveStream, first_frame: int, seconds: int):
    """Stream frames [first_frame, first_frame + seconds * fps) through MPEG-TS and the 2 fps
    decode, as a session sees them: (Frames, the sampled stream frames)."""
    frames = load_frames(stream.encode_ts(first_frame, first_frame + round(seconds * stream.fps)),
                         session_options(seconds))
    index = first_frame + np.rint(frames.timestamps * stream.fps).astype(np.int64)
    return frames, index


@torch.no_grad()
def stream_pool(target: TargetModel, c: LiveTargetConfig, log: Callable[[str], None]) -> list[PooledStream]:
    pool, t0 = [], time.perf_counter()
    for i in range(c.pool):
        seed = c.seed * 1_000_003 + i
        stream = LiveStream(seed=seed)
        start = random.Random(seed).randrange(stream.block_frames)   # any phase and block offset
        frames, index = encoded_clip(stream, start, c.stream_s)
        video = target.processor.process(frames)
        embeds = target.hf.model.visual(video.pixel_values_videos, grid_thw=video.model_kwargs["video_grid_thw"])
        embeds = embeds if torch.is_tensor(embeds) else embeds.pooler_output
        t, h, w = video.model_kwargs["video_grid_thw"][0].tolist()
        pool.append(PooledStream(embeds, embeds.shape[0] // t, (h, w), Clip.of(stream, index)))
        if (i + 1) % 50 == 0:
            log(f"pool {i + 1}/{c.pool} streams {time.perf_counter() - t0:.0f}s")
    return pool


# ----- training ---------------------------------------------------------------------------------------
class LiveData:
    """train_world_target's data for the live world (see WorldData): each step, clips of one
    length drawn anywhere in the pool, one question each (the stage's kinds on a focus step)."""

    kinds = LIVE_KINDS

    def __init__(self, c: LiveTargetConfig):
        if len(c.pairs) != 2 or not 1 <= c.pairs[0] <= c.pairs[1] or c.pairs[1] > c.stream_s:
            raise ValueError(f"pairs must be MIN,MAX with 1 <= MIN <= MAX <= stream_s, got {c.pairs}")
        if not c.pool:
            raise ValueError("the live target trains from a pool (pool > 0)")
        unknown = set(c.kinds) - set(LIVE_KINDS)
        if unknown:
            raise ValueError(f"unknown question kinds {sorted(unknown)}; known: {LIVE_KINDS}")
        self.c = c
        self.pool: list[PooledStream] = []

    def prepare(self, target: TargetModel, stages: list[Stage], log: Callable[[str], None]) -> None:
        self.pool = stream_pool(target, self.c, log)

    def clips(self, rng: random.Random, short: bool = False, step: int | None = None) -> list[tuple[PooledVideo, Clip]]:
        """A batch of clips of one length (uniform up to the longest the step allows)."""
        c = self.c
        longest = c.pairs[1]
        if step is not None and step < c.ramp_steps:
            longest = c.pairs[0] + (c.pairs[1] - c.pairs[0]) * step // c.ramp_steps
        if short:
            longest = max(c.pairs[0], min(longest, c.short_tokens // self.pool[0].per_pair))
        pairs = rng.randint(c.pairs[0], longest)
        out = []
        for _ in range(c.batch):
            stretch = self.pool[rng.randrange(len(self.pool))]
            out.append(stretch.sub(rng.randint(0, stretch.pairs - pairs), pairs))
        return out

    def loss(self, target: TargetModel, stage: Stage, step: int, focus: bool, rng: random.Random) -> torch.Tensor:
        batch = self.clips(rng, short=focus and stage.short, step=step)
        c = self.c
        kinds = stage.kinds if focus else c.kinds
        if focus and c.contrast and kinds == ("present_now",):
            pairs = [(video, [qa]) for video, clip in batch for qa in _contrasted(clip, rng, c.contrast_negatives)]
            return pooled_loss(target, [v for v, _ in pairs], [chat for _, chat in pairs], c.loss_weighting, decode=True)
        captions = 0.0 if focus else c.caption_prob if stage.start == 0 or c.stage_caption_prob is None \
            else c.stage_caption_prob
        chats = [[(rng.choice(LIVE_CAPTION_PROMPTS), live_caption(clip)) if rng.random() < captions
                  else _one_question(clip, rng, kinds)] for _, clip in batch]
        # answers where the engine decodes them: after a long clip, past its last frame's time
        return pooled_loss(target, [v for v, _ in batch], chats, self.c.loss_weighting, decode=True)

    def heldout(self, target: TargetModel) -> dict:
        c = self.c
        return live_accuracy(target, list(range(EVAL_SEED, EVAL_SEED + c.eval_videos)), (4, 16, 32), c.kinds)


def _contrasted(clip: Clip, rng: random.Random, negatives: int) -> list[tuple[str, str]]:
    """A contrasted presence step's questions about one clip: with one negative, live_questions'
    pair (the "no" colour one the clip showed earlier half the time); with more, presence_contrast."""
    if negatives == 1:
        return [(q, a) for _, q, a in live_questions(clip, rng, ("present_now",))]
    return presence_contrast(clip, rng, negatives)


def _one_question(clip: Clip, rng: random.Random, kinds: tuple[str, ...]) -> tuple[str, str]:
    """A kind drawn uniformly from `kinds`, then one of its questions."""
    kind = rng.choice(kinds)
    _, q, a = rng.choice(live_questions(clip, rng, (kind,)))
    return q, a


def new_live_target(c: LiveTargetConfig) -> TargetModel:
    return new_world_target(c, tokenizer=live_tokenizer())


# ----- evaluation -------------------------------------------------------------------------------------
def heldout_clip(seed: int, pairs: int) -> tuple[LiveStream, int]:
    """A held-out clip of `pairs` seconds: its stream and the frame its window ends at (from
    the seed: anywhere in the stream's first ten minutes past the first `pairs` seconds)."""
    stream = LiveStream(seed=seed)
    rng = random.Random(seed * 7919 + pairs)
    end_s = rng.randrange(pairs, 600)
    return stream, round(end_s * stream.fps) + rng.randrange(round(stream.fps))


@torch.no_grad()
def live_accuracy(target: TargetModel, seeds: list[int], pairs: tuple[int, ...] = (1, 4, 8, 16, 24, 32),
                  kinds: tuple[str, ...] = LIVE_KINDS, engine: Engine | None = None,
                  on_clip: Callable[[], None] | None = None) -> dict:
    """Exact match of single-turn answers at temperature 0 through the engine, on one clip per
    (seed, length): the stream's frames up to the clip's end, MPEG-TS encoded and decoded at
    2 fps as a session samples them. Per kind, per clip length, and both."""
    engine = engine or Engine(target, spec=SpecConfig(method="none"), prefix_cache=PrefixCache(max_entries=1))
    right: dict[tuple[int, str], int] = {}
    total: dict[tuple[int, str], int] = {}
    for seed in seeds:
        for n in pairs:
            stream, end = heldout_clip(seed, n)
            frames, index = encoded_clip(stream, end - round(n * stream.fps), n)
            if not np.array_equal(index, clip_frames(stream, end, n)):     # what a 2 fps session samples
                raise AssertionError(f"decoded frames {index} are not the session's {clip_frames(stream, end, n)}")
            clip = Clip.of(stream, index)
            video = target.processor.process(frames)
            key = f"live-eval/{seed}/{n}"
            for kind, q, a in live_questions(clip, random.Random(seed * 31 + n), kinds):
                got = engine.generate(video, q, SamplingParams(max_new_tokens=4), video_key=key).text.strip()
                right[n, kind] = right.get((n, kind), 0) + (got == a)
                total[n, kind] = total.get((n, kind), 0) + 1
            if on_clip:
                on_clip()

    def share(keys) -> float | None:
        keys = [k for k in keys if total.get(k)]
        return sum(right[k] for k in keys) / sum(total[k] for k in keys) if keys else None

    per_kind = {k: share([(n, k) for n in pairs]) for k in kinds if share([(n, k) for n in pairs]) is not None}
    return {"accuracy": share(list(total)), "per_kind": per_kind,
            "standing": share([k for k in total if k[1] in STANDING_KINDS]),
            "per_pairs": {str(n): share([(n, k) for k in kinds]) for n in pairs},
            "per_pairs_kind": {str(n): {k: share([(n, k)]) for k in kinds if total.get((n, k))} for n in pairs},
            "questions": sum(total.values()), "clips": len(seeds) * len(pairs), "streams": len(seeds)}


def train_live_target_cli(c: LiveTargetConfig, out: str | Path, eval_streams: int = 40,
                          eval_pairs: tuple[int, ...] = (1, 4, 8, 16, 24, 32), init: str | Path | None = None,
                          log: Callable[[str], None] | None = None) -> dict:
    """Train (from scratch, or on from `init`), save to `out`, measure held-out accuracy on
    fresh streams (seeds disjoint from training's) at each clip length, write live_target.json."""
    target = TargetModel.from_pretrained(init) if init is not None else new_live_target(c)
    t0 = time.perf_counter()
    target, history = train_world_target(c, log=log, target=target, out=out, data=LiveData(c))
    seconds = time.perf_counter() - t0
    target.save_pretrained(out)
    t1 = time.perf_counter()
    accuracy = live_accuracy(target, list(range(EVAL_SEED, EVAL_SEED + eval_streams)), eval_pairs, c.kinds)
    report = {"config": asdict(c), "init": None if init is None else str(init), "train_seconds": seconds,
              "eval_seconds": time.perf_counter() - t1,
              "final_loss": [h for h in history if "loss" in h][-1]["loss"],
              "lm_parameters": lm_parameters(target), "accuracy": accuracy,
              "heldout_during_training": [h for h in history if "heldout" in h]}
    Path(out, "live_target.json").write_text(json.dumps(report, indent=2))
    return report
