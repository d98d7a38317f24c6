"""World v2's scenes: what happens, as a pure function of a seed and a length.

A scene holds 1-4 objects at a time (a shape, a size, a colour) in a square frame, and a script
of events at whole seconds: an object enters from a side, leaves through a side, moves in one of
eight directions and stops, moves toward another and bumps into it, changes colour; the count of
objects changes when one enters or is gone. Every object's centre is a piecewise-linear track
(keyframes), so the state at any time - and so any frame - is computed on its own.

Geometry is in frame units (0..1 across the side); `TOKEN` is one visual token of the default
224 px frame (8 x 8 tokens a frame pair: 28 px patches merged 2x2), and the legibility rules are
stated in tokens and seconds:

- an object is at least 1 token across (the smallest), at most 4 (a large bar);
- moves go in one of eight exact directions, at least 2 tokens, at most `MAX_SPEED` tokens a
  second (under a token per frame pair at 2 fps), so the direction is plain;
- actions happen one at a time and any two event times are `MIN_GAP` seconds apart or more
  (two temporal patches at 2 fps); an object's entering and the new count share one moment;
- objects touch only by a collision, and objects present together have distinct colours, so
  "the red circle" names one object at any moment.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from sparrow.errors import InvalidRequest
from sparrow.video.synthetic import PALETTE

TOKEN = 1 / 8                       # one visual token of a 224 px frame, in frame units
MIN_GAP = 2                         # seconds between any two event moments
MAX_SPEED = 1.5 * TOKEN             # frame units a second
MAX_OBJECTS = 4
MAX_ACTIONS = 10                    # a long video stays sparse: narrations of 60-250 tokens
TRIES = 12                          # draws of one action kind before the next kind is tried
ACTION_SLOT = 7                     # seconds per action: its motion (<= 5 s) and a gap
COLOURS = tuple(PALETTE)
SHAPES = ("circle", "rectangle", "bar")                     # round; tall (1 x 2); wide (2 x 1)
SIZES = {"small": TOKEN, "medium": 1.5 * TOKEN, "large": 2 * TOKEN}   # the short side
SIDES = ("left", "right", "top", "bottom")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1),
              "up and left": (-1, -1), "up and right": (1, -1), "down and left": (-1, 1), "down and right": (1, 1)}
EVENT_KINDS = ("enter", "leave", "move", "stop", "colour", "collide", "count")
ACTIONS = ("enter", "leave", "move", "colour", "collide")


@dataclass(frozen=True, slots=True)
class SceneObject:
    ident: int
    shape: str
    size: str
    colours: tuple[tuple[int, str], ...]            # (from second, colour), the first at `start`
    track: tuple[tuple[float, float, float], ...]   # (t s, x, y) keyframes of the centre
    start: int                                      # first second it is visible (0: there at the start)
    end: float                                      # gone from this second on (inf: stays)

    @property
    def half(self) -> tuple[float, float]:
        return half_extents(self.shape, self.size)

    def centre(self, t: float) -> tuple[float, float]:
        ts, xs, ys = zip(*self.track)
        return float(np.interp(t, ts, xs)), float(np.interp(t, ts, ys))

    def colour(self, t: float) -> str:
        return [c for s, c in self.colours if s <= t][-1] if t >= self.colours[0][0] else self.colours[0][1]

    def present(self, t: float) -> bool:
        return self.start <= t < self.end


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happens, at a whole second. `who`/`other`: object idents."""

    t: int
    kind: str                        # one of EVENT_KINDS
    who: int | None = None           # count: the object that entered or is gone
    other: int | None = None         # collide, or a move toward it
    side: str | None = None          # enter from / leave through
    direction: str | None = None     # move (None with `other`: toward it)
    colour: str | None = None        # colour: the new one
    previous: str | None = None      # colour: the old one
    count: int | None = None         # count: objects present from now


@dataclass(frozen=True, slots=True)
class Scene:
    seed: int
    seconds: int
    objects: tuple[SceneObject, ...]
    events: tuple[Event, ...]        # in time order

    def obj(self, ident: int) -> SceneObject:
        return self.objects[ident]

    def present(self, t: float) -> list[SceneObject]:
        return [o for o in self.objects if o.present(t)]

    def count(self, t: float) -> int:
        return len(self.present(t))

    def moving(self, t: float) -> bool:
        """Whether anything is in motion at t (between an action's start and its end)."""
        return any(a <= t < b for a, b in self.busy)

    @property
    def busy(self) -> list[tuple[int, float]]:
        out = []
        for o in self.objects:
            out += [(a[0], b[0]) for a, b in zip(o.track, o.track[1:]) if (a[1], a[2]) != (b[1], b[2])]
        return out


# ----- geometry ---------------------------------------------------------------------------------------
def half_extents(shape: str, size: str) -> tuple[float, float]:
    """Half extents (x, y) in frame units: a circle is its size across, a rectangle twice as
    tall as wide, a bar twice as wide as tall."""
    d = SIZES[size]
    return {"circle": (d / 2, d / 2), "rectangle": (d / 2, d), "bar": (d, d / 2)}[shape]


