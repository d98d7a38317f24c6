"""Video in, model inputs out: decode and sample with PyAV, patchify like the target's HF
processor. Imports no model code, so it can run in a separate decode worker."""

from sparrow.video.decode import ALLOWED_DEMUXERS, Source, load_frames
from sparrow.video.options import Frames, VideoOptions
from sparrow.video.processors import (
    LlavaOnevisionVideoProcessor,
    ProcessedVideo,
    QwenVLVideoProcessor,
    VideoProcessor,
    processor_for,
    smart_resize,
)
from sparrow.video.synthetic import SyntheticVideo, write_synthetic_video

__all__ = [
    "ALLOWED_DEMUXERS",
    "Frames",
    "LlavaOnevisionVideoProcessor",
    "ProcessedVideo",
    "QwenVLVideoProcessor",
    "Source",
    "SyntheticVideo",
    "VideoOptions",
    "VideoProcessor",
    "load_frames",
    "processor_for",
    "smart_resize",
    "write_synthetic_video",
]
