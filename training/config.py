"""Draft-training configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from sparrow.config import SpecConfig, check

RESPONSE_SOURCES = ("target", "answer")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """How a Sparrow draft is trained against a frozen target (online distillation).

    unroll: draft steps per chain in the training-time test (1 = plain next-token training,
        >1 = multi-token prediction: steps >= 1 read the draft's own previous output).
    bridge_tokens: bridge-layer (L/2) visual states the draft sees as a pinned prefix during
        training (0 = no bridging); chosen with the same rule as the inference glimpse.
    bridge_dropout: a draft trained always with the prefix leans on it, and at inference
        without a glimpse its tau fell from 2.94 to 1.57 (world, RESULTS.md); dropping the
        prefix for a share of samples keeps it useful both ways.
    ce_weight / hidden_weight: loss = ce_weight * CE(target dist, draft) + hidden_weight *
        SmoothL1(draft hidden, target final hidden). EAGLE-3 is (1, 0); EAGLE-1 is (0.1, 1).
        The cross-entropy is to the target's whole distribution (topk 0) or its top-k tokens.
        The default is (1, 0): on the world pair (1, 1) gave higher tau up to 8k visual tokens
        and lower at 25k; (0.1, 1) was lower on average up to 8k (training/RESULTS.md).
    window / anchors / glimpse: the draft's attention at inference (and, via the same mask
        function, at training).
    context / prune_keep: the draft context (SpecConfig.draft_context / prune_keep): "text"
        trains a Sparrow draft; "all" / "pruned" the EAGLE-style baselines that attend to all
        (or a pruned share of the) visual tokens, with the same recipe.
    """

    steps: int = 300                    # optimizer steps
    grad_accum: int = 4                 # samples per optimizer step
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    unroll: int = 3
    step_decay: float = 0.8             # loss weight of unroll step j is step_decay ** j (EAGLE-3)
    ce_weight: float = 1.0
    hidden_weight: float = 0.0
    topk: int = 0                       # 0: the target's whole distribution; k: its top-k (loss.py)
    bridge_tokens: int = 64
    bridge_dropout: float = 0.5         # share of samples trained without the prefix (see below)
    window: int = 32
    anchors: int = 64
    glimpse: int = 0
    context: str = "text"               # "text" | "all" | "pruned"
    prune_keep: float = 0.1             # "pruned": share of the visual tokens kept
    # draft shape (a fresh draft; ignored when resuming)
    draft_layers: int = 1
    feature_layers: tuple[int, ...] | None = None
    draft_intermediate: int | None = None      # None: the target's intermediate size
    # data
    length_balance: float = 0.0         # feature store: 0 uniform over responses, 1 each video length alike
    store_responses: str = "all"        # feature store: "all", "greedy" or "sampled" responses
    responses: str = "target"           # "target": the target's own greedy generation; "answer": the manifest's
    max_new_tokens: int = 64            # length cap of the target's responses
    fps: float | None = 2.0             # video sampling (sparrow.video.VideoOptions)
    num_frames: int | None = None
    # bookkeeping
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100               # 0: never
    eval_samples: int = 8
    eval_draft_tokens: int = 4
    save_every: int = 100               # 0: only at the end

    def __post_init__(self) -> None:
        check(self.steps >= 1 and self.grad_accum >= 1, "steps and grad_accum must be >= 1")
        check(self.lr > 0 and self.warmup >= 0 and self.grad_clip >= 0, "bad lr / warmup / grad_clip")
        check(1 <= self.unroll <= 16, f"unroll must be in [1, 16], got {self.unroll}")
        check(0 < self.step_decay <= 1, "step_decay must be in (0, 1]")
        check(self.ce_weight >= 0 and self.hidden_weight >= 0 and self.ce_weight + self.hidden_weight > 0,
               "ce_weight and hidden_weight must be >= 0, not both 0")
        check(self.bridge_tokens >= 0, "bridge_tokens must be >= 0")
        check(self.topk >= 0, "topk must be >= 0 (0: the whole distribution)")
        check(0.0 <= self.length_balance <= 1.0, "length_balance must be in [0, 1]")
        check(self.store_responses in ("all", "greedy", "sampled"), "store_responses must be all, greedy or sampled")
        check(0.0 <= self.bridge_dropout <= 1.0, "bridge_dropout must be in [0, 1]")
        check(self.responses in RESPONSE_SOURCES, f"responses must be one of {RESPONSE_SOURCES}")
        check(self.max_new_tokens >= 2, "max_new_tokens must be >= 2 (a chain needs two tokens)")
        self.spec()          # window / anchors / glimpse / context / layers are validated by SpecConfig

    def spec(self, num_draft_tokens: int | None = None) -> SpecConfig:
        """The inference settings this draft is trained for (k fixed: tau is measured at k)."""
        return SpecConfig(method="sparrow", num_draft_tokens=num_draft_tokens or self.eval_draft_tokens, adaptive_k=False,
                          window=self.window, anchors=self.anchors, glimpse=self.glimpse,
                          draft_context=self.context, prune_keep=self.prune_keep)


# What each TrainConfig field does, for `sparrow train-draft --help` (one option per field).
TRAIN_HELP = {
    "steps": "optimizer steps",
    "grad_accum": "samples per optimizer step (gradient accumulation)",
    "lr": "peak learning rate (AdamW)",
    "warmup": "linear warmup steps before the cosine decay",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient norm clip (0: none)",
    "unroll": "draft steps per chain in the training-time test (1: next-token only; >1: multi-token prediction "
              "on the draft's own outputs)",
    "step_decay": "loss weight of unroll step j is step_decay ** j",
    "ce_weight": "weight of the cross-entropy to the target's distribution",
    "hidden_weight": "weight of the SmoothL1 to the target's final hidden state",
    "topk": "the cross-entropy's teacher: 0 the target's whole distribution (KL), k its k most likely tokens "
            "renormalised (1: the greedy token)",
    "bridge_tokens": "bridge-layer (L/2) visual states the draft sees as a prefix while training (0: no bridging)",
    "bridge_dropout": "share of samples trained without the bridging prefix",
    "window": "the draft's attention window: the last W tokens",
    "anchors": "prompt text tokens the draft always attends to (at most A)",
    "glimpse": "bridge-layer visual states the draft attends to at inference (0: pure Sparrow)",
    "context": "draft context: text (Sparrow), all or pruned (the EAGLE-style baselines)",
    "prune_keep": "context pruned: share of the visual tokens kept",
    "draft_layers": "decoder layers of a fresh draft",
    "feature_layers": "target hidden-state indices the draft reads, comma-separated (default: low, mid, high)",
    "draft_intermediate": "MLP width of a fresh draft (default: the target's)",
    "length_balance": "training on a feature store: how evenly video lengths (octaves of visual tokens) are drawn "
                      "(0: as often as the store holds them, 1: each length alike)",
    "store_responses": "training on a feature store: which of its responses (all, greedy or sampled)",
    "responses": "what the draft learns to continue: target (the target's own greedy answers) or answer "
                 "(the manifest's)",
    "max_new_tokens": "length cap of the target's responses",
    "fps": "video frames sampled per second",
    "num_frames": "frames sampled per video (overrides fps)",
    "seed": "seed of the draft's initialisation and the sample order",
    "log_every": "log the loss every N steps",
    "eval_every": "measure the held-out tau every N steps (0: never; needs --heldout)",
    "eval_samples": "held-out samples per tau measurement",
    "eval_draft_tokens": "draft tokens per step (k) when measuring the held-out tau",
    "save_every": "checkpoint every N steps (0: only at the end)",
}
