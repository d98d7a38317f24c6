"""sparrow.video: decoding, sampling, HF-parity patchifying, bounds and typed errors."""

from __future__ import annotations

import io
import time
import types

import av
import numpy as np
import pytest
import torch
import transformers
from transformers import LlavaOnevisionConfig, Qwen2_5_VLConfig
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from sparrow.errors import InvalidRequest, NoFrames, NoVideoStream, VideoError, VideoTooLarge, VideoUnreadable
from sparrow.video import (
    Frames,
    LlavaOnevisionVideoProcessor,
    ProcessedVideo,
    QwenVLVideoProcessor,
    VideoOptions,
    VideoProcessor,
    load_frames,
    processor_for,
    write_synthetic_video,
)
from sparrow.video.frame_sampling import pick_nearest
from sparrow.video.stream import decoded_frames, video_stream
from sparrow.video.synthetic import BACKGROUND, PALETTE

FPS, N, SIDE = 8, 64, 112  # the shared clip: 64 frames at 8 fps = 8 s, 112x112


@pytest.fixture(scope="module")
def clip():
    return write_synthetic_video(None, num_frames=N, width=SIDE, height=SIDE, fps=FPS, seed=1)


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    return write_synthetic_video(path, num_frames=N, width=SIDE, height=SIDE, fps=FPS, seed=1)


def _frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def _as_frames(images: np.ndarray, fps: float = 2.0) -> Frames:
    return Frames(images, np.arange(len(images)) / fps, fps)


# ---------------------------------------------------------------- synthetic videos


def test_synthetic_video_is_fast_and_deterministic(clip):
    start = time.process_time()      # CPU time: other processes' load does not count
    again = write_synthetic_video(None, num_frames=N, width=SIDE, height=SIDE, fps=FPS, seed=1)
    assert time.process_time() - start < 1.0
    assert again.data == clip.data and again.events == clip.events
    other = write_synthetic_video(None, num_frames=N, width=SIDE, height=SIDE, fps=FPS, seed=2)
    assert other.events != clip.events
    assert clip.data[4:8] == b"ftyp" and clip.path is None and clip.source is clip.data
    assert clip.duration_s == 8.0
    times = [e["t"] for e in clip.events]
    assert times == sorted(times) and all(0 <= t < 8.0 for t in times)
    assert {e["kind"] for e in clip.events} <= {"appear", "move", "color", "disappear"}
    assert clip.events[0]["t"] == 0.0 and clip.events[0]["kind"] == "appear"


@pytest.mark.parametrize("seed", [3, 5, 8])
def test_synthetic_events_show_on_screen(seed):
    video = write_synthetic_video(None, num_frames=48, width=96, height=96, fps=12, seed=seed, num_shapes=1)
    frames = load_frames(video.data, VideoOptions(num_frames=48)).frames
    assert len(frames) == 48
    for event in video.events:
        x, y = event["center"]
        pixel = frames[event["frame"], y, x].astype(int)
        expected = BACKGROUND if event["kind"] == "disappear" else PALETTE[event["color"]]
        # yuv420p + crf 18 moves flat colours by a few levels at most
        np.testing.assert_allclose(pixel, expected, atol=24, err_msg=str(event))


def test_synthetic_rejects_odd_size():
    with pytest.raises(InvalidRequest):
        write_synthetic_video(None, num_frames=4, width=33, height=32, fps=4)


# ---------------------------------------------------------------- decoding and sampling


def test_path_bytes_and_array_give_the_same_frames(clip, clip_file):
    options = VideoOptions(num_frames=16)
    from_bytes = load_frames(clip.data, options)
    from_view = load_frames(memoryview(clip.data), options)
    from_path = load_frames(clip_file.path, options)
    from_str = load_frames(str(clip_file.path), options)
    everything = load_frames(clip.data, VideoOptions(num_frames=N))
    from_array = load_frames(everything.frames, VideoOptions(fps=FPS, num_frames=16))
    assert from_bytes.frames.shape == (16, SIDE, SIDE, 3) and from_bytes.frames.dtype == np.uint8
    for other in (from_view, from_path, from_str, from_array):
        np.testing.assert_array_equal(other.frames, from_bytes.frames)
        np.testing.assert_array_equal(other.timestamps, from_bytes.timestamps)
        assert other.sample_fps == from_bytes.sample_fps == 2.0
    # 16 samples over 8 s are the centres of 0.5 s bins, each landing on a frame
    np.testing.assert_array_equal(from_bytes.timestamps, np.arange(16) * 0.5 + 0.25)
    np.testing.assert_array_equal(everything.timestamps, np.arange(N) / FPS)
    np.testing.assert_array_equal(from_bytes.frames, everything.frames[2::4])


