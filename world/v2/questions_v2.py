"""World v2's questions: each kind in several wordings, each answer true to the scene.

Kinds: the dense narration (long answers), counting (at the start, at the end, at a time, how
many enter / leave / change colour / collide), ordering (what happens first, which of two
happens first, what happens after an event), "when does ...", yes/no about an object or the
video, and an object's story (every narrated event about it, with times: a medium answer).
An answer's form depends on the kind only, never on the wording, so it is learnable:

    counts: "3"   when: "at 1 : 05"   yes/no: "yes" / "no"   orderings: "the red circle stops ."

An event or object is asked about only when its words name exactly one in the scene (an object
by a colour it has at some moment and its shape; an event by its phrase); yes/no answers are
drawn yes or no with equal chance.
"""

from __future__ import annotations

import random

from sparrow.world.v2.narration import clock, narration, phrase, sentence
from sparrow.world.v2.scenes_v2 import COLOURS, SHAPES, SIDES, Event, Scene

QUESTIONS_V2: dict[str, tuple[str, ...]] = {
    "narrate": ("describe the video in detail , with times .", "narrate the video with times .",
                "what happens in the video , and when ?"),
    "count_start": ("how many objects are there at the start ?", "how many objects do you see at first ?",
                    "at the start , how many objects are there ?"),
    "count_end": ("how many objects are there at the end ?", "how many objects are left at the end ?",
                  "at the end , how many objects are there ?"),
    "count_at": ("how many objects are there at {time} ?", "at {time} , how many objects are there ?",
                 "how many objects can you see at {time} ?"),
    "count_enter": ("how many objects enter the video ?", "how many objects come in ?",
                    "how many times does an object enter ?"),
    "count_leave": ("how many objects leave the video ?", "how many objects go out ?",
                    "how many times does an object leave ?"),
    "count_colour": ("how many times does an object change colour ?", "how many colour changes are there ?",
                     "how often does something change colour ?"),
    "count_collide": ("how many collisions are there ?", "how many times do two objects bump into each other ?",
                      "how many times do objects collide ?"),
    "first": ("what happens first ?", "what is the first thing that happens ?", "which event comes first ?"),
    "order": ("which happens first : {a} , or {b} ?", "what comes earlier : {a} , or {b} ?",
              "which is first : {a} , or {b} ?"),
    "after": ("what happens after {a} ?", "what happens next , after {a} ?", "after {a} , what happens ?"),
    "when": ("when does {base} ?", "at what time does {base} ?", "what time is it when {a} ?"),
    "story": ("what happens to the {obj} ?", "tell me about the {obj} .", "what does the {obj} do ?"),
}
# yes/no questions: (template, what it asks); each in several wordings
YES_NO: dict[str, tuple[str, ...]] = {
    "leaves": ("does the {obj} leave the video ?", "does the {obj} go out of the picture ?",
               "is the {obj} gone at some point ?"),
    "recolours": ("does the {obj} change colour ?", "does the {obj} ever turn another colour ?",
                  "is the colour of the {obj} ever different ?"),
    "collides": ("does the {obj} bump into anything ?", "does the {obj} collide with something ?",
                 "does anything touch the {obj} ?"),
    "ever": ("is there ever a {colour} {shape} ?", "do you see a {colour} {shape} at any time ?",
             "does a {colour} {shape} appear in the video ?"),
    "side": ("does anything enter from the {side} ?", "does an object come in from the {side} ?",
             "does something enter on the {side} side ?"),
}
QUESTION_KINDS_V2 = (*QUESTIONS_V2, "yesno")


def askable_events(scene: Scene) -> list[Event]:
    """The scene's events whose phrase names one event only (count changes are asked by counting)."""
    said = [(e, phrase(scene, e)) for e in scene.events if e.kind != "count"]
    texts = [p for _, p in said]
    return [e for e, p in said if texts.count(p) == 1]


def askable_objects(scene: Scene) -> dict[str, int]:
    """'red circle' -> the object's ident, for each (colour, shape) that only one object ever has."""
    owners: dict[str, set[int]] = {}
    for o in scene.objects:
        for _, colour in o.colours:
            owners.setdefault(f"{colour} {o.shape}", set()).add(o.ident)
    return {k: next(iter(v)) for k, v in owners.items() if len(v) == 1}


def story(scene: Scene, ident: int) -> str:
    """Every narrated event about one object, with times."""
    o = scene.obj(ident)
    lines = [f"at {clock(0)} it is there ."] if o.start == 0 else []
    events = list(scene.events)
    for i, e in enumerate(events):
        if ident not in (e.who, e.other) or e.kind == "count" and i > 0 and events[i - 1].kind == "enter":
            continue
        joined = events[i + 1] if e.kind == "enter" and i + 1 < len(events) and events[i + 1].kind == "count" else None
        lines.append(sentence(scene, e, joined))
    return " ".join(lines) if len(lines) > (o.start == 0) else " ".join(lines + ["nothing else happens to it ."])


