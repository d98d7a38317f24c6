"""`sparrow world train-target`: a tiny Qwen2.5-VL trained from scratch on the synthetic world.

Training videos are rendered once (mp4 through the real decode + patchify path, as serving
sees it) into a pool whose visual tokens the frozen vision tower computes once; every step
draws a batch of pooled videos of one length and a fresh single-turn conversation about each
(a question or the caption request, in a random wording), loss on the answer only. Training
runs in stages (`WorldTargetConfig.stages`): the usual mix first, then questions that the mix
leaves at chance asked alone, then the mix again with those upweighted. Evaluation asks
single-turn questions through the engine at temperature 0 and counts exact matches.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixCache
from sparrow.video import ProcessedVideo, load_frames, processor_for
from sparrow.video.processors import OPENAI_CLIP_MEAN as QWEN_MEAN, OPENAI_CLIP_STD as QWEN_STD
from sparrow.video.synthetic import BACKGROUND

from .world import CAPTION_PROMPTS, QUESTION_KINDS, WorldVideo, caption, questions, world_tokenizer

# Held-out videos use seeds from here on; training videos use (seed * 1_000_003 + step) * 64 + b,
# below 10**9 for config seeds < 15.
EVAL_SEED = 10**9


@dataclass(frozen=True, slots=True)
class WorldTargetConfig:
    hidden: int = 128
    layers: int = 6
    heads: int = 4
    intermediate: int = 384
    vision_hidden: int = 32
    vision_depth: int = 2
    # Qwen2.5-VL's own patching (14 px patches, 2x2 merged: one visual token per 28x28 px of a
    # frame pair), and no upscaling of small frames (min_pixels one token): an 84 px world
    # frame is 3x3 tokens, and long videos stay affordable (25k tokens = 470 MB of pixels).
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 28 * 28
    # M-RoPE (sections t, h, w; sum head_dim/2). Qwen2.5-VL gives time the highest
    # frequencies and width the lowest: here width positions barely rotate, and left/right
    # motion is read from the visual code's frame-to-frame change instead. A small theta that
    # makes width visible leaves time only high frequencies, which alias over a video's
    # positions: "colour at the start" was not learned in 2000 steps (training/RESULTS.md).
    rope_theta: float = 10000.0
    mrope_section: tuple[int, ...] = (6, 5, 5)
    # Every video spans at most this many temporal positions (QwenVLVideoProcessor
    # .temporal_positions): long videos are seen at the positions short ones trained.
    temporal_positions: int | None = 8
    # "token": every learned token weighs the same; "chat": every chat weighs the same (its
    # tokens share it). Captions name the colours twice, so under "token" they carry most of
    # the colour signal; under "chat" colour was still unlearned at step 1000-2000.
    loss_weighting: str = "token"
    steps: int = 5200
    batch: int = 10                       # videos (conversations) per step
    lr: float = 2e-3
    vision_lr_scale: float = 0.0          # 0: the vision tower stays as initialised (see train_world_target)
    vision_init: str = "readable"         # "readable" (see readable_vision_init) or "random"
    warmup: int = 100
    frames: tuple[int, ...] = (8, 12, 16, 32)  # training video lengths (frames), drawn uniformly
    sizes: tuple[int, ...] = (84, 84, 168)    # training frame sides (px), drawn uniformly with the length
    # Longer videos, a long_prob share of training: 84 px (3x3 tokens a frame pair) so they
    # stay cheap; beyond temporal_positions several frame pairs share a temporal position,
    # which is how the long benchmark videos are seen.
    long_frames: tuple[int, ...] = (64, 128)
    long_prob: float = 0.15
    max_turns: int = 1                    # chat turns per conversation (see world_turns)
    caption_prob: float = 0.3             # chance a conversation is the caption request (long answers)
    kinds: tuple[str, ...] = QUESTION_KINDS   # question kinds to train on
    # Curriculum: the first warm_steps train only on questions whose answers have no useful
    # language prior, so the only way to lower the loss is to look at the video.
    warm_steps: int = 0
    warm_kinds: tuple[str, ...] = ("start", "end", "present")
    # Later stages, after the first `steps`, each "KINDS@SHARE:STEPS[:short]" (or "mix:STEPS",
    # no focus steps): STEPS more steps (a warmup of stage_warmup, then cosine from stage_lr to
    # 5%) of which a SHARE are focus steps, asking only KINDS ("+"-joined question kinds) about
    # videos of at most short_tokens visual tokens if ":short"; the others draw the first stage's mix from the whole pool,
    # except that short_only_kinds are asked about short videos only. Presence ("is there a
    # <colour> shape?") and direction have little first-order signal in the mixed recipe and
    # stay near chance; asked alone, on top of the features the other questions build, they
    # are learned in a few hundred steps, and mixed steps afterwards restore what the focused
    # ones displaced (training/RESULTS.md).
    stages: tuple[str, ...] = ()
    stage_lr: float = 1e-3
    stage_warmup: int = 20
    short_tokens: int = 72
    # Direction is learned on 3x3-token frames (84 px); asked about 6x6-token ones as well it
    # was lost again (the width positions barely rotate, so where a token sits in a frame is
    # read from the token order, which differs between the two).
    short_only_kinds: tuple[str, ...] = ("direction",)
    # Caption share of the later stages' mixed steps (None: caption_prob). Focus steps teach
    # one-word answers; with captions at the first stage's share, a tuned target began long
    # videos' captions with "a" and ended the turn there.
    stage_caption_prob: float | None = None
    seed: int = 0
    log_every: int = 50
    eval_every: int = 1000                # per-kind accuracy on a few held-out videos (0: never)
    eval_videos: int = 8
    save_every: int = 500                 # checkpoint (save_pretrained) when training with an `out`
    # Videos rendered once; their visual tokens (the tower is frozen) are reused across steps,
    # each time with freshly drawn questions and wordings. 0: a fresh video per sample (slow:
    # rendering + decoding is most of a step on a CPU). Needs vision_lr_scale == 0.
    pool: int = 3000
    # A pooled batch is videos of one length (a random video and others with its token
    # count), so little of a step is padding; every video is still drawn equally often.
    length_batches: bool = True


# What each WorldTargetConfig field does, for `sparrow world train-target --help` (one option per field).
WORLD_TARGET_HELP = {
    "hidden": "language model hidden size",
    "layers": "language model layers",
    "heads": "attention heads (half as many KV heads)",
    "intermediate": "language model MLP width",
    "vision_hidden": "vision tower width",
    "vision_depth": "vision tower blocks",
    "patch_size": "vision patch side in px",
    "merge_size": "patches merged per visual token along each side",
    "min_pixels": "smallest frame area in px (frames are not upscaled past it)",
    "rope_theta": "M-RoPE base",
    "mrope_section": "M-RoPE sections t,h,w (sum: head_dim/2)",
    "temporal_positions": "temporal rope positions every video spans (time as a fraction of the video)",
    "loss_weighting": "token (every answer token weighs the same) or chat (every chat does)",
    "steps": "first-stage optimizer steps",
    "batch": "conversations per step",
    "lr": "first-stage peak learning rate",
    "vision_lr_scale": "vision tower learning rate as a share of lr (0: frozen)",
    "vision_init": "readable (hand-set codes of colour and change) or random",
    "warmup": "first-stage warmup steps",
    "frames": "training video lengths in frames, comma-separated",
    "sizes": "training frame sides in px, comma-separated",
    "long_frames": "lengths of the longer training videos (84 px), comma-separated",
    "long_prob": "share of training videos that are long",
    "max_turns": "chat turns per training conversation",
    "caption_prob": "share of conversations that ask for the caption",
    "kinds": "question kinds trained on, comma-separated",
    "warm_steps": "first steps that ask only warm_kinds",
    "warm_kinds": "question kinds of the warm steps, comma-separated",
    "stages": "later stages, comma-separated KINDS@SHARE:STEPS[:short] or mix:STEPS items",
    "stage_lr": "later stages' peak learning rate",
    "stage_warmup": "later stages' warmup steps",
    "short_tokens": "most visual tokens of a :short stage's focus videos",
    "short_only_kinds": "question kinds asked about short videos only, comma-separated",
    "stage_caption_prob": "caption share of the later stages' mixed steps (default: caption_prob)",
    "seed": "seed of the initialisation, the video pool and the questions",
    "log_every": "log the loss every N steps",
    "eval_every": "per-kind accuracy on held-out videos every N steps (0: never)",
    "eval_videos": "held-out videos per accuracy check",
    "save_every": "checkpoint every N steps when training into --out",
    "pool": "videos rendered once and reused with fresh questions (0: a fresh video per sample)",
    "length_batches": "a batch is videos of one length (true/false)",
}


# `sparrow world tune-target`: the later stages on top of a trained target (`train-target`'s
# first stage), over a pool drawn like the first stage's. Presence and direction are asked
# alone about 84 px 8-frame videos (36 tokens); then 40% of the steps ask them about those and
# the rest draw the first stage's mix from the whole pool, so long and 168 px videos (their
# captions, which the draft learns from) are not forgotten. Presence leaves its saddle sooner
# the better the colour features it starts from: from the committed first stage (5200 steps)
# within ~500 steps; from 4000 steps at ~950 of 1500; from 3600 not within 2500
# (training/RESULTS.md), so the stages follow a full first stage, as a second command, rather
# than a shortened first stage in one 30-minute run. Alone this preset leaves long videos'
# captions broken; the committed target adds runs of mixed steps (`--stages mix:1200`, then
# `mix:600` over longer videos: models/world/MODEL_CARD.md).
TUNE = dict(steps=0, stages=("present@1:2000:short", "direction@1:400:short", "present+direction@0.4:2000:short"),
            pool=1500, batch=12, short_tokens=36, stage_caption_prob=0.6)

# The SpecVLM-style baseline's draft: a smaller full VLM of the same family, trained with the
# same recipe (`sparrow world train-baselines --only small-target`).
SMALL_TARGET = dict(hidden=64, layers=2, heads=2, intermediate=192)


def world_target_config(tok, c: WorldTargetConfig) -> Qwen2_5_VLConfig:
    ids = tok.convert_tokens_to_ids
    head_dim = c.hidden // c.heads
    section = list(c.mrope_section)
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section must be 3 sizes summing to head_dim/2 = {head_dim // 2}, got {section}")
    text = dict(vocab_size=len(tok), hidden_size=c.hidden, intermediate_size=c.intermediate,
                num_hidden_layers=c.layers, num_attention_heads=c.heads, num_key_value_heads=max(1, c.heads // 2),
                max_position_embeddings=32768, eos_token_id=ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                bos_token_id=None, tie_word_embeddings=False, initializer_range=0.02,
                rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta, "mrope_section": section})
    vision = dict(depth=c.vision_depth, hidden_size=c.vision_hidden, intermediate_size=2 * c.vision_hidden,
                  num_heads=2, out_hidden_size=c.hidden, patch_size=c.patch_size, spatial_merge_size=c.merge_size,
                  temporal_patch_size=2, window_size=12 * c.patch_size,   # one window per frame: few attention calls
                  fullatt_block_indexes=[c.vision_depth - 1], tokens_per_second=2, initializer_range=0.02)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                            video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                            vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False)


def new_world_target(c: WorldTargetConfig, tokenizer=None) -> TargetModel:
    """A fresh target for config `c`, with the world's tokenizer unless one is given."""
    tok = tokenizer if tokenizer is not None else world_tokenizer()
    config = world_target_config(tok, c)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(c.seed)
        hf = Qwen2_5_VLForConditionalGeneration(config)
    if c.vision_init == "readable":
        readable_vision_init(hf.model.visual)
    hf.generation_config.eos_token_id = config.get_text_config().eos_token_id
    hf.generation_config.pad_token_id = tok.pad_token_id
    return TargetModel(hf, tok, processor_for(config, min_pixels=c.min_pixels,
                                                  temporal_positions=c.temporal_positions))


