"""A checkpoint's own HF processor files decide how its videos are processed, as HF would
read them: token counts and pixels equal HF's processor for the same files."""

import json

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.errors import InvalidRequest
from sparrow.models import TargetModel
from sparrow.models.target import HF_VIDEO_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE
from sparrow.video import Frames, LlavaOnevisionVideoProcessor, QwenVLVideoProcessor

# Non-default everything HF reads: the layout Qwen2.5-VL-7B ships (top-level min/max pixels in
# the image processor's file), other bounds and other statistics.
QWEN_IMAGE_CONFIG = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                     "min_pixels": 20 * 28 * 28, "max_pixels": 40 * 28 * 28, "patch_size": 14,
                     "temporal_patch_size": 2, "merge_size": 2,
                     "image_mean": [0.45, 0.5, 0.55], "image_std": [0.2, 0.25, 0.3]}
QWEN_VIDEO_CONFIG = {"video_processor_type": "Qwen2VLVideoProcessor",
                     "size": {"shortest_edge": 8 * 28 * 28, "longest_edge": 12 * 28 * 28},
                     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _pair(height: int, width: int, seed: int = 0) -> tuple[np.ndarray, Frames]:
    image = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return image, Frames(np.stack([image, image]), np.array([0.0, 0.5]), 2.0)


def _write(path, name: str, data: dict) -> None:
    (path / name).write_text(json.dumps(data))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, qwen_target):
    path = tmp_path_factory.mktemp("qwen")
    qwen_target.hf.save_pretrained(path)          # weights and tokenizer only: no processor files yet
    qwen_target.tokenizer.save_pretrained(path)
    return path


def test_qwen_image_processor_file_gives_hf_tokens_and_pixels(qwen_dir):
    _write(qwen_dir, "preprocessor_config.json", QWEN_IMAGE_CONFIG)
    loaded = TargetModel.from_pretrained(qwen_dir)
    p = loaded.processor
    assert (p.min_pixels, p.max_pixels) == (QWEN_IMAGE_CONFIG["min_pixels"], QWEN_IMAGE_CONFIG["max_pixels"])
    hf = Qwen2VLImageProcessorPil.from_pretrained(qwen_dir)          # HF's reading of the same file
    for height, width in ((500, 333), (60, 90), (720, 1280)):       # in range, upscaled, downscaled
        image, frames = _pair(height, width, seed=height)
        ours, ref = p.process(frames), hf(images=[image], return_tensors="np")
        assert ours.model_kwargs["video_grid_thw"].tolist() == ref["image_grid_thw"].tolist()
        assert ours.num_visual_tokens == int(np.prod(ref["image_grid_thw"])) // 4
        np.testing.assert_array_equal(ours.pixel_values_videos.numpy(), ref["pixel_values"])
    default = QwenVLVideoProcessor.from_hf_config(loaded.hf.config)
    assert default.process(_pair(720, 1280)[1]).num_visual_tokens != p.process(_pair(720, 1280)[1]).num_visual_tokens


def test_video_processor_file_wins_and_sparrow_file_only_adds(qwen_dir, small_video):
    _write(qwen_dir, "preprocessor_config.json", QWEN_IMAGE_CONFIG)
    _write(qwen_dir, HF_VIDEO_PROCESSOR_FILE, QWEN_VIDEO_CONFIG)
    _write(qwen_dir, VIDEO_PROCESSOR_FILE, {"processor": "QwenVLVideoProcessor", "temporal_positions": 6})
    try:
        loaded = TargetModel.from_pretrained(qwen_dir)
    finally:
        for name in (HF_VIDEO_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE):
            (qwen_dir / name).unlink()
    p = loaded.processor
    assert (p.min_pixels, p.max_pixels, p.image_mean) == (8 * 28 * 28, 12 * 28 * 28, (0.5, 0.5, 0.5))
    assert p.temporal_positions == 6
    hf = Qwen2VLImageProcessorPil(**QWEN_VIDEO_CONFIG)               # the video file, read by HF's rules
    image, frames = _pair(300, 500, seed=3)
    assert p.process(frames).model_kwargs["video_grid_thw"].tolist() == \
        hf(images=[image], return_tensors="np")["image_grid_thw"].tolist()
    # the engine serves with it (the model accepts its token count), not with the defaults
    out = Engine(loaded, spec=SpecConfig(method="none")).generate(small_video, "What moves?",
                                                                  SamplingParams(max_new_tokens=2))
    default = QwenVLVideoProcessor.from_hf_config(loaded.hf.config)
    assert out.metrics.visual_tokens == p.plan(4, 56, 56).num_visual_tokens != default.plan(4, 56, 56).num_visual_tokens


