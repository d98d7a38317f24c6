"""World v2's questions: each kind in six wordings, each answer true to the scene.

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
from sparrow.world.v2.scenes_v2 import COLOURS, SHAPES, SIDES, TOKEN, Event, Scene

QUESTIONS_V2: dict[str, tuple[str, ...]] = {
    "narrate": ("describe the video in detail , with times .", "narrate the video with times .",
                "what happens in the video , and when ?", "tell me everything that happens , with the times .",
                "give a timed account of the clip .", "list every event in the video with its time ."),
    "count_start": ("how many objects are there at the start ?", "how many objects do you see at first ?",
                    "at the start , how many objects are there ?", "how many shapes are in the first frame ?",
                    "count the objects at the beginning .", "how many things are visible when the clip begins ?"),
    "count_end": ("how many objects are there at the end ?", "how many objects are left at the end ?",
                  "at the end , how many objects are there ?", "how many shapes remain in the last frame ?",
                  "count the objects at the finish .", "how many things are still visible when the clip ends ?"),
    "count_at": ("how many objects are there at {time} ?", "at {time} , how many objects are there ?",
                 "how many objects can you see at {time} ?", "count the shapes on screen at {time} .",
                 "how many things are visible at the moment {time} ?", "at time {time} , how many shapes are shown ?"),
    "count_enter": ("how many objects enter the video ?", "how many objects come in ?",
                    "how many times does an object enter ?", "how many new shapes arrive during the clip ?",
                    "count the objects that come into view .", "how many things appear after the start ?"),
    "count_leave": ("how many objects leave the video ?", "how many objects go out ?",
                    "how many times does an object leave ?", "how many shapes exit the frame ?",
                    "count the objects that disappear off the edge .", "how many things go out of view ?"),
    "count_colour": ("how many times does an object change colour ?", "how many colour changes are there ?",
                     "how often does something change colour ?", "how many times does a shape switch colour ?",
                     "count the colour changes .", "how many recolourings happen in the clip ?"),
    "count_collide": ("how many collisions are there ?", "how many times do two objects bump into each other ?",
                      "how many times do objects collide ?", "how many crashes happen in the clip ?",
                      "count the collisions .", "how often does one shape hit another ?"),
    "first": ("what happens first ?", "what is the first thing that happens ?", "which event comes first ?",
              "what is the earliest event ?", "what happens before anything else ?",
              "tell me the opening event of the clip ."),
    "order": ("which happens first : {a} , or {b} ?", "what comes earlier : {a} , or {b} ?",
              "which is first : {a} , or {b} ?", "which event is sooner : {a} , or {b} ?",
              "in time order , which comes first : {a} , or {b} ?", "which one happens before the other : {a} , or {b} ?"),
    "after": ("what happens after {a} ?", "what happens next , after {a} ?", "after {a} , what happens ?",
              "what is the next event after {a} ?", "once {a} , what follows ?",
              "which event follows when {a} ?"),
    "when": ("when does {base} ?", "at what time does {base} ?", "what time is it when {a} ?",
             "at which moment does {base} ?", "give the time when {a} .", "how far into the clip does {base} ?"),
    "story": ("what happens to the {obj} ?", "tell me about the {obj} .", "what does the {obj} do ?",
              "describe the {obj} over the whole clip .", "follow the {obj} : what does it do ?",
              "give the history of the {obj} , with times ."),
    "where": ("where is the {obj} at the start ?", "at first , where is the {obj} ?",
              "in which part of the frame is the {obj} at the beginning ?",
              "where do you see the {obj} in the first frame ?", "which area holds the {obj} when the clip begins ?",
              "locate the {obj} at the start ."),
    "size": ("what size is the {obj} ?", "how big is the {obj} ?", "is the {obj} small , medium or large ?",
             "how large is the {obj} ?", "what is the size of the {obj} ?", "tell me the size of the {obj} ."),
    "direction": ("which way does the {obj} move ?", "in what direction does the {obj} go ?",
                  "where does the {obj} head when it moves ?", "which direction does the {obj} travel ?",
                  "toward which side does the {obj} slide ?", "how does the {obj} move : which way ?"),
    "shape": ("what shape is the {colour} object ?", "what kind of shape is {colour} ?",
              "which shape has the colour {colour} ?", "the {colour} object is what shape ?",
              "name the shape that is {colour} .", "what is the {colour} thing ?"),
    "colour_end": ("what colour is the {obj} at the end ?", "what colour does the {obj} finish in ?",
                   "in the last frame , what colour is the {obj} ?", "which colour does the {obj} have when the clip ends ?",
                   "what hue is the {obj} at the close ?", "by the end , what colour has the {obj} become ?"),
    "duration": ("how long is the video ?", "what is the length of the clip ?", "how long does the video last ?",
                 "what is the running time of the footage ?", "when does the video end ?",
                 "for how many minutes and seconds does the recording play ?"),
}
# Answer forms by wording (the rest answer bare): a form is the wording's, never the scene's,
# so an answer's words still follow from the question alone.
ANSWER_FORMS: dict[str, str] = {
    **{w: "{} in all" for w in ("count the objects at the beginning .", "count the objects at the finish .",
                                "count the shapes on screen at {time} .", "count the objects that come into view .",
                                "count the objects that disappear off the edge .", "count the colour changes .",
                                "count the collisions .")},
    **{w: "it happens {}" for w in ("at which moment does {base} ?", "give the time when {a} .",
                                    "how far into the clip does {base} ?")},
    **{w: "first , {}" for w in ("which event is sooner : {a} , or {b} ?", "in time order , which comes first : {a} , or {b} ?",
                               "which one happens before the other : {a} , or {b} ?")},
    **{w: "it is {}" for w in ("what size is the {obj} ?", "how big is the {obj} ?")},
    **{w: "it is a {}" for w in ("what shape is the {colour} object ?", "which shape has the colour {colour} ?")},
    **{w: "it lasts {}" for w in ("how long is the video ?", "what is the running time of the footage ?")},
    **{w: "the recording runs for {}" for w in ("for how many minutes and seconds does the recording play ?",)},
    **{w: "in the {}" for w in ("in which part of the frame is the {obj} at the beginning ?",
                                "which area holds the {obj} when the clip begins ?")},
}
# yes/no questions: (template, what it asks); each in several wordings
YES_NO: dict[str, tuple[str, ...]] = {
    "leaves": ("does the {obj} leave the video ?", "does the {obj} go out of the picture ?",
               "is the {obj} gone at some point ?", "does the {obj} exit the frame ?",
               "does the {obj} disappear off an edge ?"),
    "recolours": ("does the {obj} change colour ?", "does the {obj} ever turn another colour ?",
                  "is the colour of the {obj} ever different ?", "does the {obj} switch colour ?",
                  "is the {obj} recoloured at some point ?"),
    "collides": ("does the {obj} bump into anything ?", "does the {obj} collide with something ?",
                 "does anything touch the {obj} ?", "does the {obj} crash into another shape ?",
                 "is the {obj} ever hit ?"),
    "ever": ("is there ever a {colour} {shape} ?", "do you see a {colour} {shape} at any time ?",
             "does a {colour} {shape} appear in the video ?", "is a {colour} {shape} ever visible ?",
             "does the clip show a {colour} {shape} ?"),
    "side": ("does anything enter from the {side} ?", "does an object come in from the {side} ?",
             "does something enter on the {side} side ?", "does a shape arrive through the {side} edge ?",
             "is there an entrance from the {side} ?"),
}
# the part of the frame an object is in (thirds across and down), as "where" answers it
COLUMNS, ROWS = ("left", "middle", "right"), ("top", "middle", "bottom")
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


def colour_owners(scene: Scene) -> dict[str, set[int]]:
    """colour -> the idents of the objects that have it at some moment."""
    owners: dict[str, set[int]] = {}
    for o in scene.objects:
        for _, colour in o.colours:
            owners.setdefault(colour, set()).add(o.ident)
    return owners


def named_object(scene: Scene, question: str) -> int | None:
    """The object a question names: by a colour and shape only it ever has (askable_objects),
    else by a colour only it ever has ("what shape is the red object ?"); None if it names none."""
    padded = f" {question} "
    names = askable_objects(scene)
    found = [name for name in names if f" {name} " in padded]
    if found:
        return names[max(found, key=len)]
    owners = colour_owners(scene)
    once = [colour for colour, who in owners.items() if len(who) == 1 and f" {colour} " in padded]
    return next(iter(owners[once[0]])) if len(once) == 1 else None


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


def where(scene: Scene, ident: int) -> str | None:
    """The part of the frame (thirds across and down) the object's centre is in at the start:
    "top left", "top", "middle", ...; None when it is within half a token of a third's border."""
    x, y = scene.obj(ident).centre(0)
    if any(abs(v - b) < TOKEN / 2 for v in (x, y) for b in (1 / 3, 2 / 3)):
        return None
    row, column = ROWS[min(2, int(y * 3))], COLUMNS[min(2, int(x * 3))]
    return "middle" if row == column == "middle" else column if row == "middle" else row if column == "middle" \
        else f"{row} {column}"