@torch.no_grad()
def readable_vision_init(visual, background: tuple[int, int, int] = BACKGROUND) -> None:
    """Initialise the vision tower (same architecture, hand-set weights) so that every visual
    token is a plain, background-centred code of its patches: per patch, its mean colour and
    the change between the two frames of the temporal patch, minus what an empty background
    patch gives, plus a constant marker. An empty token is then just the marker, and a shape
    stands out at full strength however small it is.

    Why not random: a random tower scrambles colour (a linear probe finds colour presence at
    ~62%), and a code centred on grey left the shape a ~5% ripple on a large constant vector,
    which a from-scratch LM did not learn to read in the CPU budget (training/RESULTS.md)."""
    w = visual.patch_embed.proj.weight                     # (D, 3, tp, p, p)
    dim, _, tp, p, _ = w.shape
    area = tp * p * p
    w.zero_()
    for c in range(3):
        w[c, c] = 1 / area                                 # mean colour
        w[3 + c, c, 1], w[3 + c, c, 0] = 2 / area, -2 / area   # second frame minus first
    for block in visual.blocks:                            # identity blocks: the code passes through
        for lin in (block.attn.proj, block.mlp.down_proj):
            lin.weight.zero_()
            lin.bias.zero_()
    # A large constant channel makes the merger's RMSNorm close to a fixed scale (near-linear).
    visual.blocks[0].mlp.down_proj.bias[dim - 1] = 20.0
    first, last = visual.merger.mlp[0], visual.merger.mlp[2]
    patches = first.in_features // dim                     # merge_size ** 2
    out = last.out_features
    first.weight.copy_(0.25 * torch.eye(first.in_features))   # x/4 + 1.5 keeps GELU near-linear
    first.bias.fill_(1.5)
    last.weight.zero_()
    last.bias.zero_()
    for q in range(patches):                               # out: colours | changes | marker
        for c in range(3):
            last.weight[3 * q + c, q * dim + c] = 8.0
            last.weight[3 * patches + 3 * q + c, q * dim + 3 + c] = 8.0
    # Centre on the background: whatever an empty patch gives is subtracted.
    mean = torch.tensor(QWEN_MEAN).view(1, 3, 1, 1, 1)
    std = torch.tensor(QWEN_STD).view(1, 3, 1, 1, 1)
    pixel = (torch.tensor(background, dtype=torch.float32).view(1, 3, 1, 1, 1) / 255 - mean) / std
    frames = pixel.expand(patches, 3, tp, p, p).reshape(patches, -1)
    grid = torch.tensor([[1, visual.spatial_merge_size, visual.spatial_merge_size]])
    empty = visual(frames, grid_thw=grid)
    empty = empty if torch.is_tensor(empty) else empty.pooler_output
    last.bias.copy_(-empty[0])
    assert 6 * patches + 32 <= out, "hidden size too small for the readable code"
    last.bias[6 * patches:6 * patches + 32] = 0.25         # the marker


