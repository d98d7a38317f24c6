"""Per-request speculative-decoding metrics, in DESIGN.md's terms.

  mean_acceptance_length (tau) = tokens emitted per verify step = 1 + accepted / steps
  accepted_per_step            = accepted / steps  (the convention without the bonus token)
  acceptance_rate_per_position[i] = fraction of steps whose i-th draft token was accepted
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class SpecMetrics:
    num_draft_tokens: int = 0             # k configured
    steps: int = 0                        # verify steps (plain decoding: decode steps)
    draft_tokens: int = 0                 # draft tokens proposed
    accepted_tokens: int = 0              # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)   # counts, index = draft position
    prompt_tokens: int = 0                # incl. visual tokens
    visual_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0         # prompt tokens whose prefill was reused (same video)
    video_seconds: float = 0.0            # decode + sample + patchify
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0           # after prefill until the last token
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    policy_seconds: float = 0.0           # deciding the steps' k (and cutting their trees), measuring their costs
    draft_max_keys: int = 0               # most keys one draft query attended to (DraftState.max_keys)
    draft_kv_bytes: int = 0               # draft KV memory the request held at its end (DraftState.kv_bytes)

    def record_step(self, proposed: int, accepted: int, nodes: int | None = None, emitted: int | None = None) -> None:
        """proposed: the draft's depth (a chain's k); nodes: its draft tokens when a tree has
        more than one per depth; emitted: the step's tokens the answer kept (None: all). Drafts
        accepted past the answer's end (its stop token, its length cap) are not counted: tau
        is tokens emitted a step."""
        if emitted is not None:
            accepted = min(accepted, max(0, emitted - 1))
        self.steps += 1
        self.draft_tokens += proposed if nodes is None else nodes
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def accepted_per_step(self) -> float:
        return self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_per_step if self.steps else 0.0

    tau = mean_acceptance_length

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [c / self.steps for c in self.accepted_per_position] if self.steps else []

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes from prefill; decode produced the rest.
        return (self.completion_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_acceptance_length=self.mean_acceptance_length, accepted_per_step=self.accepted_per_step,
                 acceptance_rate_per_position=self.acceptance_rate_per_position,
                 decode_tokens_per_second=self.decode_tokens_per_second)
        return d
