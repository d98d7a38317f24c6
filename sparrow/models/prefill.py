"""A prompt into the target's KV cache, and what the draft reads from it.

    TargetState      a request's cache and where its sequence stands
    FeatureNeeds     which hidden-state rows a draft reads (the Proposer contract's `needs`)
    FeatureCollector those rows, gathered chunk by chunk (one definition for serving and training)
    PrefillJob       one request's prefill, chunk by chunk, so a scheduler can interleave it
    finish_together  the rest of several short prefills in ONE forward (ragged.py)
    VideoPrefix      a video's prefilled prefix, for later questions about it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidRequest
from .compiling import GATE
from .ragged import RaggedBatch, RaggedSegment


@dataclass(slots=True)
class TargetState:
    """One request's target-side state: its KV cache and where the sequence stands."""

    kv: object            # transformers Cache
    length: int           # tokens in the KV cache
    rope_delta: int       # position of sequence index i (after the prompt) is i + rope_delta
    time_shift: int = 0   # added to the temporal axis of those positions (a live window, live_window.py)


@dataclass(slots=True)
class PrefillOutput:
    state: TargetState
    logits: torch.Tensor              # (V,) next-token logits after the prompt
    text_token_ids: torch.Tensor      # (n,) the prompt's text tokens (t >= 1), in order
    text_features: torch.Tensor       # (n, F*H) target features at position t-1 of each text token t
    last_feature: torch.Tensor        # (F*H,) features at the prompt's last position
    bridge_text: torch.Tensor | None  # (n, H) bridge-layer states at the text positions
    bridge_visual: torch.Tensor | None  # (Nv, H) bridge-layer states at the visual positions
    # Only with prefill(visual_features=True) (drafts whose context holds visual entries):
    text_positions: torch.Tensor | None = None     # (n,) prompt positions of the text tokens above
    visual_positions: torch.Tensor | None = None   # (Nv',) prompt positions t >= 1 of the visual tokens
    visual_features: torch.Tensor | None = None    # (Nv', F*H) target features at t-1 of each of them
    video_token_id: int | None = None              # the token id at the visual positions
    # The bridge-layer text rows before the video's end (the system prompt's: the same for every
    # question about the video), and the cached video prefix the prompt started from, or the one its
    # prefill made for the cache (ModelRunner.start_decoding), if any: the glimpse scores those rows
    # against the video once per video (glimpse.prompt_attention).
    video_text_rows: int = 0
    prefix: "VideoPrefix | None" = None


@dataclass(frozen=True, slots=True)
class FeatureNeeds:
    """What a proposer reads from the target's prefill (the Proposer contract's `needs`):
    feature_layers   hidden-state indices whose rows at t-1 pair with each text token t
    bridge_layer     the layer whose states at text and visual positions guide glimpse/pruning
    visual_features  also the feature rows at t-1 of the visual tokens (drafts with visual entries)
    """

    feature_layers: tuple[int, ...] = ()
    bridge_layer: int | None = None
    visual_features: bool = False

    @property
    def hidden(self) -> bool:
        return bool(self.feature_layers) or self.bridge_layer is not None


