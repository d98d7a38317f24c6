"""SpecVLM-style proposer: the draft is a smaller full VLM of the target's family that reads
the video through a verifier-guided pruned set of visual tokens (the baseline the benchmarks
compare Sparrow against).

Per request:
  1. the target's prefill returns its bridge-layer states (text and visual positions); their
     text->video attention (`glimpse.text_to_visual_attention`) ranks the visual tokens and
     `prune.prune_visual` keeps `keep_ratio` of them (stage 1: top attention up to `mass`,
     stage 2: uniform over the rest);
  2. the small VLM runs its own vision tower on the whole video, keeps the embeddings of the
     selected visual tokens only, and prefills its LM over prompt text + kept visual tokens,
     each at its ORIGINAL position (Qwen2.5-VL: the 3-axis M-RoPE position of the full
     sequence, computed for the full prompt and then indexed), into its own KV cache;
  3. decoding is standard draft-model speculative decoding: `propose` drafts k tokens
     autoregressively (argmax at T=0; at T>0 sampled from the draft's distribution with the
     request's generator, and the distributions are returned so acceptance is lossless
     rejection sampling); `commit` crops the draft cache back to the accepted prefix and
     queues the emitted tokens, which the next `propose` feeds first.

It follows the Proposer contract (proposer.py): `begin` reads the prompt inputs and the video
from its BeginInput, not only the prefill. Prefix-cache entries drop the video's pixels, so the proposer keeps the small
VLM's visual tokens of recent keyed videos itself (`video_cache_entries`, LRU): a hit reuses
them; a hit on a key it no longer holds (evicted here, or a prefix made by another engine)
raises InvalidRequest.

Cache bookkeeping (lazy append, no extra forward in commit: the contract's deferred commit,
proposer.py). The draft cache always holds a prefix of the request's sequence: kept prompt +
emitted tokens, except a `pending` tail of emitted tokens not fed yet. propose(k) feeds
`pending` + d_1..d_{k-1} (d_k is never fed: nothing would read its keys before the verdict).
commit(tokens = accepted a drafts + the target's correction/bonus token): the first
min(a, k-1) fed drafts are right and stay, the other fed drafts are cropped off
(`cache.crop(-n)`), and the emitted tokens not in the cache join `pending`: [correction] if
a < k, [d_k, bonus] if a == k, the one token of a step that did not draft.

The draft cache is the target's kind (kv_cache.py: a preallocated buffer per layer plus a
length, so a crop is a length move), sized at `begin` for the kept prompt + BeginInput.room;
fed past that (a direct caller), it grows by doubling.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from ..config import SamplingParams, SpecConfig
from ..errors import InvalidRequest
from ..models.kv_cache import new_kv_cache
from ..models.prefill import FeatureNeeds, PrefillOutput
from ..models.target import TargetModel
from .glimpse import text_to_visual_attention
from .proposer import BeginInput, DraftRequest, DraftState, Pending, Proposal, StepResult
from .prune import prune_budget, prune_visual
from .sampling import PositionNoise, draw_token


@dataclass(slots=True)
class SpecVLMState(DraftState):
    """One request's draft-side state (the proposer itself holds none)."""

    cache: Cache | None              # the small VLM's KV: PreallocatedLayers (kv_cache.py); None once ended
    next_index: int                  # full-sequence index of the next token fed (position = index + rope_delta)
    rope_delta: int
    pending: Pending                 # emitted tokens not yet fed to the draft (proposer.py's deferred commit)
    num_visual: int                  # visual tokens in the target's prompt
    kept_visual: torch.Tensor        # (keep,) sorted indices of the visual tokens the draft sees
    prompt_entries: int              # draft cache entries after its prefill (text + kept visual)
    fed_drafts: int = 0              # draft tokens of the last proposal that are in the cache
    drafted: list[int] = field(default_factory=list)   # the last proposal
    max_visible: int = 0             # most keys one draft query attended to (the cache's length after a feed)

    @property
    def num_kept(self) -> int:
        return int(self.kept_visual.shape[0])

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @property
    def capacity(self) -> int:
        return self.cache.layers[0].capacity if self.cache is not None else 0

    def kv_bytes(self) -> int:
        """The small VLM's key/value buffers as allocated (every layer, the whole capacity,
        filled or not); 0 once the request ended and they were freed."""
        if self.cache is None:
            return 0
        return sum(layer.k_buf.nbytes + layer.v_buf.nbytes for layer in self.cache.layers if layer.is_initialized)

    def max_keys(self) -> int:
        return self.max_visible

    def reserve(self, n: int) -> None:
        """Room for n more entries: a cache that would overflow is copied into one of twice
        the capacity (or what n needs), through the layers' own update."""
        need = self.cached + n
        if need <= self.capacity:
            return
        grown = new_kv_cache("static", len(self.cache.layers), max(need, 2 * self.capacity))
        for old, new in zip(self.cache.layers, grown.layers):
            new.update(old.keys, old.values)
        self.cache = grown


