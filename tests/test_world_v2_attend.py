"""World v2's attention objective (world/v2/attend_v2.py): the question's object is the one its
answer is about, its cells are where the rendered frames show it, the term is -log of the mass a
head puts there, it leaves the model's forward unchanged, and a head trained on it looks there."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sparrow.world.target_data import pooled_logits
from sparrow.world.v2.attend_v2 import ATTEND_KINDS, attention_loss, attention_of, chat_cells, head_map, object_cells
from sparrow.world.v2.questions_v2 import ask, named_object
from sparrow.world.v2.render_v2 import FPS, background, render_frame
from sparrow.world.v2.scenes_v2 import make_scene
from sparrow.world.v2.target_v2 import V2Data, V2TargetConfig, new_v2_target

# 56 px frames: 2 x 2 visual tokens a frame pair, so an 8 s video is 32 tokens
TINY = dict(hidden=64, layers=2, heads=2, intermediate=64, batch=2, pool=6, side=56, seconds=(8,), eval_every=0,
            log_every=1, kinds=("where", "size"), attend_layer=1)


def test_the_named_object_is_the_one_the_answer_is_about():
    checked = {kind: 0 for kind in ("where", "size", "shape", "colour_end")}
    for seed in range(200):
        scene = make_scene(seed, 8)
        for kind in checked:
            qa = ask(scene, kind, random.Random(seed))
            if qa is None:
                continue
            ident = named_object(scene, qa[0])
            assert ident is not None, (seed, qa)
            o = scene.obj(ident)
            expected = {"size": o.size, "shape": o.shape, "colour_end": o.colour(scene.seconds), "where": None}[kind]
            assert expected is None or qa[1].split()[-1] == expected, (seed, kind, qa, o)
            checked[kind] += 1
    assert min(checked.values()) >= 20, checked
    assert named_object(make_scene(0, 8), "how many objects are there at the start ?") is None


def _changed_cells(scene, seconds: tuple[float, ...], side: int, block: int) -> set[tuple[int, int]]:
    """(row, column) of the 4 x 4 cells where a block x block square of pixels differs from the
    empty scene in one of those moments' frames."""
    cell, out = side // 4, set()
    for second in seconds:
        diff = np.abs(render_frame(scene, second, side).astype(int) - background(side).astype(int)).sum(-1) > 30
        out |= {(i, j) for i in range(4) for j in range(4)
                if any(diff[i * cell + a:i * cell + a + block, j * cell + b:j * cell + b + block].all()
                       for a in range(cell - block + 1) for b in range(cell - block + 1))}
    return out


