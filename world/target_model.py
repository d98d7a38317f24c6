"""`sparrow world train-target`'s model: a tiny Qwen2.5-VL trained from scratch on the synthetic world.

This module holds the target itself: its config (`WorldTargetConfig`, with the command's help
and presets), its construction (`new_world_target`, the readable vision tower), how it reads a
world video (`world_sample`) and its held-out accuracy (`world_accuracy`: single-turn questions
through the engine at temperature 0, exact matches counted). What a training step reads and its
loss are in world/target_data.py; the loop and the command in
world/target_train.py.

Training videos are rendered once (mp4 through the real decode + patchify path, as serving
sees it) into a pool whose visual tokens the frozen vision tower computes once; every step
draws a batch of pooled videos of one length and a fresh single-turn conversation about each
(a question or the caption request, in a random wording), loss on the answer only. Training
runs in stages (`WorldTargetConfig.stages`): the usual mix first, then questions that the mix
leaves at chance asked alone, then the mix again with those upweighted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixCache
from sparrow.video import ProcessedVideo, load_frames, processor_for
from sparrow.video.processors import OPENAI_CLIP_MEAN as QWEN_MEAN, OPENAI_CLIP_STD as QWEN_STD
from sparrow.video.synthetic import BACKGROUND

from sparrow.world.scenes import QUESTION_KINDS, WorldVideo, questions, world_tokenizer

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
    # Longer videos, a long_prob share of training: long_size px (84: 3x3 tokens a frame pair)
    # so they stay cheap; beyond temporal_positions several frame pairs share a temporal
    # position, which is how the long benchmark videos are seen.
    long_frames: tuple[int, ...] = (64, 128)
    long_prob: float = 0.15
    long_size: int = 84
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
    "long_frames": "lengths of the longer training videos (long_size px), comma-separated",
    "long_prob": "share of training videos that are long",
    "long_size": "frame side of the longer training videos (px)",
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


def world_sample(target: TargetModel, world: WorldVideo, seed: int) -> tuple[ProcessedVideo, list[dict]]:
    video = world.make(seed)
    return target.processor.process(load_frames(video.source, world.options())), video.events


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