def test_decoded_frames_is_every_frame_timed_from_the_first(clip):
    """The one demux/decode loop (video/stream.py): every frame once, in order, at seconds from
    the first frame; each packet's size goes to on_packet before it is decoded."""
    sizes = []
    with av.open(io.BytesIO(clip.data)) as container:
        stream = video_stream(container)
        timed = [(t, frame.to_ndarray(format="rgb24")) for t, frame in
                 decoded_frames(container, stream, on_packet=sizes.append)]
    assert [t for t, _ in timed] == pytest.approx(np.arange(N) / FPS)
    everything = load_frames(clip.data, VideoOptions(num_frames=N))
    np.testing.assert_array_equal(np.stack([image for _, image in timed]), everything.frames)
    assert sum(sizes) > 0 and len(sizes) >= N          # the closing empty packet is decoded too
    with av.open(io.BytesIO(_audio_only_mp4())) as container, pytest.raises(NoVideoStream, match="the feed .*audio"):
        video_stream(container, "the feed")


@pytest.mark.parametrize(
    ("num_frames", "start_s", "end_s", "expected"),
    [(1, 0.0, None, 2), (5, 0.0, None, 6), (16, 0.0, None, 16), (63, 0.0, None, 64),
     (100, 0.0, None, 64), (8, 2.0, 5.0, 8), (6, 7.0, None, 6)],
)
def test_num_frames_sampling(clip, num_frames, start_s, end_s, expected):
    frames = load_frames(clip.data, VideoOptions(num_frames=num_frames, start_s=start_s, end_s=end_s))
    end = 8.0 if end_s is None else end_s
    assert len(frames) == expected and len(frames) % 2 == 0
    assert np.all(np.diff(frames.timestamps) > 0)  # distinct frames: never more than the video has
    assert frames.timestamps[0] >= start_s and frames.timestamps[-1] < end
    assert frames.sample_fps == pytest.approx(expected / (end - start_s))


def test_seeking_returns_the_frames_a_full_decode_would(clip):
    late = load_frames(clip.data, VideoOptions(num_frames=24, start_s=2.0, end_s=5.0))
    full = load_frames(clip.data, VideoOptions(num_frames=N))
    np.testing.assert_array_equal(late.timestamps, np.arange(16, 40) / FPS)
    np.testing.assert_array_equal(late.frames, full.frames[16:40])


@pytest.mark.parametrize(
    ("options", "expected"),
    [(VideoOptions(fps=2.0), 16), (VideoOptions(fps=1.125), 8), (VideoOptions(fps=0.1), 4),
     (VideoOptions(fps=0.1, min_frames=7), 6), (VideoOptions(fps=100.0), 64), (VideoOptions(fps=2.0, max_frames=9), 8),
     (VideoOptions(fps=2.0, start_s=2.0, end_s=5.0), 6), (VideoOptions(fps=4.0, end_s=100.0), 32)],
)
def test_fps_sampling(clip, options, expected):
    frames = load_frames(clip.data, options)
    end = min(options.end_s or 8.0, 8.0)
    assert len(frames) == expected
    assert np.all(np.diff(frames.timestamps) > 0)
    assert options.start_s <= frames.timestamps[0] and frames.timestamps[-1] < end
    assert frames.sample_fps == pytest.approx(expected / (end - options.start_s))


