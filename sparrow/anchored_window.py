"""Text-anchored window attention's rule: which keys a draft query may see.

Keys are tagged with a position (the draft's text-only index) and a `pinned` flag. A query
at position q sees
    pinned keys with pos <= q       (glimpse states, pos -1, and the prompt's anchor tokens)
    unpinned keys with q - window < pos <= q   (the sliding window over recent tokens)
so the number of keys it attends to is at most glimpse + anchors + window, however many
visual tokens the video had. Training and inference both build their masks with
`window_mask`, so what the draft learns is what it runs.

A leaf module (torch only): the draft (sparrow.models), the training unroll and the kernels
(sparrow.kernels, which the core loads by name) all read the rule from here, so no kernel
imports the core that loads it.
"""

from __future__ import annotations

import torch

# A key position no query reaches (the rule is causal): free or padding key slots carry it,
# so ragged key sets batch without a length tensor.
PAD_POS = 2 ** 62


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_pinned: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean mask (..., nq, nk): True where query i may attend to key j.

    q_pos: (..., nq) query positions; k_pos: (..., nk) key positions; k_pinned: (..., nk) bool.
    Leading dimensions broadcast: one request is (nq,) against (nk,), a batch of requests each
    over its own keys (B, nq) against (B, nk).
    """
    q = q_pos.unsqueeze(-1)
    k = k_pos.unsqueeze(-2)
    causal = k <= q
    in_window = k > q - window
    return causal & (in_window | k_pinned.unsqueeze(-2))
