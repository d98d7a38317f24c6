"""Text-anchored window attention: which keys a draft query may see, and the backends that
compute it.

Keys are tagged with a position (the draft's text-only index) and a `pinned` flag. A query
at position q sees
    pinned keys with pos <= q       (glimpse states, pos -1, and the prompt's anchor tokens)
    unpinned keys with q - window < pos <= q   (the sliding window over recent tokens)
so the number of keys it attends to is at most glimpse + anchors + window, however many
visual tokens the video had. Training and inference both build their masks with
`window_mask`, so what the draft learns is what it runs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_pinned: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean mask (nq, nk): True where query i may attend to key j.

    q_pos: (nq,) query positions; k_pos: (nk,) key positions; k_pinned: (nk,) bool.
    """
    q = q_pos.view(-1, 1)
    k = k_pos.view(1, -1)
    causal = k <= q
    in_window = k > q - window
    return causal & (in_window | k_pinned.view(1, -1))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # q: (B, H, nq, D); k, v: (B, Hkv, nk, D); mask: (nq, nk) bool
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference: softmax(q k^T / sqrt(d) + mask) v."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ATTENTION_BACKENDS: dict[str, AttentionFn] = {"sdpa": _sdpa, "eager": _eager}


def register_backend(name: str, fn: AttentionFn) -> None:
    """Kernels (sparrow.kernels) register themselves here; the draft looks them up by name."""
    ATTENTION_BACKENDS[name] = fn


def get_backend(name: str) -> AttentionFn:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(ATTENTION_BACKENDS)}") from None
