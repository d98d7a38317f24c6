"""World v2 in words: the dense narration of a scene, every event with its time, and its parser.

Text is written in the tokenizer's canonical spacing (every word and mark apart, as v1 writes
"appears ."), so decoding a tokenized answer gives the same string back; a time reads
"1 : 05" (minutes, colon, two-digit seconds: three words). An object is introduced with its
size ("a small green circle") and named after that by colour and shape ("the green circle"),
which is unique among the objects present at that moment (scenes_v2's rule).

    at 0 : 00 there are 2 objects : a small red circle and a large blue bar .
    at 0 : 04 the red circle moves up and left . at 0 : 06 the red circle stops .
    at 0 : 11 a medium green rectangle enters from the top ; now there are 3 objects .
    at 0 : 17 the blue bar leaves through the right . at 0 : 20 the blue bar is gone ; now there are 2 objects .
    at 0 : 30 the video ends with 2 objects .

`facts` is a scene's ground truth in a comparable form and `parse_narration` reads the same
form back from text, so `event_recall` can score a model's narration against the scene.
"""

from __future__ import annotations

import re

from sparrow.world.v2.scenes_v2 import Event, Scene

# event kind -> (finite verb, base verb): "the red circle stops" / "when does the red circle stop"
VERBS = {"enter": ("enters", "enter"), "leave": ("leaves", "leave"), "move": ("moves", "move"),
         "stop": ("stops", "stop"), "colour": ("turns", "turn"), "collide": ("bumps", "bump")}
# how many objects, in words ("now there are 3 objects", "now there is 1 object")
NUMBER_WORDS = {0: "no"}


def clock(t: int) -> str:
    """Seconds as narrated: 65 -> "1 : 05"."""
    return f"{t // 60} : {t % 60:02d}"


def objects_phrase(n: int) -> str:
    return f"there is 1 object" if n == 1 else f"there are {NUMBER_WORDS.get(n, n)} objects"


def name(scene: Scene, ident: int, t: int) -> str:
    """'the red circle': the object's colour just before t and its shape."""
    o = scene.obj(ident)
    return f"the {o.colour(t - 0.5)} {o.shape}"


def introduce(scene: Scene, ident: int, t: int) -> str:
    """'a small red circle': the object's size, colour at t and shape."""
    o = scene.obj(ident)
    return f"a {o.size} {o.colour(t)} {o.shape}"


def phrase(scene: Scene, e: Event, base: bool = False) -> str:
    """The event without its time: 'the red circle turns blue'; base=True: 'the red circle turn
    blue' (after "when does"). Count events are phrased by `sentence` only."""
    verb = VERBS[e.kind][1 if base else 0]
    if e.kind == "enter":
        return f"{introduce(scene, e.who, e.t)} {verb} from the {e.side}"
    subject = name(scene, e.who, e.t)
    if e.kind == "leave":
        return f"{subject} {verb} through the {e.side}"
    if e.kind == "move":
        where = e.direction if e.other is None else f"toward {name(scene, e.other, e.t)}"
        return f"{subject} {verb} {where}"
    if e.kind == "colour":
        return f"{subject} {verb} {e.colour}"
    if e.kind == "collide":
        return f"{subject} {verb} into {name(scene, e.other, e.t)} and {VERBS['stop'][1 if base else 0]}"
    return f"{subject} {verb}"


def sentence(scene: Scene, e: Event, joined: Event | None = None) -> str:
    """One narrated event with its time; `joined`: the count that changes with it (an entering)."""
    if e.kind == "count":      # an object is gone: the count after it
        return f"at {clock(e.t)} {name(scene, e.who, e.t)} is gone ; now {objects_phrase(e.count)} ."
    text = f"at {clock(e.t)} {phrase(scene, e)}"
    return f"{text} ; now {objects_phrase(joined.count)} ." if joined is not None else f"{text} ."


def cast(scene: Scene) -> str:
    """'at 0 : 00 there are 2 objects : a small red circle and a large blue bar .'"""
    first = [introduce(scene, o.ident, 0) for o in scene.present(0)]
    if not first:
        return f"at {clock(0)} {objects_phrase(0)} ."
    listed = first[0] if len(first) == 1 else " , ".join(first[:-1]) + f" and {first[-1]}"
    return f"at {clock(0)} {objects_phrase(len(first))} : {listed} ."


