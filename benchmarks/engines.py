"""The methods the speculative benchmarks compare, and an engine for each: the methods table,
the benchmark's configuration, the models under --models and the engine built per method
(every one sharing a prefix cache), with the probes that read a draft's memory per request."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparrow import Engine, SpecConfig
from sparrow.config import EngineConfig
from sparrow.kernels import cpu_prefix
from sparrow.kernels import draft_chain
from sparrow.models.draft import CONFIG_NAME as DRAFT_CONFIG, SparrowDraft
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixCache
from sparrow.world.scenes import LADDER   # (168 px frames, 504 ... 25,056 visual tokens)

# (frame side px, frames): with 14-px patches merged 2x2 and no upscaling, a frame pair of an
# S-px square is (S/28)^2 visual tokens: 504, 1512, 8064, 16992, 25056.
QUICK_LADDER = (LADDER[0], LADDER[-1])
BENCH_SEED = 2 * 10**9          # world videos: training seeds < 1e9, held-out evaluation from 1e9


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    label: str                       # column header
    ablation: bool = False           # ablation drafts: T=0, smallest and largest video only


METHODS = {m.name: m for m in (
    Method("plain", "plain"),
    Method("eagle", "EAGLE (all tokens)"),
    Method("specvlm", "SpecVLM"),
    Method("specvlm-eagle", "EAGLE + SpecVLM pruning"),
    Method("sparrow", "Sparrow"),                            # the default engine: k chosen per step
    Method("sparrow-glimpse", "Sparrow + glimpse"),          # glimpse --glimpse, whatever the draft's
    Method("sparrow-text", "Sparrow, text only"),            # glimpse 0: the window and anchors alone
    Method("sparrow-tree", "Sparrow tree"),
    Method("sparrow-tree-auto", "Sparrow tree, cut by cost"),   # opt-in: SpecConfig.adaptive_tree
    Method("sparrow-compiled", "Sparrow, compiled draft"),   # the default engine, draft_step="compiled"
    Method("ablation-none", "none", ablation=True),
    Method("ablation-window", "window", ablation=True),
    Method("ablation-mtp", "mtp", ablation=True),
    Method("ablation-bridge", "bridge", ablation=True),
)}
# Every drafting method runs under a policy: "adaptive" (the engine's default: each request's k
# chosen per step from measured acceptance and costs, SpecConfig.adaptive_k) or "fixed" (k drafts
# every step). A run's method key names both: "specvlm" is adaptive, "specvlm@fixed" fixed k.
POLICIES = ("adaptive", "fixed")
FIXED = "@fixed"


def method_of(key: str) -> Method:
    """The method a run's key ("sparrow", "sparrow@fixed") runs."""
    return METHODS[key.removesuffix(FIXED)]


def is_adaptive(key: str) -> bool:
    return not key.endswith(FIXED)


def method_label(key: str) -> str:
    """A key's column header: the method's label, ", fixed k" under the fixed policy."""
    return method_of(key).label + ("" if is_adaptive(key) else ", fixed k")


def method_keys(methods: tuple[str, ...], policies: tuple[str, ...]) -> tuple[str, ...]:
    """Each method under each policy (plain, which drafts nothing, once), methods first."""
    return tuple(m if m == "plain" or p == "adaptive" else m + FIXED
                 for m in methods for p in (policies if m != "plain" else policies[:1]))


# Ablation draft -> the context it attends to: "none" and "bridging without window" attend to
# every token (full attention); "window" and "window + MTP" use the text-anchored window.
ABLATIONS = {"none": "all", "window": "text", "mtp": "text", "bridge": "all"}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    models: str = "models"
    videos: tuple[tuple[int, int], ...] = QUICK_LADDER
    temperatures: tuple[float, ...] = (0.0,)
    reps: int = 3
    max_new_tokens: int = 48
    k: int = 4
    glimpse: int = 16
    window: int = 16   # the world drafts are trained with window 16, anchors 32 (world/draft_data.py)
    anchors: int = 32
    tree: tuple[int, int, int] = (4, 2, 16)   # sparrow-tree: width, branch, node budget (depth: k)
    methods: tuple[str, ...] = tuple(m for m in METHODS if m not in ("sparrow-tree-auto", "sparrow-text"))
    policies: tuple[str, ...] = POLICIES   # each drafting method under each (method_keys); both reported
    seed: int = BENCH_SEED
    warmup_tokens: int = 8           # one untimed request per method first (0: none)
    target_step: str = "eager"       # TargetModel.target_step; "compiled": every bucket built before timing
    world: str = "v1"                # whose videos and prompts (benchmarks/world_videos.py); videos in its units

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; known: {list(METHODS)}")
        if "plain" not in self.methods:
            raise ValueError("plain is the reference of every ratio: include it in methods")
        if not self.policies or set(self.policies) - set(POLICIES) or len(set(self.policies)) < len(self.policies):
            raise ValueError(f"policies: one or both of {POLICIES}, got {self.policies}")
        if self.reps < 1 or self.max_new_tokens < 2:
            raise ValueError("need reps >= 1 and max_new_tokens >= 2")

    @property
    def keys(self) -> tuple[str, ...]:
        """The runs' method keys: each method under each policy."""
        return method_keys(self.methods, self.policies)


class Skip(Exception):
    """A method that cannot run here (a model or an API is missing): reported, not fatal."""


