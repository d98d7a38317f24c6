"""What a step of `sparrow world train-target` reads, and its loss (the model is in
world/target_model.py, the loop in world/target_train.py).

A conversation about a video becomes token ids with the answers marked to learn
(`conversation_ids`, batched by `chat_batch`); its loss is the cross-entropy on those answers
(`answer_loss`), over full videos (`conversation_loss`) or over a pool of videos whose visual
tokens the frozen tower computed once (`video_pool`, `pooled_loss`). The stages
(`training_stages`) say which questions each step asks, and `WorldData` draws each step's batch
from the world; another task (world/live_target.py) brings its own data object.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from sparrow.models.target import TargetModel
from sparrow.video import ProcessedVideo

from sparrow.world.scenes import CAPTION_PROMPTS, QUESTION_KINDS, WorldVideo, caption, questions
from sparrow.world.target_model import EVAL_SEED, WorldTargetConfig, world_accuracy, world_sample


# ----- conversations ---------------------------------------------------------------------------------
def conversation_ids(target: TargetModel, num_visual_tokens: int, turns: list[tuple[str, str]]) -> tuple[list[int], list[bool]]:
    """Token ids of a chat about the video (the video in the first user turn, through the real
    chat template) and which tokens to learn: each assistant answer and its <|im_end|>."""
    tok = target.tokenizer
    messages = []
    for i, (q, a) in enumerate(turns):
        content = [{"type": "video"}, {"type": "text", "text": q}] if i == 0 else q
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": a}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    at = ids.index(target.video_token_id)
    ids = ids[:at] + [target.video_token_id] * num_visual_tokens + ids[at + 1:]
    start, reply, end = tok.convert_tokens_to_ids(["<|im_start|>", "assistant", "<|im_end|>"])
    learn, inside = [], False
    for i, t in enumerate(ids):
        learn.append(inside)
        if i > 0 and ids[i - 1] == start and t == reply:
            inside = True                      # the answer starts after "<|im_start|> assistant"
        elif t == end:
            inside = False                     # ... and its <|im_end|> is the last learned token
    return ids, learn


def chat_batch(target: TargetModel, num_visual: list[int], model_kwargs: list[dict],
               chats: list[list[tuple[str, str]]]) -> tuple[dict, torch.Tensor]:
    """Token-side HF inputs for B chats, right-padded (ids, attention mask, the videos' grid
    kwargs, family extras), and the (B, T) mask of tokens to learn."""
    rows = [conversation_ids(target, n, turns) for n, turns in zip(num_visual, chats)]
    width = max(len(ids) for ids, _ in rows)
    pad = target.tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    learn = torch.tensor([m + [False] * (width - len(m)) for _, m in rows])
    inputs = {"input_ids": input_ids, "attention_mask": attention,   # video_grid_thw (B, 3), second_per_grid_ts (B,)
              **{k: torch.cat([kw[k] for kw in model_kwargs]) for k in model_kwargs[0]}}
    inputs.update(target.family.extra_inputs(input_ids, target.video_token_id))
    return inputs, learn


def conversation_batch(target: TargetModel, videos: list[ProcessedVideo],
                       chats: list[list[tuple[str, str]]]) -> tuple[dict, torch.Tensor]:
    """HF inputs for B chats about B processed videos, and the mask of tokens to learn.
    Batching several videos per forward is what makes CPU training fast enough."""
    inputs, learn = chat_batch(target, [v.num_visual_tokens for v in videos], [v.model_kwargs for v in videos], chats)
    inputs["pixel_values_videos"] = torch.cat([v.pixel_values_videos for v in videos])
    return inputs, learn


def answer_loss(logits: torch.Tensor, ids: torch.Tensor, pick: torch.Tensor, weighting: str = "token") -> torch.Tensor:
    """Cross-entropy of the picked next tokens; logits (N, V) are at pick's True places of
    (B, T-1), in order. "token": the mean over tokens; "chat": the mean over chats of each
    chat's mean, so a one-word answer weighs as much as a caption."""
    losses = F.cross_entropy(logits.float(), ids[:, 1:][pick], reduction="none")
    if weighting == "token":
        return losses.mean()
    if weighting != "chat":
        raise ValueError(f"loss weighting must be 'token' or 'chat', got {weighting!r}")
    per_chat = pick.sum(1)
    rows = pick.nonzero()[:, 0]
    return (losses / per_chat[rows]).sum() / (per_chat > 0).sum()