def lm_parameters(target: TargetModel) -> int:
    """Language-model parameters (embedding, decoder, lm_head), the draft's budget reference."""
    lm = target.hf.model.language_model
    return sum(p.numel() for p in lm.parameters()) + target.lm_head().weight.numel()


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


def world_sample(target: TargetModel, world: WorldVideo, seed: int) -> tuple[ProcessedVideo, list[dict]]:
    video = world.make(seed)
    return target.processor.process(load_frames(video.source, world.options())), video.events


# ----- training --------------------------------------------------------------------------------------
def training_world(c: WorldTargetConfig, rng: random.Random) -> WorldVideo:
    if c.long_frames and rng.random() < c.long_prob:
        return WorldVideo(num_frames=rng.choice(c.long_frames), size=84)
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

    @staticmethod
    def parse(spec: str, start: int, c: WorldTargetConfig, known: tuple[str, ...] = QUESTION_KINDS) -> "Stage":
        try:
            head, steps, *flags = spec.split(":")
            kinds, share = ("", "0") if head == "mix" and not flags else head.split("@")   # mixed steps only
            if flags not in ([], ["short"]):
                raise ValueError(flags)
            stage = Stage(start, int(steps), c.stage_lr, c.stage_warmup, tuple(filter(None, kinds.split("+"))),
                          float(share), flags == ["short"])
        except ValueError:
            raise ValueError(f"stage {spec!r}: expected KINDS@SHARE:STEPS, KINDS@SHARE:STEPS:short "
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


def lr_factor(c: WorldTargetConfig, stages: list[Stage], step: int) -> float:
    """The learning rate at `step` over c.lr: each stage warms up, then decays (cosine) to 5%."""
    st = stage_at(stages, step)
    s = step - st.start
    return st.lr / c.lr * min(1.0, (s + 1) / st.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / st.steps))))


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
    and questions. Another task (training/live_target.py) supplies its own object with the
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


