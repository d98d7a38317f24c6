"""The v2 target's attention objective: at the positions that predict an answer about one object,
one attention head is asked to put its weight on the visual tokens that hold that object.

Why: trained on answers alone, the target does not learn to pick one object out among several by
its colour (MODEL_CARD, "Why stage 1 plateaued": several-object "where" stays at 0.38 with 24,000
scenes and 27,000 steps; 42 of 126 wrong answers are another object's place). Its tokens carry the
object (the placed tower), and given the object's tokens a model reads their place; what it does
not find is the selection. This term supervises the selection directly, in one head of one layer:
-log(the attention mass on the named object's tokens), averaged over the answer's positions. The
rest of the model, and inference, are unchanged: a plain Qwen2.5-VL whose head learned where to
look. `V2TargetConfig.attend_weight` (0: off) weighs it against the answers' cross-entropy.

Which tokens hold the object: the merged 2x2-patch cells its box overlaps in a frame of the
cell's temporal patch (two frames) - at the start for "where", at the end for "colour_end", and
wherever it is for the other kinds that name one object (size, shape, direction, story). For the
kinds about one event (when, first, order, after), the event the answer is about (named in a
"when" question; the answer's own for the others): its object's cells (and the other object's, in
a collision or a move toward it) in the temporal patch of its second, or the one before where the
object is no longer shown (it left).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

from sparrow.models.target import TargetModel
from sparrow.world.v2.narration import phrase
from sparrow.world.v2.questions_v2 import named_object
from sparrow.world.v2.render_v2 import FPS
from sparrow.world.v2.scenes_v2 import Event, Scene

# Question kinds about one object, and the object's frames each reads: "start", "end" or "all".
ATTEND_KINDS = {"where": "start", "colour_end": "end", "size": "all", "shape": "all", "direction": "all",
                "story": "all"}
# Question kinds about one event, and where its words are: in the question, or in the answer.
EVENT_KINDS = {"when": "question", "first": "answer", "order": "answer", "after": "answer"}
OVERLAP = 0.02       # frame units (2 px at 112 px) a box must reach into a cell, across and down, to hold it


def object_cells(scene: Scene, ident: int, grid_thw: tuple[int, int, int], when: str | int,
                 merge: int = 2) -> list[int]:
    """Indices among a video's visual tokens (temporal patch, row, column order, the merger's)
    of the cells object `ident` covers: in the first temporal patch ("start"), its last one that
    shows the object ("end"), every one ("all"), or temporal patch `when` (an int; the one
    before it when that one does not show the object). grid_thw: the video's patch grid."""
    t_patches, rows, cols = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    o = scene.obj(ident)
    hx, hy = o.half
    per_slice: dict[int, set[int]] = {}
    for t in range(t_patches):
        for frame in (2 * t, 2 * t + 1):                 # a temporal patch is two frames
            seconds = frame / FPS
            if not o.present(seconds) or seconds >= scene.seconds:
                continue
            cx, cy = o.centre(seconds)
            for i in range(rows):
                across_y = min(cy + hy, (i + 1) / rows) - max(cy - hy, i / rows)
                for j in range(cols):
                    across_x = min(cx + hx, (j + 1) / cols) - max(cx - hx, j / cols)
                    if across_x > OVERLAP and across_y > OVERLAP:
                        per_slice.setdefault(t, set()).add(t * rows * cols + i * cols + j)
    if not per_slice:
        return []
    if isinstance(when, int):
        slices = [t for t in (when, when - 1) if t in per_slice][:1]
    else:
        slices = {"start": [0] if 0 in per_slice else [], "end": [max(per_slice)], "all": sorted(per_slice)}[when]
    return sorted(cell for t in slices for cell in per_slice[t])


def asked_event(scene: Scene, kind: str, question: str, answer: str) -> Event | None:
    """The event a chat's answer is about (EVENT_KINDS): the one whose phrase a "when" question
    holds, or the answer holds; None when no event or more than one matches ("first": the first)."""
    text = f" {question if EVENT_KINDS[kind] == 'question' else answer} "
    events = [e for e in scene.events if e.kind != "count"]
    found = [e for e in events if f" {phrase(scene, e)} " in text or f" {phrase(scene, e, base=True)} " in text]
    if kind == "first" and events and events[0] in found:
        return events[0]
    return found[0] if len(found) == 1 else None


def chat_cells(scene: Scene, kind: str, question: str, grid_thw: tuple[int, int, int], answer: str = "") -> list[int]:
    """The cells a chat's answer should look at: its named object's (ATTEND_KINDS), its event's
    objects' at its moment (EVENT_KINDS), else none."""
    if kind in EVENT_KINDS:
        e = asked_event(scene, kind, question, answer)
        if e is None or e.who is None:
            return []
        patch = int(e.t * FPS) // 2
        who = [e.who] + ([e.other] if e.other is not None else [])
        return sorted({c for ident in who for c in object_cells(scene, ident, grid_thw, patch)})
    if kind not in ATTEND_KINDS:
        return []
    ident = named_object(scene, question)
    return [] if ident is None else object_cells(scene, ident, grid_thw, ATTEND_KINDS[kind])


@contextlib.contextmanager
def attention_of(target: TargetModel, layer: int) -> Iterator[dict]:
    """While open, the language model runs eager attention and layer `layer`'s attention
    weights (B, heads, T, T) of the last forward land in the yielded dict's "weights"."""
    lm = target.hf.model.language_model
    if not 0 <= layer < len(lm.layers):
        raise ValueError(f"attend_layer {layer}: the language model has {len(lm.layers)} layers")
    box: dict = {}
    before = lm.config._attn_implementation
    lm.config._attn_implementation = "eager"            # the one path that returns its weights
    handle = lm.layers[layer].self_attn.register_forward_hook(lambda _m, _i, out: box.__setitem__("weights", out[1]))
    try:
        yield box
    finally:
        handle.remove()
        lm.config._attn_implementation = before


def head_map(items: tuple[str, ...], kinds: tuple[str, ...] = (*ATTEND_KINDS, *EVENT_KINDS)) -> dict[str, tuple[int, ...]]:
    """`KIND=HEAD[+HEAD...]` items (a kind's own heads) as {kind: heads}; ValueError on a bad item."""
    found = {}
    for item in items:
        kind, _, heads = item.partition("=")
        if kind not in kinds or not re.fullmatch(r"\d+(\+\d+)*", heads):
            raise ValueError(f"attend_head_of items are KIND=HEAD[+HEAD...] with KIND among {kinds}, got {item!r}")
        found[kind] = tuple(int(h) for h in heads.split("+"))
    return found


def attention_loss(weights: torch.Tensor, ids: torch.Tensor, pick: torch.Tensor, video_token_id: int,
                   cells: list[list[int]], heads: list[tuple[int, ...]]) -> torch.Tensor | None:
    """Mean over the chats with cells of -log(the attention mass `heads` put on the chat's cells),
    averaged over its heads and the positions that predict its answer (pick: (B, T-1), token
    t+1 predicted at position t). heads: each chat's heads.
    None when no chat has cells."""
    terms = []
    for b, chat in enumerate(cells):
        if not chat:
            continue
        visual = (ids[b] == video_token_id).nonzero()[:, 0]
        keys = visual[torch.tensor(chat, device=visual.device)]
        rows = pick[b].nonzero()[:, 0]
        mass = weights[b, list(heads[b])][:, rows][:, :, keys].sum(-1)        # (heads, answer positions)
        terms.append(-(mass.float() + 1e-6).log().mean())
    return torch.stack(terms).mean() if terms else None