def decode_positions(position_ids: torch.Tensor, learn: torch.Tensor) -> torch.Tensor:
    """(3, B, T) positions with each row's answer (from its first learned token on) where the
    engine decodes it: one past the prompt's largest position and on from there (HF's rope
    delta), not one past the question. The two differ when a video's temporal positions run
    past the text after it: transformers 5.24 starts that text at start + the frame grid's side,
    so a real-time clip longer than a few seconds has its last frames "later" than its
    question, and a target taught contiguous answers meets a jump at its second answer token
    (live clips of 16-32 s answered "red circle" to "what colour is the shape now ?").
    Single-turn chats: the engine prefills an earlier turn's answer contiguously."""
    out = position_ids.clone()
    for b in range(learn.shape[0]):
        first = learn[b].nonzero()
        if len(first):
            at = int(first[0])
            top = position_ids[:, b, :at].max()
            out[:, b, at:] = top + 1 + torch.arange(learn.shape[1] - at, device=out.device)
    return out


def conversation_loss(target: TargetModel, inputs: dict, learn: torch.Tensor, weighting: str = "token",
                      decode: bool = False) -> torch.Tensor:
    """Cross-entropy over the learned tokens of the batch (answer_loss's weighting). decode:
    answers at the engine's decode positions (decode_positions), else contiguous (HF's)."""
    position_ids, _ = target.family.prefill_positions(target.hf, inputs)
    if decode:
        position_ids = decode_positions(position_ids, learn)
    logits = target.hf(**inputs, position_ids=position_ids, use_cache=False).logits      # (B, T, V)
    pick = learn[:, 1:]                                    # token t+1 is predicted at position t
    return answer_loss(logits[:, :-1][pick], inputs["input_ids"], pick, weighting)


def world_turns(events: list[dict], rng: random.Random, max_turns: int, caption_prob: float,
                kinds: tuple[str, ...] = QUESTION_KINDS) -> list[tuple[str, str]]:
    """The chat turns about one video: with probability caption_prob the caption request
    first, then questions in random order, at most max_turns. Single-turn (max_turns 1) is
    the recipe: in a longer chat a later answer can be copied from an earlier one (the caption
    names every colour), and a model trained that way learned to answer "is there a red
    shape?" from the text, which a single question about a video does not have."""
    qa = [(q, a) for _, q, a in questions(events, rng, kinds)]
    rng.shuffle(qa)
    if rng.random() < caption_prob:
        qa.insert(0, (rng.choice(CAPTION_PROMPTS), caption(events)))
    return qa[:max_turns]


# ----- the video pool ---------------------------------------------------------------------------------
def training_world(c: WorldTargetConfig, rng: random.Random) -> WorldVideo:
    if c.long_frames and rng.random() < c.long_prob:
        return WorldVideo(num_frames=rng.choice(c.long_frames), size=c.long_size)
    return WorldVideo(num_frames=rng.choice(c.frames), size=rng.choice(c.sizes))


@dataclass(slots=True)
class PooledVideo:
    """A rendered world video as the frozen tower sees it: its visual tokens, grid and script."""

    embeds: torch.Tensor          # (Nv, H) the vision tower's output
    model_kwargs: dict            # video_grid_thw (1, 3), second_per_grid_ts (1,)
    events: list[dict]


@torch.no_grad()
def video_pool(target: TargetModel, c: WorldTargetConfig, log: Callable[[str], None]) -> list[PooledVideo]:
    pool, t0 = [], time.perf_counter()
    for i in range(c.pool):
        rng = random.Random(c.seed * 1_000_003 + i)
        world = training_world(c, rng)
        video, events = world_sample(target, world, seed=(c.seed * 1_000_003 + i) * 64)
        embeds = target.hf.model.visual(video.pixel_values_videos, grid_thw=video.model_kwargs["video_grid_thw"])
        embeds = embeds if torch.is_tensor(embeds) else embeds.pooler_output
        pool.append(PooledVideo(embeds, dict(video.model_kwargs), events))
        if (i + 1) % 500 == 0:
            log(f"pool {i + 1}/{c.pool} videos {time.perf_counter() - t0:.0f}s")
    return pool


def length_groups(pool: list[PooledVideo]) -> list[list[int]]:
    """For each pooled video, the indices of the pool's videos with its number of tokens."""
    by: dict[int, list[int]] = {}
    for i, v in enumerate(pool):
        by.setdefault(v.embeds.shape[0], []).append(i)
    return [by[v.embeds.shape[0]] for v in pool]


