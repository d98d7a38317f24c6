"""Proposers: where draft tokens come from. Every proposer goes through the one acceptance
path (accept.py); the engine sees only this interface:

    feature_layers / bridge_layer   which target states the proposer needs from the target
    begin(context) -> state         per request, from what prefill produced
    propose(state, k, ...) -> Proposal
    commit(state, tokens, features) the tokens the step emitted, with the target's features
                                    at the positions before each of them

Proposers keep no per-request state on themselves, so one serves many requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams, SpecConfig
from ..models.draft import DraftKV, SparrowDraft
from .glimpse import select_glimpse, text_to_visual_attention
from .prune import prune_budget, prune_visual
from .sampling import draw_token

# A window no sequence reaches: with it nothing slides out of view and nothing is evicted, so
# `window_mask` is plain causal attention ("all" / "pruned" draft contexts).
FULL_WINDOW = 1 << 40


@dataclass(slots=True)
class Proposal:
    tokens: torch.Tensor                # (k,) long
    probs: torch.Tensor | None          # (k, V) draft distributions, None for a deterministic draft


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
        vpos, vfeats = vpos[keep.to(vpos.device)], prefill.visual_features[keep.to(feats.device)]
        num_visual = vpos.shape[0]
        order = torch.argsort(torch.cat([prefill.text_positions, vpos]).cpu())
        ids = torch.cat([ids, torch.full((num_visual,), prefill.video_token_id, dtype=ids.dtype)])[order]
        feats = torch.cat([feats, vfeats])[order.to(feats.device)]
    ids = torch.cat([ids, torch.tensor([first_token])])
    feats = torch.cat([feats, prefill.last_feature[None]])
    g = prefill.bridge_visual[:0] if prefill.bridge_visual is not None else feats.new_zeros(0, 0)
    if glimpse > 0 and prefill.bridge_visual is not None:
        att = text_to_visual_attention(prefill.bridge_text, prefill.bridge_visual)
        g = prefill.bridge_visual[select_glimpse(att, glimpse)]
    return DraftContext(ids.to(feats.device), feats, ids.shape[0] - 1, g, num_visual)


@dataclass(slots=True)
class SparrowState:
    kv: DraftKV
    next_pos: int                # draft position of the next entry
    committed: int               # entries in kv that hold target-verified inputs
    last_hidden: torch.Tensor    # (H,) draft output at the last committed entry


class SparrowProposer:
    """Chain drafting with the Sparrow draft. With the "text" draft context (Sparrow) it runs
    text-anchored window attention; with "all" / "pruned" (the EAGLE-style baselines) the
    same draft attends causally to every entry, visual ones included, and keeps them all."""

    def __init__(self, draft: SparrowDraft, spec: SpecConfig):
        self.draft = draft
        self.spec = spec
        self.feature_layers = draft.config.feature_layers
        needs_bridge = spec.glimpse > 0 or spec.draft_context == "pruned"
        self.bridge_layer = draft.config.bridge_layer if needs_bridge else None
        self.visual_features = spec.draft_context != "text"     # prefill must return them
        self.window = draft_attention(spec.draft_context, spec.window, spec.anchors, 0)[0]

    @torch.inference_mode()
    def begin(self, ctx: DraftContext) -> SparrowState:
        """Process glimpse + anchors + window of the context. Entries that are neither an
        anchor nor in the final window are never visible to a later query: skipped."""
        spec, draft, n = self.spec, self.draft, ctx.token_ids.shape[0]
        window, anchors = draft_attention(spec.draft_context, spec.window, spec.anchors, ctx.num_prompt)
        device = ctx.features.device
        kv = DraftKV.empty(device)
        if ctx.glimpse.shape[0] > 0:
            g = ctx.glimpse.shape[0]
            draft.forward_entries(draft.inputs_from_glimpse(ctx.glimpse), torch.full((g,), -1, device=device),
                                  torch.ones(g, dtype=torch.bool, device=device), kv, window)
        pos = torch.arange(n, device=device)
        anchor = (pos >= ctx.num_prompt - anchors) & (pos < ctx.num_prompt)
        keep = anchor | (pos > n - 1 - window)
        z = draft.inputs_from_target(ctx.token_ids[keep], ctx.features[keep])
        hidden = draft.forward_entries(z, pos[keep], anchor[keep], kv, window)
        kv.evict(n, window)
        return SparrowState(kv, n, len(kv), hidden[-1])

    @torch.inference_mode()
    def propose(self, state: SparrowState, k: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        draft = self.draft
        hidden = state.last_hidden
        tokens, probs = [], []
        for j in range(k):
            tok, q = draw_token(draft.logits(hidden), sampling, generator)
            if q is not None:
                probs.append(q)
            tokens.append(tok)
            if j + 1 < k:   # feed the drafted token forward (speculative entry, dropped at commit)
                z = draft.inputs_from_draft(torch.tensor([tok], device=hidden.device), hidden[None])
                pos = torch.tensor([state.next_pos + j], device=hidden.device)
                hidden = draft.forward_entries(z, pos, torch.zeros(1, dtype=torch.bool, device=hidden.device),
                                               state.kv, self.window)[0]
        return Proposal(torch.tensor(tokens, dtype=torch.long),
                        torch.stack(probs) if probs else None)

    @torch.inference_mode()
    def commit(self, state: SparrowState, tokens: list[int], features: torch.Tensor) -> None:
        """tokens: (m,) emitted this step; features: (m, F*H) target features before each."""
        draft = self.draft
        state.kv.truncate(state.committed)
        m = len(tokens)
        ids = torch.tensor(tokens, device=features.device)
        pos = torch.arange(state.next_pos, state.next_pos + m, device=features.device)
        hidden = draft.forward_entries(draft.inputs_from_target(ids, features), pos,
                                       torch.zeros(m, dtype=torch.bool, device=features.device),
                                       state.kv, self.window)
        state.next_pos += m
        state.kv.evict(state.next_pos, self.window)
        state.committed = len(state.kv)
        state.last_hidden = hidden[-1]