def test_other_containers_share_the_time_axis(tmp_path, clip):
    reference = load_frames(clip.data, VideoOptions(num_frames=N))
    for suffix in ("mkv", "ts", "avi", "h264"):  # h264: raw stream, no timestamps, no duration
        video = write_synthetic_video(tmp_path / f"clip.{suffix}", num_frames=N, width=SIDE, height=SIDE, fps=FPS, seed=1)
        frames = load_frames(video.path, VideoOptions(num_frames=N))
        np.testing.assert_allclose(frames.timestamps, reference.timestamps, atol=1e-9, err_msg=suffix)
        np.testing.assert_array_equal(frames.frames, reference.frames, err_msg=suffix)


def test_single_frame_video_is_padded_by_repeating_it():
    video = write_synthetic_video(None, num_frames=1, width=32, height=32, fps=4)
    frames = load_frames(video.data)
    assert len(frames) == 2 and frames.timestamps.tolist() == [0.0, 0.0]
    np.testing.assert_array_equal(frames.frames[0], frames.frames[1])
    assert frames.sample_fps == 4.0  # 1 frame over its 0.25 s


def test_array_source_sampling():
    clip = _frames(10, 8, 8)
    every = load_frames(clip)  # taken as a 2 fps clip: 10 frames = 5 s
    np.testing.assert_array_equal(every.frames, clip)
    np.testing.assert_array_equal(every.timestamps, np.arange(10) / 2)
    some = load_frames(clip, VideoOptions(num_frames=4))
    np.testing.assert_array_equal(some.frames, clip[[1, 4, 6, 9]])  # nearest to 0.625, 1.875, 3.125, 4.375 s
    odd = load_frames(clip[:7], VideoOptions(fps=1.0, num_frames=3))
    assert len(odd) == 4


def test_pick_nearest_ties_go_to_the_earlier_frame_and_repeats_collapse():
    items = [(t, i) for i, t in enumerate([0.0, 0.5, 1.0, 1.5])]
    assert pick_nearest(iter(items), np.array([0.25, 0.75, 1.2]), keep=str) == [(0.0, "0"), (0.5, "1"), (1.0, "2")]
    assert pick_nearest(iter(items), np.array([0.1, 0.2, 9.0]), keep=str) == [(0.0, "0"), (1.5, "3")]
    # float noise around a halfway point must not send two neighbouring targets to one frame
    noisy = np.array([0.25 + 1e-9, 0.75 - 1e-9])
    assert pick_nearest(iter(items), noisy, keep=str) == [(0.0, "0"), (0.5, "1")]
    consumed = []
    picks = pick_nearest((consumed.append(i) or i for i in items), np.array([0.1]), keep=str)
    assert picks == [(0.0, "0")] and len(consumed) == 2  # stops pulling once resolved


# ---------------------------------------------------------------- bad input


