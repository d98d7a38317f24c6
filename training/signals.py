"""The training signal, produced on the fly by the frozen target (or read back from a feature
store, feature_store.py, which keeps the same fields).

One teacher-forced target forward over prompt + response gives exactly what inference
hands the draft (DraftContext: token x_t paired with the target's features at t-1) plus what
the draft must learn to predict (the target's next-token distribution and final hidden
state). With the "text" draft context the entries are the text positions only, and visual
positions contribute only the bridge-layer states that form the bridging prefix; with "all" /
"pruned" the prompt's visual positions (all of them, or those `visual_entries` keeps, the
very function inference uses) are entries too, in prompt order, with the video pad id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.errors import InvalidRequest
from sparrow.models.prefill import FeatureCollector, FeatureNeeds
from sparrow.models.target import TargetModel
from sparrow.speculative.glimpse import select_glimpse, text_to_visual_attention
from sparrow.speculative.draft_context import in_prompt_order, visual_entries
from sparrow.video import ProcessedVideo


@dataclass(slots=True)
class TargetSignals:
    """Per sequence. Entries are the text tokens (t >= 1) of prompt + response, in order, plus
    the prompt's visual tokens the draft context holds ("all" / "pruned"); the first
    `num_prompt` are the prompt's, the rest the response's."""

    token_ids: torch.Tensor        # (N,) long
    features: torch.Tensor         # (N, F*H) target features at position t-1 of each entry
    num_prompt: int                # P
    logits: torch.Tensor           # (N - P, V) target next-token logits at response entries P..N-1
    final_hidden: torch.Tensor     # (N - P, H) the states the lm_head reads, same entries
    bridge_text: torch.Tensor      # (P, H) bridge-layer states at the prompt's text positions
    bridge_visual: torch.Tensor    # (Nv, H) bridge-layer states at the visual positions
    num_visual: int = 0            # how many of the prompt entries are visual tokens
    # From a feature store: the bridging prefix already chosen per budget (the visual states
    # themselves are not kept), so `prefix` looks it up instead of choosing.
    glimpses: dict[int, torch.Tensor] | None = None

    @property
    def num_entries(self) -> int:
        return self.token_ids.shape[0]

    def prefix(self, budget: int) -> torch.Tensor:
        """(G, H) bridge visual states for the bridging prefix, chosen by the inference
        glimpse rule (so bridging with budget G is training with a glimpse of G)."""
        if budget <= 0 or self.bridge_visual.shape[0] == 0:
            return self.bridge_visual[:0]
        if self.glimpses is not None:
            if budget not in self.glimpses:
                raise InvalidRequest(f"bridging budget {budget} was not stored (stored: {sorted(self.glimpses)})")
            return self.glimpses[budget]
        att = text_to_visual_attention(self.bridge_text, self.bridge_visual)
        return self.bridge_visual[select_glimpse(att, budget).to(self.bridge_visual.device)]


def sequence_inputs(target: TargetModel, video: ProcessedVideo, prompt: str,
                    response: list[int]) -> dict[str, torch.Tensor]:
    """The HF kwargs of prompt + response: the prompt as inference builds it, response appended."""
    inputs = target.build_inputs(video, prompt)
    ids = torch.cat([inputs["input_ids"], torch.tensor([response], device=target.device)], dim=1)
    inputs = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs.update(target.family.extra_inputs(ids, target.video_token_id))   # e.g. Qwen's token types
    return inputs


@torch.no_grad()
def target_signals(target: TargetModel, video: ProcessedVideo, prompt: str, response: list[int],
                   feature_layers: tuple[int, ...], bridge_layer: int, context: str = "text",
                   prune_keep: float = 0.1) -> TargetSignals:
    """One teacher-forced forward of the frozen target over prompt + response.
    context / prune_keep: the draft context (SpecConfig.draft_context / prune_keep)."""
    prompt_len = len(target.prompt_ids(prompt, video.num_visual_tokens))
    inputs = sequence_inputs(target, video, prompt, response)
    position_ids, _ = target.family.prefill_positions(target.hf, inputs)
    out = target.hf(**inputs, position_ids=position_ids, output_hidden_states=True, use_cache=False)
    # The rows prefill gathers (FeatureCollector), here over prompt + response in one chunk.
    # Visual rows are gathered for every context: their positions place the text entries too.
    ids = inputs["input_ids"][0]
    rows = FeatureCollector(ids, target.video_token_id, FeatureNeeds(tuple(feature_layers), bridge_layer, True))
    rows.add(out.hidden_states, 0)
    seq = rows.output(state=None, logits=None)     # a teacher-forced forward: no KV cache, no next token
    num_text = int((seq.text_positions < prompt_len).sum())        # the prompt's text entries come first
    bridge_text = seq.bridge_text[:num_text]
    keep = visual_entries(context, prune_keep, seq.visual_positions.shape[0], bridge_text, seq.bridge_visual)
    prompt_ids, prompt_feats = in_prompt_order(
        seq.text_token_ids[:num_text], seq.text_features[:num_text], seq.text_positions[:num_text],
        seq.visual_positions[keep.to(ids.device)], seq.visual_features[keep.to(ids.device)], target.video_token_id)
    final = out.hidden_states[-1][0, seq.text_positions[num_text:]]   # (N-P, H), already normed by HF
    return TargetSignals(
        token_ids=torch.cat([prompt_ids, seq.text_token_ids[num_text:]]),
        features=torch.cat([prompt_feats, seq.text_features[num_text:]]), num_prompt=prompt_ids.shape[0],
        logits=target.lm_head()(final).float(), final_hidden=final,
        bridge_text=bridge_text, bridge_visual=seq.bridge_visual, num_visual=keep.shape[0])
