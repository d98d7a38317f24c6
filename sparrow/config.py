"""Request and engine configuration: small frozen dataclasses, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest

SPEC_METHODS = ("sparrow", "eagle-style", "eagle3", "specvlm", "none")
DRAFT_CONTEXTS = ("text", "all", "pruned")
DRAFT_STEPS = ("reference", "static", "compiled")
TARGET_STEPS = ("eager", "compiled")      # how the target's decode/verify steps run (models/step_graph.py)
# Verify attention kernels by name: (module, function), imported on first use (models/ragged.py's
# verify_kernel). "packed": the prefix unmasked + the new tokens' own mask, merged by log-sum-exp
# (the CPU default); "split": flash-decoding in torch; "triton": the split-KV Triton kernel (CUDA;
# on CPU only under TRITON_INTERPRET=1, for tests). "sdpa", besides them, is ragged SDPA.
VERIFY_KERNELS: dict[str, tuple[str, str]] = {
    "packed": ("sparrow.kernels.packed", "verify_attention_packed"),
    "split": ("sparrow.kernels.split_kv", "verify_attention_split"),
    "triton": ("sparrow.kernels.triton_attention", "verify_attention_triton"),
}


def check(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequest(message)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples. temperature 0 is greedy (the lossless golden path)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0                      # 0: off
    top_p: float = 1.0                  # 1.0: off
    seed: int | None = None             # seeds the request's own torch.Generator
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()          # stop strings, matched on the decoded text
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # inf would sample uniformly at random and nan compares false everywhere: both refused.
        check(math.isfinite(self.temperature) and self.temperature >= 0.0,
               f"temperature must be a finite number >= 0, got {self.temperature}")
        check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")   # false for nan
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be ids >= 0")
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def replayable(self) -> bool:
        """Sampled with a seed: its tokens are a function of its inputs and seed alone (the same in
        any batch, with any k or tree, and equal to plain decoding's): Gumbel-max under noise
        keyed by seed and position (speculative/sampling.py)."""
        return not self.greedy and self.seed is not None


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding settings for an engine.

    method: the proposer, by its registered name (sparrow.speculative.registry): "sparrow" (the
    Sparrow draft), "eagle-style" (the same draft over a context with visual entries:
    draft_context "all" unless "pruned" is asked for), "eagle3" (a published EAGLE-3 draft,
    sparrow.speculative.eagle3), "specvlm" (a small VLM on a pruned video), or "none" (plain autoregressive decoding through the same prefill and KV path:
    the baseline every benchmark compares against).
    num_draft_tokens: the most draft tokens per step (k). adaptive_k (on by default, so the
    engine is never slower than plain decoding where drafting cannot pay): the engine chooses
    each request's k in [0, num_draft_tokens] each step from its measured acceptance and the
    step's measured costs on this machine and this batch (draft_policy.DraftPolicy,
    step_costs.MeasuredCosts); a request's explicit k keeps k fixed.
    False: every request drafts num_draft_tokens each step.
    tree_width/tree_branch/tree_budget: the shape of the draft tree (see the fields).
    adaptive_tree: each step, greedy requests' trees (chains too) are cut to the nodes worth
    their verify cost: the step's measured verify cost per token against each node's chance
    of acceptance (its path's draft probability, calibrated by what was accepted at its depth), shared
    across the batch (draft_policy.TreeTrim). Off by default; sampled requests keep their trees.
    window/anchors/glimpse: the draft's text-anchored window attention sees at most
    `anchors` prompt text tokens + the last `window` tokens + `glimpse` bridge-layer visual
    states, whatever the length of the video.
    draft_context: what the draft's context entries are.
        "text"    the prompt's text tokens under text-anchored window attention (Sparrow);
        "all"     every prompt token, visual ones included (token = the video pad id, features
                  = the target's at t-1), all visible to every query: full causal attention, no
                  window eviction, no anchor cap (EAGLE-2/3 on a VLM, the baseline);
        "pruned"  like "all" over the text tokens plus a `prune_keep` share of the visual ones,
                  chosen by sparrow.speculative.prune.prune_visual (SpecVLM-style pruning).
    """

    method: str = "sparrow"
    num_draft_tokens: int = 4
    adaptive_k: bool = True
    adaptive_tree: bool = False
    # Draft trees (EAGLE-2 style, dynamic): num_draft_tokens is the depth; each level expands
    # the tree_width most probable nodes (by cumulative draft probability) with tree_branch
    # children each, up to tree_budget nodes (0: no cap). width = branch = 1 is a chain.
    tree_width: int = 1
    tree_branch: int = 1
    tree_budget: int = 0
    window: int = 32
    anchors: int = 64
    glimpse: int = 0
    draft_context: str = "text"     # "text" | "all" | "pruned"
    prune_keep: float = 0.1         # "pruned": share of the visual tokens kept
    # When sampling, the draft may draw from its own distribution cut to its most likely tokens:
    # the smallest set holding draft_mass of it, at most draft_max_candidates (0: no cap);
    # draft_mass 1 and no cap (the default): the request's distribution itself. Acceptance reads
    # that same q, so the output is the target's distribution exactly; acceptance loses at most
    # the cut mass, and a remote draft's reply carries only those entries (services.draft.
    # DraftProbs: the remote placement cuts by default, services.settings.REMOTE_DRAFT_CUT).
    draft_mass: float = 1.0
    draft_max_candidates: int = 0
    # How the Sparrow draft runs its k steps (sparrow.models.draft_compile): "static" (the
    # default: the whole batch's levels over keys gathered once, static shapes, no host read per
    # step; for a small float32 draft on a CPU each call is one C++ kernel once it is built
    # (kernels/draft_chain.py: ~8x the reference at batch 1 on the 2-core CPU; torch ops until then,
    # ~1.5x; SPARROW_DRAFT_NATIVE=off keeps them), "compiled" (the same,
    # torch.compile on a CPU, CUDA graphs on a GPU: ~5x the reference at batch 1; each batch
    # bucket compiles once, ~10 s on a CPU, the time logged at INFO: for long-lived servers) or
    # "reference" (eager, per request and level: SparrowDraft.forward_packed; what the other two
    # are tested equal to). "static"/"compiled" apply to the "text" context with sdpa/eager
    # attention; anything else runs the reference.
    draft_step: str = "static"

    @classmethod
    def as_trained(cls, trained_with: Mapping[str, Any], k: int, **fields: Any) -> "SpecConfig":
        """A spec at draft depth k (and the named `fields`) with the rest of a draft's trained
        geometry: how the tools that measure a draft at a fixed k run it."""
        return cls(num_draft_tokens=k, **fields).with_geometry(trained_with, ("num_draft_tokens", *fields))

    def with_geometry(self, trained_with: Mapping[str, Any], given: Collection[str] = ()) -> "SpecConfig":
        """This spec with a draft's trained geometry (SparrowDraft.trained_with: window, anchors,
        glimpse, num_draft_tokens, draft_context) in every field not named in `given` (the
        fields a user set)."""
        fields = {k: v for k, v in trained_with.items() if k not in given and k in self.__dataclass_fields__}
        return dataclasses.replace(self, **fields) if fields else self

    def __post_init__(self) -> None:
        check(self.method in SPEC_METHODS, f"method must be one of {SPEC_METHODS}, got {self.method!r}")
        check(1 <= self.num_draft_tokens <= 32, f"num_draft_tokens must be in [1, 32], got {self.num_draft_tokens}")
        check(self.window >= 1, f"window must be >= 1, got {self.window}")
        check(self.anchors >= 0, f"anchors must be >= 0, got {self.anchors}")
        check(self.glimpse >= 0, f"glimpse must be >= 0, got {self.glimpse}")
        check(0.0 < self.draft_mass <= 1.0, f"draft_mass must be in (0, 1], got {self.draft_mass}")
        check(self.draft_max_candidates >= 0, f"draft_max_candidates must be >= 0, got {self.draft_max_candidates}")
        check(self.draft_context in DRAFT_CONTEXTS,
               f"draft_context must be one of {DRAFT_CONTEXTS}, got {self.draft_context!r}")
        check(isinstance(self.prune_keep, (int, float)) and 0.0 <= self.prune_keep <= 1.0,
               f"prune_keep must be in [0, 1], got {self.prune_keep!r}")
        check(self.tree_width >= 1 and self.tree_branch >= 1, "tree_width and tree_branch must be >= 1")
        check(0 <= self.tree_budget <= 256, f"tree_budget must be in [0, 256], got {self.tree_budget}")
        check(self.draft_step in DRAFT_STEPS, f"draft_step must be one of {DRAFT_STEPS}, got {self.draft_step!r}")
        if self.method == "eagle-style" and self.draft_context == "text":
            object.__setattr__(self, "draft_context", "all")

    def max_tree_nodes(self, depth: int) -> int:
        """The most draft nodes a tree of this depth may have (a chain: depth)."""
        nodes = depth * self.tree_width * self.tree_branch
        return min(nodes, self.tree_budget) if self.tree_budget else nodes

    @property
    def speculative(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine internals (how requests share the machine), apart from the speculation policy
    (SpecConfig) and each request's sampling (SamplingParams).

    kv_cache_bytes       the target KV arena: admission is by these bytes, not a request count
    kv_prefault          write the whole arena when the engine is made (committing its memory),
                         so that no request pays the first touch of its slot's pages: ~35 ms of a
                         25k-token request's start on a CPU, where a burst of 8 new requests on a
                         fresh server waits ~0.3 s for it. A server does (`sparrow serve`); built in
                         code, the arena costs address space until used.
    max_running          requests prefilling or decoding at once
    max_waiting          requests waiting for KV memory; past it, new ones are refused
    queue_timeout_s      how long a request may wait for KV memory before it is refused
    prefill_chunk_tokens the most prompt positions per prefill slice
    prefill_slice_s      while streams are decoding or other prefills wait, a slice is sized to
                         take about this long (from the measured cost of the request's previous
                         slice: it grows with the cached length), so a running stream waits
                         about this much at most; the prefill with the fewest positions left
                         runs first (scheduler.STARVED_SLICES: one that waited 5 x prefill_slice_s
                         goes first, so none is starved)
    prefill_share        ... and prefill gets about this share of the time while streams decode
                         (the rest goes to decode steps); alone, a prefill runs slices of about
                         4 x prefill_slice_s (scheduler.ALONE_SLICES), at most a chunk
    prepare_threads      videos decoded at once (off the scheduler thread)
    step_draft_nodes     draft-tree nodes a whole step may verify, shared by the requests that
                         draft (each gets at most its equal share, however large its tree
                         could be); 0: no cap. Verify cost grows with the tokens scored, so a
                         batch gives each request a smaller tree (BENCHMARKS.md: verify cost).
    """

    kv_cache_bytes: int = 2 << 30
    kv_prefault: bool = False
    max_running: int = 64
    max_waiting: int = 256
    queue_timeout_s: float = 30.0
    prefill_chunk_tokens: int = 2048
    prefill_slice_s: float = 0.1
    prefill_share: float = 0.5
    step_draft_nodes: int = 0
    prepare_threads: int = 2

    def __post_init__(self) -> None:
        for name in ("kv_cache_bytes", "max_running", "prefill_chunk_tokens", "prepare_threads"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0 or not self.queue_timeout_s >= 0:
            raise InvalidRequest("max_waiting and queue_timeout_s must be >= 0")
        if self.step_draft_nodes < 0:
            raise InvalidRequest("step_draft_nodes must be >= 0")
        if not self.prefill_slice_s > 0 or not 0 < self.prefill_share <= 1:
            raise InvalidRequest("need prefill_slice_s > 0 and 0 < prefill_share <= 1")