def _audio_only_mp4() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000, layout="mono")
        for index in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, index * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def _packet_start_near_middle(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as container:
        offsets = [p.pos for p in container.demux(video=0) if p.size and p.pos is not None]
    return min(offsets, key=lambda pos: abs(pos - len(data) // 2))


def test_bad_bytes_raise_typed_errors():
    with pytest.raises(VideoUnreadable):
        load_frames(np.random.default_rng(0).bytes(4096))
    with pytest.raises(VideoUnreadable, match="empty"):
        load_frames(b"")
    with pytest.raises(NoVideoStream, match="audio"):
        load_frames(_audio_only_mp4())
    with pytest.raises(VideoUnreadable):
        load_frames(b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n")  # playlists are not videos


def test_truncated_files_are_refused(clip, clip_file):
    # Decision: a cut file is VideoUnreadable, never a silent answer about part of the video.
    with pytest.raises(VideoUnreadable):
        load_frames(clip.data[: len(clip.data) // 2])  # index at the end: lost
    whole = clip_file.path.read_bytes()
    assert whole[4:8] == b"ftyp" and b"moov" in whole[:2000]  # index first: a prefix still opens
    with pytest.raises(VideoUnreadable):
        load_frames(whole[: len(whole) // 2])  # cut inside a packet: the decoder fails
    with pytest.raises(VideoUnreadable, match="truncated"):
        load_frames(whole[: _packet_start_near_middle(whole)])  # cut between packets: caught by duration
    # a range that ends before the cut is still fine
    head = load_frames(whole[: _packet_start_near_middle(whole)], VideoOptions(num_frames=4, end_s=2.0))
    assert len(head) == 4


def test_missing_file_and_bad_source_types(tmp_path):
    with pytest.raises(VideoUnreadable, match="cannot read"):
        load_frames(tmp_path / "nope.mp4")
    with pytest.raises(VideoUnreadable, match="not a regular file"):
        load_frames(tmp_path)
    with pytest.raises(InvalidRequest):
        load_frames(12345)


@pytest.mark.parametrize(
    "array",
    [np.zeros((4, 8, 8, 3), np.float32), np.zeros((4, 8, 8), np.uint8), np.zeros((4, 8, 8, 4), np.uint8),
     np.zeros((0, 8, 8, 3), np.uint8), np.zeros((8, 8, 3), np.uint8)],
)
def test_bad_arrays_are_invalid_requests(array):
    with pytest.raises(InvalidRequest) as info:
        load_frames(array)
    assert not isinstance(info.value, VideoTooLarge)


def test_bounds(clip, clip_file):
    size = len(clip.data)
    with pytest.raises(VideoTooLarge, match="bytes"):
        load_frames(clip.data, VideoOptions(max_bytes=size - 1))
    with pytest.raises(VideoTooLarge, match="bytes"):
        load_frames(clip_file.path, VideoOptions(max_bytes=100))
    assert len(load_frames(clip.data, VideoOptions(max_bytes=size))) == 16
    with pytest.raises(VideoTooLarge, match="8.0 s"):
        load_frames(clip.data, VideoOptions(max_duration_s=7.5))
    with pytest.raises(VideoTooLarge, match="112x112"):
        load_frames(clip.data, VideoOptions(max_frame_pixels=SIDE * SIDE - 1))
    with pytest.raises(VideoTooLarge, match="112x112"):
        load_frames(_frames(2, SIDE, SIDE), VideoOptions(max_frame_pixels=100))
    with pytest.raises(VideoTooLarge, match="frames requested"):
        load_frames(clip.data, VideoOptions(num_frames=40, max_decoded_frames=32))
    with pytest.raises(NoFrames):
        load_frames(clip.data, VideoOptions(start_s=9.0))
    assert issubclass(VideoTooLarge, VideoError) and issubclass(NoFrames, VideoError)


@pytest.mark.parametrize(
    "kwargs",
    [dict(fps=0), dict(fps=-1.0), dict(fps=float("nan")), dict(fps=None), dict(num_frames=0),
     dict(num_frames=2.5), dict(min_frames=8, max_frames=4), dict(min_frames=0), dict(start_s=-1.0),
     dict(start_s=3.0, end_s=3.0), dict(max_bytes=0), dict(max_duration_s=0), dict(num_frames=True)],
)
def test_options_validation(kwargs):
    with pytest.raises(InvalidRequest):
        VideoOptions(**kwargs)


# ---------------------------------------------------------------- Qwen2.5-VL parity


def _hf_qwen(processor: QwenVLVideoProcessor, image: np.ndarray) -> dict:
    hf = Qwen2VLImageProcessorPil(min_pixels=processor.min_pixels, max_pixels=processor.max_pixels)
    return hf(images=[image], return_tensors="np")


@pytest.mark.parametrize(
    ("height", "width", "grid"),
    [(448, 448, [32, 32]), (500, 333, [36, 24]), (100, 150, [20, 28]), (37, 530, [6, 86]), (720, 1280, [40, 72]),
     (12, 12, [24, 24])],
)
def test_qwen_matches_hf_image_processor_on_a_still_pair(height, width, grid):
    # 500x333 rounds to multiples of 28; 720x1280 is over max_pixels (downscaled to 560x1008);
    # 100x150, 37x530 and 12x12 are under min_pixels (upscaled)
    processor = QwenVLVideoProcessor()
    image = _frames(1, height, width, seed=height)[0]
    ours = processor.process(_as_frames(np.stack([image, image])))
    reference = _hf_qwen(processor, image)
    assert ours.model_kwargs["video_grid_thw"].tolist() == [[1, *grid]] == reference["image_grid_thw"].tolist()
    assert ours.model_kwargs["video_grid_thw"].dtype == torch.long
    assert ours.pixel_values_videos.dtype == torch.float32
    np.testing.assert_array_equal(ours.pixel_values_videos.numpy(), reference["pixel_values"])
    assert ours.num_visual_tokens == grid[0] * grid[1] // 4


def test_qwen_multi_frame_layout_matches_hf_per_temporal_patch():
    processor = QwenVLVideoProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    stills = _frames(3, 90, 130, seed=7)
    video = np.repeat(stills, 2, axis=0)  # pairs (a, a), (b, b), (c, c)
    ours = processor.process(_as_frames(video, fps=4.0))
    t, h, w = ours.model_kwargs["video_grid_thw"][0].tolist()
    assert t == 3 and ours.pixel_values_videos.shape == (t * h * w, 3 * 2 * 14 * 14)
    blocks = ours.pixel_values_videos.numpy().reshape(t, h * w, -1)
    for k in range(3):
        np.testing.assert_array_equal(blocks[k], _hf_qwen(processor, stills[k])["pixel_values"])
    # Within a patch the frame axis sits after the channel axis: [3, 2, 14, 14].
    mixed = processor.process(_as_frames(stills[:2])).pixel_values_videos.numpy().reshape(h * w, 3, 2, -1)
    for k in range(2):
        expected = _hf_qwen(processor, stills[k])["pixel_values"].reshape(h * w, 3, 2, -1)[:, :, k]
        np.testing.assert_array_equal(mixed[:, :, k], expected)
    assert ours.num_visual_tokens == t * h * w // 4
    assert ours.model_kwargs["second_per_grid_ts"].tolist() == [0.5]  # 2 frames per patch at 4 fps
    np.testing.assert_array_equal(ours.timestamps, np.arange(6) / 4.0)


def test_qwen_pads_an_odd_count_by_repeating_the_last_frame():
    processor = QwenVLVideoProcessor(min_pixels=28 * 28 * 4)
    images = _frames(3, 56, 56, seed=3)
    odd = processor.process(_as_frames(images))
    even = processor.process(_as_frames(np.concatenate([images, images[-1:]])))
    assert odd.model_kwargs["video_grid_thw"].tolist() == [[2, 4, 4]]
    torch.testing.assert_close(odd.pixel_values_videos, even.pixel_values_videos, rtol=0, atol=0)
    assert odd.timestamps.tolist() == [0.0, 0.5, 1.0, 1.0]


def test_qwen_video_token_budget():
    frames = _as_frames(_frames(32, 448, 448))
    assert QwenVLVideoProcessor().process(frames).num_visual_tokens == 16 * 256  # 16 pairs of 16x16 merged
    capped = QwenVLVideoProcessor(min_pixels=56 * 56, max_video_tokens=1000).process(frames)
    # each pair gets 90% of 1000 / 16 tokens of pixels (as HF's cap_pixels_per_frame): 196x196 -> 7x7
    assert capped.model_kwargs["video_grid_thw"].tolist() == [[16, 14, 14]]
    assert capped.num_visual_tokens == 16 * 49 <= 900


def test_qwen_temporal_positions_fit_long_videos_into_the_trained_span():
    """With temporal_positions P, a video of more than P rope steps is spaced so HF's own rope
    index puts it on positions 0..P-1 (several pairs share one); shorter ones keep real time;
    the setting is read from the config's tokens_per_second and validated."""
    config = Qwen2_5_VLConfig(vision_config={"tokens_per_second": 2})
    processor = processor_for(config, min_pixels=28 * 28, temporal_positions=8)
    assert processor.tokens_per_second == config.vision_config.tokens_per_second == 2
    model = types.SimpleNamespace(config=config)
    rope_index = transformers.Qwen2_5_VLModel.get_rope_index.__get__(model)
    model.get_vision_position_ids = transformers.Qwen2_5_VLModel.get_vision_position_ids.__get__(model)
    for pairs, spacing in ((3, 0.5), (8, 0.5), (9, 8 / 9 / 2), (40, 8 / 40 / 2)):
        out = processor.process(_as_frames(_frames(2 * pairs, 28, 28), fps=4.0))
        spg = out.model_kwargs["second_per_grid_ts"]
        assert spg.tolist() == pytest.approx([spacing])
        ids = torch.full((1, pairs), 5)
        pos, _ = rope_index(ids, torch.full((1, pairs), 2), video_grid_thw=out.model_kwargs["video_grid_thw"],
                            second_per_grid_ts=spg)
        t = pos[0, 0].tolist()
        assert t == sorted(t) and t[0] == 0 and t[-1] == min(pairs - 1, 7)
        if pairs >= 8:
            assert len(set(t)) == 8        # the whole span is used
    with pytest.raises(InvalidRequest):
        QwenVLVideoProcessor(temporal_positions=0)


def test_qwen_end_to_end_on_a_decoded_clip(clip):
    frames = load_frames(clip.data, VideoOptions(fps=2.0))
    out = processor_for(Qwen2_5_VLConfig()).process(frames)
    # 112x112 is under min_pixels (128 tokens): smart_resize scales up to 336x336
    assert out.model_kwargs["video_grid_thw"].tolist() == [[8, 24, 24]]
    assert out.num_visual_tokens == 8 * 24 * 24 // 4
    torch.testing.assert_close(out.model_kwargs["second_per_grid_ts"], torch.tensor([1.0]))
    assert np.isfinite(out.pixel_values_videos.numpy()).all()


# ---------------------------------------------------------------- LLaVA-OneVision parity


@pytest.mark.parametrize(("height", "width"), [(384, 384), (240, 320), (500, 90)])
def test_llava_onevision_matches_hf_image_processor(height, width):
    processor = processor_for(LlavaOnevisionConfig())
    assert isinstance(processor, LlavaOnevisionVideoProcessor)
    assert (processor.image_size, processor.patch_size) == (384, 14)
    images = _frames(2, height, width, seed=width)
    out = processor.process(_as_frames(images))
    assert out.pixel_values_videos.shape == (1, 2, 3, 384, 384)
    assert out.num_visual_tokens == 2 * 14 * 14 + 1  # p = 27 -> pooled 14 x 14, plus a newline
    assert out.model_kwargs == {}
    hf = LlavaOnevisionImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for k in range(2):
        # For a single image HF's first patch is the whole image resized to 384x384.
        reference = hf(images=[images[k]], return_tensors="np")["pixel_values"][0, 0]
        np.testing.assert_array_equal(out.pixel_values_videos[0, k].numpy(), reference)


def test_llava_token_count_follows_the_config():
    config = LlavaOnevisionConfig(vision_config={"model_type": "siglip_vision_model", "image_size": 56, "patch_size": 14})
    processor = processor_for(config)
    out = processor.process(_as_frames(_frames(4, 30, 40)))
    assert out.pixel_values_videos.shape == (1, 4, 3, 56, 56)
    assert out.num_visual_tokens == 4 * 2 * 2 + 1  # p = 4 -> pooled 2 x 2


# ---------------------------------------------------------------- dispatch


def test_processor_for_reads_the_hf_config():
    config = Qwen2_5_VLConfig(vision_config={"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2})
    processor = processor_for(config, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 100)
    assert isinstance(processor, QwenVLVideoProcessor) and isinstance(processor, VideoProcessor)
    assert (processor.patch_size, processor.merge_size, processor.factor) == (16, 2, 32)
    out = processor.process(_as_frames(_frames(2, 64, 96)))
    assert isinstance(out, ProcessedVideo)
    assert out.model_kwargs["video_grid_thw"].tolist() == [[1, 4, 6]]
    assert out.pixel_values_videos.shape == (24, 3 * 2 * 16 * 16)
    with pytest.raises(InvalidRequest, match="llama"):
        processor_for(types.SimpleNamespace(model_type="llama"))
    with pytest.raises(InvalidRequest):
        QwenVLVideoProcessor(min_pixels=10, max_pixels=5)