class SpecVLMProposer:
    """Draft-model speculative decoding with a small VLM on a pruned video (SpecVLM).

    target: the verifier (its processor turns the video into pixels; its bridge layer guides pruning).
    small: a smaller TargetModel of the same family, same tokenizer/vocabulary and same video processor.
    keep_ratio: share of visual tokens the small VLM sees (prune_budget: ceil(ratio * Nv)).
    mass: stage-1 attention mass of the two-stage pruning.
    bridge_layer: the target hidden-state index whose text->video attention guides pruning
        (default num_layers // 2, as the Sparrow draft's glimpse).
    video_cache_entries: keyed videos whose small-VLM visual tokens are kept for prefix-cache
        hits (which carry no pixels); the prefix cache's own entry budget is a good value.
    """

    def __init__(self, target: TargetModel, small: TargetModel, keep_ratio: float = 0.1, mass: float = 0.5,
                 bridge_layer: int | None = None, video_cache_entries: int = 32, draft_mass: float = 1.0,
                 draft_max_candidates: int = 0):
        _check_compatible(target, small)
        self.draft_mass, self.draft_max_candidates = draft_mass, draft_max_candidates     # sampling.draft_probs
        if not isinstance(keep_ratio, (int, float)) or not 0.0 <= keep_ratio <= 1.0:
            raise InvalidRequest(f"keep_ratio must be in [0, 1], got {keep_ratio!r}")
        if not isinstance(mass, (int, float)) or not 0.0 <= mass <= 1.0:
            raise InvalidRequest(f"mass must be in [0, 1], got {mass!r}")
        bridge_layer = target.num_layers // 2 if bridge_layer is None else bridge_layer
        if not 0 <= bridge_layer <= target.num_layers:
            raise InvalidRequest(f"bridge_layer must be in [0, {target.num_layers}], got {bridge_layer}")
        self.target, self.small = target, small
        self.keep_ratio, self.mass = float(keep_ratio), float(mass)
        # Pruning at ratio 1 needs no guidance: then the target's prefill is not asked for hidden states.
        self.bridge_layer = bridge_layer if keep_ratio < 1.0 else None
        self.needs = FeatureNeeds(bridge_layer=self.bridge_layer)
        self.video_token_id = target.video_token_id
        if video_cache_entries < 0:
            raise InvalidRequest(f"video_cache_entries must be >= 0, got {video_cache_entries}")
        self.video_cache_entries = video_cache_entries
        self._visual: OrderedDict[str, torch.Tensor] = OrderedDict()   # video key -> (Nv, H) visual tokens
        self._visual_lock = threading.Lock()

    @classmethod
    def from_spec(cls, target: TargetModel, small: TargetModel, spec: SpecConfig) -> "SpecVLMProposer":
        """The registry's "specvlm": the draft is the small VLM; spec.prune_keep is the share of
        visual tokens it sees."""
        return cls(target, small, keep_ratio=spec.prune_keep, draft_mass=spec.draft_mass,
                   draft_max_candidates=spec.draft_max_candidates)

    # ----- per request ------------------------------------------------------------------------
    def begin(self, start: BeginInput) -> SpecVLMState:
        return self.begin_request(start.prefill, start.inputs, start.video, start.first_token, start.video_key,
                                  start.room)

    @torch.inference_mode()
    def begin_request(self, pre: PrefillOutput, inputs: dict[str, torch.Tensor], video,
                      first_token: int, video_key: str | None = None, room: int = 1) -> SpecVLMState:
        """Prune, prefill the small VLM on text + kept visual tokens; `first_token` is pending.
        With a video_key the small VLM's visual tokens are kept for later prefix-cache hits.
        room: entries the cache is sized for beyond the prompt's (BeginInput.room)."""
        small = self.small
        dev = small.device
        ids = inputs["input_ids"][0].to(dev)
        is_vis = ids == self.video_token_id
        vis_pos = torch.nonzero(is_vis).view(-1)
        n_vis = int(vis_pos.shape[0])
        kept = self.select_visual(pre, inputs, n_vis).to(dev)

        sm_inputs = {k: v.to(dev) for k, v in inputs.items()}
        if "pixel_values_videos" in sm_inputs:
            sm_inputs["pixel_values_videos"] = sm_inputs["pixel_values_videos"].to(small.hf.dtype)
        # Positions of the FULL prompt (nothing is left on the model), then the kept entries'.
        position_ids, rope_delta = small.family.prefill_positions(small.hf, sm_inputs)
        keep_mask = ~is_vis
        keep_mask[vis_pos[kept]] = True
        embeds = small.embed_tokens()(ids[keep_mask][None])                       # (1, L, H)
        if kept.numel() > 0:
            visual = self._visual_tokens(sm_inputs, video_key)                   # (Nv, H)
            if visual.shape[0] != n_vis:
                raise InvalidRequest(f"the small VLM's vision tower made {visual.shape[0]} visual tokens "
                                     f"for a prompt with {n_vis}: its vision config does not match the target's")
            embeds[0, is_vis[keep_mask]] = visual[kept].to(embeds.dtype)
        length = embeds.shape[1]
        cache = new_kv_cache("static", small.num_layers, length + room)
        small.hf(inputs_embeds=embeds, position_ids=position_ids[..., keep_mask.to(position_ids.device)].to(dev),
                 cache=cache, use_cache=True, logits_to_keep=1)
        return SpecVLMState(cache=cache, next_index=ids.shape[0], rope_delta=rope_delta, pending=Pending([int(first_token)]),
                            num_visual=n_vis, kept_visual=kept.cpu(), prompt_entries=length, max_visible=length)

    def _visual_tokens(self, sm_inputs: dict[str, torch.Tensor], video_key: str | None) -> torch.Tensor:
        """The small VLM's visual tokens: from the pixels (kept under video_key), or, on a
        prefix-cache hit (no pixels), those kept for the key."""
        pixels = sm_inputs.get("pixel_values_videos")
        if pixels is not None and pixels.numel() > 0:
            visual = self.small.family.video_embeds(self.small.hf, sm_inputs)
            if video_key is not None and self.video_cache_entries:
                with self._visual_lock:
                    self._visual.pop(video_key, None)
                    self._visual[video_key] = visual
                    while len(self._visual) > self.video_cache_entries:
                        self._visual.popitem(last=False)
            return visual
        with self._visual_lock:
            visual = self._visual.get(video_key) if video_key is not None else None
            if visual is not None:
                self._visual.move_to_end(video_key)
        if visual is None:
            raise InvalidRequest(f"SpecVLM's small VLM needs the video's pixels, and a prefix-cache hit has none: "
                                 f"it keeps the visual tokens of the last {self.video_cache_entries} keyed videos "
                                 f"it read, and video key {video_key!r} is not among them (evicted, or cached by "
                                 "another engine); send the video again under a new key")
        return visual

    def select_visual(self, pre: PrefillOutput, inputs: dict[str, torch.Tensor], num_visual: int) -> torch.Tensor:
        """Sorted indices (CPU long) of the visual tokens the small VLM keeps."""
        keep = prune_budget(num_visual, self.keep_ratio)
        if keep >= num_visual:
            return torch.arange(num_visual)
        if pre.bridge_text is None or pre.bridge_visual is None:
            raise InvalidRequest("SpecVLM pruning needs the target's bridge-layer states, but this prefill has none "
                                 "(a prefix-cache entry made by an engine with another proposer?)")
        if pre.bridge_visual.shape[0] != num_visual:
            raise InvalidRequest(f"bridge-layer states cover {pre.bridge_visual.shape[0]} visual tokens, "
                                 f"the prompt has {num_visual}")
        attention = text_to_visual_attention(pre.bridge_text, pre.bridge_visual).cpu()
        return prune_visual(attention, self._merged_grid(inputs, num_visual), keep, self.mass).cpu()

    def _merged_grid(self, inputs: dict[str, torch.Tensor], num_visual: int) -> list[int] | None:
        """(t, h, w) of the visual tokens after patch merging (Qwen2.5-VL), else None."""
        grid = inputs.get("video_grid_thw")
        vision = getattr(self.target.hf.config, "vision_config", None)
        merge = getattr(vision, "spatial_merge_size", None)
        if grid is None or grid.shape[0] != 1 or not merge:
            return None
        t, h, w = (int(x) for x in grid[0].tolist())
        dims = [t, h // merge, w // merge]
        return dims if dims[0] * dims[1] * dims[2] == num_visual else None

    # ----- decoding -----------------------------------------------------------------------------
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        """Each request's small VLM drafts on its own cache (a KV cache per request, in HF's
        layout): the batch is served one request after another."""
        return [self.propose_one(r.state, r.k, r.sampling, r.generator, r.noise) for r in batch]

    def commit(self, states: list[SpecVLMState], results: list[StepResult]) -> None:
        for state, result in zip(states, results):
            self.commit_one(state, result.tokens)

    @torch.inference_mode()
    def propose_one(self, state: SpecVLMState, k: int, sampling: SamplingParams,
                    generator: torch.Generator, noise: PositionNoise | None = None) -> Proposal:
        if state.cache is None:
            raise RuntimeError("this request's draft state was already released")
        if not state.pending:
            raise RuntimeError("propose called without a committed token to continue from")
        feed, tokens, probs = state.pending.take().tokens, [], []
        for j in range(k):
            tok, q = draw_token(self._feed(state, feed), sampling, generator, self.draft_mass,
                                self.draft_max_candidates, noise, j)
            if q is not None:
                probs.append(q)
            tokens.append(tok)
            feed = [tok]
        state.drafted, state.fed_drafts = tokens, max(0, k - 1)     # d_k is never fed
        out_probs = torch.stack(probs).to(self.target.device) if probs else None
        return Proposal(torch.tensor(tokens, dtype=torch.long), out_probs)

    @torch.inference_mode()
    def commit_one(self, state: SpecVLMState, tokens: list[int], features=None) -> None:
        """tokens: what the step emitted (accepted drafts + the correction/bonus token)."""
        tokens = [int(t) for t in tokens]
        accepted = 0           # fed drafts the target agreed with: they stay in the cache
        limit = min(state.fed_drafts, len(tokens) - 1)
        while accepted < limit and tokens[accepted] == state.drafted[accepted]:
            accepted += 1
        remove = state.fed_drafts - accepted
        if remove > 0:
            state.cache.crop(-remove)
            state.next_index -= remove
        state.pending.add(StepResult(None, tokens[accepted:], None))
        state.drafted, state.fed_drafts = [], 0

    def end(self, state: SpecVLMState) -> None:
        """The request is over (done, aborted or closed): free its KV cache now."""
        state.cache = None

    def _feed(self, state: SpecVLMState, ids: list[int]) -> torch.Tensor:
        """Run tokens through the small LM on top of its cache; (V,) logits after the last."""
        small, n = self.small, len(ids)
        position_ids = small.family.step_positions(state.next_index, n, state.rope_delta).to(small.device)
        state.reserve(n)
        out = small.hf(input_ids=torch.tensor([ids], device=small.device), position_ids=position_ids,
                       cache=state.cache, use_cache=True, logits_to_keep=1)
        state.next_index += n
        state.max_visible = max(state.max_visible, state.cached)
        return out.logits[0, -1].float()


# ----- helpers -------------------------------------------------------------------------------------
def _check_compatible(target: TargetModel, small: TargetModel) -> None:
    if not isinstance(target, TargetModel) or not isinstance(small, TargetModel):
        raise InvalidRequest("SpecVLM needs the target and the small VLM as sparrow TargetModels")
    t_type, s_type = target.hf.config.model_type, small.hf.config.model_type
    if t_type != s_type:
        raise InvalidRequest(f"the small VLM must be of the target's family: {s_type!r} vs {t_type!r}")
    if small.vocab_size != target.vocab_size:
        raise InvalidRequest(f"the small VLM must share the target's vocabulary: "
                             f"{small.vocab_size} vs {target.vocab_size} output rows")
    if small is not target and small.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise InvalidRequest("the small VLM must share the target's tokenizer (the vocabularies differ)")
    if small.video_token_id != target.video_token_id:
        raise InvalidRequest("the small VLM's video placeholder token differs from the target's")
    if small.processor != target.processor:
        raise InvalidRequest(f"the small VLM must take the target's video inputs: processors differ "
                             f"({small.processor} vs {target.processor})")

