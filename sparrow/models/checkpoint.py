"""A target checkpoint's files beyond the weights and tokenizer: its video processor (HF's
files, and Sparrow's sparrow_video_processor.json beside them) and its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidRequest
from ..video import VideoProcessor, processor_for, processor_from_hf

VIDEO_PROCESSOR_FILE = "sparrow_video_processor.json"
# HF's processor files, in the order HF's video processor looks for them: a processor_config.json
# with a nested "video_processor" (transformers 5), then the video processor's own file, then the
# image processor's (which Qwen2.5-VL-7B ships alone, and HF's video processor then reads).
HF_PROCESSOR_FILE = "processor_config.json"
HF_VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
HF_IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidRequest(f"{file} must hold a JSON object")
    return data


def read_hf_processor_config(path: Path) -> dict | None:
    """The video processor settings HF would load from this checkpoint, or None if it has none."""
    nested = path / HF_PROCESSOR_FILE
    if nested.is_file():
        video = _read_json(nested).get("video_processor")
        if isinstance(video, dict):
            return video
    for name in (HF_VIDEO_PROCESSOR_FILE, HF_IMAGE_PROCESSOR_FILE):
        if (path / name).is_file():
            return _read_json(path / name)
    return None


def read_processor(path: Path, hf_config) -> VideoProcessor:
    """The checkpoint's own processor, read as HF reads it (so visual token counts equal HF's
    for this checkpoint), with Sparrow's additions from sparrow_video_processor.json on top
    (fields HF has none for, e.g. temporal_positions). A checkpoint with neither file gets the
    model config's defaults; one saved before the HF file was written keeps every field in
    Sparrow's file, which is read as before."""
    file = path / VIDEO_PROCESSOR_FILE
    hf = read_hf_processor_config(path)
    settings, kind = {}, None
    if file.is_file():
        settings = _read_json(file)
        kind = settings.pop("processor", None)
        if kind is None:
            raise InvalidRequest(f"{file} is not a valid video processor file: no 'processor' entry")
    try:
        overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
        processor = processor_for(hf_config, **overrides) if hf is None else processor_from_hf(hf_config, hf, **overrides)
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidRequest(f"{path}: the video processor settings are not valid: {e}") from e
    if kind is not None and type(processor).__name__ != kind:
        raise InvalidRequest(f"{file} is for a {kind}, but the model needs a {type(processor).__name__}")
    return processor


# What HF's processor files cannot say; saved beside them in sparrow_video_processor.json.
SPARROW_ONLY_FIELDS = ("temporal_positions", "tokens_per_second")


def read_chat_template(path: Path) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text()).get("chat_template")
    return None
