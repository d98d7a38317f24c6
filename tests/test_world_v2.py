"""World v2 (issue 47): scenes are pure functions of their seed, every event kind happens, the
words are true to the scene and to its pixels, answers are long, the vocabulary and tokenizer
cover them, the splits never meet, the legibility rules hold, and make-data-v2 writes real data."""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import replace

import numpy as np
import pytest

from sparrow.errors import InvalidRequest
from sparrow.video.synthetic import PALETTE
from sparrow.world.v2.narration import event_recall, facts, narration, parse_narration
from sparrow.world.v2.questions_v2 import QUESTION_KINDS_V2, QUESTIONS_V2, ask, askable_events, questions, where
from sparrow.world.v2.render_v2 import SIDE, make_video, render_frame, visual_tokens
from sparrow.world.v2.scenes_v2 import (DIRECTIONS, EVENT_KINDS, MAX_OBJECTS, MAX_SPEED, MIN_GAP, SIZES, TOKEN, gap,
                                        make_scene)
from sparrow.world.v2.splits_v2 import SPLITS, split_of, split_seeds
from sparrow.world.v2.vocab_v2 import v2_tokenizer

SEEDS = range(12)


@pytest.fixture(scope="module")
def scenes():
    return [make_scene(seed, 30) for seed in SEEDS]


@pytest.fixture(scope="module")
def tok():
    return v2_tokenizer()


# ----- determinism and coverage -------------------------------------------------------------------------
def test_a_scene_and_its_frames_are_a_pure_function_of_the_seed():
    a, b, other = make_scene(5, 30), make_scene(5, 30), make_scene(6, 30)
    assert a == b and a != other
    for t in (0.0, 7.5, 29.5):
        assert np.array_equal(render_frame(a, t), render_frame(b, t))
    # any frame renders on its own: the same picture whatever was rendered before it
    later = render_frame(a, 21.0)
    for t in (3.0, 11.0):
        render_frame(a, t)
    assert np.array_equal(render_frame(a, 21.0), later)
    with pytest.raises(InvalidRequest):
        make_scene(1, 3)


def test_every_event_kind_happens_within_a_few_seeds(scenes):
    seen = {e.kind for s in scenes for e in s.events}
    assert seen == set(EVENT_KINDS), set(EVENT_KINDS) - seen
    assert {len(s.present(0)) for s in scenes} >= {1, 2, 3}
    assert max(s.count(t + 0.5) for s in scenes for t in range(30)) <= MAX_OBJECTS
    moves = {e.direction for s in [make_scene(seed, 60) for seed in range(30)] for e in s.events if e.direction}
    assert len(moves) >= 6, moves                    # several of the eight directions


# ----- the words are true -----------------------------------------------------------------------------
def test_the_narration_states_exactly_the_scenes_events_times_and_counts(scenes):
    for s in scenes:
        text = narration(s)
        said = parse_narration(text)
        assert said == facts(s)
        assert event_recall(text, s) == 1.0
        times = {e.t for e in s.events}
        for fact in said:
            t, kind = fact[:2]
            if kind == "count":                       # the count is true just after the moment
                assert s.count(t + 0.5) == fact[2] and t in times
            elif kind == "end":
                assert t == s.seconds and s.count(s.seconds - 0.5) == fact[2]
            elif kind != "cast":
                assert any(e.t == t and e.kind == kind for e in s.events), fact
    # a narration with one time wrong loses that fact
    s = next(s for s in scenes if any(e.kind == "colour" for e in s.events))
    e = next(e for e in s.events if e.kind == "colour")
    text = narration(s)
    minutes, seconds = divmod(e.t, 60)
    wrong = text.replace(f"at {minutes} : {seconds:02d} the {e.previous}", f"at {minutes} : {(seconds + 1) % 60:02d} the {e.previous}")
    assert wrong != text and event_recall(wrong, s) < 1.0


def _visible_colours(frame: np.ndarray) -> set[str]:
    """Palette colours covering at least a quarter of a visual token's pixels."""
    least = (SIDE / 8) ** 2 / 4
    return {c for c, rgb in PALETTE.items() if np.all(frame == rgb, axis=-1).sum() >= least}


