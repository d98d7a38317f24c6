"""The Proposer contract: what every draft method gives the engine, and the registry that
builds one by name (SpecConfig.method).

A proposer declares what it needs from the target's prefill (`needs`), starts a request
from what that prefill produced (`begin`), drafts for a whole batch of requests at once
(`propose`), and learns the verdict of each request's step (`commit`, with the AcceptResult
and the tokens the step emitted). Everything a proposer keeps for a request lives in the
state `begin` returned, so one proposer serves every request of an engine.

    needs                 FeatureNeeds: feature layers, bridge layer, visual features
    begin(start)          -> state                     per request, after its prefill
    propose(batch)        -> [Proposal]                one batched draft pass for the step
    commit(states, steps) -> None                      what each step emitted
    end(state)            -> None                      the request is over (done or not)

Every proposal goes through the one acceptance path (accept.py); no proposer accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from ..config import SamplingParams, SpecConfig
from ..errors import InvalidRequest
from ..models.target import FeatureNeeds, PrefillOutput
from .accept import AcceptResult
from .tree import DraftTree


# A proposal is a draft tree (tree.py): Proposal(tokens, probs) is a chain.
Proposal = DraftTree


@dataclass(slots=True)
class BeginInput:
    """What a proposer may read when a request starts."""

    prefill: PrefillOutput
    first_token: int                    # the token prefill's logits gave
    max_new_tokens: int
    inputs: dict[str, torch.Tensor] | None = None   # the prompt's model inputs (pixels only on a prefix miss)
    video: Any = None                   # the ProcessedVideo
    video_key: str | None = None        # names the video when the prefix cache serves it


@dataclass(slots=True)
class DraftRequest:
    """One request's part of a batched propose: its state, how many tokens, how to draw."""

    state: Any
    k: int                              # depth (a chain's length)
    sampling: SamplingParams
    generator: torch.Generator
    budget: int | None = None           # the most draft nodes this step (the batch's share); None: the method's


@dataclass(slots=True)
class StepResult:
    """One request's verdict: the acceptance result, the tokens the step emitted (accepted
    drafts + the recovered/bonus token) and the target's features before each of them."""

    accept: AcceptResult
    tokens: list[int]
    features: torch.Tensor | None       # (len(tokens), F*H) or None when not asked for


@runtime_checkable
class Proposer(Protocol):
    needs: FeatureNeeds

    def begin(self, start: BeginInput) -> Any: ...

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]: ...

    def commit(self, states: list[Any], results: list[StepResult]) -> None: ...

    def end(self, state: Any) -> None: ...


# name -> builder(target, draft, spec): the draft is whatever the method drafts with (a
# SparrowDraft, a small TargetModel for "specvlm", None for "none").
ProposerBuilder = Callable[[Any, Any, SpecConfig], "Proposer | None"]
PROPOSERS: dict[str, ProposerBuilder] = {}


def register_proposer(name: str, builder: ProposerBuilder) -> None:
    PROPOSERS[name] = builder


def build_proposer(spec: SpecConfig, target, draft) -> Proposer | None:
    """The proposer SpecConfig.method names, or None for plain decoding ("none")."""
    _ensure_builtin()
    builder = PROPOSERS.get(spec.method)
    if builder is None:
        raise InvalidRequest(f"unknown speculative method {spec.method!r}; registered: {sorted(PROPOSERS)}")
    return builder(target, draft, spec)


register_proposer("none", lambda target, draft, spec: None)


def _ensure_builtin() -> None:
    """The built-in methods register on first use (their modules import this one)."""
    from . import eagle3, propose, specvlm  # noqa: F401
