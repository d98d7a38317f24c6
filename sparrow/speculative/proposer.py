"""The Proposer contract: what every draft method gives the engine (the registry that builds
one by name, SpecConfig.method, is registry.py).

A proposer declares what it needs from the target's prefill (`needs`), starts a request
from what that prefill produced (`begin`), drafts for a whole batch of requests at once
(`propose`), and learns the verdict of each request's step (`commit`, with the AcceptResult
and the tokens the step emitted). Everything a proposer keeps for a request lives in the
DraftState `begin` returned, so one proposer serves every request of an engine.

Commits are deferred here, in the proposer, and nowhere else: the engine commits every step of
every request that has a DraftState, drafted or not, and a commit runs no draft pass. It
drops the step's speculative entries and keeps what the step emitted in the state's `Pending`;
the request's next `propose` runs it first (in its own draft call where it can: Sparrow's
greedy chain, SpecVLM's first feed, the remote draft's next RPC). A step that does not draft
costs the draft nothing, and steps a request sat out run in one pass when it drafts again.

    needs                 FeatureNeeds: feature layers, bridge layer, visual features
    begin(start)          -> DraftState                per request, after its prefill
    propose(batch)        -> [Proposal]                one batched draft pass for the step
    commit(states, steps) -> None                      what each step emitted (kept for the next propose)
    end(state)            -> None                      the request is over (done or not)

The engine reads a DraftState through its two measures only (`kv_bytes`, `max_keys`), into
the request's metrics before `end`. Every proposal goes through the one acceptance path
(accept.py); no proposer accepts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..config import SamplingParams
from ..models.prefill import FeatureNeeds, PrefillOutput
from .accept import AcceptResult
from .sampling import PositionNoise
from .tree import DraftTree


# A proposal is a draft tree (tree.py): Proposal(tokens, probs) is a chain.
Proposal = DraftTree


class DraftState(ABC):
    """One request's draft-side state, as `begin` returns it: each proposer's own subclass.
    The engine reads these two measures when the request ends (before `end` frees it)."""

    __slots__ = ()

    @abstractmethod
    def kv_bytes(self) -> int:
        """Bytes of draft KV memory this request holds now (0 once released, or when it lives
        elsewhere): what the subclass's docstring says it counts."""

    @abstractmethod
    def max_keys(self) -> int:
        """The most keys one draft query of this request has attended to so far."""


@dataclass(slots=True)
class BeginInput:
    """What a proposer may read when a request starts."""

    prefill: PrefillOutput
    first_token: int                    # the token prefill's logits gave
    max_new_tokens: int
    inputs: dict[str, torch.Tensor] | None = None   # the prompt's model inputs (pixels only on a prefix miss)
    video: Any = None                   # the ProcessedVideo
    video_key: str | None = None        # names the video when the prefix cache serves it
    draft_tokens: int = 0               # the most draft tokens (tree nodes) one step proposes for it

    @property
    def room(self) -> int:
        """Draft cache entries a request may add after its prompt: every new token, one
        step's draft tokens, and one more (a draft cache sized with it never grows)."""
        return self.max_new_tokens + self.draft_tokens + 1


@dataclass(slots=True)
class DraftRequest:
    """One request's part of a batched propose: its state, how many tokens, how to draw."""

    state: DraftState
    k: int                              # depth (a chain's length)
    sampling: SamplingParams
    generator: torch.Generator
    budget: int | None = None           # the most draft nodes this step (the batch's share); None: the method's
    noise: PositionNoise | None = None  # a seeded request's: draws are Gumbel-max under it (sampling.py)


@dataclass(slots=True)
class StepResult:
    """One request's verdict: the acceptance result, the tokens the step emitted (accepted
    drafts + the recovered/bonus token) and the target's features before each of them."""

    accept: AcceptResult
    tokens: list[int]
    features: torch.Tensor | None       # (len(tokens), F*H) or None when not asked for


@dataclass(slots=True)
class Pending:
    """What a request's steps emitted since its draft last ran: the tokens, in order, and the
    target's features before each ((n, F*H) pieces; none for a proposer that reads tokens
    only). `commit` adds to it; the next `propose` takes it."""

    tokens: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, result: StepResult) -> None:
        m, features = len(result.tokens), result.features
        self.tokens.extend(result.tokens)
        if features is not None:       # (a view only when a caller passed more rows than tokens)
            self.features.append(features if features.shape[0] == m else features[:m])

    def joined_features(self) -> torch.Tensor | None:
        """The features as one (n, F*H) tensor (one piece: itself, no copy); None if there are none."""
        if not self.features:
            return None
        return self.features[0] if len(self.features) == 1 else torch.cat(self.features)

    def take(self) -> StepResult | None:
        """Everything pending as one StepResult (None when nothing is), and empty after."""
        if not self.tokens:
            return None
        out = StepResult(None, self.tokens, self.joined_features())
        self.tokens, self.features = [], []
        return out


@runtime_checkable
class Proposer(Protocol):
    needs: FeatureNeeds

    def begin(self, start: BeginInput) -> DraftState: ...

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]: ...

    def commit(self, states: list[DraftState], results: list[StepResult]) -> None: ...

    def end(self, state: DraftState) -> None: ...
