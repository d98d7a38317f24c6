"""The draft context a Sparrow request starts from: the prompt's text entries in order, the
visual entries its context kind keeps (none, a glimpse, pruned or all), and how far its draft
attends (the window and the anchors). The proposer (sparrow_proposer.py) begins from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.models.draft import SparrowDraft
from sparrow.speculative.glimpse import prompt_attention, select_glimpse, text_to_visual_attention
from sparrow.speculative.prune import prune_budget, prune_visual

# A window no sequence reaches: with it nothing slides out of view and nothing is evicted, so
# `window_mask` is plain causal attention ("all" / "pruned" draft contexts).
FULL_WINDOW = 1 << 40

@dataclass(slots=True)
class DraftContext:
    """What a draft needs to start on a request.

    Entry t pairs a prompt token x_t with the target features at position t-1, in prompt
    order; the last entry is the first generated token. With the "text" draft context the
    entries are the prompt's text tokens only (independent of the video's length); with
    "all" / "pruned" they include (some of) the visual tokens, whose token id is the video
    pad id. This is what the state cache stores for a request.
    """

    token_ids: torch.Tensor      # (n,) long
    features: torch.Tensor       # (n, F*H)
    num_prompt: int              # the first num_prompt entries are the prompt's
    glimpse: torch.Tensor        # (G, H) bridge-layer visual states, G may be 0
    num_visual: int = 0          # how many of the prompt entries are visual tokens

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"token_ids": self.token_ids, "features": self.features, "glimpse": self.glimpse,
                "num_prompt": torch.tensor([self.num_prompt]), "num_visual": torch.tensor([self.num_visual])}

    @classmethod
    def synthetic(cls, draft: SparrowDraft, entries: int, glimpse: int, generator: torch.Generator) -> "DraftContext":
        """Random ids, features and glimpse states of a prompt of `entries` text entries (+ the
        first generated token), on the draft's device and dtype: for compiling and timing steps."""
        cfg, p = draft.config, draft.fuse.weight
        ids = torch.randint(0, cfg.vocab_size, (entries + 1,), generator=generator)
        feats = torch.randn(entries + 1, p.shape[1], generator=generator)
        states = torch.randn(glimpse, cfg.hidden_size, generator=generator)
        return cls(ids.to(p.device), feats.to(p.device, p.dtype), entries, states.to(p.device, p.dtype))

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "DraftContext":
        num_visual = int(t["num_visual"][0]) if "num_visual" in t else 0
        return cls(t["token_ids"], t["features"], int(t["num_prompt"][0]), t["glimpse"], num_visual)


def visual_entries(context: str, prune_keep: float, num_visual: int, bridge_text: torch.Tensor | None,
                   bridge_visual: torch.Tensor | None) -> torch.Tensor:
    """Which of the prompt's visual tokens (t >= 1, in order; `num_visual` of them) are draft
    context entries: indices, sorted. "text": none; "all": every one; "pruned": the
    `prune_budget(num_visual, prune_keep)` that `prune_visual` keeps by the bridge layer's
    text->visual attention (the glimpse's proxy). Inference (build_context) and training
    (sparrow.training.signals) both call this, so they choose the same tokens."""
    if context == "text" or num_visual == 0:
        return torch.empty(0, dtype=torch.long)
    if context == "all":
        return torch.arange(num_visual)
    if context != "pruned":
        raise ValueError(f"unknown draft context {context!r}")
    if bridge_text is None or bridge_visual is None:
        raise ValueError("the 'pruned' draft context needs the bridge layer's states from prefill")
    att = text_to_visual_attention(bridge_text, bridge_visual)
    att = att[att.shape[0] - num_visual:]     # a visual token at position 0 (no t-1) is no entry
    return prune_visual(att, None, prune_budget(num_visual, prune_keep)).cpu()


def in_prompt_order(text_ids: torch.Tensor, text_features: torch.Tensor, text_positions: torch.Tensor,
                    visual_positions: torch.Tensor, visual_features: torch.Tensor,
                    video_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Text entries (n,) / (n, F*H) at text_positions and visual entries (m, F*H) at
    visual_positions merged in prompt order: ids (n + m,), the visual ones the video pad id,
    and features (n + m, F*H). Inference (build_context) and training (target_signals) both
    merge with it, so their entries come in the same order."""
    order = torch.argsort(torch.cat([text_positions, visual_positions]).cpu())      # positions are distinct
    pad = torch.full((visual_positions.shape[0],), video_token_id, dtype=text_ids.dtype, device=text_ids.device)
    ids = torch.cat([text_ids, pad])[order.to(text_ids.device)]
    return ids, torch.cat([text_features, visual_features])[order.to(text_features.device)]


def draft_attention(context: str, window: int, anchors: int, num_prompt: int) -> tuple[int, int]:
    """(window, anchors) the draft runs with. "text": as configured (text-anchored window
    attention). "all" / "pruned": every prompt entry is an anchor and the window never
    slides, so every query sees every earlier entry and nothing is evicted."""
    if context == "text":
        return window, anchors
    return FULL_WINDOW, num_prompt


def build_context(prefill, first_token: int, glimpse: int, context: str = "text",
                  prune_keep: float = 0.1) -> DraftContext:
    """Draft context from a PrefillOutput: the prompt entries + the first generated token.

    context: SpecConfig.draft_context. "text" uses the text entries only; "all" and "pruned"
    interleave the visual entries (prefill must have run with visual_features=True, and for
    "pruned" with the bridge layer) in prompt order."""
    ids, feats, num_visual = prefill.text_token_ids.cpu(), prefill.text_features, 0
    if context != "text":
        if prefill.visual_features is None:
            raise ValueError(f"draft context {context!r} needs prefill(..., visual_features=True)")
        vpos = prefill.visual_positions
        keep = visual_entries(context, prune_keep, vpos.shape[0], prefill.bridge_text, prefill.bridge_visual)
        num_visual = keep.shape[0]
        ids, feats = in_prompt_order(ids, feats, prefill.text_positions, vpos[keep.to(vpos.device)],
                                     prefill.visual_features[keep.to(feats.device)], prefill.video_token_id)
    ids = torch.cat([ids, torch.tensor([first_token])])
    feats = torch.cat([feats, prefill.last_feature[None]])
    g = prefill.bridge_visual[:0] if prefill.bridge_visual is not None else feats.new_zeros(0, 0)
    if glimpse > 0 and prefill.bridge_visual is not None:
        g = prefill.bridge_visual[select_glimpse(prompt_attention(prefill), glimpse)]
    return DraftContext(ids.to(feats.device), feats, ids.shape[0] - 1, g, num_visual)
