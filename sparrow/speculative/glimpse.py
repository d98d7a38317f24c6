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


def visual_mass(text_states: torch.Tensor, visual_states: torch.Tensor) -> torch.Tensor:
    """(nt, H), (Nv, H) -> (Nv,) attention mass each visual token receives, summed over text."""
    scores = text_states.float() @ visual_states.float().T / text_states.shape[-1] ** 0.5   # (nt, Nv)
    return torch.softmax(scores, dim=-1).sum(0)


def text_to_visual_attention(text_states: torch.Tensor, visual_states: torch.Tensor) -> torch.Tensor:
    """(nt, H), (Nv, H) -> (Nv,) attention mass each visual token receives, averaged over text."""
    return visual_mass(text_states, visual_states) / text_states.shape[0]


def prompt_attention(prefill) -> torch.Tensor:
    """text_to_visual_attention of a PrefillOutput's bridge-layer states, its text rows in two
    parts: those before the video's end (the system prompt's, the same for every question about
    the video) and the question's. A prompt that started from a cached video prefix takes the first
    part from the prefix, made there by the video's first such question (VideoPrefix.glimpse_mass):
    at 25k visual tokens the glimpse scores ~9 question rows, not ~20 (4.5 -> ~2 ms a request on
    the 2-core EPYC). Every prompt splits at the same place, cached or not, so both give the same
    mass; against one sum over all rows it differs by rounding only."""
    text, visual, m = prefill.bridge_text, prefill.bridge_visual, prefill.video_text_rows
    prefix = prefill.prefix
    if prefix is not None and prefix.bridge_text is not None and prefix.bridge_text.shape[0] == m:
        if prefix.glimpse_mass is None:
            prefix.glimpse_mass = visual_mass(prefix.bridge_text, prefix.bridge_visual)
        head = prefix.glimpse_mass
    else:
        head = visual_mass(text[:m], visual)
    return (head + visual_mass(text[m:], visual)) / text.shape[0]


def ends_included(n_remaining: int, n_pick: int, device: torch.device) -> torch.Tensor:
    """n_pick indices evenly spaced over n_remaining tokens, the first and the last included."""
    return torch.linspace(0, n_remaining - 1, n_pick, device=device).round().long()


def select_glimpse(attention: torch.Tensor, budget: int, mass: float = 0.5) -> torch.Tensor:
    """Indices (sorted, <= budget) of visual tokens to keep, from their attention (Nv,).

    Pruning's two-stage rule with the glimpse's own bounds: stage 1 takes at most half the
    budget (one token when the budget is 1), and stage 2's picks reach both ends of the video."""
    return prune_visual(attention, None, budget, mass, max_top=max(1, budget // 2), spread=ends_included)
