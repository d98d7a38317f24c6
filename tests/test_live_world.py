"""The live world: an endless synthetic stream whose ground truth matches its pixels, its
MPEG-TS encoding, the questions about a session's clip, and the committed live target."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from sparrow.video import LiveSource, VideoOptions, load_frames
from sparrow.world.live_stream import LiveStream, View
from sparrow.video.synthetic import BACKGROUND, PALETTE

LIVE = Path(__file__).resolve().parents[1] / "models" / "live" / "target"


def _lit(frame: np.ndarray) -> np.ndarray:
    """bool [H, W]: pixels away from the background."""
    return np.abs(frame.astype(int) - np.array(BACKGROUND)).sum(-1) > 60


# ----- the stream -----------------------------------------------------------------------------------
def test_the_stream_is_deterministic_per_seed():
    a, b, other = LiveStream(seed=5), LiveStream(seed=5), LiveStream(seed=6)
    assert np.array_equal(a.frames(0, 300), b.frames(0, 300))
    assert a.events(0, 300) == b.events(0, 300)
    assert not np.array_equal(a.frames(0, 300), other.frames(0, 300))
    assert a.events(0, 300) != other.events(0, 300)


@pytest.mark.parametrize("start,end", [(37, 81), (230, 250), (479, 480), (5, 6)])
def test_any_frame_range_renders_as_in_a_longer_render(start, end):
    stream = LiveStream(seed=11)                           # blocks of 240 frames: (230, 250) crosses one
    whole = stream.frames(0, 500)
    assert np.array_equal(stream.frames(start, end), whole[start:end])
    assert np.array_equal(stream.frames(start, end, step=2), whole[start:end:2])
    assert [stream.view(i) for i in range(start, end)] == [LiveStream(seed=11).view(i) for i in range(start, end)]


def test_a_range_far_into_the_stream_renders_alone():
    stream = LiveStream(seed=2)
    far = 4 * 3600 * 24 * 30                                 # a month in
    frames = stream.frames(far, far + 400)
    views = [stream.view(i) for i in range(far, far + 400)]
    assert frames.shape == (400, 84, 84, 3) and any(views) and not all(views)
    assert stream.events(far, far + 400) == LiveStream(seed=2).events(far, far + 400)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ground_truth_matches_the_pixels(seed):
    stream = LiveStream(seed=seed)
    frames = stream.frames(0, 720)                         # 3 minutes
    shown = {"circle": 0, "rectangle": 0, None: 0}
    for i, frame in enumerate(frames):
        view = stream.view(i)
        lit = _lit(frame)
        shown[view.shape if view else None] += 1
        if view is None:
            assert not lit.any(), i
            continue
        rgb = np.array(PALETTE[view.color])
        match = (frame == rgb).all(-1)
        assert match.sum() >= 0.9 * lit.sum() > 100, (i, view)   # the whole shape is that colour
        ys, xs = np.nonzero(lit)
        height, width = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
        if view.shape == "rectangle":
            assert height >= 1.8 * width, (i, height, width)
        else:
            assert abs(height - width) <= 2, (i, height, width)
        assert 84 / 7 * 2 - 2 <= width <= 84 / 6 * 2 + 2        # a seventh to a sixth of the side (radius)
    assert min(shown.values()) > 60                             # circles, rectangles and empty gaps


@pytest.mark.parametrize("seed", [0, 3])
def test_events_and_views_tell_the_same_story(seed):
    stream = LiveStream(seed=seed)
    n = 960
    views = [stream.view(i) for i in range(n)]
    events = stream.events(0, n)
    assert events == sorted(events, key=lambda e: e["frame"])
    for e in events:
        before, now = views[e["frame"] - 1] if e["frame"] else None, views[e["frame"]]
        assert e["t"] == e["frame"] / stream.fps
        if e["kind"] == "appear":
            assert before is None and now == View(e["shape"], e["color"])
        elif e["kind"] == "disappear":
            assert now is None and before == View(e["shape"], e["color"])
        elif e["kind"] == "color":
            assert before == View(e["shape"], e["previous"]) and now == View(e["shape"], e["color"])
        else:
            assert e["kind"] == "move" and e["direction"] in ("left", "right")
    # every change of view is an event, and every state lasts min_hold_s (gaps: gap_s) or more
    changes = [i for i in range(1, n) if views[i] != views[i - 1]]
    assert changes == sorted({e["frame"] for e in events if e["kind"] != "move"})
    runs = np.diff([0, *changes, n])[1:-1]
    assert runs.min() >= stream.min_hold_s * stream.fps
    gaps = [b - a for a, b in zip(changes, changes[1:]) if views[a] is None]
    assert min(gaps) >= stream.gap_s[0] * stream.fps


def test_moves_are_plainly_left_or_right():
    stream = LiveStream(seed=4)
    moves = [e for e in stream.events(0, 2400) if e["kind"] == "move"]
    assert len(moves) >= 5
    for m in moves:
        a, b = stream.frame(m["frame"]), stream.frame(round(m["until_t"] * stream.fps))
        xa, xb = np.nonzero(_lit(a))[1].mean(), np.nonzero(_lit(b))[1].mean()
        assert (xb - xa) * (1 if m["direction"] == "right" else -1) >= 84 / 3 - 2


# ----- encoding and sampling -----------------------------------------------------------------------
def test_mpegts_decodes_back_with_the_right_frames_and_times(tmp_path):
    stream = LiveStream(seed=8)
    start, end = 101, 181                                  # 20 s from an odd frame
    data = stream.encode_ts(start, end, path=tmp_path / "clip.ts")
    assert (tmp_path / "clip.ts").read_bytes() == data and data[0] == 0x47   # MPEG-TS sync byte
    every = load_frames(tmp_path / "clip.ts", VideoOptions(fps=4.0, max_frames=1000))
    assert len(every) == end - start
    assert np.allclose(every.timestamps, np.arange(end - start) / 4.0)
    raw = stream.frames(start, end)
    assert np.abs(every.frames.astype(int) - raw).mean() < 3.0
    session = load_frames(data, VideoOptions(fps=2.0))    # what a 2 fps session samples
    assert len(session) == 40
    index = start + np.rint(session.timestamps * stream.fps).astype(int)
    assert np.array_equal(index, stream.session_frames(start / stream.fps, end / stream.fps))
    assert np.array_equal(index, np.arange(start + 1, end, 2))   # the second of every two frames
    for frame, i in zip(session.frames, index):                 # the colour in view survives the codec
        view = stream.view(i)
        near = np.abs(frame.astype(int) - PALETTE[view.color]).sum(-1) < 40 if view else _lit(frame)
        assert near.sum() > 60 if view else near.sum() == 0


def test_mpegts_chunks_feed_a_live_source():
    stream = LiveStream(seed=9)
    live = LiveSource(retention_s=60.0)
    chunks = stream.ts_chunks(40, chunk_frames=4)           # endless: take 12 s
    for _ in range(12):
        live.append(next(chunks))
    assert 10.0 <= live.now_s <= 12.0
    recent = load_frames(live, VideoOptions(fps=2.0, last_s=4.0))
    assert len(recent) == 8 and live.now_s - 4.0 <= recent.timestamps[0]
    for frame, t in zip(recent.frames, recent.timestamps):
        view = stream.view(40 + round(t * stream.fps))
        assert _lit(frame).sum() > 60 if view else not _lit(frame).any()
    chunks.close()


# ----- the words -----------------------------------------------------------------------------------
def test_now_is_the_last_sampled_frame_and_the_window_is_its_changes():
    from sparrow.world.live_words import Clip, answer, live_questions

    red, blue, green = View("circle", "red", 1), View("circle", "blue", 1), View("rectangle", "green", 2)
    clip = Clip(tuple(range(8)), (None, red, red, blue, blue, None, None, green))
    assert answer("what_now", clip) == "green rectangle" and answer("colour_now", clip) == "green"
    assert answer("left", clip) == "yes" and answer("appeared", clip) == "yes"
    assert answer("last", clip) == "green rectangle"
    gone = Clip(tuple(range(4)), (blue, blue, None, None))
    assert (answer("what_now", gone), answer("colour_now", gone), answer("appeared", gone),
            answer("last", gone), answer("left", gone)) == ("nothing", "none", "no", "nothing", "yes")
    # a shape in view from the first frame did not appear inside the clip; a colour change is no leave
    assert (answer("appeared", Clip((0, 1), (red, blue))), answer("left", Clip((0, 1), (red, blue)))) == ("no", "no")
    for seed in range(20):
        asks = [(q, a) for k, q, a in live_questions(clip, random.Random(seed)) if k == "present_now"]
        assert asks[0] == (asks[0][0], "yes") and "green" in asks[0][0]
        assert asks[1][1] == "no" and "green" not in asks[1][0]
    # presence never says yes about a colour that was in view but is not now
    for seed in range(20):
        for q, a in [(q, a) for k, q, a in live_questions(gone, random.Random(seed)) if k == "present_now"]:
            assert a == "no"


def test_the_caption_tells_the_clip_from_its_first_frame_to_now():
    from sparrow.world.live_words import Clip, live_caption

    red, blue, green = View("circle", "red", 1), View("circle", "blue", 1), View("rectangle", "green", 2)
    clip = Clip(tuple(range(8)), (red, red, blue, blue, None, None, green, green))
    assert live_caption(clip) == ("a red circle is in view . the circle turns blue . the blue circle leaves . "
                                  "a green rectangle appears . now a green rectangle is in view .")
    assert live_caption(Clip((0, 1), (None, None))) == "nothing is in view . now nothing is in view ."


def test_live_tokenizer_knows_every_question_and_keeps_the_world_vocabulary():
    from sparrow.world.live_words import LIVE_QUESTIONS, live_tokenizer
    from sparrow.world.scenes import world_tokenizer

    tok, world = live_tokenizer(), world_tokenizer()
    assert set(world.get_vocab()) < set(tok.get_vocab())
    unk = tok.convert_tokens_to_ids("<unk>")
    from sparrow.world.live_words import LIVE_CAPTION_PROMPTS, Clip, live_caption

    stream = LiveStream(seed=3)
    story = live_caption(Clip.of(stream, stream.session_frames(0, 60)))
    for qs in (*LIVE_QUESTIONS.values(), LIVE_CAPTION_PROMPTS, (story,)):
        for q in qs:
            text = q.format(c="magenta") + " red circle nothing none yes no"
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert unk not in ids and tok.decode(ids) == text


def test_session_frames_are_load_frames_rule():
    from sparrow.world.live_words import clip_frames

    stream = LiveStream(seed=1)
    clip = clip_frames(stream, end_frame=403, pairs=5)     # a window of 5 s ending at frame 402
    assert len(clip) == 10 and clip[-1] == 402 and np.all(np.diff(clip) == 2)
    window = load_frames(stream.encode_ts(0, 403), VideoOptions(fps=2.0, start_s=403 / 4 - 5, end_s=403 / 4))
    assert np.array_equal(np.rint(window.timestamps * 4).astype(int), clip)


# ----- training on pooled clips ----------------------------------------------------------------------
def test_a_pooled_clip_is_the_clip_through_the_tower():
    """Any run of a pooled stretch's frame pairs equals processing those frames alone (the
    tower sees a pair at a time), positions start at 0, and the loss equals the pixel path's."""
    import torch

    from sparrow.world.live_target import LiveData, LiveTargetConfig, encoded_clip, new_live_target
    from sparrow.world.live_words import Clip
    from sparrow.world.target_data import conversation_batch, conversation_loss, pooled_loss
    from sparrow.video import Frames

    c = LiveTargetConfig(pool=2, stream_s=40, layers=2, batch=3, pairs=(2, 6))
    target = new_live_target(c)
    data = LiveData(c)
    data.prepare(target, [], log=lambda line: None)
    stretch = data.pool[1]
    assert stretch.embeds.shape == (40 * 9, c.hidden) and stretch.pairs == 40
    stream = LiveStream(seed=c.seed * 1_000_003 + 1)
    frames, index = encoded_clip(stream, stretch.clip.frames[0] - 1, 40)
    assert np.array_equal(index, stretch.clip.frames)
    videos, clips, pixels = [], [], []
    for first, pairs in ((0, 3), (17, 6), (34, 6)):
        video, clip = stretch.sub(first, pairs)
        sub = Frames(frames.frames[2 * first:2 * (first + pairs)], frames.timestamps[2 * first:2 * (first + pairs)],
                     2.0, frames.options)
        processed = target.processor.process(sub)
        with torch.no_grad():
            alone = target.hf.model.visual(processed.pixel_values_videos,
                                           grid_thw=processed.model_kwargs["video_grid_thw"]).pooler_output
        assert torch.allclose(video.embeds, alone, atol=1e-5)
        assert all(torch.equal(video.model_kwargs[k], processed.model_kwargs[k]) for k in video.model_kwargs)
        assert clip == Clip.of(stream, index[2 * first:2 * (first + pairs)])
        videos.append(video), clips.append(clip), pixels.append(processed)
    chats = [[("what is in view now ?", "red circle")], [("did a shape leave ?", "yes")],
             [("is a red shape in view ?", "no")]]
    with torch.no_grad():
        for i in range(3):           # one at a time: clips of different lengths
            a = pooled_loss(target, videos[i:i + 1], chats[i:i + 1])
            b = conversation_loss(target, *conversation_batch(target, pixels[i:i + 1], chats[i:i + 1]))
            assert torch.allclose(a, b, atol=1e-5), (i, float(a), float(b))
    # a training step's batch: clips of one length, questions of the stage's kinds
    from sparrow.world.target_data import training_stages
    stages = training_stages(LiveTargetConfig(steps=1, stages=("present_now@1:1:short",)), data.kinds)
    batch = data.clips(random.Random(0), short=True)
    assert len({v.embeds.shape[0] for v, _ in batch}) == 1 and batch[0][0].embeds.shape[0] <= 6 * 9
    with torch.no_grad():
        assert torch.isfinite(data.loss(target, stages[1], 1, True, random.Random(0)))