def test_the_pixels_show_the_ground_truth(scenes):
    """At every whole second with nothing entering or leaving, the frame shows exactly the
    present objects' colours (distinct per object), so the count and the colours are on screen."""
    checked = 0
    for s in scenes[:6]:
        ins_outs = [(e.t, e.t + 6) for e in s.events if e.kind in ("enter", "leave")]
        for t in range(s.seconds):
            if any(a - 1 <= t <= b for a, b in ins_outs):
                continue
            colours = [o.colour(t) for o in s.present(t)]
            assert len(set(colours)) == len(colours)
            assert _visible_colours(render_frame(s, t)) == set(colours), (s.seed, t)
            checked += 1
    assert checked > 50


def test_answers_are_true_to_the_scene(scenes):
    for s in scenes:
        rng = random.Random(s.seed)
        asked = {k: (q, a) for k, q, a in questions(s, rng)}
        assert asked["count_start"][1].split()[0] == str(s.count(0.5))      # "3" or "3 in all"
        assert asked["count_enter"][1].split()[0] == str(sum(e.kind == "enter" for e in s.events))
        assert asked["count_collide"][1].split()[0] == str(sum(e.kind == "collide" for e in s.events))
        assert asked["duration"][1].endswith(f"0 : {s.seconds}")
        if "when" in asked:
            q, a = asked["when"]
            assert any(a.endswith(f"at {e.t // 60} : {e.t % 60:02d}") for e in askable_events(s))
            assert a.startswith("at ") or a.startswith("it happens at ")
        if "size" in asked:
            obj = asked["size"][0].split("the ")[-1].split(" ?")[0].split(" small")[0]
            colour, shape = obj.split()[:2]
            sizes = {o.size for o in s.objects if o.shape == shape and any(c == colour for _, c in o.colours)}
            assert sizes == {asked["size"][1].split()[-1]}, (obj, asked["size"])
        assert asked["narrate"][1] == narration(s)
    answers = [ask(make_scene(seed, 30), "yesno", random.Random(seed))[1] for seed in range(40)]
    assert 12 <= answers.count("yes") <= 28                       # drawn yes or no with equal chance
    kinds = {k for s in scenes for k, _, _ in questions(s, random.Random(0))}
    assert kinds == set(QUESTION_KINDS_V2)
    wordings = {q for seed in range(60) for q, _ in [ask(scenes[0], "count_start", random.Random(seed))]}
    assert len(wordings) == len(QUESTIONS_V2["count_start"]) >= 6
    forms = {a for seed in range(60) for _, a in [ask(scenes[0], "count_start", random.Random(seed))]}
    assert len(forms) == 2                                          # "N" and "N in all", by wording


def test_narrations_are_long_and_stay_within_bounds(tok):
    def tokens(scene) -> int:
        return len(tok(narration(scene), add_special_tokens=False)["input_ids"])

    short = [tokens(make_scene(seed, 30)) for seed in range(40)]
    assert statistics.median(short) >= 60, statistics.median(short)
    longest = [tokens(make_scene(seed, 784)) for seed in range(10)]     # 50k visual tokens
    assert statistics.median(longest) >= 120 and max(longest) <= 400, longest


# ----- vocabulary and tokenizer -----------------------------------------------------------------------
def test_the_vocabulary_covers_every_question_and_answer(tok):
    unk = tok.convert_tokens_to_ids("<unk>")
    assert len(tok) >= 280
    for seed in range(60):
        scene = make_scene(seed, (8, 30, 125, 784)[seed % 4])
        for _, q, a in questions(scene, random.Random(seed)):
            for text in (q, a):
                ids = tok(text, add_special_tokens=False)["input_ids"]
                assert unk not in ids, text
                assert tok.decode(ids) == text
    assert unk in tok("a purple hexagon", add_special_tokens=False)["input_ids"]     # the check can fail


def test_the_tokenizer_round_trips_through_save_pretrained(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    text = narration(make_scene(3, 125))
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    chat = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "narrate the video with times ."}]}]
    rendered = loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = loaded(rendered, add_special_tokens=False)["input_ids"]
    for special in ("<|im_start|>", "<|vision_start|>", "<|video_pad|>", "<|vision_end|>", "<|im_end|>"):
        assert loaded.convert_tokens_to_ids(special) in ids


