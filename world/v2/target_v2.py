"""`sparrow world train-target-v2`'s model and data: a tiny Qwen2.5-VL trained from nothing on
world v2, through the world target's machinery (world/target_model.py, world/target_data.py,
world/target_train.py): the same model config and frozen readable vision tower, a pool of videos
whose visual tokens the tower computed once, batches of one length, single-turn chats with the
loss on the answer, stages with checkpoints, resumed from OUT/checkpoint.

What v2 changes: the tokenizer (`v2_tokenizer`), the questions (`questions_v2.ask`, several
wordings, answers of one word to a few hundred), real time (`temporal_positions=None`: 2 rope
steps a second, so "at 0 : 17" is a position the model can read, and long videos append rather
than squeeze), and the pool: v2 scenes from the train split's seeds, rendered to mp4 and decoded
as serving does, at `side` px (112 px: 4 x 4 tokens a frame pair, 16 a second; 224 px, the
benchmark's 64 a second, is the long stage's).

Training runs as stages, each its own command on the previous one's output (`STAGES_V2`):

    short    one-word and short answers (counts, yes/no, when, ordering, size, ...) about 8-30 s
    narrate  the same with narrations and object stories mixed in (answers of 60-270 tokens)
    long     224 px videos to 391 s (25k visual tokens), batches of one
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from sparrow.models.target import TargetModel
from sparrow.video import load_frames

from sparrow.world.target_data import (PooledVideo, Stage, answer_loss, length_groups, pool_batch, pooled_logits,
                                       pooled_loss)
from sparrow.world.target_model import WORLD_TARGET_HELP, WorldTargetConfig, new_world_target
from sparrow.world.v2.attend_v2 import ATTEND_KINDS, EVENT_KINDS, attention_loss, attention_of, chat_cells, head_map
from sparrow.world.v2.questions_v2 import QUESTION_KINDS_V2, ask
from sparrow.world.v2.render_v2 import BACKGROUND_BASE, BACKGROUND_SPAN, FPS, make_video
from sparrow.world.v2.scenes_v2 import Scene, make_scene
from sparrow.world.v2.splits_v2 import split_seeds
from sparrow.world.v2.tower_v2 import placed_vision_init
from sparrow.world.v2.vocab_v2 import v2_tokenizer

LONG_KINDS = ("narrate", "story")                 # answers of 20-270 tokens
SHORT_KINDS = tuple(k for k in QUESTION_KINDS_V2 if k not in LONG_KINDS)
FALLBACK_KIND = "count_start"                     # every scene can be asked it


@dataclass(frozen=True, slots=True)
class V2TargetConfig(WorldTargetConfig):
    """WorldTargetConfig's model and schedule fields with world v2's defaults and data."""

    temporal_positions: int | None = None        # real time: 2 rope steps a second
    vision_depth: int = 3                        # the placed tower (world/v2/tower_v2.py)
    vision_init: str = "placed"
    mrope_section: tuple[int, ...] = (8, 4, 4)   # more of the head for time (times are answers)
    kinds: tuple[str, ...] = SHORT_KINDS         # drawn uniformly per chat (repeat one to weigh it more)
    caption_prob: float = 0.0                    # share of chats that ask for the narration
    steps: int = 6000
    batch: int = 8
    lr: float = 2e-3
    warmup: int = 100
    pool: int = 1200
    side: int = 112                              # frame side in px (a multiple of 28)
    seconds: tuple[int, ...] = (8, 12, 16, 24, 30)   # pooled video lengths, in turn
    eval_every: int = 500
    # Replay against forgetting: a share of steps drawn from a second pool (the earlier stages' side and lengths)
    replay_prob: float = 0.0
    replay_pool: int = 400
    replay_side: int = 112
    replay_seconds: tuple[int, ...] = (8, 30)
    replay_batch: int = 8
    eval_videos: int = 4                         # test-split videos per periodic check (8 s and 30 s each)
    save_every: int = 100
    log_every: int = 25
    # The attention objective (world/v2/attend_v2.py): weight 0 is off
    attend_weight: float = 0.0
    attend_layer: int = 2
    attend_heads: tuple[int, ...] = (0,)
    attend_head_of: tuple[str, ...] = ()     # KIND=HEAD[+HEAD...]: a kind's own heads (the others: attend_heads)
    attend_kinds: tuple[str, ...] = tuple(ATTEND_KINDS)      # and any of EVENT_KINDS


# Fields of WorldTargetConfig that v2 does not read (not offered on its command line).
V2_UNUSED = ("frames", "sizes", "long_frames", "long_prob", "long_size", "max_turns", "warm_steps", "warm_kinds",
             "short_only_kinds", "vision_lr_scale", "short_tokens")

V2_TARGET_HELP = {
    **WORLD_TARGET_HELP,
    "temporal_positions": "temporal rope positions every video spans (unset: real time, 2 steps a second)",
    "kinds": f"question kinds drawn per chat, comma-separated, among {','.join(QUESTION_KINDS_V2)} "
             "(repeat one to weigh it more)",
    "caption_prob": "share of chats that ask for the narration (besides kinds)",
    "stage_caption_prob": "narration share of the later stages' mixed steps (default: caption_prob)",
    "stages": "later stages, comma-separated KINDS@SHARE:STEPS[:one|:two|:three] or mix:STEPS items (:one: focus "
              "steps on one-object scenes; :two, :three: on scenes of at most that many)",
    "pool": "videos rendered once and reused with fresh questions",
    "side": "frame side in px (a multiple of 28; 224 is the benchmark's)",
    "seconds": "pooled video lengths in seconds, comma-separated, in turn",
    "replay_prob": "share of steps drawn from the replay pool (the earlier stages' videos, against forgetting; 0: off)",
    "replay_pool": "videos in the replay pool (their seeds apart from the main pool's)",
    "replay_side": "the replay pool's frame side in px",
    "replay_seconds": "the replay pool's video lengths in seconds, comma-separated, in turn",
    "replay_batch": "videos a replay step",
    "eval_videos": "test-split videos per periodic accuracy check (at 8 s and 30 s)",
    "attend_weight": "weight of the attention objective: one head, at an answer about one object, asked to look at "
                     "that object's visual tokens (world/v2/attend_v2.py; 0: off)",
    "attend_layer": "the language-model layer whose head the attention objective trains",
    "attend_heads": "that layer's heads it trains, comma-separated",
    "attend_head_of": "kinds on heads of their own, comma-separated KIND=HEAD[+HEAD...] items (e.g. where=0,"
                      "colour_end=1,size=2); the kinds not named train attend_heads",
    "attend_kinds": f"the question kinds it looks for, comma-separated: about one object ({','.join(ATTEND_KINDS)}) "
                    f"and about one event ({','.join(EVENT_KINDS)})",
    "vision_init": "the tower: placed (each object patch's colour, change and place) or named (also one code "
                   "per palette colour: world/v2/tower_v2.py)",
}

# Each stage is a command on the previous one's output (--init); its options over the config's.
STAGES_V2: dict[str, dict] = {
    "short": {},
    "narrate": dict(kinds=(*SHORT_KINDS, "story"), caption_prob=0.3, steps=4000, lr=1e-3, warmup=50),
    "long": dict(kinds=(*SHORT_KINDS, "story"), caption_prob=0.4, steps=1500, lr=3e-4, warmup=20, side=224,
                 seconds=(24, 60, 125, 250, 391), pool=200, batch=1, eval_every=0),
}


def new_v2_target(c: V2TargetConfig) -> TargetModel:
    """A fresh v2 target: the world target's model with v2's tokenizer, c's time and the placed
    tower (its tokens carry an object's place: tower_v2.py; "named": also a code per palette
    colour), unless c asks for v1's."""
    target = new_world_target(c, tokenizer=v2_tokenizer())
    if c.vision_init in ("placed", "named"):
        placed_vision_init(target.hf.model.visual, named=c.vision_init == "named")
    return target