def test_save_writes_hf_file_and_round_trips(tmp_path, qwen_target):
    custom = QwenVLVideoProcessor.from_hf_config(qwen_target.hf.config, min_pixels=4 * 28 * 28, max_pixels=9 * 28 * 28,
                                                 temporal_positions=5, image_mean=(0.5, 0.5, 0.5))
    TargetModel(qwen_target.hf, qwen_target.tokenizer, custom).save_pretrained(tmp_path)
    assert json.loads((tmp_path / VIDEO_PROCESSOR_FILE).read_text()) == \
        {"processor": "QwenVLVideoProcessor", "temporal_positions": 5, "tokens_per_second": 2.0}
    hf_file = json.loads((tmp_path / HF_VIDEO_PROCESSOR_FILE).read_text())
    assert hf_file["size"] == {"shortest_edge": 4 * 28 * 28, "longest_edge": 9 * 28 * 28}
    assert TargetModel.from_pretrained(tmp_path).processor == custom


@pytest.mark.parametrize("bad", [{"do_normalize": False}, {"patch_size": 16}, {"resample": 2},
                                 {"merge_size": 3}])
def test_processor_files_we_cannot_honour_are_refused(qwen_dir, bad):
    _write(qwen_dir, "preprocessor_config.json", {**QWEN_IMAGE_CONFIG, **bad})
    with pytest.raises(InvalidRequest):
        TargetModel.from_pretrained(qwen_dir)


def test_llava_video_processor_file(tmp_path, llava_target, small_video):
    llava_target.hf.save_pretrained(tmp_path)
    llava_target.tokenizer.save_pretrained(tmp_path)
    side = llava_target.hf.config.vision_config.image_size
    config = {"video_processor_type": "LlavaOnevisionVideoProcessor", "size": {"height": side, "width": side},
              "image_mean": [0.4, 0.5, 0.6], "image_std": [0.3, 0.3, 0.3]}
    _write(tmp_path, HF_VIDEO_PROCESSOR_FILE, config)
    loaded = TargetModel.from_pretrained(tmp_path)
    assert loaded.processor == LlavaOnevisionVideoProcessor(image_size=side, patch_size=14,
                                                           image_mean=(0.4, 0.5, 0.6), image_std=(0.3, 0.3, 0.3))
    frames = Frames(small_video, np.arange(4) / 2.0, 2.0)
    x = loaded.processor.process(frames).pixel_values_videos
    raw = torch.from_numpy(small_video[0]).permute(2, 0, 1).float() / 255          # side == video side here
    expected = (raw - torch.tensor([0.4, 0.5, 0.6])[:, None, None]) / 0.3
    torch.testing.assert_close(x[0, 0], expected, atol=1e-5, rtol=0)
    # a file without statistics gets HF's class defaults (CLIP's), not Sparrow's SigLIP defaults
    _write(tmp_path, HF_VIDEO_PROCESSOR_FILE, {"size": {"height": side, "width": side}})
    assert TargetModel.from_pretrained(tmp_path).processor.image_mean == (0.48145466, 0.4578275, 0.40821073)
    _write(tmp_path, HF_VIDEO_PROCESSOR_FILE, {"size": {"height": side * 2, "width": side * 2}})
    with pytest.raises(InvalidRequest):
        TargetModel.from_pretrained(tmp_path)