# ----- splits -----------------------------------------------------------------------------------------
def test_the_splits_never_meet():
    ranges = sorted(SPLITS.values(), key=lambda r: r.start)
    for a, b in zip(ranges, ranges[1:]):
        assert a.stop <= b.start
    for name in SPLITS:
        seeds = split_seeds(name, 5, first=3)
        assert {split_of(s) for s in seeds} == {name}
    with pytest.raises(InvalidRequest):
        split_seeds("validation", 1)
    with pytest.raises(InvalidRequest):
        split_seeds("test", 2, first=len(SPLITS["test"]) - 1)
    with pytest.raises(InvalidRequest):
        split_of(SPLITS["test"].stop)


# ----- legibility -------------------------------------------------------------------------------------
def test_objects_are_big_enough_to_see_at_the_targets_resolution():
    assert min(SIZES.values()) * SIDE >= 28                        # a visual token covers 28 px
    assert visual_tokens(784) == 50_176 and visual_tokens(8) == 512


def test_events_are_far_enough_apart_and_moves_are_plain(scenes):
    for s in [*scenes, *(make_scene(seed, 391) for seed in range(4))]:
        moments = sorted({e.t for e in s.events})
        assert all(b - a >= MIN_GAP for a, b in zip(moments, moments[1:])), moments
        for t in moments:                                           # two events share a moment only as
            kinds = sorted(e.kind for e in s.events if e.t == t)    # an entering and its new count
            assert len(kinds) == 1 or kinds == ["count", "enter"], kinds
        assert moments[0] >= MIN_GAP and moments[-1] <= s.seconds - MIN_GAP
        for e in s.events:
            if e.kind == "move" and e.direction is not None:
                o = s.obj(e.who)
                stop = next(x.t for x in s.events if x.kind == "stop" and x.who == e.who and x.t > e.t)
                (x0, y0), (x1, y1) = o.centre(e.t), o.centre(stop)
                dx, dy = DIRECTIONS[e.direction]
                assert np.sign(x1 - x0) == dx and np.sign(y1 - y0) == dy
                if dx and dy:
                    assert math.isclose(abs(x1 - x0), abs(y1 - y0), rel_tol=1e-6)
                assert math.hypot(x1 - x0, y1 - y0) >= 2 * TOKEN - 1e-9
                assert math.hypot(x1 - x0, y1 - y0) / (stop - e.t) <= MAX_SPEED + 1e-9


def test_objects_touch_only_by_a_collision(scenes):
    for s in scenes:
        collided: dict[frozenset, int] = {}
        for e in s.events:
            if e.kind == "collide":
                collided[frozenset((e.who, e.other))] = e.t
        for step in range(s.seconds * 4):
            t = step / 4
            live = s.present(t)
            for i, a in enumerate(live):
                for b in live[i + 1:]:
                    if gap(a.shape, a.half, a.centre(t), b.shape, b.half, b.centre(t)) <= 1e-9:
                        pair = frozenset((a.ident, b.ident))
                        assert pair in collided and t >= collided[pair] - 0.5, (s.seed, t, pair)
    s = make_scene(7, 30)                     # the check can fail: two objects pushed together
    a, b = s.present(0)[:2]
    moved = replace(a, track=((0.0, *b.centre(0)),))
    assert gap(moved.shape, moved.half, moved.centre(1), b.shape, b.half, b.centre(1)) <= 0