# ----- the pool -----------------------------------------------------------------------------------
@dataclass(slots=True)
class PooledScene(PooledVideo):
    """A pooled v2 video; `events` is unused, `scene` is its truth."""

    scene: Scene | None = None


REPLAY_SEED_OFFSET = 50       # the replay pool draws as config seed + 50 does: no scene of the main pool


def replay_config(c: V2TargetConfig) -> V2TargetConfig:
    """The config whose pool is c's replay pool (scene_pool reads pool, seed, side and seconds)."""
    return replace(c, pool=c.replay_pool, side=c.replay_side, seconds=c.replay_seconds, seed=c.seed + REPLAY_SEED_OFFSET)


def pool_seed(c: V2TargetConfig, i: int) -> int:
    """The train-split seed of pooled video i (config seeds 0-99 never share a scene)."""
    return split_seeds("train", 1, first=c.seed * 10_000_000 + i)[0]


@torch.no_grad()
def encode_video(target: TargetModel, seed: int, seconds: int, side: int) -> tuple[torch.Tensor, dict]:
    """The frozen tower's visual tokens of a v2 video (mp4 through the serving decode) and its grid kwargs."""
    video = make_video(seed, seconds, None, side, FPS)
    processed = target.processor.process(load_frames(video.source, video.options()))
    embeds = target.hf.model.visual(processed.pixel_values_videos, grid_thw=processed.model_kwargs["video_grid_thw"])
    embeds = embeds if torch.is_tensor(embeds) else embeds.pooler_output
    return embeds, dict(processed.model_kwargs)