def _core(o_shape: str, half: tuple[float, float]) -> tuple[float, float, float]:
    """A shape as a box core plus a rounding radius: a circle is a point rounded by its radius."""
    return (0.0, 0.0, half[0]) if o_shape == "circle" else (half[0], half[1], 0.0)


def gap(shape_a: str, half_a, pa, shape_b: str, half_b, pb) -> float:
    """Distance between two shapes' outlines in frame units (<= 0: they touch or overlap).
    Exact for circle/circle, box/box and circle/box (a rounded box is their Minkowski sum)."""
    ax, ay, ar = _core(shape_a, half_a)
    bx, by, br = _core(shape_b, half_b)
    gx = max(0.0, abs(pa[0] - pb[0]) - ax - bx)
    gy = max(0.0, abs(pa[1] - pb[1]) - ay - by)
    return math.hypot(gx, gy) - ar - br          # boxes that overlap: 0 or less


def inside(half, p) -> bool:
    return half[0] <= p[0] <= 1 - half[0] and half[1] <= p[1] <= 1 - half[1]


# ----- the generator ----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Live:
    """An object while its script is written (mutable; frozen into a SceneObject at the end)."""

    ident: int
    shape: str
    size: str
    colours: list[tuple[int, str]]
    track: list[tuple[float, float, float]]
    start: int
    end: float = math.inf

    @property
    def half(self) -> tuple[float, float]:
        return half_extents(self.shape, self.size)

    @property
    def pos(self) -> tuple[float, float]:
        return self.track[-1][1], self.track[-1][2]

    @property
    def colour(self) -> str:
        return self.colours[-1][1]