class FeatureCollector:
    """The rows of the target's hidden states a draft reads, gathered chunk by chunk as a
    prefill runs (or in one go over a whole teacher-forced sequence, for training). One
    definition of "the target features": prefill, the video-prefix prefill and the training
    signals all take their rows from here.

    For every text token t >= 1: features at t-1 (the draft's input pairs x_t with h_{t-1}) and
    bridge-layer states at t; for the visual tokens: bridge-layer states at each, and (only
    with needs.visual_features) features at t-1 for t >= 1. `before`: the features at the
    position before ids[0], for ids that continue a sequence (pairs appended to a live window),
    so that position 0 has its t-1 row too.
    """

    def __init__(self, ids: torch.Tensor, video_token_id: int, needs: FeatureNeeds, prefix: "VideoPrefix | None" = None,
                 before: torch.Tensor | None = None):
        n = ids.shape[0]
        pos = torch.arange(n, device=ids.device)
        visual = ids == video_token_id
        first = 0 if before is not None else 1           # the first position whose t-1 row exists
        self.ids, self.video_token_id, self.needs = ids, video_token_id, needs
        self.text_pos = pos[~visual & (pos >= first)]    # (n_text,)
        self.visual_pos = pos[visual & (pos >= first)]   # visual entries (their t-1 exists)
        self.visual_all = pos[visual]                    # every visual position (bridge states)
        self.features: list[torch.Tensor] = []
        self.visual_features: list[torch.Tensor] = []
        self.bridge_text: list[torch.Tensor] = []
        self.bridge_visual: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None
        self.started_from = prefix                         # the cached video prefix, if any
        if prefix is not None:                            # rows of the prefix span, prefilled before
            if (missing := prefix.missing(needs)) is not None:
                raise ValueError(f"this video prefix was prefilled without {missing}")
            self._extend(prefix.features, prefix.visual_features, prefix.bridge_text, prefix.bridge_visual)
        if before is not None and needs.feature_layers and n:     # the t-1 row of position 0
            if not bool(visual[0]):
                self.features.append(before[None])
            elif needs.visual_features:
                self.visual_features.append(before[None])

    def _extend(self, feats, vfeats, btext, bvis) -> None:
        needs = self.needs
        if needs.feature_layers:
            self.features.append(feats)
            if needs.visual_features:
                self.visual_features.append(vfeats)
        if needs.bridge_layer is not None:
            self.bridge_text.append(btext)
            self.bridge_visual.append(bvis)

    def add(self, hidden_states: tuple[torch.Tensor, ...], start: int) -> None:
        """hidden_states: HF's tuple of (1, c, H) for positions [start, start + c)."""
        needs = self.needs
        end = start + hidden_states[0].shape[1]
        feats = vfeats = btext = bvis = None

        def rows(positions: torch.Tensor, shift: int) -> torch.Tensor:     # positions p with p - shift in the chunk
            p = positions - shift
            return p[(p >= start) & (p < end)] - start

        if needs.feature_layers:
            hs = torch.cat([hidden_states[i][0] for i in needs.feature_layers], dim=-1)    # (c, F*H)
            feats = hs[rows(self.text_pos, 1)]
            if needs.visual_features:
                vfeats = hs[rows(self.visual_pos, 1)]
            if end == self.ids.shape[0]:
                self.last = hs[-1]
        if needs.bridge_layer is not None:
            bridge = hidden_states[needs.bridge_layer][0]                                   # (c, H)
            btext, bvis = bridge[rows(self.text_pos, 0)], bridge[rows(self.visual_all, 0)]
        self._extend(feats, vfeats, btext, bvis)

    @staticmethod
    def _cat(parts: list[torch.Tensor]) -> torch.Tensor | None:
        """The parts as one tensor; one part with rows is returned as it is, not copied (a question
        after a cached video adds no visual rows: its bridge-layer visual states, 12.8 MB at 25k
        visual tokens on the world target, are the cached prefix's, which nothing writes)."""
        full = [p for p in parts if p.shape[0]]
        if len(full) == 1:
            return full[0]
        return torch.cat(parts) if parts else None

    def output(self, state: "TargetState", logits: torch.Tensor) -> "PrefillOutput":
        visual = {}
        if self.needs.feature_layers and self.needs.visual_features:
            visual = dict(text_positions=self.text_pos, visual_positions=self.visual_pos,
                          visual_features=self._cat(self.visual_features), video_token_id=self.video_token_id)
        video_end = int(self.visual_all[-1]) + 1 if self.visual_all.numel() else 0
        return PrefillOutput(state, logits, self.ids[self.text_pos], self._cat(self.features), self.last,
                             self._cat(self.bridge_text), self._cat(self.bridge_visual), **visual,
                             video_text_rows=int((self.text_pos < video_end).sum()), prefix=self.started_from)

    def prefix(self, kv, end: int) -> "VideoPrefix":
        """The VideoPrefix of positions [0, end) from a cache that holds them and the rows
        collected so far (at least through end - 1)."""
        feats = self._cat(self.features)
        n_feat = int((self.text_pos <= end).sum())      # text tokens t with t-1 < end
        n_btext = int((self.text_pos < end).sum())
        btext = self._cat(self.bridge_text)
        layers = kv.layers
        return VideoPrefix(self.ids[:end].clone(), [layer.keys[:, :, :end].clone() for layer in layers],
                           [layer.values[:, :, :end].clone() for layer in layers],
                           feats[:n_feat].clone() if feats is not None else None,
                           btext[:n_btext].clone() if btext is not None else None,
                           self._cat(self.bridge_visual), self._cat(self.visual_features))