def test_an_objects_cells_are_where_the_frames_show_it():
    """One-object scenes at 112 px (4 x 4 cells a frame pair, 8 temporal patches in 8 s): the
    start's cells hold every cell where the first two frames show the object (a 3 x 3 block of
    its pixels) and only cells where they show some of it; so do the end's for the last two
    frames; "all" holds both."""
    seen = 0
    for seed in range(400):
        scene = make_scene(seed, 8)
        if len(scene.objects) != 1 or scene.objects[0].start != 0 or scene.objects[0].end <= 8:
            continue
        ident = scene.objects[0].ident
        grid = (8, 8, 8)
        start = {(c // 4, c % 4) for c in object_cells(scene, ident, grid, "start")}
        first = (0.0, 1 / FPS)
        assert _changed_cells(scene, first, 112, 3) <= start <= _changed_cells(scene, first, 112, 1), seed
        end = {((c % 16) // 4, c % 4) for c in object_cells(scene, ident, grid, "end")}
        assert all(c // 16 == 7 for c in object_cells(scene, ident, grid, "end"))
        last = (14 / FPS, 15 / FPS)
        assert _changed_cells(scene, last, 112, 3) <= end <= _changed_cells(scene, last, 112, 1), seed
        assert start and end
        every = object_cells(scene, ident, grid, "all")
        assert set(object_cells(scene, ident, grid, "start")) | set(object_cells(scene, ident, grid, "end")) <= set(every)
        seen += 1
        if seen == 12:
            break
    assert seen == 12
    scene = make_scene(3, 8)
    assert chat_cells(scene, "count_start", "how many objects are there at the start ?", (8, 8, 8)) == []
    assert set(ATTEND_KINDS) == {"where", "colour_end", "size", "shape", "direction", "story"}


def test_the_term_is_minus_log_the_heads_mass_on_the_cells():
    # one chat of 6 tokens: 2 text, 3 visual (ids 9), 1 answer position predicting the last token
    ids = torch.tensor([[1, 9, 9, 9, 2, 3]])
    pick = torch.tensor([[False, False, False, False, True]])        # position 4 predicts token 5
    weights = torch.zeros(1, 2, 6, 6)
    weights[0, 0, 4, [1, 2, 3, 4]] = torch.tensor([0.5, 0.2, 0.1, 0.2])
    weights[0, 1, 4, [0, 2]] = torch.tensor([0.6, 0.4])
    # cells 0 and 2 of the video: positions 1 and 3
    assert attention_loss(weights, ids, pick, 9, [[0, 2]], [(0,)]).item() == pytest.approx(-np.log(0.6), rel=1e-5)
    both = attention_loss(weights, ids, pick, 9, [[0, 2]], [(0, 1)]).item()
    assert both == pytest.approx(-(np.log(0.6) + np.log(1e-6 + 0.0)) / 2, rel=1e-3)
    assert attention_loss(weights, ids, pick, 9, [[]], [(0,)]) is None
    # each chat on its own heads (kinds on heads of their own): two chats, the second on head 1
    two = attention_loss(weights.expand(2, -1, -1, -1), ids.expand(2, -1), pick.expand(2, -1), 9, [[0, 2], [0, 2]],
                         [(0,), (1,)]).item()
    assert two == pytest.approx(-(np.log(0.6) + np.log(1e-6 + 0.0)) / 2, rel=1e-3)


def test_kinds_on_heads_of_their_own_are_parsed_and_checked():
    assert head_map(("where=0", "size=2+3", "when=1")) == {"where": (0,), "size": (2, 3), "when": (1,)}
    assert head_map(()) == {}
    for bad in ("where", "where=", "where=a", "count=0", "where=0+"):
        with pytest.raises(ValueError, match="KIND=HEAD"):
            head_map((bad,))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    c = V2TargetConfig(**TINY, attend_weight=1.0)
    target = new_v2_target(c)
    data = V2Data(c, tmp_path_factory.mktemp("attend") / "pool.pt")
    data.prepare(target, [], lambda _: None)
    return c, target, data


def test_the_objective_leaves_the_forward_unchanged_and_adds_its_term(tiny):
    c, target, data = tiny
    videos = data.pool[:2]
    chats = [[ask(v.scene, "count_start", random.Random(0))] for v in videos]
    with torch.no_grad():
        plain, _, _ = pooled_logits(target, videos, chats, decode=True)
        with attention_of(target, 1) as seen:
            eager, ids, _ = pooled_logits(target, videos, chats, decode=True)
    assert torch.allclose(plain, eager, atol=1e-5)
    assert seen["weights"].shape == (2, 2, ids.shape[1], ids.shape[1])
    assert target.hf.model.language_model.config._attn_implementation != "eager"     # restored
    with pytest.raises(ValueError, match="attend_layer 5"):
        with attention_of(target, 5):
            pass
    # the same step with the objective off and on: the difference is its term, >= 0
    stage = type("S", (), {"objects": 0, "kinds": (), "start": 0})()
    on = data.loss(target, stage, 0, False, random.Random(1))
    data.c = V2TargetConfig(**TINY)
    off = data.loss(target, stage, 0, False, random.Random(1))
    data.c = c
    assert on.item() > off.item()


def test_a_head_trained_on_it_looks_at_the_named_object(tiny):
    """The objective alone, 40 steps on one batch: the head's mass on the objects rises from
    where a fresh model has it (about the cells' share of the sequence) to most of it."""
    _, target, data = tiny
    videos, asked, cells = [], [], []
    for v in data.pool:
        grid = tuple(v.model_kwargs["video_grid_thw"][0].tolist())
        qa = ask(v.scene, "size", random.Random(0))
        if qa is not None and chat_cells(v.scene, "size", qa[0], grid):
            videos.append(v)
            asked.append(qa)
            cells.append(chat_cells(v.scene, "size", qa[0], grid))
    assert len(videos) >= 2
    opt = torch.optim.Adam(target.hf.model.language_model.parameters(), lr=3e-3)

    def mass() -> torch.Tensor:
        with attention_of(target, 1) as seen:
            _, ids, pick = pooled_logits(target, videos, [[qa] for qa in asked], decode=True)
        return attention_loss(seen["weights"], ids, pick, target.video_token_id, cells, [(0,)] * len(cells))

    before = mass().item()
    for _ in range(40):
        loss = mass()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = mass().item()
    assert np.exp(-after) > 0.5 > np.exp(-before) * 1.5, (np.exp(-before), np.exp(-after))


def test_an_event_question_looks_at_its_events_objects_at_its_moment():
    """when / first / order / after: the event found is the one the answer is about (its time is
    the "when" answer's; the first event; the earlier of the two asked; the one after the asked
    one), and its cells lie in that second's temporal patch (or the one before, if it left)."""
    from sparrow.world.v2.attend_v2 import asked_event
    from sparrow.world.v2.narration import clock, phrase

    found = {kind: 0 for kind in ("when", "first", "order", "after")}
    for seed in range(150):
        scene = make_scene(seed, 30)
        events = [e for e in scene.events if e.kind != "count"]
        for kind in found:
            qa = ask(scene, kind, random.Random(seed))
            if qa is None:
                continue
            q, a = qa
            e = asked_event(scene, kind, q, a)
            if e is None:
                continue
            found[kind] += 1
            if kind == "when":
                assert a.endswith(f"at {clock(e.t)}"), (q, a, e)
            elif kind == "first":
                assert e == events[0]
            elif kind == "order":                     # both asked; the other one is later
                asked = [x for x in events if f" {phrase(scene, x)} " in f" {q} "]
                assert e in asked and len(asked) == 2 and all(x.t > e.t for x in asked if x is not e), (q, a, e)
            else:                                     # the event before it is the one asked about
                assert events.index(e) >= 1 and f" {phrase(scene, events[events.index(e) - 1])} " in f" {q} ", (q, a, e)
            cells = chat_cells(scene, kind, q, (30, 8, 8), a)
            assert cells and {c // 16 for c in cells} <= {e.t, e.t - 1}, (kind, q, a, e, cells)
    assert min(found.values()) >= 20, found
    # off unless asked for: the objective's default kinds are the object kinds
    assert set(V2TargetConfig().attend_kinds) == set(ATTEND_KINDS)
    with pytest.raises(ValueError, match="attend_kinds"):
        V2Data(V2TargetConfig(**{**TINY, "attend_kinds": ("count_start",)}))


def test_heads_the_model_does_not_have_are_refused_before_the_pool_renders(tiny, tmp_path):
    c, target, _ = tiny                                   # 2 heads a layer
    for extra in (dict(attend_heads=(2,)), dict(attend_head_of=("where=0", "size=1+2"))):
        data = V2Data(V2TargetConfig(**TINY, attend_weight=1.0, **extra), tmp_path / "pool.pt")
        with pytest.raises(ValueError, match="the language model has 2"):
            data.prepare(target, [], lambda _: None)
        assert not (tmp_path / "pool.pt").exists()
