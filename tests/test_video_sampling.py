"""sparrow.video sampling: the visual-token budget (never exceeded, HF's size when it fits),
pixel options, the byte cap, last_s, and seeking (same frames as decoding through, and
chosen by cost)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sparrow.errors import InvalidRequest, NoFrames, VideoTooLarge
from sparrow.video import (Frames, LlavaOnevisionVideoProcessor, QwenVLVideoProcessor, VideoOptions, load_frames,
                           prepare_video, smart_resize, write_synthetic_video)
from sparrow.video import decode
from sparrow.video.frame_sampling import thin

QWEN_MIN, QWEN_MAX = 128 * 28 * 28, 768 * 28 * 28  # the processor's defaults


def _tokens(height: int, width: int, factor: int = 28) -> int:
    return (height // factor) * (width // factor)


# ---------------------------------------------------------------- the budget rule


pixels = st.none() | st.integers(1, 3_000_000)


@settings(max_examples=400, deadline=None)
@given(height=st.integers(1, 4000), width=st.integers(1, 4000), frames=st.integers(1, 2000),
       budget=st.integers(1, 60_000), min_px=pixels, max_px=pixels, total_px=st.none() | st.integers(1, 60_000 * 784))
def test_qwen_plan_never_exceeds_the_budget(height, width, frames, budget, min_px, max_px, total_px):
    assume(max(height, width) <= 200 * min(height, width))
    if min_px is not None and max_px is not None and min_px > max_px:
        min_px, max_px = max_px, min_px
    options = VideoOptions(min_pixels=min_px, max_pixels=max_px, total_pixels=total_px, max_visual_tokens=budget)
    cap = min(budget, total_px // 784) if total_px is not None else budget
    if cap < 1:
        with pytest.raises(VideoTooLarge):
            QwenVLVideoProcessor().plan(frames, height, width, options)
        return
    plan = QwenVLVideoProcessor().plan(frames, height, width, options)
    patches = math.ceil(plan.num_frames / 2)
    assert plan.num_visual_tokens == patches * _tokens(plan.height, plan.width) <= cap
    assert plan.height % 28 == 0 and plan.width % 28 == 0 and plan.height >= 28 and plan.width >= 28
    assert 1 <= plan.num_frames <= frames and (plan.num_frames == frames or plan.num_frames % 2 == 0)
    # The pixel bounds the options give (over the processor's defaults).
    high = max_px or max(QWEN_MAX, min_px or 0)
    low = min(min_px or QWEN_MIN, high)
    hf = smart_resize(height, width, 28, low, high)
    if math.ceil(frames / 2) * _tokens(*hf) <= cap:  # the budget does not bind: exactly HF's size
        assert (plan.height, plan.width, plan.num_frames) == (*hf, frames)
    smallest = _tokens(*smart_resize(height, width, 28, low, low))
    if plan.num_frames < frames:  # frames go only when even the smallest size does not fit them
        assert math.ceil(frames / 2) * smallest > cap
        assert patches == 1 or (patches + 1) * smallest > cap  # and no more than needed


@settings(max_examples=100, deadline=None)
@given(frames=st.integers(1, 1000), budget=st.integers(1, 30_000), total_px=st.none() | st.integers(1, 10**9),
       image_size=st.sampled_from([56, 384]))
def test_llava_plan_never_exceeds_the_budget(frames, budget, total_px, image_size):
    processor = LlavaOnevisionVideoProcessor(image_size=image_size)
    options = VideoOptions(max_visual_tokens=budget, total_pixels=total_px)
    per_frame = processor.tokens_per_frame()
    fits = min((budget - 1) // per_frame, total_px // image_size**2 if total_px else frames)
    if fits < 1:
        with pytest.raises(VideoTooLarge):
            processor.plan(frames, 100, 100, options)
        return
    plan = processor.plan(frames, 100, 100, options)
    assert plan.num_visual_tokens == plan.num_frames * per_frame + 1 <= budget
    assert plan.num_frames == min(frames, fits) and (plan.height, plan.width) == (image_size, image_size)


# A small Qwen geometry keeps the end-to-end examples fast; the rule is the same.
SMALL_QWEN = QwenVLVideoProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
SMALL_LLAVA = LlavaOnevisionVideoProcessor(image_size=56)  # 4 tokens per frame


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(count=st.integers(1, 48), height=st.integers(8, 96), width=st.integers(8, 96), budget=st.integers(1, 400),
       fps=st.floats(0.2, 12.0), num_frames=st.none() | st.integers(1, 64), start=st.floats(0.0, 10.0),
       length=st.none() | st.floats(0.5, 30.0), last=st.none() | st.floats(0.5, 30.0), qwen=st.booleans())
def test_processed_videos_never_exceed_the_budget(count, height, width, budget, fps, num_frames, start, length, last,
                                                  qwen):
    """Random clips, durations and sampling options, through both entry points."""
    assume(max(height, width) <= 200 * min(height, width))
    assume(qwen or budget >= 5)  # LLaVA needs room for one frame
    clip = np.random.default_rng(count).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    end = start + length if length is not None else None
    options = VideoOptions(fps=fps, num_frames=num_frames, start_s=start, end_s=end, last_s=last,
                           max_visual_tokens=budget, max_frames=64)
    assume(start < count / fps)  # else NoFrames, tested elsewhere
    processor = SMALL_QWEN if qwen else SMALL_LLAVA
    try:
        direct = prepare_video(clip, processor, options)
    except NoFrames:  # no frame starts inside the range: tested elsewhere
        assume(False)
    via_frames = processor.process(load_frames(clip, options))  # the engine's call: budget from frames.options
    for out in (direct, via_frames):
        assert out.num_visual_tokens <= budget
        if qwen:
            t, h, w = out.model_kwargs["video_grid_thw"][0].tolist()
            assert out.num_visual_tokens == t * h * w // 4 and out.pixel_values_videos.shape[0] == t * h * w
        else:
            assert out.num_visual_tokens == out.pixel_values_videos.shape[1] * 4 + 1
        assert np.all(np.diff(out.timestamps) >= 0)


def test_a_long_request_at_the_default_budget():
    """768 frames of 448x448 would be 98,304 tokens: the resolution drops to min_pixels
    (308x308, 121 tokens a pair), then 203 pairs fit in 24,576."""
    plan = QwenVLVideoProcessor().plan(768, 448, 448)
    assert (plan.num_frames, plan.height, plan.width, plan.num_visual_tokens) == (406, 308, 308, 24563)
    fits = QwenVLVideoProcessor().plan(192, 448, 448)  # exactly the ceiling: untouched
    assert (fits.num_frames, fits.height, fits.num_visual_tokens) == (192, 448, 24576)
    shrunk = QwenVLVideoProcessor().plan(96, 448, 448, VideoOptions(max_visual_tokens=6144))
    assert (shrunk.num_frames, shrunk.height) == (96, 308)  # resolution first, every frame kept
    tiny = QwenVLVideoProcessor().plan(8, 448, 448, VideoOptions(max_visual_tokens=10))
    assert (tiny.num_frames, tiny.num_visual_tokens) == (2, 9)  # below min_pixels only when one pair must


def test_pixel_options_follow_qwen_vl_utils():
    p = QwenVLVideoProcessor()
    small = p.plan(32, 448, 448, VideoOptions(max_pixels=28 * 28 * 16))
    large = p.plan(2, 56, 56, VideoOptions(min_pixels=28 * 28 * 64))
    assert (small.height, small.width, large.height, large.width) == (112, 112, 224, 224)
    # total_pixels: pixels summed over temporal patches, i.e. a budget of total / 28**2 tokens
    assert p.plan(32, 448, 448, VideoOptions(total_pixels=28 * 28 * 256)).num_visual_tokens <= 256
    # the processor's own cap (HF's max_video_tokens) is a budget too
    assert QwenVLVideoProcessor(max_video_tokens=100).plan(64, 448, 448).num_visual_tokens <= 100


def test_thin_keeps_bin_centres_and_rescales_the_rate():
    frames = Frames(np.zeros((10, 2, 2, 3), np.uint8) + np.arange(10, dtype=np.uint8)[:, None, None, None],
                    np.arange(10) / 2.0, 2.0)
    kept = thin(frames, 4)
    assert kept.frames[:, 0, 0, 0].tolist() == [1, 3, 6, 8] and kept.timestamps.tolist() == [0.5, 1.5, 3.0, 4.0]
    assert kept.sample_fps == 0.8 and thin(frames, 10) is frames


def test_the_budget_travels_with_the_frames():
    clip = np.random.default_rng(0).integers(0, 256, (32, 448, 448, 3), dtype=np.uint8)
    options = VideoOptions(fps=2.0, max_visual_tokens=1000)
    frames = load_frames(clip, options)
    assert frames.options is options and len(frames) == 32  # nothing dropped yet
    processor = QwenVLVideoProcessor()
    assert processor.process(frames).num_visual_tokens <= 1000  # as the engine calls it
    assert processor.process(frames, VideoOptions(fps=2.0)).num_visual_tokens == 16 * 256  # explicit options win
    planned = load_frames(clip, options, processor=processor)  # frames the budget drops are never decoded
    assert len(planned) == processor.plan(32, 448, 448, options).num_frames < 32
    assert prepare_video(clip, processor, options).num_visual_tokens <= 1000


# ---------------------------------------------------------------- bounds and ranges


@pytest.fixture(scope="module")
def long_videos(tmp_path_factory):
    """60 s at 10 fps, keyframe every second, in three containers."""
    folder = tmp_path_factory.mktemp("long")
    videos = {ext: write_synthetic_video(folder / f"long.{ext}", num_frames=600, width=64, height=64, fps=10, seed=3)
              for ext in ("mp4", "mkv", "ts")}
    every = load_frames(videos["mp4"].path, VideoOptions(num_frames=600, max_frames=600))
    return videos, every


def test_byte_cap_on_kept_frames(long_videos):
    videos, _ = long_videos
    frame = 64 * 64 * 3
    assert len(load_frames(videos["mp4"].path, VideoOptions(num_frames=16, max_frame_bytes=16 * frame))) == 16
    with pytest.raises(VideoTooLarge, match="max_frames"):
        load_frames(videos["mp4"].path, VideoOptions(num_frames=16, max_frame_bytes=16 * frame - 1))
    clip = np.zeros((16, 64, 64, 3), np.uint8)
    with pytest.raises(VideoTooLarge, match="bytes"):
        load_frames(clip, VideoOptions(num_frames=16, max_frame_bytes=frame))
    # the budget is applied first: frames it drops do not count against the cap
    options = VideoOptions(num_frames=16, max_visual_tokens=2, max_frame_bytes=2 * frame)
    assert len(load_frames(clip, options, processor=QwenVLVideoProcessor())) == 2


def test_last_seconds(long_videos):
    videos, every = long_videos
    for source in (videos["mp4"].path, every.frames):
        frames = load_frames(source, VideoOptions(fps=10, last_s=2.0, end_s=30.0))
        np.testing.assert_allclose(frames.timestamps, 28.0 + np.arange(20) / 10, atol=1e-9)
        np.testing.assert_array_equal(frames.frames, every.frames[280:300])


@pytest.mark.parametrize(
    "kwargs",
    [dict(last_s=0), dict(min_pixels=0), dict(max_pixels=-1), dict(min_pixels=10, max_pixels=5), dict(total_pixels=1.5),
     dict(max_visual_tokens=0), dict(max_frame_bytes=0), dict(open_timeout_s=0), dict(read_timeout_s=float("inf")),
     dict(timeout_s=-1), dict(seek="sometimes")],
)
def test_new_options_are_validated(kwargs):
    with pytest.raises(InvalidRequest):
        VideoOptions(**kwargs)


# ---------------------------------------------------------------- seeking


@pytest.fixture()
def decoders(monkeypatch):
    """Every _Decoder made during the test, counting its seeks."""
    made = []

    class Counting(decode._Decoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seeks = 0
            made.append(self)

        def seek(self, pts):
            self.seeks += 1
            return super().seek(pts)

    monkeypatch.setattr(decode, "_Decoder", Counting)
    return made


@pytest.mark.parametrize("ext", ["mp4", "mkv", "ts"])
@pytest.mark.parametrize(("num_frames", "start_s"), [(4, 0.0), (16, 0.0), (100, 0.0), (6, 41.3)])
def test_seeking_returns_the_frames_decoding_through_would(long_videos, ext, num_frames, start_s, decoders):
    videos, every = long_videos
    results = {mode: load_frames(videos[ext].path, VideoOptions(num_frames=num_frames, start_s=start_s, seek=mode))
               for mode in ("never", "always", "auto")}
    assert decoders[0].seeks == 0 and decoders[1].seeks > 0  # "never" and "always" did what they say
    for mode, frames in results.items():
        np.testing.assert_array_equal(frames.timestamps, results["never"].timestamps, err_msg=mode)
        np.testing.assert_array_equal(frames.frames, results["never"].frames, err_msg=mode)
    index = np.round(results["never"].timestamps * 10).astype(int)
    np.testing.assert_array_equal(results["never"].frames, every.frames[index])  # the nearest frames


def test_auto_seeks_when_that_is_cheaper(long_videos, decoders):
    videos, _ = long_videos
    path = videos["mp4"].path  # indexed: keyframe every 1 s, so seeking pays beyond ~1.4 s gaps
    load_frames(path, VideoOptions(num_frames=8, seek="auto"))  # a sample every 7.5 s
    sparse = decoders[-1]
    assert sparse.seeks == 8 and sparse.frames_decoded < 8 * 12
    load_frames(path, VideoOptions(num_frames=100, seek="auto"))  # every 0.6 s: decode through
    dense = decoders[-1]
    assert dense.seeks == 0 and dense.frames_decoded >= 590
    load_frames(videos["ts"].path, VideoOptions(num_frames=8, seek="auto"))  # no index: bisection, not worth it
    assert decoders[-1].seeks == 0
