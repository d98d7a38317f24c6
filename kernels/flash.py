"""flash-attn adapters (optional, CUDA only; contract: reference.py).

flash-attn takes no arbitrary mask: it knows "all keys" and "causal, aligned to the last
key" (plus a symmetric sliding window). That covers a chain verify step, whose draft
tokens see the whole prefix and the drafts before them, but neither a tree nor the draft's
pinned anchors + window; those go to Triton (or fall back to SDPA here).

Not run on the CPU machine (flash-attn does not install there): written against
flash-attn 2.6's documented API, to be checked on a GPU (see kernels/README.md).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_func, flash_attn_with_kvcache


def verify_attention_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           prefix_lens: torch.Tensor, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Chain verify: q (B, H, nq, D) over k_cache, v_cache (B, Hkv, capacity, D) whose rows
    prefix_lens[b] .. prefix_lens[b] + nq - 1 already hold the draft tokens. (B, H, nq, D)."""
    if tree is not None:
        raise ValueError("flash-attn cannot apply a tree mask; use the 'triton' or 'flex' verify attention")
    nq = q.shape[2]
    # flash-attn's layout is (B, seq, heads, D): transposed views of ours, D still unit-stride
    out = flash_attn_with_kvcache(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                  cache_seqlens=(prefix_lens + nq).to(torch.int32), causal=True)
    return out.transpose(1, 2)                                                     # (B, H, nq, D)


_warned = False


def masked_attention_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The registry signature. Masks flash-attn can express run there; any other (the draft's
    window with pinned anchors, usually) falls back to SDPA, with one warning per process.
    Checking the mask's pattern reads it on the host: one sync per call."""
    global _warned
    nq, nk = mask.shape
    causal = torch.ones(nq, nk, dtype=torch.bool, device=mask.device).tril(nk - nq)   # bottom-right aligned
    if bool(mask.all()) or torch.equal(mask, causal):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal=not bool(mask.all()))
        return out.transpose(1, 2)
    if not _warned:
        warnings.warn("flash_attn backend: mask is neither full nor causal; using SDPA for such calls")
        _warned = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