def train_world_target(c: WorldTargetConfig, log: Callable[[str], None] | None = None,
                       target: TargetModel | None = None, out: str | Path | None = None,
                       data: WorldData | None = None) -> tuple[TargetModel, list[dict]]:
    """Deterministic under c.seed: the videos of step i come from seeds derived from (c.seed, i).
    `data`: what to train on (default: the world, WorldData(c))."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    data = data if data is not None else WorldData(c)
    target = target or new_world_target(c)
    hf = target.hf.train()
    # Trained jointly from scratch, the vision tower collapses: before the LM can read it, the
    # cheapest way to lower the loss is to make every visual token the same large vector (an
    # attention sink), and the video is ignored for good. The tower stays as initialised.
    vision = list(hf.model.visual.parameters())
    vision_ids = {id(p) for p in vision}
    groups = [{"params": [p for p in hf.parameters() if id(p) not in vision_ids], "lr": c.lr}]
    if c.vision_lr_scale > 0:
        if c.pool:
            raise ValueError("a video pool needs a frozen vision tower (vision_lr_scale 0)")
        groups.append({"params": vision, "lr": c.lr * c.vision_lr_scale})
    else:
        hf.model.visual.requires_grad_(False)
    stages = training_stages(c, data.kinds)
    data.prepare(target, stages, log)
    opt = torch.optim.AdamW(groups, lr=c.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(c, stages, s))
    total = sum(s.steps for s in stages)
    history, t0, run = [], time.perf_counter(), 0.0
    for step in range(total):
        rng = random.Random(c.seed * 1_000_003 + step)
        stage = stage_at(stages, step)
        focus = focus_step(stage, rng)
        loss = data.loss(target, stage, step, focus, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        opt.step()
        sched.step()
        run = float(loss.detach()) if step == 0 else 0.98 * run + 0.02 * float(loss.detach())
        if (step + 1) % c.log_every == 0 or step + 1 == total:
            history.append({"step": step + 1, "loss": run, "seconds": time.perf_counter() - t0})
            log(f"step {step + 1}/{total} loss {run:.4f} lr {sched.get_last_lr()[0]:.2e} "
                f"{time.perf_counter() - t0:.0f}s")
        if c.eval_every and (step + 1) % c.eval_every == 0:
            hf.eval()
            acc = data.heldout(target)
            hf.train()
            history.append({"step": step + 1, "heldout": acc})
            kinds_acc = " ".join(f"{k} {v:.2f}" for k, v in acc["per_kind"].items())
            log(f"  held-out accuracy {acc['accuracy']:.3f} ({kinds_acc})")
        if out is not None and c.save_every and (step + 1) % c.save_every == 0:
            target.save_pretrained(out)
    hf.eval()
    return target, history


# ----- evaluation -----------------------------------------------------------------------------------
@torch.no_grad()
def world_accuracy(target: TargetModel, world: WorldVideo, seeds: list[int],
                   kinds: tuple[str, ...] = QUESTION_KINDS, engine: Engine | None = None,
                   on_video: Callable[[], None] | None = None) -> dict:
    """Exact match of single-turn answers at temperature 0, per question kind and overall.
    A video's questions share its prefill (the prefix cache), which long videos need.
    on_video: called after each video's questions (for progress)."""
    engine = engine or Engine(target, spec=SpecConfig(method="none"), prefix_cache=PrefixCache(max_entries=1))
    right: dict[str, int] = {k: 0 for k in kinds}
    total: dict[str, int] = {k: 0 for k in kinds}
    tokens = 0
    for seed in seeds:
        video, events = world_sample(target, world, seed)
        tokens = video.num_visual_tokens
        key = f"world-eval/{world}/{seed}"
        for kind, q, a in questions(events, random.Random(seed), kinds):
            got = engine.generate(video, q, SamplingParams(max_new_tokens=4), video_key=key).text.strip()
            right[kind] += got == a
            total[kind] += 1
        if on_video:
            on_video()
    per_kind = {k: right[k] / total[k] for k in kinds if total[k]}
    return {"accuracy": sum(right.values()) / max(1, sum(total.values())), "per_kind": per_kind,
            "questions": sum(total.values()), "videos": len(seeds), "visual_tokens": tokens}