def _about_object(scene: Scene, kind: str, wording: str, rng: random.Random) -> tuple[str, str] | None:
    """story, where, size, direction, colour_end and shape: a question about one object, or None."""
    objects = askable_objects(scene)
    if kind == "shape":
        colours = colour_owners(scene)
        once = sorted(c for c, owners in colours.items() if len(owners) == 1)
        if not once:
            return None
        colour = rng.choice(once)
        return wording.format(colour=colour), scene.obj(next(iter(colours[colour]))).shape
    answers = {}
    for obj, ident in objects.items():
        o = scene.obj(ident)
        moves = [e.direction for e in scene.events if e.kind == "move" and e.who == ident and e.direction]
        answers[obj] = {"story": lambda i=ident: story(scene, i), "size": lambda o=o: o.size,
                        "where": lambda i=ident, o=o: where(scene, i) if o.start == 0 else None,
                        "direction": lambda m=moves: m[0] if len(m) == 1 else None,
                        "colour_end": lambda o=o: o.colour(scene.seconds) if o.end > scene.seconds else None}[kind]()
    choices = sorted(obj for obj, a in answers.items() if a is not None)
    if not choices:
        return None
    obj = rng.choice(choices)
    return wording.format(obj=obj), answers[obj]


def _bare(scene: Scene, kind: str, wording: str, rng: random.Random) -> tuple[str, str] | None:
    """ask's question and its answer before the wording's answer form."""
    counts = {"count_start": scene.count(0.5), "count_end": scene.count(scene.seconds - 0.5),
              "count_enter": _count(scene, "enter"), "count_leave": _count(scene, "leave"),
              "count_colour": _count(scene, "colour"), "count_collide": _count(scene, "collide")}
    if kind == "narrate":
        return wording, narration(scene)
    if kind == "duration":
        return wording, f"at {clock(scene.seconds)}" if wording.startswith("when") else clock(scene.seconds)
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
    return _about_object(scene, kind, wording, rng)


def ask(scene: Scene, kind: str, rng: random.Random) -> tuple[str, str] | None:
    """(question, answer) of one kind in a random wording, or None when the scene has nothing
    to ask of that kind (e.g. no two askable events to order). The answer takes the wording's
    form (ANSWER_FORMS): "3" or "3 in all", "at 0 : 14" or "it happens at 0 : 14"."""
    if kind == "yesno":
        return _yes_no(scene, rng)
    wording = rng.choice(QUESTIONS_V2[kind])
    qa = _bare(scene, kind, wording, rng)
    return None if qa is None else (qa[0], ANSWER_FORMS.get(wording, "{}").format(qa[1]))


def questions(scene: Scene, rng: random.Random,
              kinds: tuple[str, ...] = QUESTION_KINDS_V2) -> list[tuple[str, str, str]]:
    """(kind, question, answer) per kind the scene can be asked, in random wordings."""
    out = []
    for kind in kinds:
        qa = ask(scene, kind, rng)
        if qa is not None:
            out.append((kind, *qa))
    return out
