"""The target's attention for multi-token steps: grouped-query attention without copying K/V.

A verify step scores k + 1 tokens on top of the cache, with a causal mask over the new ones.
transformers' `sdpa` attention handles grouped-query models (fewer key/value heads than query
heads) without copies only for one query token or no mask; for a masked multi-token step it
repeats every cached key and value once per query group (`repeat_kv`). At 25k cached tokens
that copy is most of a verify step on a CPU: it made verifying 5 tokens cost 2.6x a decode
step (BENCHMARKS.md).

Here the query heads that share a key/value head are stacked along the query axis instead
(`(B, Hq, n, D) -> (B, Hkv, G*n, D)`, the mask repeated to match), so one attention call per
key/value head reads the cache once. Same softmax, same keys; only the batching of queries
differs. Everything else (one query token, no mask, no groups, the vision tower) goes to
transformers' own `sdpa` unchanged.

Registered in transformers' public `AttentionInterface` (with `sdpa`'s masks) as "sparrow_sdpa";
`TargetModel` switches a model loaded with "sdpa" to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .ragged import RaggedBatch, RaggedStep, ragged_attend

NAME = "sparrow_sdpa"


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    if isinstance(attention_mask, RaggedBatch):       # several requests in one forward (ragged.py)
        return attention_mask.attend(module.layer_idx, query, scaling), None
    if isinstance(attention_mask, RaggedStep):        # the same, inside a compiled step (ragged.py)
        return ragged_attend(query, key, value, module.layer_idx, scaling), None
    groups = getattr(module, "num_key_value_groups", 1)
    n = query.shape[2]
    packable = (groups > 1 and n > 1 and attention_mask is not None and attention_mask.dim() == 4
                and attention_mask.shape[1] == 1 and dropout == 0.0 and kwargs.get("position_bias") is None
                and kwargs.get("softcap") is None and kwargs.get("cache") is None
                and key.shape[1] * groups == query.shape[1])
    if not packable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, hq, _, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    # Query head h uses key/value head h // groups (repeat_kv's order), so heads of one group are adjacent.
    q = query.reshape(b, hkv, groups * n, d)
    mask = attention_mask[:, :, :, :length]
    mask = mask.unsqueeze(2).expand(mask.shape[0], 1, groups, n, length).reshape(mask.shape[0], 1, groups * n, length)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)   # (B, Hkv, G*n, Dv)
    out = out.reshape(b, hq, n, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)     # the masks `sdpa` gets (None where is_causal suffices)