def train_world_target_cli(c: WorldTargetConfig, out: str | Path, eval_videos: int = 40,
                           init: str | Path | None = None) -> dict:
    """Train (from scratch, or on from the target in `init`), save to `out` (save_pretrained
    form), measure held-out accuracy on fresh short videos (seeds disjoint from training's),
    write the report next to the weights; a report found in `init` is kept in it as `before`."""
    if not c.steps and not c.stages:
        raise ValueError("nothing to train: steps is 0 and there are no stages")
    before = None
    target = None
    if init is not None:
        target = TargetModel.from_pretrained(init)
        found = Path(init, "world_target.json")
        before = json.loads(found.read_text()) if found.is_file() else None
    t0 = time.perf_counter()
    target, history = train_world_target(c, target=target, out=out)
    seconds = time.perf_counter() - t0
    target.save_pretrained(out)
    accuracy = world_accuracy(target, WorldVideo(), list(range(EVAL_SEED, EVAL_SEED + eval_videos)))
    report = {"config": asdict(c), "init": None if init is None else str(init), "train_seconds": seconds,
              "final_loss": [h for h in history if "loss" in h][-1]["loss"],
              "lm_parameters": lm_parameters(target), "accuracy": accuracy,
              "heldout_during_training": [h for h in history if "heldout" in h]}
    if before is not None:
        report["before"] = before
    Path(out, "world_target.json").write_text(json.dumps(report, indent=2))
    return report
