"""Training data: (video, prompt, optional answer) samples from a JSONL manifest or a folder.

    manifest.jsonl   one object per line: {"video": "clips/a.mp4", "prompt": "...", "answer": "..."}
                     (relative video paths are relative to the manifest; "answer" is optional),
                     or a conversation about the video instead of "prompt": {"video": ...,
                     "messages": [{"role": "user", "text": ...}, {"role": "assistant", "text": ...},
                     ..., {"role": "user", "text": ...}]} ("content" may stand for "text"). When
                     the messages end with the assistant's turn, that turn is the answer and the
                     turns before it the prompt. The video belongs to the first user turn.
    folder/          every video file; prompts from a sidecar `<name>.txt` (one per line, each
                     a sample) or, without one, the default prompts

Nothing is opened here: an unreadable video or an empty prompt is found when the sample is
first used, and the trainer skips it with a count rather than stopping the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sparrow.chat import Message, Prompt, as_messages
from sparrow.errors import InvalidRequest

VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".mov", ".avi", ".m4v", ".gif", ".ts", ".flv")
DEFAULT_PROMPTS = ("Describe the video in detail.",)


@dataclass(frozen=True, slots=True)
class Sample:
    video: object                 # anything Engine.process_video takes: a path, bytes, frames
    prompt: Prompt                # a question, or a conversation ending with the user's question
    answer: str | None = None


def load_samples(source: str | Path, prompts: tuple[str, ...] = DEFAULT_PROMPTS) -> list[Sample]:
    """Samples from a JSONL manifest file or a folder of videos."""
    source = Path(source)
    if source.is_dir():
        return _from_folder(source, prompts)
    if source.is_file():
        return _from_manifest(source)
    raise InvalidRequest(f"training data {source} is neither a manifest file nor a folder")


def _from_manifest(path: Path) -> list[Sample]:
    samples = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            video = Path(row["video"])
            # A malformed prompt is kept as it is: the trainer counts it as a bad sample.
            prompt, answer = _conversation(row) if "messages" in row else (row.get("prompt", ""), row.get("answer"))
            samples.append(Sample(video if video.is_absolute() else path.parent / video, prompt, answer))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidRequest(f"{path}:{line_no}: not a manifest row ({exc})") from exc
        except InvalidRequest as exc:
            raise InvalidRequest(f"{path}:{line_no}: {exc}") from exc
    return samples


def _conversation(row: dict) -> tuple[tuple[Message, ...], str | None]:
    """(prompt, answer) of a manifest row with "messages": a closing assistant turn is the answer."""
    if not isinstance(row["messages"], list):
        raise InvalidRequest('"messages" must be a list of {"role", "text"} objects')
    messages = [Message.from_dict(m) for m in row["messages"]]
    answer = row.get("answer")
    if messages and messages[-1].role == "assistant":
        if answer is not None:
            raise InvalidRequest('the messages end with the answer: give no "answer" besides')
        messages, answer = messages[:-1], messages[-1].text
    return as_messages(messages), answer


def _from_folder(folder: Path, prompts: tuple[str, ...]) -> list[Sample]:
    samples = []
    for video in sorted(p for p in folder.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES):
        sidecar = video.with_suffix(".txt")
        lines = [ln for ln in sidecar.read_text().splitlines() if ln.strip()] if sidecar.is_file() else prompts
        samples.extend(Sample(video, prompt) for prompt in lines)
    return samples


def prompt_json(prompt: Prompt) -> str | list[dict]:
    """A prompt as JSON: the question, or the conversation's turns as {"role", "text"} objects."""
    if isinstance(prompt, str):
        return prompt
    return [{"role": m.role, "text": m.text} for m in prompt]


def write_manifest(path: str | Path, samples: list[Sample]) -> None:
    """A JSONL manifest of samples whose videos are paths."""
    def question(s: Sample) -> dict:
        p = prompt_json(s.prompt)
        return {"prompt": p} if isinstance(p, str) else {"messages": p}

    rows = [{"video": str(s.video), **question(s), **({"answer": s.answer} if s.answer is not None else {})}
            for s in samples]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
