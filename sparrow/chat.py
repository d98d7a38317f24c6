"""Conversations about one video: the turns a request carries before its new question.

A prompt is either one question (a str) or a conversation: `Message`s of the user and the
assistant, oldest first, alternating, ending with the user's new question. The video belongs
to the first user turn (as in HF's chat messages, `{"type": "video"}` before the text), so
every conversation about a video starts with the same tokens through its last video token:
the prefix cache (prefix_cache.py) reuses that prefill for each follow-up, and only the turns
after the video are prefilled again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import InvalidRequest

ROLES = ("user", "assistant")


@dataclass(frozen=True, slots=True)
class Message:
    role: str          # "user" | "assistant"
    text: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"a message's role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise InvalidRequest(f"a {self.role} message must have non-empty text")

    @classmethod
    def from_dict(cls, row: Mapping) -> "Message":
        """{"role": ..., "text": ...} (or "content", as chat APIs name it)."""
        if not isinstance(row, Mapping):
            raise InvalidRequest(f"a message must be an object with role and text, got {type(row).__name__}")
        text = row.get("text", row.get("content"))
        return cls(str(row.get("role", "")), text if isinstance(text, str) else "")


Prompt = str | Sequence[Message]


def as_messages(prompt: Prompt) -> tuple[Message, ...]:
    """The prompt as a validated conversation: user first, turns alternating, the last one
    the user's question. A str is a one-turn conversation."""
    if isinstance(prompt, str):
        return (Message("user", prompt),)
    if not isinstance(prompt, Sequence) or not all(isinstance(m, Message) for m in prompt):
        raise InvalidRequest("prompt must be a string or a sequence of sparrow.chat.Message")
    messages = tuple(prompt)
    if not messages:
        raise InvalidRequest("a conversation needs at least the user's question")
    for i, m in enumerate(messages):
        if m.role != ROLES[i % 2]:
            raise InvalidRequest(f"turn {i} is {m.role!r}: turns alternate user, assistant, user, ... "
                                 f"starting with the user")
    if messages[-1].role != "user":
        raise InvalidRequest("a conversation must end with the user's question")
    return messages


def with_history(history: Sequence[Message], question: str) -> tuple[Message, ...]:
    """Earlier turns followed by a new question, validated."""
    return as_messages((*history, Message("user", question)))


def chat_template_messages(prompt: Prompt) -> list[dict]:
    """HF chat-template messages with the video placeholder at the start of the first user turn."""
    messages = as_messages(prompt)
    out = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": messages[0].text}]}]
    out += [{"role": m.role, "content": [{"type": "text", "text": m.text}]} for m in messages[1:]]
    return out
