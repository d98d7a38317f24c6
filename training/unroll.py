"""The training-time forward of the Sparrow draft: every chain of an inference step at once.

At inference (sparrow.speculative.sparrow_proposer.SparrowProposer) a chain starts at the last committed
entry s: step 0 is the draft's output there; step j >= 1 feeds entry (token x_{s+j}, the
draft's own previous output) at position s + j, which attends to what the request's DraftKV
then holds: the bridge/glimpse prefix, the committed entries <= s, and its own chain's
earlier steps - each filtered by `window_mask`. Training runs all chain starts s in parallel
(EAGLE-3's training-time test): step 0 is one forward over all entries with target features;
step j is one forward of one new entry per chain. The rule "which keys are in chain s's cache"
is `in_cache` below; the rule "which of those a query may see" is the inference function
`window_mask` itself. Tokens fed at steps >= 1 are the sequence's own (the target's greedy
tokens): a draft token that differs is rejected anyway, so only the accepted path matters.

The draft context ("text" / "all" / "pruned") changes only which entries there are (see
signals.py) and the (window, anchors) the masks are built with: `context_attention` takes them
from `sparrow.speculative.sparrow_proposer.draft_attention`, the function SparrowProposer uses, so in "all" /
"pruned" every chain sees every earlier entry, as at inference.

The draft's modules are reused as they are (fc, fuse, glimpse_proj, layers, norm, the shared
embedding and lm_head); only the order of calls differs from inference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sparrow.models.attention import get_backend
from sparrow.models.draft import SparrowDraft
from sparrow.speculative.draft_context import draft_attention
from sparrow.anchored_window import window_mask


@dataclass(slots=True)
class Unrolled:
    chains: torch.Tensor                    # (C,) chain starts s (entry indices)
    hidden: list[torch.Tensor]              # per step j: (C, H) draft output, predicts entry s + j + 1
    logits: list[torch.Tensor]              # per step j: (C, V)
    masks: list[torch.Tensor] = field(default_factory=list)      # per step: (queries, keys) bool
    key_pos: list[torch.Tensor] = field(default_factory=list)    # per step: (keys,) positions


def anchor_flags(num_entries: int, num_prompt: int, anchors: int, device=None) -> torch.Tensor:
    """(N,) bool: the last `anchors` prompt entries are pinned, as SparrowProposer.begin does."""
    pos = torch.arange(num_entries, device=device)
    return (pos >= num_prompt - anchors) & (pos < num_prompt)


def context_attention(context: str, num_entries: int, num_prompt: int, anchors: int, window: int,
                      device=None) -> tuple[torch.Tensor, int]:
    """(pinned (N,), window) for a draft context, exactly as SparrowProposer.begin runs it."""
    window, anchors = draft_attention(context, window, anchors, num_prompt)
    return anchor_flags(num_entries, num_prompt, anchors, device), window


def step0_mask(num_prefix: int, pinned: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefix + all entries, committed: every query sees what window_mask allows.
    Returns mask (G+N, G+N), positions (G+N,), pinned (G+N,)."""
    pos, pin = step0_keys(num_prefix, pinned)
    return window_mask(pos, pos, pin, window), pos, pin


def step0_keys(num_prefix: int, pinned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0's key positions (G+N,) (the prefix at -1) and pinned flags (G+N,)."""
    n, device = pinned.shape[0], pinned.device
    pos = torch.cat([torch.full((num_prefix,), -1, device=device), torch.arange(n, device=device)])
    return pos, torch.cat([torch.ones(num_prefix, dtype=torch.bool, device=device), pinned])


def chain_mask(step: int, chains: torch.Tensor, num_prefix: int, pinned: torch.Tensor,
               window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask (C, G + N + step*C) of step `step` >= 1 over keys [prefix | entries | steps 1..step]
    and the key positions. Chain c (start s) queries at s + step."""
    n, c, device = pinned.shape[0], chains.shape[0], pinned.device
    pos0, pin0 = step0_keys(num_prefix, pinned)
    spec_pos = torch.cat([chains + k for k in range(1, step + 1)])              # (step*C,)
    k_pos = torch.cat([pos0, spec_pos])
    k_pin = torch.cat([pin0, torch.zeros_like(spec_pos, dtype=torch.bool)])
    # What chain s's DraftKV holds: prefix, committed entries <= s (truncate drops later ones),
    # and its own speculative entries.
    entry_idx = torch.arange(n, device=device)
    in_cache = torch.cat([
        torch.ones(c, num_prefix, dtype=torch.bool, device=device),
        entry_idx[None, :] <= chains[:, None],
        torch.eye(c, dtype=torch.bool, device=device).repeat(1, step),
    ], dim=1)
    return window_mask(chains + step, k_pos, k_pin, window) & in_cache, k_pos


def plainly_causal(num_prefix: int, pinned: torch.Tensor, window: int) -> bool:
    """Whether step 0's mask is the plain causal one: no prefix, and every key that falls out of
    a query's window is pinned (a draft that reads every entry, context "all")."""
    n = pinned.shape[0]
    return num_prefix == 0 and (window >= n or bool(pinned[: n - window].all()))


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: None) -> torch.Tensor:
    """Step 0 over n entries with the causal mask, without building it: n x n at 25k entries is
    625M mask entries, which sent SDPA to its unfused path (minutes a sample)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def _layers(draft: SparrowDraft, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
            past: list[tuple[torch.Tensor, torch.Tensor]] | None) -> tuple[torch.Tensor, list]:
    """Run entries x (n, H) at pos (n,) through the draft layers over past keys (per layer);
    mask None: causal among x (no past)."""
    attn = _causal if mask is None else get_backend(draft.attention_backend)
    kv = []
    for i, layer in enumerate(draft.layers):
        pk, pv = past[i] if past is not None else (None, None)
        x, k, v = layer(x, pos, pk, pv, mask, attn)
        kv.append((k, v))
    return x, kv


def unroll(draft: SparrowDraft, token_ids: torch.Tensor, features: torch.Tensor, pinned: torch.Tensor,
           prefix: torch.Tensor, chains: torch.Tensor, steps: int, window: int,
           keep_masks: bool = False) -> Unrolled:
    """token_ids (N,), features (N, F*H), pinned (N,), prefix (G, H) bridge visual states,
    chains (C,) chain starts. Returns the draft's hidden states and logits for steps 0..steps-1."""
    n, g = token_ids.shape[0], prefix.shape[0]
    if plainly_causal(g, pinned, window) and not keep_masks:
        mask, pos = None, step0_keys(g, pinned)[0]
    else:
        mask, pos, _ = step0_mask(g, pinned, window)
    z = torch.cat([draft.inputs_from_glimpse(prefix), draft.inputs_from_target(token_ids, features)])
    out, past = _layers(draft, z, pos, mask, None)
    hidden = out[g:][chains]                                             # (C, H) step 0
    result = Unrolled(chains, [hidden], [draft.logits(hidden)])
    if keep_masks:
        result.masks.append(mask[g:][chains])
        result.key_pos.append(pos)
    for j in range(1, steps):
        mask, k_pos = chain_mask(j, chains, g, pinned, window)
        tokens = token_ids[(chains + j).clamp(max=n - 1)]                 # past the end: masked from the loss
        z = draft.inputs_from_draft(tokens, hidden)
        hidden, kv = _layers(draft, z, chains + j, mask, past)
        past = kv                                                        # keys now include step j
        result.hidden.append(hidden)
        result.logits.append(draft.logits(hidden))
        if keep_masks:
            result.masks.append(mask)
            result.key_pos.append(k_pos)
    return result
