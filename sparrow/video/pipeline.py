"""Source -> model inputs in one call, within the token budget."""

from __future__ import annotations

import threading

from sparrow.errors import RequestAborted
from sparrow.video.decode import Source, load_frames
from sparrow.video.options import Frames, VideoOptions
from sparrow.video.policy import SourcePolicy
from sparrow.video.processors import ProcessedVideo, VideoProcessor


def prepare_video(
    source: Source | Frames,
    processor: VideoProcessor,
    options: VideoOptions | None = None,
    *,
    policy: SourcePolicy | None = None,
    cancelled: threading.Event | None = None,
) -> ProcessedVideo:
    """Decode, sample and patchify `source` for `processor`'s model, with at most
    `options.max_visual_tokens` visual tokens (the rule: `processor.plan`).

    The same rule holds for `processor.process(load_frames(source, options))` (the frames
    carry their options), but this is cheaper when the budget binds: the kept frames are
    sampled directly at the lower count (bin centres of the range) instead of being decoded
    and then thinned out. `cancelled` (a request's abort) stops the decode at its next packet
    and the patchify before it starts, with RequestAborted."""
    if isinstance(source, Frames):
        return processor.process(source, options)
    options = options or VideoOptions()
    frames = load_frames(source, options, policy=policy, processor=processor, cancelled=cancelled)
    if cancelled is not None and cancelled.is_set():
        raise RequestAborted("the request ended while its video was being prepared")
    return processor.process(frames, options)
