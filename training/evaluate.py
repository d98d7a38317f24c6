"""Held-out measurements with the serving engine itself: tau is the engine's own metric."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.errors import SparrowError
from sparrow.models.draft import SparrowDraft
from sparrow.models.target import TargetModel
from sparrow.video import VideoOptions

from .data import Sample


@dataclass(slots=True)
class TauReport:
    """None where nothing was measured (no sample ran a verify step): never a made-up 0."""

    mean_acceptance_length: float | None = None     # tau = 1 + accepted / steps, over all samples
    accepted_per_step: float | None = None
    acceptance_rate_per_position: list[float] = field(default_factory=list)
    steps: int = 0
    samples: int = 0
    skipped: int = 0

    def to_dict(self) -> dict:
        return {"tau": self.mean_acceptance_length, "accepted_per_step": self.accepted_per_step,
                "per_position": self.acceptance_rate_per_position, "steps": self.steps,
                "samples": self.samples, "skipped": self.skipped}


@torch.no_grad()
def held_out_tau(target: TargetModel, draft: SparrowDraft, samples: list[Sample], spec: SpecConfig,
                 max_new_tokens: int, options: VideoOptions | None = None,
                 on_sample: Callable[[], None] | None = None) -> TauReport:
    """Greedy speculative generation over `samples`; tau pooled over every verify step.
    on_sample: called after each sample (for progress)."""
    was_training = draft.training
    engine = Engine(target, draft.eval(), spec)
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    steps = accepted = done = skipped = 0
    per_pos: list[int] = []
    try:
        for s in samples:
            try:
                m = engine.generate(s.video, s.prompt, sampling, options).metrics
            except (SparrowError, OSError):
                skipped += 1
                continue
            finally:
                if on_sample:
                    on_sample()
            steps, accepted, done = steps + m.steps, accepted + m.accepted_tokens, done + 1
            per_pos += [0] * (len(m.accepted_per_position) - len(per_pos))
            for j, count in enumerate(m.accepted_per_position):
                per_pos[j] += count
    finally:
        draft.train(was_training)
    if not steps:
        return TauReport(None, None, [], 0, done, skipped)
    aps = accepted / steps
    return TauReport(1.0 + aps, aps, [c / steps for c in per_pos], steps, done, skipped)