def _stable_second(scene: Scene, rng: random.Random) -> int | None:
    """A whole second at least a second away from any count change (the count is plain there)."""
    changes = {e.t for e in scene.events if e.kind == "count"}
    ok = [t for t in range(1, scene.seconds - 1) if not changes & {t - 1, t, t + 1}]
    return rng.choice(ok) if ok else None


def _count(scene: Scene, kind: str) -> int:
    return sum(e.kind == kind for e in scene.events)


def _yes_no(scene: Scene, rng: random.Random) -> tuple[str, str] | None:
    """(question, "yes"|"no"), yes or no first drawn with equal chance."""
    facts: dict[str, list[str]] = {"yes": [], "no": []}
    objects = askable_objects(scene)
    for obj, ident in objects.items():
        o = scene.obj(ident)
        truths = {"leaves": o.end != float("inf"), "recolours": len(o.colours) > 1,
                  "collides": any(e.kind == "collide" and ident in (e.who, e.other) for e in scene.events)}
        for what, truth in truths.items():
            facts["yes" if truth else "no"].append(rng.choice(YES_NO[what]).format(obj=obj))
    seen = {f"{c} {o.shape}" for o in scene.objects for _, c in o.colours}
    unseen = [f"{c} {s}" for c in COLOURS for s in SHAPES if f"{c} {s}" not in seen]
    for pair, truth in ((rng.choice(sorted(seen)), "yes"), (rng.choice(unseen), "no")):
        colour, shape = pair.split()
        facts[truth].append(rng.choice(YES_NO["ever"]).format(colour=colour, shape=shape))
    entered = {e.side for e in scene.events if e.kind == "enter"}
    side = rng.choice(SIDES)
    facts["yes" if side in entered else "no"].append(rng.choice(YES_NO["side"]).format(side=side))
    answer = rng.choice(("yes", "no"))
    return rng.choice(facts[answer]), answer


def ask(scene: Scene, kind: str, rng: random.Random) -> tuple[str, str] | None:
    """(question, answer) of one kind in a random wording, or None when the scene has nothing
    to ask of that kind (e.g. no two askable events to order)."""
    if kind == "yesno":
        return _yes_no(scene, rng)
    wording = rng.choice(QUESTIONS_V2[kind])
    counts = {"count_start": scene.count(0.5), "count_end": scene.count(scene.seconds - 0.5),
              "count_enter": _count(scene, "enter"), "count_leave": _count(scene, "leave"),
              "count_colour": _count(scene, "colour"), "count_collide": _count(scene, "collide")}
    if kind == "narrate":
        return wording, narration(scene)
    if kind in counts:
        return wording, str(counts[kind])
    if kind == "count_at":
        t = _stable_second(scene, rng)
        return None if t is None else (wording.format(time=clock(t)), str(scene.count(t + 0.5)))
    events = [e for e in scene.events if e.kind != "count"]
    askable = askable_events(scene)
    if kind == "first":
        return (wording, phrase(scene, events[0]) + " .") if events else None
    if kind == "order":
        if len(askable) < 2:
            return None
        a, b = rng.sample(askable, 2)
        first = a if a.t < b.t else b
        return wording.format(a=phrase(scene, a), b=phrase(scene, b)), phrase(scene, first) + " ."
    if kind == "after":
        pairs = [(e, events[i + 1]) for i, e in enumerate(events[:-1]) if e in askable]
        if not pairs:
            return None
        a, nxt = rng.choice(pairs)
        return wording.format(a=phrase(scene, a)), phrase(scene, nxt) + " ."
    if kind == "when":
        if not askable:
            return None
        e = rng.choice(askable)
        return wording.format(base=phrase(scene, e, base=True), a=phrase(scene, e)), f"at {clock(e.t)}"
    objects = askable_objects(scene)                                  # story
    if not objects:
        return None
    obj = rng.choice(sorted(objects))
    return wording.format(obj=obj), story(scene, objects[obj])


def questions(scene: Scene, rng: random.Random,
              kinds: tuple[str, ...] = QUESTION_KINDS_V2) -> list[tuple[str, str, str]]:
    """(kind, question, answer) per kind the scene can be asked, in random wordings."""
    out = []
    for kind in kinds:
        qa = ask(scene, kind, rng)
        if qa is not None:
            out.append((kind, *qa))
    return out
