"""Video in, model inputs out: decode and sample with PyAV (paths, URLs, bytes, file
objects, live streams; allowlisted, bounded, with timeouts), patchify like the target's HF
processor within a visual-token budget. Imports no model code, so it can run in a
separate decode worker.

    prepare_video(source, processor, options, policy=policy) -> ProcessedVideo
    load_frames(source, options, policy=policy) -> Frames; processor.process(frames)
"""

from sparrow.lazy import lazy_exports

# Loaded on first use: a client that only checks a URL (policy) does not import torch.
__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(("Source", "load_frames", "probe_video"), "decode"),
    "LiveSource": "growing_stream",
    **dict.fromkeys(("QWEN_MAX_VISUAL_TOKENS", "Frames", "VideoOptions"), "options"),
    "prepare_video": "pipeline",
    **dict.fromkeys(("URL_SCHEMES", "SourcePolicy"), "policy"),
    **dict.fromkeys(("LlavaOnevisionVideoProcessor", "ProcessedVideo", "QwenVLVideoProcessor", "VideoPlan",
                     "VideoProcessor", "processor_for", "processor_from_hf", "smart_resize"), "processors"),
    "ALLOWED_DEMUXERS": "sources",
    **dict.fromkeys(("SyntheticVideo", "write_synthetic_video"), "synthetic"),
})

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