# ----- the dataset writer -----------------------------------------------------------------------------
def test_make_data_v2_writes_real_videos_a_manifest_and_the_truth(tmp_path, capsys):
    from sparrow.training.data import load_samples
    from sparrow.video import load_frames
    from sparrow.video.processors import QwenVLVideoProcessor
    from sparrow.world.v2.dataset_v2 import make_data_v2

    manifest = make_data_v2(tmp_path, "test", videos=2, seconds=(8,), questions_per_video=3)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(rows) == 2 * 4 and {r["split"] for r in rows} == {"test"}
    assert all(split_of(r["seed"]) == "test" for r in rows)
    assert sum(r["kind"] == "narrate" for r in rows) == 2
    samples = load_samples(manifest)
    assert [s.answer for s in samples] == [r["answer"] for r in rows]
    truths = [json.loads(line) for line in (tmp_path / "scenes.jsonl").read_text().splitlines()]
    scene = make_scene(truths[0]["seed"], 8)
    assert truths[0]["facts"] == json.loads(json.dumps(facts(scene)))
    video = make_video(truths[0]["seed"], 8)
    frames = load_frames(tmp_path / truths[0]["video"], video.options())
    assert frames.frames.shape == (16, SIDE, SIDE, 3)
    processed = QwenVLVideoProcessor(min_pixels=28 * 28).process(frames)
    assert processed.num_visual_tokens == video.visual_tokens == 512
    decoded = frames.frames[5].astype(int)
    assert np.abs(decoded - render_frame(scene, 2.5)).mean() < 4          # lossy, but the same picture
    for bad in (dict(split="dev"), dict(seconds=(3,)), dict(videos=0), dict(kinds=("poem",)),
                dict(seconds=(7,), questions_per_video=1)):
        with pytest.raises(InvalidRequest):
            make_data_v2(tmp_path / "bad", **{"split": "train", "videos": 1, **bad}, fps=1.0)
    # the command, at the short stage's side: a quarter of the tokens
    from sparrow.cli.main import main
    assert main(["world", "make-data-v2", "--out", str(tmp_path / "small"), "--split", "test", "--videos", "1",
                 "--seconds", "8", "--questions-per-video", "0", "--side", "112"]) == 0
    row, = [json.loads(line) for line in (tmp_path / "small" / "manifest.jsonl").read_text().splitlines()]
    assert row["kind"] == "narrate" and row["visual_tokens"] == 128
    assert main(["world", "make-data-v2", "--out", str(tmp_path / "odd"), "--videos", "1", "--side", "100"]) == 2
    assert "multiple of 28" in capsys.readouterr().err and not (tmp_path / "odd" / "manifest.jsonl").exists()


def test_where_names_the_third_of_the_frame_the_pixels_show(scenes):
    """"where" is read off the first frame: the object's pixels' centre lies in the named third
    (across and down), and an object near a border is not asked about."""
    cells = {"top": (None, 0), "bottom": (None, 2), "left": (0, None), "right": (2, None), "middle": (1, 1)}
    checked = 0
    for s in [*scenes, *(make_scene(seed, 8) for seed in range(40, 60))]:
        frame = render_frame(s, 0.0)
        for o in s.present(0):
            answer = where(s, o.ident)
            if answer is None:
                x, y = o.centre(0)
                assert min(abs(v - b) for v in (x, y) for b in (1 / 3, 2 / 3)) < TOKEN / 2
                continue
            ys, xs = np.nonzero(np.all(frame == PALETTE[o.colour(0)], axis=-1))
            column, row = int(xs.mean() / SIDE * 3), int(ys.mean() / SIDE * 3)
            words = answer.split()
            want_col = next((cells[w][0] for w in words if cells[w][0] is not None), 1)
            want_row = next((cells[w][1] for w in words if cells[w][1] is not None), 1)
            assert (column, row) == (want_col, want_row), (s.seed, o.ident, answer)
            checked += 1
    assert checked >= 20


# ----- the lit background and the placed tower (world/v2/tower_v2.py) ----------------------------
def test_the_background_is_lit_at_one_brightness_darker_than_any_object():
    """Red grows across, blue down, R + G + B the same everywhere and far below every palette colour's."""
    from sparrow.world.v2.render_v2 import BACKGROUND_SPAN, background

    bg = background(SIDE).astype(int)
    sums = bg.sum(-1)
    assert sums.max() - sums.min() <= 2 and sums.max() + 100 < min(sum(rgb) for rgb in PALETTE.values())
    assert np.all(np.diff(bg[..., 0], axis=1) >= 0) and np.all(np.diff(bg[..., 2], axis=0) >= 0)
    assert bg[0, -1, 0] - bg[0, 0, 0] >= BACKGROUND_SPAN - 2 and bg[-1, 0, 2] - bg[0, 0, 2] >= BACKGROUND_SPAN - 2


@pytest.fixture(scope="module")
def placed():
    from sparrow.world.v2.target_v2 import V2TargetConfig, new_v2_target

    return new_v2_target(V2TargetConfig())


