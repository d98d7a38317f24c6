"""The live world in words: what a session's clip of a LiveStream shows, as questions and answers.

A clip is what a live session holds: frames of a `sparrow.world.live_stream.LiveStream` sampled
at 2 fps, in frame pairs. **"Now" is the clip's last sampled frame** (the second frame of its
newest pair): what is in view in that frame is what "now" questions are about, whatever the
frames before it showed (a shape that left or changed colour a moment earlier no longer
counts). Window questions are about changes between consecutive sampled frames of the clip: a
shape *appeared* when a frame shows a shape the frame before did not (nothing, or another
visit), and *left* when a frame no longer shows the shape the frame before showed. A shape
already in view in the first frame did not appear inside the clip.

Standing questions (what a live analytics user asks every few seconds) are the "now" kinds:
`colour_now`, `what_now` and `present_now`; `left`, `appeared` and `last` are about the window.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from sparrow.world.live_stream import LiveStream, View
from sparrow.video.synthetic import PALETTE

from sparrow.world.scenes import world_tokenizer

# Answers: a colour / "none"; "<colour> <shape>" / "nothing"; yes / no. {c}: a colour.
LIVE_QUESTIONS = {
    "colour_now": ("what colour is the shape now ?", "what colour is in view now ?", "which colour do you see now ?"),
    "what_now": ("what is in view now ?", "what do you see now ?", "what is on screen now ?"),
    "present_now": ("is a {c} shape in view ?", "is there a {c} shape now ?", "do you see a {c} shape now ?"),
    "left": ("did a shape leave ?", "has a shape left ?", "did anything disappear ?"),
    "appeared": ("did a shape appear ?", "has a shape appeared ?", "did anything new appear ?"),
    "last": ("what appeared last ?", "what was the last shape to appear ?", "what came in last ?"),
}
LIVE_KINDS = tuple(LIVE_QUESTIONS)
STANDING_KINDS = ("colour_now", "what_now", "present_now")
NOTHING, NONE = "nothing", "none"
# The clip's story, first frame to now (see live_caption): many answer tokens a clip, which is
# what taught the world target to read colours (one-word answers alone did not, in either world).
LIVE_CAPTION_PROMPTS = ("what happens ?", "describe the clip .", "tell me what happens .")


@dataclass(frozen=True)
class Clip:
    """A session's clip: the stream frames it sampled (an even number, in time order) and what
    each shows."""

    frames: tuple[int, ...]
    views: tuple[View | None, ...]

    @staticmethod
    def of(stream: LiveStream, frames) -> "Clip":
        frames = tuple(int(f) for f in frames)
        return Clip(frames, tuple(stream.view(f) for f in frames))

    @property
    def pairs(self) -> int:
        return len(self.frames) // 2

    @property
    def now(self) -> View | None:
        return self.views[-1]

    def _changes(self):
        return zip(self.views, self.views[1:])

    @property
    def left(self) -> bool:
        return any(a is not None and (b is None or b.episode != a.episode) for a, b in self._changes())

    @property
    def appeared(self) -> bool:
        return any(b is not None and (a is None or a.episode != b.episode) for a, b in self._changes())

    @property
    def last_appeared(self) -> View | None:
        """The last shape to appear inside the clip, as it looked when it appeared."""
        last = None
        for a, b in self._changes():
            if b is not None and (a is None or a.episode != b.episode):
                last = b
        return last

    @property
    def colours_seen(self) -> set[str]:
        return {v.color for v in self.views if v is not None}


def live_caption(clip: Clip) -> str:
    """What the clip's sampled frames show, in order: what is in view in the first frame, each
    change between consecutive frames, and what is in view now:
    "a red circle is in view . the circle turns blue . the blue circle leaves . a green
    rectangle appears . now a green rectangle is in view ." """
    def in_view(v: View | None) -> str:
        return f"a {v.text} is in view ." if v else "nothing is in view ."

    parts = [in_view(clip.views[0])]
    for a, b in clip._changes():
        if a is not None and (b is None or b.episode != a.episode):
            parts.append(f"the {a.text} leaves .")
        if b is not None and (a is None or a.episode != b.episode):
            parts.append(f"a {b.text} appears .")
        elif a is not None and b is not None and a.color != b.color:
            parts.append(f"the {b.shape} turns {b.color} .")
    parts.append("now " + in_view(clip.now))
    return " ".join(parts)


def answer(kind: str, clip: Clip) -> str:
    now = clip.now
    if kind == "colour_now":
        return now.color if now else NONE
    if kind == "what_now":
        return now.text if now else NOTHING
    if kind == "left":
        return "yes" if clip.left else "no"
    if kind == "appeared":
        return "yes" if clip.appeared else "no"
    if kind == "last":
        last = clip.last_appeared
        return last.text if last else NOTHING
    raise ValueError(f"no single answer for kind {kind!r}")


def live_questions(clip: Clip, rng: random.Random, kinds: tuple[str, ...] = LIVE_KINDS) -> list[tuple[str, str, str]]:
    """(kind, question, answer) per kind, in a random wording. Presence asks twice: about the
    colour in view now ("yes"; skipped when nothing is), and about one that is not ("no"),
    half the time one the clip showed earlier when there is one (so "now" must be told from
    "a moment ago")."""
    qa = []
    for kind in kinds:
        if kind == "present_now":
            qa += _presence(clip, rng)
        else:
            qa.append((kind, rng.choice(LIVE_QUESTIONS[kind]), answer(kind, clip)))
    return qa


def _presence(clip: Clip, rng: random.Random) -> list[tuple[str, str, str]]:
    now = clip.now.color if clip.now else None
    asks = [(now, "yes")] if now else []
    earlier = sorted(clip.colours_seen - {now})
    absent = sorted(set(PALETTE) - {now})
    asks.append((rng.choice(earlier) if earlier and rng.random() < 0.5 else rng.choice(absent), "no"))
    return [("present_now", rng.choice(LIVE_QUESTIONS["present_now"]).format(c=c), a) for c, a in asks]


def presence_contrast(clip: Clip, rng: random.Random, negatives: int) -> list[tuple[str, str]]:
    """Presence asked both ways about one clip: the colour in view now ("yes", when one is) and
    `negatives` colours that are not ("no"): those the clip showed earlier first, then others."""
    now = clip.now.color if clip.now else None
    earlier = sorted(clip.colours_seen - {now})
    others = sorted(set(PALETTE) - {now} - set(earlier))
    rng.shuffle(earlier)
    rng.shuffle(others)
    asks = ([(now, "yes")] if now else []) + [(c, "no") for c in (earlier + others)[:negatives]]
    return [(rng.choice(LIVE_QUESTIONS["present_now"]).format(c=c), a) for c, a in asks]


def live_words() -> list[str]:
    words = {NOTHING, NONE, "yes", "no", "leaves", "is", "in", "view", "now", "appears", "turns"}
    for texts in (*LIVE_QUESTIONS.values(), LIVE_CAPTION_PROMPTS):
        for text in texts:
            words |= set(text.replace("{c}", "").split())
    return sorted(words)


def live_tokenizer():
    """The world tokenizer (its words, chat template and special tokens) plus the live words."""
    return world_tokenizer(extra_words=live_words())


def clip_frames(stream: LiveStream, end_frame: int, pairs: int) -> np.ndarray:
    """The stream frames a 2 fps session holding `pairs` frame pairs samples when its window
    ends at `end_frame` (exclusive; the last sampled frame is end_frame - 1 at 4 fps)."""
    end_s = end_frame / stream.fps
    return stream.session_frames(end_s - pairs, end_s)