def pool_batch(pool: list[PooledVideo], same_length: list[list[int]] | None, rng: random.Random,
               batch: int, among: list[int] | None = None) -> list[PooledVideo]:
    """`batch` videos drawn from the pool (or its indices `among`; a length group lies wholly
    inside or outside a token bound, so `among` from one keeps batches inside it)."""
    among = among if among is not None else range(len(pool))
    if same_length is None:
        return [pool[rng.choice(among)] for _ in range(batch)]
    group = same_length[rng.choice(among)]
    return [pool[rng.choice(group)] for _ in range(batch)]


def pooled_loss(target: TargetModel, videos: list[PooledVideo], chats: list[list[tuple[str, str]]],
                weighting: str = "token", decode: bool = False) -> torch.Tensor:
    """conversation_loss for pooled videos: the language model on inputs_embeds with the
    video's tokens in place, positions from the same M-RoPE rule as inference."""
    logits, ids, pick = pooled_logits(target, videos, chats, decode)
    return answer_loss(logits, ids, pick, weighting)


def pooled_logits(target: TargetModel, videos: list[PooledVideo], chats: list[list[tuple[str, str]]],
                  decode: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits (N, V) predicting each learned token, input ids (B, T), pick (B, T-1)) for pooled_loss."""
    inputs, learn = chat_batch(target, [v.embeds.shape[0] for v in videos], [v.model_kwargs for v in videos], chats)
    ids, attention = inputs["input_ids"], inputs["attention_mask"]
    position_ids, _ = target.family.prefill_positions(target.hf, inputs)
    if decode:
        position_ids = decode_positions(position_ids, learn)
    embeds = target.hf.model.language_model.embed_tokens(ids)
    embeds = embeds.masked_scatter((ids == target.video_token_id)[..., None],
                                   torch.cat([v.embeds for v in videos]).to(embeds.dtype))
    hidden = target.hf.model.language_model(inputs_embeds=embeds, position_ids=position_ids,
                                            attention_mask=attention, use_cache=False).last_hidden_state
    pick = learn[:, 1:]
    return target.lm_head()(hidden[:, :-1][pick]), ids, pick


# ----- stages -----------------------------------------------------------------------------------------
# A stage's flag for a curriculum by object count: its focus steps ask about scenes of at most this many objects.
OBJECT_FLAGS = {"one": 1, "two": 2, "three": 3}


@dataclass(frozen=True, slots=True)
class Stage:
    """A stretch of training with its own learning-rate schedule and question mix."""

    start: int                     # first step (global)
    steps: int
    lr: float
    warmup: int
    kinds: tuple[str, ...] = ()    # asked alone on a `share` of the stage's steps
    share: float = 0.0
    short: bool = False            # videos of at most short_tokens visual tokens only
    objects: int = 0               # focus steps on scenes of at most this many objects (world v2's pool; 0: any)

    @staticmethod
    def parse(spec: str, start: int, c: WorldTargetConfig, known: tuple[str, ...] = QUESTION_KINDS) -> "Stage":
        try:
            head, steps, *flags = spec.split(":")
            kinds, share = ("", "0") if head == "mix" and not flags else head.split("@")   # mixed steps only
            if flags not in ([], ["short"], *([f] for f in OBJECT_FLAGS)):
                raise ValueError(flags)
            stage = Stage(start, int(steps), c.stage_lr, c.stage_warmup, tuple(filter(None, kinds.split("+"))),
                          float(share), flags == ["short"], OBJECT_FLAGS.get(flags[0], 0) if flags else 0)
        except ValueError:
            raise ValueError(f"stage {spec!r}: expected KINDS@SHARE:STEPS, KINDS@SHARE:STEPS:short, "
                             "KINDS@SHARE:STEPS:one (or :two, :three: scenes of at most that many objects) "
                             "or mix:STEPS") from None
        unknown = set(stage.kinds) - set(known)
        if unknown or not 0 <= stage.share <= 1 or stage.steps <= 0:
            raise ValueError(f"stage {spec!r}: kinds among {known}, share in [0, 1], steps > 0")
        return stage


def training_stages(c: WorldTargetConfig, known: tuple[str, ...] = QUESTION_KINDS) -> list[Stage]:
    """The first stage (c.steps) and c.stages after it; `known`: the question kinds a stage may name."""
    stages = [Stage(0, c.steps, c.lr, c.warmup)] if c.steps else []
    for spec in c.stages:
        stages.append(Stage.parse(spec, sum(s.steps for s in stages), c, known))
    return stages


def stage_at(stages: list[Stage], step: int) -> Stage:
    return next(s for s in reversed(stages) if s.start <= step)


def focus_step(stage: Stage, rng: random.Random) -> bool:
    """Whether a step of this stage asks only the stage's kinds (drawn once per step)."""
    return bool(stage.share) and rng.random() < stage.share