def test_train_live_target_command_trains_saves_and_reports(tmp_path, capsys):
    from sparrow.models import TargetModel
    from sparrow.cli.main import main

    out = tmp_path / "live"
    code = main(["world", "train-live-target", "--out", str(out), "--steps", "2", "--stages", "present_now@1:1",
                 "--layers", "1", "--batch", "2", "--pool", "2", "--stream-s", "40", "--pairs", "1,3",
                 "--eval-every", "0", "--final-eval-streams", "1", "--final-eval-pairs", "2,3"])
    assert code == 1                                         # two steps answer nothing right
    report = json.loads((out / "live_target.json").read_text())
    assert report["config"]["temporal_positions"] is None and report["config"]["stages"] == ["present_now@1:1"]
    assert report["accuracy"]["clips"] == 2 and set(report["accuracy"]["per_pairs"]) == {"2", "3"}
    target = TargetModel.from_pretrained(out)
    assert target.processor.temporal_positions is None
    with pytest.raises(SystemExit):
        main(["world", "train-live-target", "--help"])
    text = capsys.readouterr().out
    assert "--pairs" in text and "--ramp-steps" in text and "--frames" not in text   # the world's video options are not offered


# ----- the committed live target ---------------------------------------------------------------------
needs_live = pytest.mark.skipif(not (LIVE / "config.json").is_file(),
                                reason="models/live not trained yet (sparrow world train-live-target)")


