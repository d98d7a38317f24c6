"""Visual-token pruning: which visual tokens a pruning draft keeps (SpecVLM's two-stage rule).

The one implementation of the rule: the "pruned" draft context (SpecConfig.draft_context),
SpecVLM-style proposers and, with its own bounds, the glimpse (glimpse.select_glimpse) all
call `prune_visual`. Given how much attention each visual token receives from the prompt's
text (e.g. `sparrow.speculative.glimpse.text_to_visual_attention` on the target's bridge-layer
states) and a budget `keep`:

    stage 1 (verifier-guided)  the highest-attention tokens, in descending order, until their
                               cumulative attention reaches `mass` of the total (never more
                               than `keep`, or `max_top` when given);
    stage 2 (uniform)          the rest of the budget spread evenly over the tokens stage 1 did
                               not take, strided in token order. Visual tokens are laid out in
                               (t, h, w) order, so even strides cover every frame and every part
                               of a frame: no region of the video is left without a token.

The result depends only on its inputs (ties in attention go to the earlier token), so the
training signal and inference prune the same tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


def prune_budget(num_visual: int, ratio: float) -> int:
    """How many of `num_visual` tokens a keep ratio in [0, 1] keeps: ceil(ratio * Nv), so any
    positive ratio keeps at least one token of a non-empty video."""
    if num_visual <= 0 or ratio <= 0:
        return 0
    return min(num_visual, math.ceil(ratio * num_visual - 1e-9))


def centred_strides(n_remaining: int, n_pick: int, device: torch.device) -> torch.Tensor:
    """n_pick indices into n_remaining tokens, one at the centre of each of n_pick equal strides."""
    return ((torch.arange(n_pick, device=device, dtype=torch.float64) + 0.5)
            * (n_remaining / max(n_pick, 1))).floor().long()


def prune_visual(attention: torch.Tensor, grid_thw: Sequence[int] | torch.Tensor | None, keep: int,
                 mass: float = 0.5, max_top: int | None = None,
                 spread: Callable[[int, int, torch.device], torch.Tensor] = centred_strides) -> torch.Tensor:
    """Indices of the visual tokens to keep, sorted ascending (LongTensor on attention's device).

    attention: (Nv,) attention mass each visual token receives (any non-negative scores).
    grid_thw: the token grid (t, h, w) of those Nv tokens (after any patch merging), checked
        to hold exactly Nv tokens; None when unknown. The uniform stage strides in token
        order, which is (t, h, w) order.
    keep: the budget; keep >= Nv keeps every token, keep <= 0 none.
    mass: stage 1 takes top-attention tokens until they hold this share of the total
        attention (0 skips stage 1, 1 fills the budget by attention alone).
    max_top: the most tokens stage 1 may take (default: all of `keep`).
    spread: where stage 2's picks fall among the remaining tokens, (n_remaining, n_pick,
        device) -> indices (n_pick,); default one at the centre of each equal stride.
    """
    if attention.dim() != 1:
        raise ValueError(f"attention must be 1-D (Nv,), got shape {tuple(attention.shape)}")
    n, device = attention.shape[0], attention.device
    if grid_thw is not None:
        dims = [int(d) for d in (grid_thw.reshape(-1).tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)]
        if len(dims) != 3 or math.prod(dims) != n:
            raise ValueError(f"grid_thw {tuple(dims)} does not describe {n} visual tokens")
    if keep <= 0 or n == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    if keep >= n:
        return torch.arange(n, device=device)
    # stage 1: top attention until `mass` of the total is covered (at most `keep`)
    att = attention.float()
    order = torch.argsort(att, descending=True, stable=True)
    n_top = 0
    if mass > 0:
        cum = att[order].cumsum(0) / att.sum().clamp(min=1e-12)
        n_top = min(keep if max_top is None else max_top, int((cum < mass).sum()) + 1)
    top = order[:n_top]
    # stage 2: even strides over the remaining tokens, in token (t, h, w) order
    rest = torch.ones(n, dtype=torch.bool, device=device)
    rest[top] = False
    remaining = torch.nonzero(rest).view(-1)
    pick = spread(remaining.shape[0], keep - n_top, device)
    return torch.sort(torch.cat([top, remaining[pick]])).values
