"""The registry of draft methods: SpecConfig.method -> a Proposer (proposer.py).

It imports the contract and every built-in method, and nothing imports it back but the
engine, so there is no import circle.
"""

from __future__ import annotations

from typing import Any, Callable

from ..config import SpecConfig
from ..errors import InvalidRequest
from .eagle3 import Eagle3Proposer
from .proposer import Proposer
from .sparrow_proposer import SparrowProposer
from .specvlm import SpecVLMProposer

# name -> builder(target, draft, spec): the draft is whatever the method drafts with (a
# SparrowDraft, an Eagle3Draft, a small TargetModel for "specvlm", None for "none").
ProposerBuilder = Callable[[Any, Any, SpecConfig], "Proposer | None"]
PROPOSERS: dict[str, ProposerBuilder] = {
    "none": lambda target, draft, spec: None,
    "sparrow": SparrowProposer.from_spec,
    "eagle-style": SparrowProposer.from_spec,      # the same draft over a context with visual entries
    "eagle3": Eagle3Proposer.from_spec,
    "specvlm": SpecVLMProposer.from_spec,
}


def register_proposer(name: str, builder: ProposerBuilder) -> None:
    PROPOSERS[name] = builder


def build_proposer(spec: SpecConfig, target, draft) -> Proposer | None:
    """The proposer SpecConfig.method names, or None for plain decoding ("none")."""
    builder = PROPOSERS.get(spec.method)
    if builder is None:
        raise InvalidRequest(f"unknown speculative method {spec.method!r}; registered: {sorted(PROPOSERS)}")
    return builder(target, draft, spec)