def scene_pool(target: TargetModel, c: V2TargetConfig, log: Callable[[str], None],
               cache: str | Path | None = None) -> list[PooledScene]:
    """c.pool videos, lengths c.seconds in turn; `cache`: a file that keeps the visual tokens
    between runs (a resumed stage reads them back instead of rendering again)."""
    key = {"pool": c.pool, "seed": c.seed, "side": c.side, "seconds": list(c.seconds), "tower": c.vision_init,
           "depth": c.vision_depth, "background": [BACKGROUND_BASE, BACKGROUND_SPAN]}
    stored = torch.load(cache, weights_only=False) if cache is not None and Path(cache).is_file() else None
    if stored is not None and stored["key"] != key:
        log(f"pool cache {cache} is for {stored['key']}, not {key}: rendering again")
        stored = None
    rows, t0 = (stored["rows"] if stored else []), time.perf_counter()
    for i in range(len(rows), c.pool):
        seconds = c.seconds[i % len(c.seconds)]
        rows.append((pool_seed(c, i), seconds, *encode_video(target, pool_seed(c, i), seconds, c.side)))
        if (i + 1) % 100 == 0:
            log(f"pool {i + 1}/{c.pool} videos {time.perf_counter() - t0:.0f}s")
    if cache is not None and stored is None:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "rows": rows}, cache)
    return [PooledScene(embeds, kwargs, [], make_scene(seed, seconds)) for seed, seconds, embeds, kwargs in rows]


# ----- chats ----------------------------------------------------------------------------------------
def chat_about(scene: Scene, kinds: tuple[str, ...], narration_prob: float,
               rng: random.Random) -> tuple[str, str, str]:
    """One training question: (its kind, the question, its answer); the narration with
    probability narration_prob, else a kind drawn from `kinds` (another when the scene has
    nothing of that kind to ask)."""
    if narration_prob and rng.random() < narration_prob:
        return ("narrate", *ask(scene, "narrate", rng))
    for _ in range(8):
        kind = rng.choice(kinds)
        qa = ask(scene, kind, rng)
        if qa is not None:
            return (kind, *qa)
    return (FALLBACK_KIND, *ask(scene, FALLBACK_KIND, rng))