class PrefillJob:
    """One request's prefill, a chunk of at most `chunk_tokens` prompt positions per `step()`,
    so a scheduler can interleave a 25k-token prefill with other requests' decode steps.
    `target`: the TargetModel (not imported here: target.py imports this module).

    The prompt's embeddings are built once (the vision tower runs on the first step, over the
    whole video, unless `embeds` brings them: `TargetModel.prompt_embeds`, which a scheduler runs
    on a worker thread), then the language model runs over them chunk by chunk on top of the
    request's KV cache. With `prefix` the cache starts as a copy of the video prefix's (or,
    `prefix_in_place`, with its rows already there) and only the rest of the prompt runs. `end`
    stops early (a video-prefix prefill).
    `time_shift` moves the prompt later on the temporal axis (a live window's text before
    its video, re-positioned after eviction: sparrow/live/window.py); with `prefix`, the prefix's
    shift applies to what follows it.
    """

    def __init__(self, target, inputs: dict, kv, needs: FeatureNeeds = FeatureNeeds(),
                 prefix: "VideoPrefix | None" = None, chunk_tokens: int = 1 << 30, end: int | None = None,
                 time_shift: int = 0, embeds: torch.Tensor | None = None, prefix_in_place: bool = False):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.target, self.inputs, self.kv, self.needs = target, inputs, kv, needs
        self.ids = inputs["input_ids"][0]
        self.end = self.ids.shape[0] if end is None else end
        self.cursor = 0
        if prefix is not None:
            if not prefix.matches(self.ids, target.video_token_id):
                raise ValueError("this video prefix was prefilled for a different prompt start")
            self.cursor = prefix.take_in_place(kv) if prefix_in_place else prefix.load_into(kv)
            time_shift = prefix.time_shift      # a live window's text sits later in time
        # The prompt's positions (before any time shift, kept for video_prefix): after a prefix that
        # carries its own, only the text after it is placed (VideoPrefix.positions_for).
        self.prompt_positions = (prefix.positions_for(self.ids.shape[0])
                                 if prefix is not None and prefix.position_ids is not None else
                                 target.family.prefill_positions(target.hf, inputs))      # pure, no pixels
        self.position_ids, self.rope_delta = self.prompt_positions
        if time_shift:
            self.position_ids = target.family.shift_time(self.position_ids, self.cursor, time_shift)
        self.time_shift = time_shift
        self.start = self.cursor
        self.collector = FeatureCollector(self.ids, target.video_token_id, needs, prefix)
        self.chunk_tokens = chunk_tokens
        # embeds: the prompt's input embeddings made beforehand (prompt_embeds; the vision tower
        # run off the scheduler thread), used when they cover [start, end)
        self._embeds = embeds if embeds is not None and embeds.shape[1] == self.end - self.start else None
        self._logits: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.cursor >= self.end

    @property
    def remaining(self) -> int:
        return self.end - self.cursor

    @torch.inference_mode()
    def step(self, max_tokens: int | None = None) -> bool:
        """Run the next chunk (at most `max_tokens` positions, else chunk_tokens); True once the
        whole prompt is in the cache."""
        target = self.target
        a, b = self._span(max_tokens)
        with GATE.forward(long=True):       # never beside a compile (compiling.py)
            out = target.hf(inputs_embeds=self._embeds[:, a - self.start: b - self.start],
                            position_ids=self.position_ids[..., a:b].to(target.device), cache=self.kv,
                            use_cache=True, output_hidden_states=self.needs.hidden, logits_to_keep=1)
        return self._took(b, out.hidden_states, out.logits[0, -1])

    @property
    def short(self) -> bool:
        """Whether the rest is short enough to finish in finish_together (one chunk of at most
        TOGETHER_ROWS positions)."""
        return self.remaining <= min(TOGETHER_ROWS, self.chunk_tokens)

    def embed(self) -> None:
        """Make the prompt's input embeddings (the vision tower's work where the video has not
        been embedded yet), if not made: before a forward that other requests share, so that
        this prompt's error is its own."""
        target = self.target
        if self._embeds is None:
            with GATE.forward(long=True):
                self._embeds = target.family.prompt_embeds(target.hf, self.inputs, self.start, self.end,
                                                           target.video_token_id)

    def _span(self, max_tokens: int | None) -> tuple[int, int]:
        """The next chunk's positions [a, b)."""
        self.embed()
        a = self.cursor
        return a, min(self.end, a + min(self.chunk_tokens, max_tokens or self.chunk_tokens))

    def _took(self, b: int, hidden_states: tuple[torch.Tensor, ...] | None, last_logits: torch.Tensor) -> bool:
        """The chunk [cursor, b) ran: its rows collected; after the last chunk, its logits kept."""
        if self.needs.hidden:
            self.collector.add(hidden_states, self.cursor)
        self.cursor = b
        if self.done:
            self._logits, self._embeds = last_logits.float(), None
        return self.done

    def run(self) -> "PrefillJob":
        while not self.step():
            pass
        return self

    def output(self) -> "PrefillOutput":
        state = TargetState(kv=self.kv, length=self.end, rope_delta=self.rope_delta, time_shift=self.time_shift)
        return self.collector.output(state, self._logits)

    def video_prefix(self) -> "VideoPrefix":
        """The prompt through its last video token, for the prefix cache (after the run)."""
        video_pos = torch.nonzero(self.ids == self.target.video_token_id).view(-1)
        if video_pos.numel() == 0:
            raise InvalidRequest("the prompt holds no video tokens")
        end = int(video_pos[-1]) + 1
        prefix = self.collector.prefix(self.kv, end)
        positions, delta = self.prompt_positions
        if positions.shape[-1] > end:
            prefix.position_ids, prefix.text_start = positions[..., :end].clone(), positions[..., end:end + 1].clone()
            prefix.position_top = int(positions[..., :end].max()) + 1
            again, again_delta = prefix.positions_for(positions.shape[-1])
            if again_delta != delta or not torch.equal(again, positions):
                prefix.position_ids = prefix.text_start = None    # placed otherwise: each prompt computes its own
        return prefix