def test_the_placed_tower_gives_an_objects_patch_its_place_and_an_empty_token_the_marker(placed):
    """A 1-patch white square at each of the 64 (112 px) and 256 (224 px) patches: its token
    reads the patch's column and row (in [-1, 1]); a blank frame's tokens are the marker alone."""
    from sparrow.world.v2.tower_v2 import check_placed_tower

    small, large = check_placed_tower(placed.hf.model.visual, 112), check_placed_tower(placed.hf.model.visual, 224)
    assert small["empty_max"] < 0.3 and large["empty_max"] < 0.15, (small, large)
    # a third of the frame is 0.67 wide; the edge patches read ~0.2 inward (their background is one-sided)
    assert small["place_error_max"] < 0.3 and small["place_error_mean"] < 0.15, small
    assert large["place_error_max"] < 0.15 and large["place_error_mean"] < 0.05, large


def test_through_the_codec_an_objects_tokens_name_the_third_where_asks_about(placed):
    """Real mp4s at the target's 112 px: in the first frame pair of one-object scenes, the
    presence-weighted place of the object's patches falls in the third `where` answers (the
    object's centre), for nearly every object `where` asks about; the ones it does not ask about
    are near a border."""
    from sparrow.world.v2.target_v2 import encode_video
    from sparrow.world.v2.tower_v2 import PLACE_AMPLITUDE, PLACE_OUT, PRESENCE_AMPLITUDE, PRESENCE_OUT

    right = asked = 0
    for seed in range(300):
        scene = make_scene(seed, 8)
        (obj, *more) = scene.present(0.0) or (None,)
        if obj is None or more or where(scene, obj.ident) is None:
            continue
        embeds, _ = encode_video(placed, seed, 8, 112)
        first = embeds[:16].detach()                                # the first frame pair's 4 x 4 tokens
        weight = (first[:, PRESENCE_OUT:PRESENCE_OUT + 4].reshape(-1) / PRESENCE_AMPLITUDE).clamp(min=0)
        place = first[:, PLACE_OUT:PLACE_OUT + 8].reshape(-1, 2) / PLACE_AMPLITUDE
        x, y = ((place * weight[:, None]).sum(0) / weight.sum()).tolist()
        cx, cy = obj.centre(0.0)
        third = lambda v: min(2, int((v + 1) / 2 * 3))              # noqa: E731 - [-1, 1] to 0, 1, 2
        right += (third(x), third(y)) == (min(2, int(cx * 3)), min(2, int(cy * 3)))
        asked += 1
        if asked == 16:
            break
    assert asked == 16 and right >= 14, (right, asked)


def test_the_named_tower_gives_each_palette_colour_its_own_code():
    """vision_init="named": a square of one palette colour over two whole patches (one in each of
    two tokens, in both frames of the pair) lights that colour's code in those tokens (half of a
    token's most: 4 patches x 2 frames of bumps) and no other colour's; a blank frame lights none;
    the place codes still read right."""
    import torch

    from sparrow.world.v2.render_v2 import background
    from sparrow.world.v2.target_v2 import V2TargetConfig, new_v2_target
    from sparrow.world.v2.tower_v2 import NAME_AMPLITUDE, NAME_OUT, NAME_SHARPNESS, _tokens, check_placed_tower

    visual = new_v2_target(V2TargetConfig(vision_init="named")).hf.model.visual
    full = 4 * NAME_AMPLITUDE * NAME_SHARPNESS
    with torch.no_grad():
        assert check_placed_tower(visual, 112)["place_error_max"] < 0.3
        blank = _tokens(visual, torch.from_numpy(background(112).copy()))
        assert blank[:, NAME_OUT:NAME_OUT + len(PALETTE)].abs().max() < 0.05 * full
        for ci, rgb in enumerate(PALETTE.values()):
            frame = background(112).copy()
            frame[28:42, 42:70] = rgb                           # patches (2, 3) and (2, 4): tokens 5 and 6
            names = _tokens(visual, torch.from_numpy(frame))[:, NAME_OUT:NAME_OUT + len(PALETTE)]
            lit = names.max(0).values
            assert lit[ci] > 0.4 * full, (ci, lit)
            assert torch.cat([lit[:ci], lit[ci + 1:]]).abs().max() < 0.05 * full, (ci, lit)
