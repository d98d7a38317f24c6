"""The synthetic world: what happens in a SyntheticVideo, said in words.

A video's events (sparrow.video.write_synthetic_video) are the ground truth. From them come a
caption (every event, in order) and question/answer pairs with one-word answers, each
question in several wordings. A world video holds one shape: it appears, moves, changes
colour and may disappear. (With several shapes the questions need the model to bind colour,
shape and motion across objects; a from-scratch 1M-parameter model did not get there within
the 30-minute CPU budget, while one shape it learns - see training/RESULTS.md.)

Also here: the world's word-level tokenizer, with the real Qwen2-VL chat template and special
tokens, and the video settings of the world (short and long videos).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from sparrow.tokenizer import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_SPECIAL_TOKENS
from sparrow.video import VideoOptions, write_synthetic_video
from sparrow.video.synthetic import PALETTE, SHAPES, SyntheticVideo

DIRECTIONS = ("left", "right", "up", "down")   # the world moves left or right; the words stay
CAPTION_PROMPTS = ("describe the video .", "what happens in the video ?", "tell me what happens .")

# Answers are single words; {c} is a colour (presence questions only).
QUESTIONS = {
    "start": ("what colour is the shape at the start ?", "what colour is the shape at first ?",
              "at the start , what colour is the shape ?"),
    "end": ("what colour is the shape at the end ?", "what colour is the shape last ?",
            "at the end , what colour is the shape ?"),
    "shape": ("what shape is it ?", "what is the shape ?", "which shape do you see ?"),
    "direction": ("which way does the shape move ?", "in which direction does the shape go ?",
                  "where does the shape move ?"),
    "vanish": ("does the shape disappear ?", "does the shape leave the video ?", "is the shape gone at the end ?"),
    "present": ("is there a {c} shape ?", "do you see anything {c} ?", "does a {c} shape appear ?"),
}
QUESTION_KINDS = tuple(QUESTIONS)


LONGEST_VIDEO_TOKENS = 25_600
# (frame side px, frames) -> visual tokens of the world target (14 px patches merged 2x2, no
# upscaling: (side / 28)^2 per frame pair): the benchmark's ladder, ~0.5k to ~25k. Length is
# what varies; the frame size stays one the target trained on (6x6 tokens a frame pair).
LADDER = ((168, 28), (168, 84), (168, 448), (168, 944), (168, 1392))   # 504, 1512, 8064, 16992, 25056


@dataclass(frozen=True, slots=True)
class WorldVideo:
    """Short videos are what the target trains on; long ones test it up to ~25k visual tokens."""

    num_frames: int = 8
    size: int = 84
    fps: float = 4.0
    shapes: int = 1
    # Legible at the visual-token grid (a token is 28 px of an 84 px frame): shapes a seventh
    # to a sixth of the side, rectangles twice as tall as wide (a circle is about one token,
    # a rectangle a column of two), and moves left or right across a third of the frame or more.
    shape_size: tuple[float, float] = (1 / 7, 1 / 6)
    tall_rectangles: bool = True
    horizontal_motion: bool = True

    def options(self) -> VideoOptions:
        # Every frame is sampled (the events happen at frame granularity), and the benchmark's
        # longest world video (25,056 visual tokens) fits the token budget.
        return VideoOptions(fps=self.fps, max_frames=max(768, self.num_frames), max_decoded_frames=max(1536, self.num_frames),
                            max_visual_tokens=LONGEST_VIDEO_TOKENS)

    def make(self, seed: int, path=None) -> SyntheticVideo:
        return write_synthetic_video(path, num_frames=self.num_frames, width=self.size, height=self.size,
                                     fps=self.fps, seed=seed, num_shapes=self.shapes,
                                     shape_size=self.shape_size, tall_rectangles=self.tall_rectangles,
                                     horizontal_motion=self.horizontal_motion)


@dataclass(frozen=True, slots=True)
class Actor:
    shape: str
    color: str                 # first colour: its name
    new_color: str | None      # after a colour change, if any
    direction: str | None
    vanishes: bool


def actors(events: list[dict]) -> list[Actor]:
    """Reassemble each shape's story from the time-ordered events (a colour names one shape)."""
    first = [e for e in events if e["kind"] == "appear"]
    owner = {e["color"]: e["color"] for e in first}                   # any colour -> first colour
    owner.update({e["color"]: e["previous"] for e in events if e["kind"] == "color"})
    by = {e["color"]: {"appear": e} for e in first}
    for e in events:
        if e["kind"] != "appear":
            by[owner[e["color"]]][e["kind"]] = e
    return [Actor(shape=d["appear"]["shape"], color=c, new_color=d["color"]["color"] if "color" in d else None,
                  direction=d["move"]["direction"] if "move" in d else None, vanishes="disappear" in d)
            for c, d in by.items()]


