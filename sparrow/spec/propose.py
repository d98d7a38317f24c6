"""The Sparrow proposer (and the EAGLE-style baselines, the same draft over a context with
visual entries): the draft context a request starts from, and batched chain drafting.

It follows the Proposer contract (proposer.py); the engine sees nothing else. Proposers keep
no per-request state on themselves, so one serves many requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams, SpecConfig
from ..errors import InvalidRequest
from ..models.draft import DraftKV, DraftSegment, SparrowDraft
from ..models.target import FeatureNeeds
from .glimpse import select_glimpse, text_to_visual_attention
from .proposer import BeginInput, DraftRequest, Proposal, StepResult, register_proposer
from .prune import prune_budget, prune_visual
from .sampling import draw_token

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
        att = text_to_visual_attention(prefill.bridge_text, prefill.bridge_visual)
        g = prefill.bridge_visual[select_glimpse(att, glimpse)]
    return DraftContext(ids.to(feats.device), feats, ids.shape[0] - 1, g, num_visual)


@dataclass(slots=True)
class SparrowState:
    kv: DraftKV
    next_pos: int                # draft position of the next entry
    committed: int               # entries in kv that hold target-verified inputs
    last_hidden: torch.Tensor    # (H,) draft output at the last committed entry


# Room the draft cache keeps beyond its visible entries: one step's drafts and commits.
_STEP_ROOM = 2 * 33


class SparrowProposer:
    """Chain drafting with the Sparrow draft. With the "text" draft context (Sparrow) it runs
    text-anchored window attention; with "all" / "pruned" (the EAGLE-style baselines) the
    same draft attends causally to every entry, visual ones included, and keeps them all.
    Every draft forward is batched over the requests of a step."""

    def __init__(self, draft: SparrowDraft, spec: SpecConfig):
        self.draft = draft
        self.spec = spec
        needs_bridge = spec.glimpse > 0 or spec.draft_context == "pruned"
        self.needs = FeatureNeeds(tuple(draft.config.feature_layers),
                                  draft.config.bridge_layer if needs_bridge else None,
                                  spec.draft_context != "text")
        self.window = draft_attention(spec.draft_context, spec.window, spec.anchors, 0)[0]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.needs.feature_layers

    def begin(self, start: BeginInput) -> SparrowState:
        spec = self.spec
        ctx = build_context(start.prefill, start.first_token, spec.glimpse, spec.draft_context, spec.prune_keep)
        return self.begin_context(ctx, start.max_new_tokens)

    @torch.inference_mode()
    def begin_context(self, ctx: DraftContext, max_new_tokens: int = 0) -> SparrowState:
        """Process glimpse + anchors + window of the context. Entries that are neither an
        anchor nor in the final window are never visible to a later query: skipped."""
        spec, draft, n = self.spec, self.draft, ctx.token_ids.shape[0]
        window, anchors = draft_attention(spec.draft_context, spec.window, spec.anchors, ctx.num_prompt)
        device = ctx.features.device
        pos = torch.arange(n, device=device)
        anchor = (pos >= ctx.num_prompt - anchors) & (pos < ctx.num_prompt)
        keep = anchor | (pos > n - 1 - window)
        g = ctx.glimpse.shape[0]
        visible = g + int(keep.sum())
        # A sliding window keeps its cache bounded; full attention keeps every entry it is given.
        grows = max_new_tokens if spec.draft_context != "text" else min(max_new_tokens, spec.window)
        kv = draft.new_kv(visible + grows + _STEP_ROOM)
        if g > 0:
            draft.forward_entries(draft.inputs_from_glimpse(ctx.glimpse), torch.full((g,), -1, device=device),
                                  torch.ones(g, dtype=torch.bool, device=device), kv, window)
        z = draft.inputs_from_target(ctx.token_ids[keep], ctx.features[keep])
        hidden = draft.forward_entries(z, pos[keep], anchor[keep], kv, window)
        kv.evict(n, window, _STEP_ROOM)
        return SparrowState(kv, n, len(kv), hidden[-1])

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        """k_i draft tokens for every request i: step j drafts one token for each request with
        k_i > j, then feeds those still drafting forward in one packed draft pass."""
        draft = self.draft
        hidden = [r.state.last_hidden for r in batch]
        tokens: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        for j in range(max((r.k for r in batch), default=0)):
            live = [i for i, r in enumerate(batch) if r.k > j]
            logits = draft.logits(torch.stack([hidden[i] for i in live]))             # (b, V)
            for row, i in enumerate(live):      # each request draws with its own generator, in order
                tok, q = draw_token(logits[row], batch[i].sampling, batch[i].generator)
                tokens[i].append(tok)
                if q is not None:
                    probs[i].append(q)
            feed = [i for i in live if j + 1 < batch[i].k]     # the last draft token is never fed
            if not feed:
                continue
            device = hidden[feed[0]].device
            ids = torch.tensor([tokens[i][-1] for i in feed], device=device)
            z = draft.inputs_from_draft(ids, torch.stack([hidden[i] for i in feed]))
            pos = torch.tensor([batch[i].state.next_pos + j for i in feed], device=device)
            segments = [DraftSegment(batch[i].state.kv, row, row + 1, self.window) for row, i in enumerate(feed)]
            out = draft.forward_packed(z, pos, torch.zeros(len(feed), dtype=torch.bool, device=device), segments)
            for row, i in enumerate(feed):
                hidden[i] = out[row]
        return [Proposal(torch.tensor(t, dtype=torch.long), torch.stack(p) if p else None)
                for t, p in zip(tokens, probs)]

    @torch.inference_mode()
    def commit(self, states: list[SparrowState], results: list[StepResult]) -> None:
        """Drop the speculative entries; run every request's emitted tokens, paired with the
        target's features before each, through the draft in one packed pass."""
        if not states:
            return
        draft = self.draft
        segments, ids, feats, pos, row = [], [], [], [], 0
        for state, res in zip(states, results):
            state.kv.truncate(state.committed)
            m = len(res.tokens)
            segments.append(DraftSegment(state.kv, row, row + m, self.window))
            ids.extend(res.tokens)
            feats.append(res.features[:m])
            pos.append(torch.arange(state.next_pos, state.next_pos + m))
            row += m
        device = feats[0].device
        hidden = draft.forward_packed(draft.inputs_from_target(torch.tensor(ids, device=device), torch.cat(feats)),
                                      torch.cat(pos).to(device), torch.zeros(row, dtype=torch.bool, device=device),
                                      segments)
        for state, seg in zip(states, segments):
            state.next_pos += seg.end - seg.start
            state.kv.evict(state.next_pos, self.window, _STEP_ROOM)
            state.committed = len(state.kv)
            state.last_hidden = hidden[seg.end - 1]

    def end(self, state: SparrowState) -> None:
        """Nothing to release beyond the state itself (its buffers go with it)."""

    # One request at a time (benchmarks, tests, a draft replica's single session).
    def propose_one(self, state: SparrowState, k: int, sampling: SamplingParams,
                    generator: torch.Generator) -> Proposal:
        return self.propose([DraftRequest(state, k, sampling, generator)])[0]

    def commit_one(self, state: SparrowState, tokens: list[int], features: torch.Tensor) -> None:
        self.commit([state], [StepResult(None, list(tokens), features)])


def _sparrow(target, draft, spec: SpecConfig) -> SparrowProposer:
    if not isinstance(draft, SparrowDraft):
        raise InvalidRequest(f"method {spec.method!r} needs a Sparrow draft, got {type(draft).__name__}")
    if not draft.bound:
        draft.bind(target)
    return SparrowProposer(draft, spec)


register_proposer("sparrow", _sparrow)
register_proposer("eagle-style", _sparrow)     # the same draft over a context with visual entries
