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
from .sampling import logits_to_probs


@dataclass(slots=True)
class Proposal:
    tokens: torch.Tensor                # (k,) long
    probs: torch.Tensor | None          # (k, V) draft distributions, None for a deterministic draft


@dataclass(slots=True)
class DraftContext:
    """What a draft needs to start on a request, independent of the video's length.

    Entry t pairs a text token x_t with the target features at position t-1. The last entry
    is the first generated token. This is what the state cache stores for a request.
    """

    token_ids: torch.Tensor      # (n,) long
    features: torch.Tensor       # (n, F*H)
    num_prompt: int              # the first num_prompt entries are the prompt's text
    glimpse: torch.Tensor        # (G, H) bridge-layer visual states, G may be 0

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"token_ids": self.token_ids, "features": self.features, "glimpse": self.glimpse,
                "num_prompt": torch.tensor([self.num_prompt])}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "DraftContext":
        return cls(t["token_ids"], t["features"], int(t["num_prompt"][0]), t["glimpse"])


def build_context(prefill, first_token: int, glimpse: int) -> DraftContext:
    """Draft context from a PrefillOutput: text entries + the first generated token."""
    ids = torch.cat([prefill.text_token_ids.cpu(), torch.tensor([first_token])])
    feats = torch.cat([prefill.text_features, prefill.last_feature[None]])
    g = prefill.bridge_visual[:0] if prefill.bridge_visual is not None else feats.new_zeros(0, 0)
    if glimpse > 0 and prefill.bridge_visual is not None:
        att = text_to_visual_attention(prefill.bridge_text, prefill.bridge_visual)
        g = prefill.bridge_visual[select_glimpse(att, glimpse)]
    return DraftContext(ids.to(feats.device), feats, ids.shape[0] - 1, g)


@dataclass(slots=True)
class SparrowState:
    kv: DraftKV
    next_pos: int                # draft position of the next entry
    committed: int               # entries in kv that hold target-verified inputs
    last_hidden: torch.Tensor    # (H,) draft output at the last committed entry


class SparrowProposer:
    """Chain drafting with the Sparrow draft and text-anchored window attention."""

    def __init__(self, draft: SparrowDraft, spec: SpecConfig):
        self.draft = draft
        self.spec = spec
        self.feature_layers = draft.config.feature_layers
        self.bridge_layer = draft.config.bridge_layer if spec.glimpse > 0 else None

    @torch.inference_mode()
    def begin(self, ctx: DraftContext) -> SparrowState:
        """Process glimpse + anchors + window of the context. Entries that are neither an
        anchor nor in the final window are never visible to a later query: skipped."""
        spec, draft, n = self.spec, self.draft, ctx.token_ids.shape[0]
        device = ctx.features.device
        kv = DraftKV.empty(device)
        if ctx.glimpse.shape[0] > 0:
            g = ctx.glimpse.shape[0]
            draft.forward_entries(draft.inputs_from_glimpse(ctx.glimpse), torch.full((g,), -1, device=device),
                                  torch.ones(g, dtype=torch.bool, device=device), kv, spec.window)
        pos = torch.arange(n, device=device)
        anchor = (pos >= ctx.num_prompt - spec.anchors) & (pos < ctx.num_prompt)
        keep = anchor | (pos > n - 1 - spec.window)
        z = draft.inputs_from_target(ctx.token_ids[keep], ctx.features[keep])
        hidden = draft.forward_entries(z, pos[keep], anchor[keep], kv, spec.window)
        kv.evict(n, spec.window)
        return SparrowState(kv, n, len(kv), hidden[-1])

    @torch.inference_mode()
    def propose(self, state: SparrowState, k: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        draft, spec = self.draft, self.spec
        hidden = state.last_hidden
        tokens, probs = [], []
        for j in range(k):
            logits = draft.logits(hidden)                                   # (V,)
            if sampling.greedy:
                tok = int(logits.argmax())
            else:
                q = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
                tok = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
            tokens.append(tok)
            if j + 1 < k:   # feed the drafted token forward (speculative entry, dropped at commit)
                z = draft.inputs_from_draft(torch.tensor([tok], device=hidden.device), hidden[None])
                pos = torch.tensor([state.next_pos + j], device=hidden.device)
                hidden = draft.forward_entries(z, pos, torch.zeros(1, dtype=torch.bool, device=hidden.device),
                                               state.kv, spec.window)[0]
        return Proposal(torch.tensor(tokens, dtype=torch.long),
                        torch.stack(probs) if probs else None)

    @torch.inference_mode()
    def commit(self, state: SparrowState, tokens: list[int], features: torch.Tensor) -> None:
        """tokens: (m,) emitted this step; features: (m, F*H) target features before each."""
        draft, spec = self.draft, self.spec
        state.kv.truncate(state.committed)
        m = len(tokens)
        ids = torch.tensor(tokens, device=features.device)
        pos = torch.arange(state.next_pos, state.next_pos + m, device=features.device)
        hidden = draft.forward_entries(draft.inputs_from_target(ids, features), pos,
                                       torch.zeros(m, dtype=torch.bool, device=features.device),
                                       state.kv, spec.window)
        state.next_pos += m
        state.kv.evict(state.next_pos, spec.window)
        state.committed = len(state.kv)
        state.last_hidden = hidden[-1]
