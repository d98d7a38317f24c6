"""Video in, model inputs out: decode and sample with PyAV (paths, URLs, bytes, file
objects, live streams; allowlisted, bounded, with timeouts), patchify like the target's HF
processor within a visual-token budget. Imports no model code, so it can run in a
separate decode worker.

    prepare_video(source, processor, options, policy=policy) -> ProcessedVideo
    load_frames(source, options, policy=policy) -> Frames; processor.process(frames)
"""

from sparrow.video.decode import Source, load_frames, probe_video
from sparrow.video.growing_stream import LiveSource
from sparrow.video.options import QWEN_MAX_VISUAL_TOKENS, Frames, VideoOptions
from sparrow.video.pipeline import prepare_video
from sparrow.video.policy import URL_SCHEMES, SourcePolicy
from sparrow.video.processors import (
    LlavaOnevisionVideoProcessor,
    ProcessedVideo,
    QwenVLVideoProcessor,
    VideoPlan,
    VideoProcessor,
    processor_for,
    processor_from_hf,
    smart_resize,
)
from sparrow.video.sources import ALLOWED_DEMUXERS
from sparrow.video.synthetic import SyntheticVideo, write_synthetic_video

__all__ = [
    "ALLOWED_DEMUXERS",
    "QWEN_MAX_VISUAL_TOKENS",
    "URL_SCHEMES",
    "Frames",
    "LiveSource",
    "LlavaOnevisionVideoProcessor",
    "ProcessedVideo",
    "QwenVLVideoProcessor",
    "Source",
    "SourcePolicy",
    "SyntheticVideo",
    "VideoOptions",
    "VideoPlan",
    "VideoProcessor",
    "load_frames",
    "probe_video",
    "prepare_video",
    "processor_for",
    "processor_from_hf",
    "smart_resize",
    "write_synthetic_video",
]
