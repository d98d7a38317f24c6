"""Choosing the glimpse: G bridge-layer visual states the draft may attend to.

Verifier-guided, two stages (SpecVLM's rule): first the visual tokens that the prompt's text
attends to most at the bridge layer, up to half the budget or until they hold `mass` of the
attention; then the rest spread uniformly over the remaining tokens, so every part of the
video keeps some coverage. The attention is measured with the target's own bridge-layer
states (text states as queries, visual states as keys, scaled dot product).
"""

from __future__ import annotations

import torch


def text_to_visual_attention(text_states: torch.Tensor, visual_states: torch.Tensor) -> torch.Tensor:
    """(nt, H), (Nv, H) -> (Nv,) attention mass each visual token receives, averaged over text."""
    scores = text_states.float() @ visual_states.float().T / text_states.shape[-1] ** 0.5   # (nt, Nv)
    return torch.softmax(scores, dim=-1).mean(0)


def select_glimpse(attention: torch.Tensor, budget: int, mass: float = 0.5) -> torch.Tensor:
    """Indices (sorted, <= budget) of visual tokens to keep, from their attention (Nv,)."""
    n = attention.shape[0]
    if budget <= 0 or n == 0:
        return torch.empty(0, dtype=torch.long)
    if budget >= n:
        return torch.arange(n)
    order = torch.argsort(attention, descending=True)
    cum = attention[order].cumsum(0) / attention.sum().clamp(min=1e-12)
    n_top = min(budget // 2 if budget > 1 else 1, int((cum < mass).sum()) + 1)
    top = order[:n_top]
    rest = torch.ones(n, dtype=torch.bool)
    rest[top] = False
    remaining = torch.nonzero(rest).view(-1)
    n_uniform = budget - n_top
    pick = torch.linspace(0, remaining.shape[0] - 1, n_uniform).round().long() if n_uniform > 0 else remaining[:0]
    return torch.sort(torch.cat([top, remaining[pick]])).values