class V2Data:
    """train_world_target's data for world v2 (see target_data.WorldData): each step, pooled
    videos of one length and one fresh question each (the stage's kinds on a focus step)."""

    kinds = QUESTION_KINDS_V2

    def __init__(self, c: V2TargetConfig, cache: str | Path | None = None, eval_seconds: tuple[int, ...] = (8, 30)):
        unknown = set(c.kinds) - set(QUESTION_KINDS_V2)
        if unknown:
            raise ValueError(f"unknown question kinds {sorted(unknown)}; known: {QUESTION_KINDS_V2}")
        if not c.pool:
            raise ValueError("the v2 target trains from a pool (pool > 0)")
        if set(c.attend_kinds) - set(ATTEND_KINDS) - set(EVENT_KINDS):
            raise ValueError(f"attend_kinds among {(*ATTEND_KINDS, *EVENT_KINDS)}, got {c.attend_kinds}")
        self.head_of = head_map(c.attend_head_of)
        self.c, self.cache, self.eval_seconds = c, cache, eval_seconds
        self.pool: list[PooledScene] = []
        self.same_length: list[list[int]] | None = None
        self.replay: list[PooledScene] = []
        self.replay_same: list[list[int]] | None = None
        # the pool's scenes of at most N objects, for the stages that ask about them (':one', ':two', ...)
        self.few_objects: dict[int, tuple[list[PooledScene], list[list[int]] | None]] = {}

    def prepare(self, target: TargetModel, stages: list[Stage], log: Callable[[str], None]) -> None:
        if self.c.attend_weight:
            n = target.hf.config.text_config.num_attention_heads
            wanted = {h for heads in (self.c.attend_heads, *self.head_of.values()) for h in heads}
            if max(wanted) >= n:
                raise ValueError(f"attention heads {sorted(wanted)}: the language model has {n} (0-{n - 1})")
        self.pool = scene_pool(target, self.c, log, self.cache)
        self.same_length = length_groups(self.pool) if self.c.length_batches else None
        if self.c.replay_prob:
            replay = replay_config(self.c)
            cache = None if self.cache is None else Path(self.cache).with_name(f"replay-seed{replay.seed}-{replay.side}px-"
                                                                               f"{replay.pool}.pt")
            self.replay = scene_pool(target, replay, log, cache)
            self.replay_same = length_groups(self.replay) if self.c.length_batches else None
        for most in sorted({s.objects for s in stages if s.objects}):
            few = [v for v in self.pool if len(v.scene.objects) <= most]
            if not few:
                raise ValueError(f"a stage of scenes of at most {most} objects needs such scenes in the pool; "
                                 "none are (one-object scenes: ':one')")
            self.few_objects[most] = (few, length_groups(few))

    def loss(self, target: TargetModel, stage: Stage, step: int, focus: bool, rng: random.Random) -> torch.Tensor:
        c = self.c
        if focus and stage.objects:              # scenes of few objects (a curriculum's first steps)
            videos = pool_batch(*self.few_objects[stage.objects], rng, c.batch)
        elif self.replay and rng.random() < c.replay_prob:
            videos = pool_batch(self.replay, self.replay_same, rng, c.replay_batch)
        else:
            videos = pool_batch(self.pool, self.same_length, rng, c.batch)
        kinds = stage.kinds if focus else c.kinds
        narration = 0.0 if focus else c.caption_prob if stage.start == 0 or c.stage_caption_prob is None \
            else c.stage_caption_prob
        asked = [chat_about(v.scene, kinds, narration, rng) for v in videos]
        chats = [[(q, a)] for _, q, a in asked]
        # answers where the engine decodes them: past the video's last temporal position
        if not c.attend_weight:
            return pooled_loss(target, videos, chats, c.loss_weighting, decode=True)
        with attention_of(target, c.attend_layer) as seen:
            logits, ids, pick = pooled_logits(target, videos, chats, decode=True)
        loss = answer_loss(logits, ids, pick, c.loss_weighting)
        cells = [chat_cells(v.scene, kind, q, tuple(v.model_kwargs["video_grid_thw"][0].tolist()), a)
                 if kind in c.attend_kinds else [] for v, (kind, q, a) in zip(videos, asked)]
        heads = [self.head_of.get(kind, c.attend_heads) for kind, _, _ in asked]
        attend = attention_loss(seen["weights"], ids, pick, target.video_token_id, cells, heads)
        return loss if attend is None else loss + c.attend_weight * attend

    def heldout(self, target: TargetModel) -> dict:
        from sparrow.world.v2.eval_v2 import v2_accuracy

        c = self.c
        return v2_accuracy(target, split_seeds("test", c.eval_videos), self.eval_seconds, c.side, SHORT_KINDS)
