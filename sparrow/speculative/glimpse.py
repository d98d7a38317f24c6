"""Choosing the glimpse: G bridge-layer visual states the draft may attend to.

Verifier-guided, two stages (SpecVLM's rule; prune.prune_visual is its one implementation):
first the visual tokens that the prompt's text attends to most at the bridge layer, up to
half the budget or until they hold `mass` of the attention; then the rest spread uniformly
over the remaining tokens, so every part of the video keeps some coverage. The attention is
measured with the target's own bridge-layer states (text states as queries, visual states as
keys, scaled dot product).
"""

from __future__ import annotations

import torch

from .prune import prune_visual


def text_to_visual_attention(text_states: torch.Tensor, visual_states: torch.Tensor) -> torch.Tensor:
    """(nt, H), (Nv, H) -> (Nv,) attention mass each visual token receives, averaged over text."""
    scores = text_states.float() @ visual_states.float().T / text_states.shape[-1] ** 0.5   # (nt, Nv)
    return torch.softmax(scores, dim=-1).mean(0)


def ends_included(n_remaining: int, n_pick: int, device: torch.device) -> torch.Tensor:
    """n_pick indices evenly spaced over n_remaining tokens, the first and the last included."""
    return torch.linspace(0, n_remaining - 1, n_pick, device=device).round().long()


def select_glimpse(attention: torch.Tensor, budget: int, mass: float = 0.5) -> torch.Tensor:
    """Indices (sorted, <= budget) of visual tokens to keep, from their attention (Nv,).

    Pruning's two-stage rule with the glimpse's own bounds: stage 1 takes at most half the
    budget (one token when the budget is 1), and stage 2's picks reach both ends of the video."""
    return prune_visual(attention, None, budget, mass, max_top=max(1, budget // 2), spread=ends_included)
