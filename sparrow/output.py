"""Output handling for one request: from the token ids each step emits to what the client
sees. Stop tokens, the length cap, stop strings and incremental detokenizing, in one place.

Detokenizing is incremental: each push decodes only a short tail of the answer (from
`prefix_offset`), never the whole answer again, and holds back a trailing partial UTF-8
sequence (U+FFFD) until its bytes complete. Text that could still become a stop string is
held back too; a stop string is not part of the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import SamplingParams
from .metrics import SpecMetrics


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What a request's reader receives per step: the tokens it added and the text they made final."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(slots=True)
class GenerationOutput:
    """A finished request: its tokens, text, why it ended, and its metrics."""

    token_ids: list[int]
    text: str
    finish_reason: str               # "stop" | "length" | "abort"
    metrics: SpecMetrics
    # The target's probability of each of the request's first_token_ids at the answer's first
    # position (softmax of its logits at temperature 1); None when none were asked for.
    first_token_probs: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class OutputDelta:
    token_ids: tuple[int, ...]        # tokens this step added to the answer
    text: str                         # text this step made final
    finish: str | None                # "stop" | "length" | None (still running)


class OutputProcessor:
    def __init__(self, tokenizer, sampling: SamplingParams, eos_token_ids: frozenset[int]):
        self.tokenizer, self.sampling = tokenizer, sampling
        self.stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
        self.token_ids: list[int] = []
        self.text = ""                                   # decoded so far (final)
        self.shown = 0                                   # characters of self.text already emitted
        self._prefix_offset = 0                          # tokens before it are decoded for good
        self._read_offset = 0
        # A stop string can start in text already decoded: this much is held back until it can't.
        self._hold = max((len(s) for s in sampling.stop), default=1) - 1

    @property
    def remaining(self) -> int:
        """Tokens the length cap still allows."""
        return self.sampling.max_new_tokens - len(self.token_ids)

    def push(self, new: list[int]) -> OutputDelta:
        new, finish = self._truncate(new)
        self.token_ids.extend(new)
        self._detokenize()
        end = len(self.text)
        if self.sampling.stop:
            cut = self._stop_string(max(0, self.shown - self._hold))
            if cut is not None:
                finish, end = "stop", cut
            elif finish is None:
                end = max(self.shown, end - self._hold)
        delta, self.shown = self.text[self.shown:end], max(self.shown, end)
        return OutputDelta(tuple(new), delta, finish)

    @property
    def final_text(self) -> str:
        return self.text[: self.shown]

    def kept(self, new: list[int]) -> int:
        """How many of a step's tokens the answer would keep (up to a stop token, within the
        length cap): what the step emitted, as its metrics count it."""
        return len(self._truncate(new)[0])

    def _truncate(self, new: list[int]) -> tuple[list[int], str | None]:
        """Cut a step's tokens at a stop token (kept, as HF generate keeps EOS) or the length cap."""
        for i, t in enumerate(new):
            if t in self.stop_ids:
                new = new[: i + 1]
                return new[: self.remaining], "stop" if i + 1 <= self.remaining else "length"
        if len(new) >= self.remaining:
            return new[: self.remaining], "length"
        return new, None

    def _detokenize(self) -> None:
        ids, decode = self.token_ids, self.tokenizer.decode
        before = decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        after = decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) < len(before):
            return                                       # an incomplete UTF-8 sequence: wait for more
        self.text += after[len(before):]
        # Keep a few tokens of left context: some tokenizers decode a token differently at the start.
        self._prefix_offset = max(self._prefix_offset, self._read_offset - 4)
        self._read_offset = len(ids)

    def _stop_string(self, start: int) -> int | None:
        """Where the earliest stop string begins in text[start:], or None."""
        found = [i for i in (self.text.find(s, start) for s in self.sampling.stop) if i >= 0]
        return min(found) if found else None