def step_turns(c: WorldTargetConfig, stage: Stage, step: int, events: list[dict], rng: random.Random,
               focus: bool = False, short: bool = True) -> list[tuple[str, str]]:
    """One training conversation at `step`: the curriculum's kinds, the stage's own kinds on
    a focus step, else the first stage's mix (in later stages without short_only_kinds when
    the video is not short)."""
    if step < c.warm_steps:
        return world_turns(events, rng, c.max_turns, 0.0, c.warm_kinds)
    if focus:
        return world_turns(events, rng, c.max_turns, 0.0, stage.kinds)
    if stage.start == 0:
        return world_turns(events, rng, c.max_turns, c.caption_prob, c.kinds)
    kinds = c.kinds if short else tuple(k for k in c.kinds if k not in c.short_only_kinds)
    caption_prob = c.caption_prob if c.stage_caption_prob is None else c.stage_caption_prob
    return world_turns(events, rng, c.max_turns, caption_prob, kinds)


class WorldData:
    """What train_world_target trains on: the world's videos (pooled, or fresh with pool=0)
    and questions. Another task (world/live_target.py) supplies its own object with the
    same four members and reuses the loop, the stages and the loss."""

    kinds = QUESTION_KINDS                 # the question kinds a stage may name

    def __init__(self, c: WorldTargetConfig):
        self.c = c
        self.pool: list[PooledVideo] | None = None
        self.same_length: list[list[int]] | None = None
        self.short: list[int] | None = None

    def prepare(self, target: TargetModel, stages: list[Stage], log: Callable[[str], None]) -> None:
        """Render and encode what training reads (the pool), before the first step."""
        c = self.c
        self.pool = video_pool(target, c, log) if c.pool else None
        self.same_length = length_groups(self.pool) if self.pool is not None and c.length_batches else None
        self.short = ([i for i, v in enumerate(self.pool) if v.embeds.shape[0] <= c.short_tokens]
                      if self.pool is not None else None)
        if self.short is not None and not self.short and any(s.short for s in stages):
            raise ValueError(f"no pooled video has at most short_tokens={c.short_tokens} visual tokens")
        if any(s.objects for s in stages):
            raise ValueError("a stage of scenes by object count (':one', ':two', ':three') is world v2's "
                             "(train-target-v2)")

    def loss(self, target: TargetModel, stage: Stage, step: int, focus: bool, rng: random.Random) -> torch.Tensor:
        """One step's batch, drawn with `rng`, and its loss."""
        c, pool = self.c, self.pool
        if pool is not None:
            videos = pool_batch(pool, self.same_length, rng, c.batch, self.short if focus and stage.short else None)
            is_short = videos[0].embeds.shape[0] <= c.short_tokens
            chats = [step_turns(c, stage, step, v.events, rng, focus, is_short) for v in videos]
            return pooled_loss(target, videos, chats, c.loss_weighting)
        world = (WorldVideo(num_frames=min(c.frames), size=min(c.sizes)) if focus and stage.short
                 else training_world(c, rng))   # one shape per batch
        videos, chats = [], []
        for b in range(c.batch):
            video, events = world_sample(target, world, seed=(c.seed * 1_000_003 + step) * 64 + b)
            videos.append(video)
            chats.append(step_turns(c, stage, step, events, rng, focus, video.num_visual_tokens <= c.short_tokens))
        return conversation_loss(target, *conversation_batch(target, videos, chats), c.loss_weighting)

    def heldout(self, target: TargetModel) -> dict:
        """The periodic check: per-kind accuracy on c.eval_videos held-out videos."""
        c = self.c
        return world_accuracy(target, WorldVideo(num_frames=c.frames[0]), list(range(EVAL_SEED, EVAL_SEED + c.eval_videos)),
                              c.kinds)