def caption(events: list[dict]) -> str:
    """Every event, in order: "a red circle appears . the red circle moves left . ..." """
    owner = {e["color"]: e["color"] for e in events if e["kind"] == "appear"}
    owner.update({e["color"]: e["previous"] for e in events if e["kind"] == "color"})
    current: dict[str, str] = {}
    parts = []
    for e in events:
        name = owner[e["color"]]
        if e["kind"] == "appear":
            current[name] = e["color"]
            parts.append(f"a {e['color']} {e['shape']} appears .")
        elif e["kind"] == "move":
            parts.append(f"the {current[name]} {e['shape']} moves {e['direction']} .")
        elif e["kind"] == "color":
            parts.append(f"the {e['previous']} {e['shape']} turns {e['color']} .")
            current[name] = e["color"]
        else:
            parts.append(f"the {current[name]} {e['shape']} disappears .")
    return " ".join(parts)


def answer(kind: str, actor: Actor) -> str:
    if kind == "start":
        return actor.color
    if kind == "end":
        return actor.new_color or actor.color
    if kind == "shape":
        return actor.shape
    if kind == "direction":
        return actor.direction or "none"
    return "yes" if actor.vanishes else "no"


def questions(events: list[dict], rng: random.Random,
              kinds: tuple[str, ...] = QUESTION_KINDS) -> list[tuple[str, str, str]]:
    """(kind, question, answer) per kind, in a random wording; about the video's first shape
    (its only one in the world). Presence: one colour that is in the video, one that is not."""
    actor = actors(events)[0]
    qa = []
    for kind in kinds:
        if kind == "present":
            qa += _presence([actor], rng)
        else:
            qa.append((kind, rng.choice(QUESTIONS[kind]), answer(kind, actor)))
    return qa


def _presence(cast: list[Actor], rng: random.Random) -> list[tuple[str, str, str]]:
    seen = sorted({a.color for a in cast} | {a.new_color for a in cast if a.new_color})
    absent = sorted(set(PALETTE) - set(seen))
    asks = [(rng.choice(seen), "yes")] + ([(rng.choice(absent), "no")] if absent else [])
    return [("present", rng.choice(QUESTIONS["present"]).format(c=c), a) for c, a in asks]


# ----- tokenizer ------------------------------------------------------------------------------------

_SYSTEM_WORDS = "system user assistant you are a helpful ."


def world_words() -> list[str]:
    words = set(_SYSTEM_WORDS.split()) | set(PALETTE) | set(SHAPES) | set(DIRECTIONS)
    words |= {"none", "yes", "no", "appears", "moves", "turns", "disappears", "the", "a", "?", "."}
    for text in (*CAPTION_PROMPTS, *(q for qs in QUESTIONS.values() for q in qs)):
        words |= set(text.replace("{c}", "").replace("{s}", "").split())
    return sorted(words)


def world_tokenizer(extra_words: tuple[str, ...] | list[str] = ()) -> PreTrainedTokenizerFast:
    """Word-level: one id per world word, lower-cased, split on spaces and punctuation; the
    Qwen2-VL special tokens are single ids and the chat template is Qwen2-VL's. `extra_words`
    (another task's, e.g. the live world's) get ids too; without them the vocabulary is the
    world's, as the committed world target saved it."""
    words = sorted(set(world_words()) | set(extra_words))
    vocab = {t: i for i, t in enumerate((*QWEN_VL_SPECIAL_TOKENS, "<unk>", *words))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens(list(QWEN_VL_SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")
    fast.chat_template = QWEN_VL_CHAT_TEMPLATE
    return fast