def narration(scene: Scene) -> str:
    """Every event in time order with its time, the cast first and the count at the end."""
    parts = [cast(scene)]
    events = list(scene.events)
    for i, e in enumerate(events):
        if e.kind == "count" and i > 0 and events[i - 1].kind == "enter" and events[i - 1].t == e.t:
            continue           # said with its entering
        after = events[i + 1] if i + 1 < len(events) else None
        joined = after if e.kind == "enter" and after is not None and after.kind == "count" and after.t == e.t else None
        parts.append(sentence(scene, e, joined))
    end = scene.count(scene.seconds - 0.5)
    parts.append(f"at {clock(scene.seconds)} the video ends with {NUMBER_WORDS.get(end, end)} object{'' if end == 1 else 's'} .")
    return " ".join(parts)


# ----- ground truth as facts, and reading them back -------------------------------------------------
def facts(scene: Scene) -> list[tuple]:
    """The scene's events as comparable tuples (t, kind, ...): what a narration must say."""
    out: list[tuple] = [(0, "cast", tuple(sorted(introduce(scene, o.ident, 0) for o in scene.present(0))))]
    for e in scene.events:
        o = scene.obj(e.who)
        named = (o.colour(e.t - 0.5), o.shape)
        if e.kind == "enter":
            out.append((e.t, "enter", o.size, o.colour(e.t), o.shape, e.side))
        elif e.kind == "count":
            out.append((e.t, "count", e.count))
        elif e.kind == "move":
            other = scene.obj(e.other) if e.other is not None else None
            out.append((e.t, "move", *named, e.direction or f"toward {other.colour(e.t - 0.5)} {other.shape}"))
        elif e.kind == "collide":
            other = scene.obj(e.other)
            out.append((e.t, "collide", *named, other.colour(e.t - 0.5), other.shape))
        elif e.kind == "colour":
            out.append((e.t, "colour", *named, e.colour))
        else:                   # leave, stop
            out.append((e.t, e.kind, *named, *((e.side,) if e.side else ())))
    return out + [(scene.seconds, "end", scene.count(scene.seconds - 0.5))]


_T = r"at (\d+) : (\d\d) "
_N = r"now there (?:is|are) (\w+) objects?"
_PATTERNS = (
    ("cast", re.compile(_T + r"there (?:is|are) \w+ objects?(?: : (.*))?$")),
    ("enter", re.compile(_T + r"a (\w+) (\w+) (\w+) enters from the (\w+) ; " + _N + "$")),
    ("count", re.compile(_T + r"the (\w+) (\w+) is gone ; " + _N + "$")),
    ("leave", re.compile(_T + r"the (\w+) (\w+) leaves through the (\w+)$")),
    ("move", re.compile(_T + r"the (\w+) (\w+) moves ((?:up|down|left|right)(?: and (?:left|right))?|toward the \w+ \w+)$")),
    ("stop", re.compile(_T + r"the (\w+) (\w+) stops$")),
    ("collide", re.compile(_T + r"the (\w+) (\w+) bumps into the (\w+) (\w+) and stops$")),
    ("colour", re.compile(_T + r"the (\w+) (\w+) turns (\w+)$")),
    ("end", re.compile(_T + r"the video ends with (\w+) objects?$")),
)


def _count(word: str) -> int | None:
    return 0 if word == "no" else int(word) if word.isdigit() else None


def parse_narration(text: str) -> list[tuple]:
    """The facts a narration states, in facts()' form; sentences that match no pattern are
    skipped (a model's malformed sentence states nothing)."""
    out: list[tuple] = []
    for raw in text.split(" ."):
        s = raw.strip()
        for kind, pattern in _PATTERNS:
            m = pattern.match(s)
            if m is None:
                continue
            t, g = int(m.group(1)) * 60 + int(m.group(2)), m.groups()[2:]
            if kind == "cast":
                listed = (g[0] or "").replace(" and ", " , ")
                out.append((t, "cast", tuple(sorted(p.strip() for p in listed.split(" , ") if p.strip()))))
            elif kind == "enter":
                out += [(t, "enter", *g[:4]), (t, "count", _count(g[4]))]
            elif kind == "count":
                out.append((t, "count", _count(g[2])))
            elif kind == "move":
                out.append((t, "move", g[0], g[1], g[2].replace("toward the ", "toward ")))
            elif kind == "end":
                out.append((t, "end", _count(g[0])))
            else:
                out.append((t, kind, *g))
            break
    return out


def event_recall(text: str, scene: Scene) -> float:
    """The share of the scene's facts (the cast, every event with its time, the final count)
    that the text states exactly."""
    truth, said = facts(scene), set(parse_narration(text))
    return sum(f in said for f in truth) / len(truth)