class _Writer:
    """Writes one scene's script action by action, each at a time the caller gives."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.objects: list[_Live] = []
        self.events: list[Event] = []

    def present(self) -> list[_Live]:
        return [o for o in self.objects if o.end == math.inf]

    def _free_colour(self) -> str:
        used = {o.colour for o in self.present()}
        return self.rng.choice([c for c in COLOURS if c not in used])

    def _new(self, t: int, pos: tuple[float, float]) -> _Live:
        o = _Live(len(self.objects), self.rng.choice(SHAPES), self.rng.choice(tuple(SIZES)),
                  [(t, self._free_colour())], [(float(t), *pos)], t)
        return o

    def _clear(self, mover: _Live, a, b, ignore: tuple[int, ...] = (), skip: float = 0.0) -> bool:
        """The straight path a -> b of `mover` keeps a token's quarter from every other present
        object (the first `skip` share of the path excepted: leaving a contact)."""
        for s in np.linspace(skip, 1.0, 24):
            p = (a[0] + s * (b[0] - a[0]), a[1] + s * (b[1] - a[1]))
            for o in self.present():
                if o.ident != mover.ident and o.ident not in ignore and \
                        gap(mover.shape, mover.half, p, o.shape, o.half, o.pos) < TOKEN / 4:
                    return False
        return True

    @staticmethod
    def _duration(a, b) -> int:
        return max(MIN_GAP, math.ceil(math.dist(a, b) / MAX_SPEED))

    def _go(self, o: _Live, t: int, to, seconds: int) -> None:
        o.track += [(float(t), *o.pos), (float(t + seconds), *to)]

    # --- the initial cast
    def place(self, count: int) -> None:
        for _ in range(count):
            for _ in range(200):
                o = self._new(0, (0.5, 0.5))
                h = o.half
                p = (self.rng.uniform(h[0], 1 - h[0]), self.rng.uniform(h[1], 1 - h[1]))
                o.track = [(0.0, *p)]
                if all(gap(o.shape, h, p, q.shape, q.half, q.pos) >= TOKEN / 2 for q in self.present()):
                    self.objects.append(o)
                    break

    # --- actions: each returns its length in seconds, or None when it cannot happen now
    def enter(self, t: int, budget: int) -> int | None:
        if len(self.present()) >= MAX_OBJECTS:
            return None
        o = self._new(t, (0.0, 0.0))
        h, side = o.half, self.rng.choice(SIDES)
        depth = self.rng.uniform(TOKEN, 3 * TOKEN)
        if side in ("left", "right"):
            y = self.rng.uniform(h[1], 1 - h[1])
            a = (-h[0], y) if side == "left" else (1 + h[0], y)
            b = (h[0] + depth, y) if side == "left" else (1 - h[0] - depth, y)
        else:
            x = self.rng.uniform(h[0], 1 - h[0])
            a = (x, -h[1]) if side == "top" else (x, 1 + h[1])
            b = (x, h[1] + depth) if side == "top" else (x, 1 - h[1] - depth)
        seconds = self._duration(a, b)
        if seconds > budget or not self._clear(o, a, b):
            return None
        o.track = [(float(t), *a), (float(t + seconds), *b)]
        self.objects.append(o)
        self.events += [Event(t, "enter", o.ident, side=side), Event(t, "count", o.ident, count=len(self.present()))]
        return seconds

    def leave(self, t: int, budget: int) -> int | None:
        if not self.present():
            return None
        o = self.rng.choice(self.present())
        (x, y), h = o.pos, o.half
        side = self.rng.choice(SIDES)
        b = {"left": (-h[0], y), "right": (1 + h[0], y), "top": (x, -h[1]), "bottom": (x, 1 + h[1])}[side]
        seconds = self._duration(o.pos, b)
        if seconds > budget or not self._clear(o, o.pos, b, skip=0.2):
            return None
        self._go(o, t, b, seconds)
        o.end = t + seconds
        self.events += [Event(t, "leave", o.ident, side=side),
                        Event(t + seconds, "count", o.ident, count=len(self.present()))]
        return seconds

    def move(self, t: int, budget: int) -> int | None:
        if not self.present():
            return None
        o = self.rng.choice(self.present())
        name = self.rng.choice(tuple(DIRECTIONS))
        dx, dy = DIRECTIONS[name]
        unit = math.hypot(dx, dy)
        distance = self.rng.uniform(2 * TOKEN, 4 * TOKEN)
        b = (o.pos[0] + dx / unit * distance, o.pos[1] + dy / unit * distance)
        seconds = self._duration(o.pos, b)
        if seconds > budget or not inside(o.half, b) or not self._clear(o, o.pos, b, skip=0.2):
            return None
        self._go(o, t, b, seconds)
        self.events += [Event(t, "move", o.ident, direction=name), Event(t + seconds, "stop", o.ident)]
        return seconds

    def colour(self, t: int, budget: int) -> int | None:
        if not self.present():
            return None
        o = self.rng.choice(self.present())
        new = self._free_colour()
        self.events.append(Event(t, "colour", o.ident, colour=new, previous=o.colour))
        o.colours.append((t, new))
        return 0

    def collide(self, t: int, budget: int) -> int | None:
        if len(self.present()) < 2:
            return None
        a, b = self.rng.sample(self.present(), 2)
        start, goal = a.pos, b.pos
        if gap(a.shape, a.half, start, b.shape, b.half, goal) < 2 * TOKEN:
            return None        # too near: the approach would not be seen
        lo, hi = 0.0, 1.0      # the share of the way to b's centre where the outlines first touch
        for _ in range(40):
            mid = (lo + hi) / 2
            p = (start[0] + mid * (goal[0] - start[0]), start[1] + mid * (goal[1] - start[1]))
            lo, hi = (lo, mid) if gap(a.shape, a.half, p, b.shape, b.half, goal) <= 0 else (mid, hi)
        contact = (start[0] + hi * (goal[0] - start[0]), start[1] + hi * (goal[1] - start[1]))
        seconds = self._duration(start, contact)
        if seconds > budget or not self._clear(a, start, contact, ignore=(b.ident,)):
            return None
        self._go(a, t, contact, seconds)
        self.events += [Event(t, "move", a.ident, other=b.ident), Event(t + seconds, "collide", a.ident, other=b.ident)]
        return seconds

    def freeze(self, seed: int, seconds: int) -> Scene:
        objects = tuple(SceneObject(o.ident, o.shape, o.size, tuple(o.colours), tuple(o.track), o.start, o.end)
                        for o in self.objects)
        return Scene(seed, seconds, objects, tuple(sorted(self.events, key=lambda e: (e.t, e.kind == "count"))))


def make_scene(seed: int, seconds: int) -> Scene:
    """The scene of `seed`, `seconds` long (>= 4): 1-4 objects at the start, then actions one at
    a time, spread over the whole length (so a long video is mostly quiet, as real ones are):
    one action per ACTION_SLOT seconds, at most MAX_ACTIONS."""
    if not isinstance(seconds, int) or seconds < 4:
        raise InvalidRequest(f"a v2 scene lasts a whole number of seconds >= 4, got {seconds!r}")
    rng = random.Random(f"sparrow-world-v2:{seed}")
    writer = _Writer(rng)
    writer.place(rng.randint(1, MAX_OBJECTS))
    slots = min(MAX_ACTIONS, max(1, (seconds - MIN_GAP) // ACTION_SLOT))
    actions = rng.randint(max(1, (slots + 1) // 2 + slots // 4), slots)
    length = (seconds - MIN_GAP) / actions
    for i in range(actions):
        begin, end = MIN_GAP + round(i * length), MIN_GAP + round((i + 1) * length)
        budget = end - begin - MIN_GAP            # the action's motion, then a gap before the next
        t = begin + rng.randint(0, max(0, budget - 4))
        budget -= t - begin
        steps = {"enter": writer.enter, "leave": writer.leave, "move": writer.move, "colour": writer.colour,
                 "collide": writer.collide}
        kinds = list(ACTIONS)
        rng.shuffle(kinds)
        # each kind gets several draws (a path may be blocked) before the next is tried, so the
        # kinds that need room are not crowded out by the colour change, which always fits
        next((kind for kind in kinds for _ in range(TRIES) if budget >= 0 and steps[kind](t, budget) is not None), None)
    return writer.freeze(seed, seconds)