@needs_live
def test_committed_live_target_keeps_real_time_and_answers_fresh_streams():
    from sparrow.models import TargetModel
    from sparrow.world.live_target import live_accuracy
    from sparrow.world.live_words import STANDING_KINDS

    target = TargetModel.from_pretrained(LIVE)
    assert target.processor.temporal_positions is None and target.processor.tokens_per_second == 2.0
    assert json.loads((LIVE / "sparrow_video_processor.json").read_text())["temporal_positions"] is None
    report = live_accuracy(target, list(range(3 * 10**9, 3 * 10**9 + 4)), (2, 12, 30), STANDING_KINDS)
    # 12 clips of 2-30 s, ~50 standing questions; models/live/MODEL_CARD.md has the full figures
    assert report["questions"] >= 40
    # Colour, what-is-in-view and presence ("is a red shape in view ?", learned in the focused
    # stages: models/live/MODEL_CARD.md) are all learned.
    assert report["per_kind"]["colour_now"] >= 0.85 and report["per_kind"]["what_now"] >= 0.85, report
    assert report["per_kind"]["present_now"] >= 0.8 and report["standing"] >= 0.85, report


def test_training_puts_answers_where_the_engine_decodes_them():
    """After a long real-time clip the engine decodes the answer past the clip's last temporal
    position (HF's rope delta), not right after the question; training does the same, so its
    teacher-forced greedy answer is the engine's, token for token."""
    import torch

    from sparrow.config import SamplingParams, SpecConfig
    from sparrow.engine import Engine
    from sparrow.world.live_target import LiveData, LiveTargetConfig, new_live_target
    from sparrow.world.target_data import pooled_logits

    c = LiveTargetConfig(pool=1, stream_s=40, layers=2, seed=3)
    target = new_live_target(c)
    data = LiveData(c)
    data.prepare(target, [], log=lambda line: None)
    stream = LiveStream(seed=c.seed * 1_000_003)
    frames = load_frames(stream.encode_ts(data.pool[0].clip.frames[0] - 1, data.pool[0].clip.frames[-1] + 1),
                         VideoOptions(fps=2.0))
    engine = Engine(target, spec=SpecConfig(method="none"))
    same = differ = 0
    for first, pairs in ((0, 24), (3, 20), (10, 12)):
        video, _ = data.pool[0].sub(first, pairs)
        for q in ("what is in view now ?", "did a shape leave ?"):
            got = engine.generate(frames.frames[2 * first:2 * (first + pairs)], q,
                                  SamplingParams(max_new_tokens=5), VideoOptions(fps=2.0))
            answer = target.tokenizer.decode(got.token_ids, skip_special_tokens=True).strip()
            if not answer or len(got.token_ids) < 2:
                continue
            want = target.tokenizer(answer, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits, _, _ = pooled_logits(target, [video], [[(q, answer)]], decode=True)
                contiguous, _, _ = pooled_logits(target, [video], [[(q, answer)]], decode=False)
            forced = logits.argmax(-1)[:len(want)].tolist()
            assert forced == want == got.token_ids[:len(want)], (pairs, q, forced, want)
            same += 1
            # the first answer token is predicted in the prompt, the later ones see the jump
            assert torch.allclose(logits[0], contiguous[0], atol=1e-5)
            differ += not torch.allclose(logits[1:], contiguous[1:], atol=1e-3)
    engine.close()
    assert same >= 3 and differ == same


def test_presence_contrast_asks_the_colour_in_view_and_others_not():
    from sparrow.world.live_words import Clip, presence_contrast

    red, blue = View("circle", "red", 0), View("circle", "blue", 0)
    clip = Clip((0, 1, 2, 3), (None, blue, blue, red))          # blue earlier, red now
    for seed in range(5):
        asks = presence_contrast(clip, random.Random(seed), 3)
        colours = [next(c for c in PALETTE if f" {c} " in q) for q, _ in asks]
        assert [a for _, a in asks] == ["yes", "no", "no", "no"] and colours[0] == "red"
        assert colours[1] == "blue" and len(set(colours)) == 4      # the earlier colour first, all distinct
    empty = Clip((0, 1), (None, None))
    assert [a for _, a in presence_contrast(empty, random.Random(0), 2)] == ["no", "no"]
