"""A request's life inside the engine: what the scheduler, the runner and the draft policy read
and write about one request between its submission and its end."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .config import SamplingParams
from .metrics import SpecMetrics
from .models.kv_cache import KVSlot
from .models.prefill import FeatureNeeds, PrefillJob, TargetState
from .output import OutputProcessor
from .prefix_cache import PrefixEntry
from .speculative.proposer import DraftState
from .speculative.sampling import PositionNoise


class Ending(threading.Event):
    """A request's abort signal: set by `abort()`, or by itself at `deadline` (time.monotonic),
    checked wherever the engine checks for an abort (before preparing, at each packet of the
    video's decode, before each prefill slice and decode step). So a deadline ends the work at
    the engine's next check, whatever thread noticed it first or whether any did."""

    def __init__(self, deadline: float | None = None):
        super().__init__()
        self.deadline = deadline

    def is_set(self) -> bool:
        if self.deadline is not None and not super().is_set() and time.monotonic() >= self.deadline:
            self.set()
        return super().is_set()


@dataclass(eq=False)
class Request:
    """One request's life in the scheduler. Only the scheduler thread touches the fields
    below `sink` once the request is queued; `abort()` is safe from any thread."""

    id: int
    video: Any
    prompt: Any                             # the question: a string, or chat turns (sparrow.chat)
    sampling: SamplingParams
    options: Any
    video_key: str | None
    requested_k: int | None
    sink: Callable[[Any], None]             # receives TokenDelta, then GenerationOutput or an exception
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    submitted: float = field(default_factory=time.monotonic)
    aborted: Ending = field(default_factory=Ending)
    k: int = 0                              # most draft tokens a step may give it
    pinned_k: bool = False                  # an explicit k: k never adapts
    needs: FeatureNeeds = FeatureNeeds()
    first_token_ids: tuple[int, ...] = ()   # tokens whose first-position probability the output reports
    first_token_probs: tuple[float, ...] | None = None
    inputs: dict | None = None
    processed: Any = None
    embeds: Any = None                      # the prompt's input embeddings, made while preparing (vision tower)
    entry: PrefixEntry | None = None
    capacity: int = 0
    slot: KVSlot | None = None
    job: PrefillJob | None = None
    state: TargetState | None = None
    draft_state: DraftState | None = None
    generator: torch.Generator | None = None
    noise: PositionNoise | None = None      # a seeded request's randomness (sampling.PositionNoise)
    output: OutputProcessor | None = None
    accepted: float = 0.0                   # its draft tokens accepted ...
    rejected: float = 0.0                   # ... and verify steps that rejected one (recent ones weigh most: DraftPolicy)
    drafted: int = 0                        # its drafting steps (the engine's record weighs less as they come)
    idle: int = 0                           # steps since it last drafted (DraftPolicy: it tries again after ...
    backoff: int = 0                        # ... this many; 0: the policy's first wait)
    decode_start: float = 0.0
    waited: bool = False                    # counted once in the scheduler's waited_for_memory
    prefill_s_per_token: float = 0.0        # measured on its last prefill slice
    prefill_last_slice: int = 0             # positions of that slice
    prefill_turn_at: float = 0.0            # when it was admitted or last ran a slice (perf_counter)
    done: bool = False

    def abort(self) -> None:
        self.aborted.set()

    @property
    def context(self) -> int:
        """Tokens in its target cache: the prompt (video included) and what it generated."""
        return self.metrics.prompt_tokens + (len(self.output.token_ids) if self.output is not None else 0)
