"""Acceptance: the one place where draft tokens become output tokens. Pure functions,
tensors in, a small result out; no model, cache or I/O.

Words (per verify step):
  draft tokens   the k tokens the draft proposed
  accepted       the longest prefix of draft tokens the target agrees with
  recovered      on the first rejection, the token the target emits instead
  bonus          when all k are accepted, the target's own next token after them

Greedy (temperature 0): a draft token is accepted iff it equals the target's argmax; the
output is exactly the target's greedy output.
Sampling: Leviathan et al. / Chen et al. speculative sampling. Draft token x_i ~ q_i is
accepted with probability min(1, p_i(x_i) / q_i(x_i)); on rejection the recovered token is
drawn from norm(max(0, p_i - q_i)). The emitted tokens are distributed exactly as the
target's p. A deterministic draft (no q) counts as q = one-hot(x_i).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AcceptResult:
    num_accepted: int      # accepted draft tokens, 0..k
    next_token: int        # recovered token (num_accepted < k) or bonus token (== k)

    def tokens(self, draft_tokens: torch.Tensor) -> list[int]:
        """The tokens this step emits: accepted prefix + recovered/bonus."""
        return draft_tokens[: self.num_accepted].tolist() + [self.next_token]


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> AcceptResult:
    """draft_tokens: (k,) long; target_logits: (k+1, V), row i scores the token after input i."""
    k = draft_tokens.shape[0]
    target_tokens = target_logits.argmax(dim=-1).to(draft_tokens.device)   # (k+1,)
    mismatch = (draft_tokens != target_tokens[:k]).nonzero()
    n = int(mismatch[0]) if mismatch.numel() else k
    return AcceptResult(n, int(target_tokens[n]))


def accept_speculative(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, generator: torch.Generator) -> AcceptResult:
    """draft_tokens: (k,); draft_probs: (k, V) or None (deterministic draft);
    target_probs: (k+1, V) after the request's temperature/top-k/top-p."""
    k = draft_tokens.shape[0]
    draft_tokens = draft_tokens.to(target_probs.device)
    idx = torch.arange(k, device=target_probs.device)
    p = target_probs[idx, draft_tokens]                                 # (k,) p_i(x_i)
    q = draft_probs[idx, draft_tokens] if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(k, generator=generator, device=p.device)
    rejected = (u * q > p).nonzero()                                    # u < p/q  <=>  accept
    n = int(rejected[0]) if rejected.numel() else k
    if n == k:
        return AcceptResult(k, int(torch.multinomial(target_probs[k], 1, generator=generator)))
    if draft_probs is not None:
        residual = (target_probs[n] - draft_probs[n]).clamp(min=0)
    else:
        residual = target_probs[n].clone()
        residual[draft_tokens[n]] = 0.0
    total = residual.sum()
    # p == q up to rounding leaves no residual mass; then p itself is the right distribution.
    residual = residual / total if total > 1e-12 else target_probs[n]
    return AcceptResult(n, int(torch.multinomial(residual, 1, generator=generator)))