# ----- models and engines ---------------------------------------------------------------------
class Models:
    """The models under --models, loaded on first use and shared between engines."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        path = self.root / "world" / "target"
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no target model at {path} (expected a save_pretrained directory; "
                                    f"--models DIR must hold world/target)")
        self.target = TargetModel.from_pretrained(path)
        if self.target.device.type == "cpu":
            cpu_prefix.load()         # the verify kernel built (or loaded) before anything is timed
            draft_chain.EXTENSION.load()     # and the draft's levels
        self._drafts: dict[str, SparrowDraft] = {}
        self._small: TargetModel | None = None

    def draft(self, rel: str) -> SparrowDraft:
        if rel not in self._drafts:
            path = self.root / rel
            if not (path / DRAFT_CONFIG).is_file():
                raise Skip(f"no draft at {path}")
            self._drafts[rel] = SparrowDraft.from_pretrained(path, self.target)
        return self._drafts[rel]

    def small_target(self) -> TargetModel:
        if self._small is None:
            path = self.root / "bench" / "small-target"
            if not (path / "config.json").is_file():
                raise Skip(f"no small target at {path}")
            self._small = TargetModel.from_pretrained(path)
        return self._small


# The engine config a server runs (`sparrow serve`'s defaults): its KV memory written at start.
SERVED = EngineConfig(kv_prefault=True)


def _spec(cfg: BenchConfig, adaptive: bool, **kw) -> SpecConfig:
    """k, the window and anchors of the run, under its policy (adaptive_k: k chosen per step)."""
    return SpecConfig(**{"num_draft_tokens": cfg.k, "window": cfg.window, "anchors": cfg.anchors, "adaptive_k": adaptive,
                         **kw})


def build_engine(key: str, models: Models, cfg: BenchConfig, cache: PrefixCache, keyed_videos: int = 0,
                 config: EngineConfig | None = None) -> Engine:
    """The engine of one method under its policy (key: "eagle", "eagle@fixed", ...), sharing
    `cache` (the videos' prefixes) with all the others.
    keyed_videos (SpecVLM only): 0, no prefix cache (its whole prefill is timed, as here); > 0,
    answers from `cache` and keeps that many videos' small-VLM visual tokens for its hits (the
    serving case: the concurrency benchmark). config: the engine's (a served benchmark passes
    SERVED, what `sparrow serve` runs)."""
    target, name, adaptive = models.target, method_of(key).name, is_adaptive(key)
    if name == "plain":
        return Engine(target, spec=SpecConfig(method="none"), prefix_cache=cache, config=config)
    if name.startswith("sparrow"):
        draft = models.draft("world/draft")
        glimpse = draft.trained_with.get("glimpse", 0)       # the Sparrow methods run the draft's own glimpse
        if name in ("sparrow", "sparrow-compiled"):
            step = "compiled" if name == "sparrow-compiled" else "static"
            spec = _spec(cfg, adaptive, glimpse=glimpse, draft_step=step)
        elif name in ("sparrow-tree", "sparrow-tree-auto"):
            width, branch, budget = cfg.tree
            spec = _spec(cfg, adaptive, glimpse=glimpse, tree_width=width, tree_branch=branch, tree_budget=budget,
                         adaptive_tree=name == "sparrow-tree-auto")
        else:
            spec = _spec(cfg, adaptive, glimpse=cfg.glimpse if name == "sparrow-glimpse" else 0)
        return Engine(target, draft, spec, prefix_cache=cache, config=config)
    if name == "eagle":
        return Engine(target, models.draft("bench/draft-eagle"), _spec(cfg, adaptive, draft_context="all"), prefix_cache=cache, config=config)
    if name == "specvlm-eagle":
        return Engine(target, models.draft("bench/draft-eagle"),
                      _spec(cfg, adaptive, draft_context="pruned", prune_keep=0.1), prefix_cache=cache, config=config)
    if name == "specvlm":
        from sparrow.speculative.specvlm import SpecVLMProposer

        # Its small VLM reads the video's pixels, which a cached prefix drops: a prefix-cache hit
        # needs the small VLM's visual tokens kept from the video's first request (keyed_videos).
        proposer = SpecVLMProposer(target, models.small_target(), keep_ratio=0.1, mass=0.5,
                                   video_cache_entries=keyed_videos)
        return Engine(target, spec=SpecConfig(method="specvlm", num_draft_tokens=cfg.k, adaptive_k=adaptive), proposer=proposer,
                      prefix_cache=cache if keyed_videos else None, config=config)
    if name.startswith("ablation-"):
        kind = name.removeprefix("ablation-")
        return Engine(target, models.draft(f"bench/ablation/{kind}"), _spec(cfg, adaptive, draft_context=ABLATIONS[kind]),
                      prefix_cache=cache, config=config)
    raise ValueError(name)


def compile_target_steps(target: TargetModel, engines: dict[str, Engine], max_tokens: int, log=print) -> None:
    """The target's steps compiled (TargetModel.target_step "compiled"), every graph a run of
    up to `max_tokens` a step can use built now, so compile time stays out of the figures: one
    per token bucket, without features (plain decoding) and with each drafting engine's."""
    target.target_step = "compiled"
    layers = {()} | {e.proposer.needs.feature_layers for e in engines.values()
                     if e.proposer is not None and e.target is target}
    tokens = tuple(range(1, max_tokens + 1))
    seconds = sum(target.step_graph.warm(tokens, tuple(lay)) for lay in sorted(layers))
    log(f"target steps compiled: {len(target.step_graph.compile_seconds)} graphs in {seconds:.0f} s"
        + (f" ({len(target.step_graph.failed)} failed, eager)" if target.step_graph.failed else ""))