# A prefill whose rest is at most this many positions (a question after a cached video) runs
# through finish_together, with others or alone: its attention is the verify path's, whoever
# its neighbours are. A longer rest runs in the model's own chunks (PrefillJob.step).
TOGETHER_ROWS = 128


@torch.inference_mode()
def finish_together(jobs: list[PrefillJob]) -> None:
    """The whole rest of each job (each `short`) in ONE forward: the
    rests are packed along the sequence and each attends only to its own cache and causally to
    its own new positions (ragged.py: a verify step's batch, with embeddings for inputs).
    Several requests' questions then cost about one question's forward: the weights are read
    once and the per-layer overhead paid once."""
    if not jobs:
        return
    target = jobs[0].target
    spans, segments, row = [], [], 0
    for job in jobs:
        if not job.short:
            raise ValueError(f"a prefill with {job.remaining} positions left is not finished together "
                             f"(at most {TOGETHER_ROWS}, and one chunk)")
        a, b = job._span(None)
        spans.append((a, b))
        segments.append(RaggedSegment(job.kv, row, row + b - a))
        row += b - a
    embeds = torch.cat([job._embeds[:, a - job.start: b - job.start] for job, (a, b) in zip(jobs, spans)], dim=1)
    positions = torch.cat([job.position_ids[..., a:b] for job, (a, b) in zip(jobs, spans)], dim=-1)
    hidden = any(job.needs.hidden for job in jobs)
    batch = RaggedBatch(segments, target.step_kernel())
    last = torch.tensor([seg.end - 1 for seg in segments], device=target.device)
    with GATE.forward(long=True):
        out = target.hf(inputs_embeds=embeds, position_ids=positions.to(target.device), cache=batch,
                        attention_mask=batch.as_mask(), use_cache=True, output_hidden_states=hidden,
                        logits_to_keep=last)
    for i, (job, seg, (_, b)) in enumerate(zip(jobs, segments, spans)):
        rows = tuple(h[:, seg.start:seg.end] for h in out.hidden_states) if job.needs.hidden else None
        job._took(b, rows, out.logits[0, i])


@dataclass(slots=True, weakref_slot=True)          # weakly held by KVArena residents
class VideoPrefix:
    """The prompt up to and including its last video token, prefilled once. The system
    prompt and the video fix these tokens, so later questions about the same video start
    from a copy of this KV cache and prefill only their own text."""

    input_ids: torch.Tensor               # (P,)
    keys: list[torch.Tensor]              # per layer (1, Hkv, P, D)
    values: list[torch.Tensor]
    features: torch.Tensor | None         # (m, F*H) features at t-1 for the text tokens t in [1, P]
    bridge_text: torch.Tensor | None      # (m', H) bridge-layer states at the text tokens in [1, P)
    bridge_visual: torch.Tensor | None    # (Nv, H) bridge-layer states at the visual tokens
    visual_features: torch.Tensor | None = None   # (Nv', F*H) features at t-1 for the visual tokens t >= 1
                                                  # (only when prefilled with visual_features=True)
    # A live window (sparrow/live/window.py) whose oldest frames were evicted: the text after it sits
    # this much later on the temporal rope axis, as the text before it was re-positioned.
    time_shift: int = 0
    # glimpse.visual_mass of bridge_text over bridge_visual (Nv,), made by the first question that
    # needs it and read by the later ones (glimpse.prompt_attention); the tensors above stay unwritten.
    glimpse_mass: torch.Tensor | None = None
    # The prefix's own prompt positions (the family's prefill_positions through its last video token,
    # before any time shift), where the first text after it goes, and the largest position in it + 1,
    # kept by a prefill that made the prefix (PrefillJob.video_prefix) when they reproduce its own
    # prompt's positions: a later question's are these and its text's (positions_for), not recomputed
    # over the whole prompt (Qwen2.5-VL's get_rope_index: ~7 ms at 25k visual tokens).
    position_ids: torch.Tensor | None = None
    text_start: torch.Tensor | None = None
    position_top: int = 0

    @property
    def length(self) -> int:
        return self.input_ids.shape[0]

    def missing(self, needs: FeatureNeeds) -> str | None:
        """What a draft with `needs` reads that this prefix, prefilled for one that reads less,
        does not carry (None: it holds everything; else a cache lookup is a miss)."""
        if needs.feature_layers and self.features is None:
            return "the draft's features"
        if needs.visual_features and self.visual_features is None:
            return "visual features"
        if needs.bridge_layer is not None and self.bridge_text is None:
            return "bridge-layer states"
        return None

    @property
    def nbytes(self) -> int:
        tensors = [self.input_ids, *self.keys, *self.values, self.features, self.bridge_text, self.bridge_visual,
                   self.visual_features, self.position_ids, self.text_start]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def matches(self, ids: torch.Tensor, video_token_id: int) -> bool:
        """Whether a prompt (n,) starts with exactly this prefix and has no video after it."""
        n = self.length
        return (ids.shape[0] > n and torch.equal(ids[:n], self.input_ids.to(ids.device))
                and not bool((ids[n:] == video_token_id).any()))

    def positions_for(self, length: int) -> tuple[torch.Tensor, int]:
        """(position_ids, rope delta) of a prompt of `length` tokens that starts with this prefix
        and has only text after it, as the families place text: one position a token on every axis
        from text_start, and the delta of what follows the prompt from the largest position in it
        (on Qwen2.5-VL a real-time video's temporal positions can run past the text's, so the delta
        depends on the text's length). video_prefix checks this against the prompt that made it."""
        rest = self.text_start + torch.arange(length - self.length, device=self.text_start.device)
        top = max(self.position_top, int(rest[..., -1].max()) + 1)
        return torch.cat([self.position_ids, rest], dim=-1), top - length

    def load_into(self, kv) -> int:
        """Copy the prefix into a fresh KV cache (the cached tensors are never written)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            kv.update(k, v, i)
        return self.length

    def take_in_place(self, kv) -> int:
        """The prefix's rows are a fresh KV cache's first rows already (a KV arena slot given
        back holding them: KVArena.allocate's prefix): they join the cache without a copy."""
        for layer in kv.layers:
            if layer.length:
                raise ValueError("a prefix is taken in place only by an empty cache")
            layer.advance(self.length)
        return self.length
