"""Speculative decoding side by side: plain, EAGLE-style, SpecVLM, Sparrow, one engine.

    python -m benchmarks.speculative --quick --out BENCHMARKS.md        # 0.5k and 25k visual tokens
    python -m benchmarks.speculative --out BENCHMARKS.md --json r.json  # the ladder, T=0 and T=1
    python -m benchmarks.speculative --methods plain,sparrow --videos 168x28,168x448 --reps 2

Every method runs through `sparrow.engine.Engine` and its one acceptance path:

    plain            SpecConfig(method="none"): the reference for every ratio and for output identity
    eagle            EAGLE-style draft attending to all tokens (draft_context="all")
    specvlm          SpecVLM: the small target drafts over ~10% of the visual tokens (specvlm_engine)
    specvlm-eagle    the EAGLE draft over SpecVLM-pruned visual tokens (draft_context="pruned")
    sparrow          the Sparrow draft, text-anchored window attention, glimpse 0
    sparrow-glimpse  the same draft with a small glimpse (--glimpse G bridge-layer visual states)
    ablation-*       ablation drafts (T=0, smallest and largest video only; see ABLATIONS)

Models (`--models DIR`): DIR/world/{target,draft} (the committed world pair), DIR/bench/draft-eagle,
DIR/bench/small-target, DIR/bench/ablation/{none,window,mtp,bridge}. A missing optional model
skips its methods with the reason printed; a missing target is an error. Trained or random
weights are all the same to the harness.

Protocol: fresh synthetic world videos (one per rep and length, never a training seed);
per rep, per video the video is decoded and its prefix (system prompt + video) prefilled ONCE,
then every method answers from a copy of that prefix through the engine's prefix cache
(except SpecVLM, whose small VLM re-reads the pixels: it prefills the whole prompt itself);
methods are interleaved within each rep (order rotated per rep) and medians taken over reps.
Decode speedup = plain decode time per token / the method's (prefill excluded); end-to-end adds
video decode, the shared prefix prefill and the method's own prompt prefill. At temperature 0
every method's tokens must equal plain decoding's: a mismatch fails the run (exit status 1).
"""

from __future__ import annotations

import os

# Before torch is imported: OpenMP threads that spin while waiting distort timings on 2 shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

from benchmarks.report import write_section  # noqa: E402
from sparrow import Engine, SamplingParams, SpecConfig  # noqa: E402
from sparrow.models.draft import CONFIG_NAME as DRAFT_CONFIG, SparrowDraft  # noqa: E402
from sparrow.models.target import TargetModel, VideoPrefix  # noqa: E402
from sparrow.prefix_cache import PrefixCache, PrefixEntry  # noqa: E402
from sparrow.video import ProcessedVideo, prepare_video  # noqa: E402

# (frame side px, frames): with 14-px patches merged 2x2 and no upscaling, a frame pair of an
# S-px square is (S/28)^2 visual tokens: 504, 1512, 8064, 16992, 25056.
from sparrow.training.world import LADDER  # noqa: E402  (168 px frames, 504 ... 25,056 visual tokens)
QUICK_LADDER = (LADDER[0], LADDER[-1])
BENCH_SEED = 2 * 10**9          # world videos: training seeds < 1e9, held-out evaluation from 1e9
PAPER_ABLATION_TAU = {"none": (3.95, 2.95), "window": (3.95, 3.86), "mtp": (4.44, 3.51),
                      "bridge": (4.53, 1.21), "all three": (4.51, 4.37)}   # DESIGN.md, 0.5k / 25k


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
    Method("sparrow", "Sparrow"),
    Method("sparrow-glimpse", "Sparrow + glimpse"),
    Method("sparrow-tree", "Sparrow tree"),
    Method("sparrow-tree-auto", "Sparrow tree, cut by cost"),   # opt-in: SpecConfig.adaptive_tree
    Method("sparrow-adaptive", "Sparrow, adaptive k"),      # the concurrency benchmark's; opt-in here
    Method("ablation-none", "none", ablation=True),
    Method("ablation-window", "window", ablation=True),
    Method("ablation-mtp", "mtp", ablation=True),
    Method("ablation-bridge", "bridge", ablation=True),
)}
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
    window: int = 16   # the world drafts are trained with window 16, anchors 32 (training/world_data.py)
    anchors: int = 32
    tree: tuple[int, int, int] = (4, 2, 16)   # sparrow-tree: width, branch, node budget (depth: k)
    methods: tuple[str, ...] = tuple(m for m in METHODS if m not in ("sparrow-adaptive", "sparrow-tree-auto"))
    seed: int = BENCH_SEED
    warmup_tokens: int = 8           # one untimed request per method first (0: none)

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; known: {list(METHODS)}")
        if "plain" not in self.methods:
            raise ValueError("plain is the reference of every ratio: include it in methods")
        if self.reps < 1 or self.max_new_tokens < 2:
            raise ValueError("need reps >= 1 and max_new_tokens >= 2")


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


def _spec(cfg: BenchConfig, **kw) -> SpecConfig:
    return SpecConfig(num_draft_tokens=cfg.k, window=cfg.window, anchors=cfg.anchors, **kw)


def build_engine(name: str, models: Models, cfg: BenchConfig, cache: PrefixCache, keyed_videos: int = 0) -> Engine:
    """The engine of one method, sharing `cache` (the videos' prefixes) with all the others.
    keyed_videos (SpecVLM only): 0, no prefix cache (its whole prefill is timed, as here); > 0,
    answers from `cache` and keeps that many videos' small-VLM visual tokens for its hits (the
    serving case: the concurrency benchmark)."""
    target = models.target
    if name == "plain":
        return Engine(target, spec=SpecConfig(method="none"), prefix_cache=cache)
    if name == "sparrow":
        return Engine(target, models.draft("world/draft"), _spec(cfg, glimpse=0), prefix_cache=cache)
    if name in ("sparrow-tree", "sparrow-tree-auto"):
        width, branch, budget = cfg.tree
        return Engine(target, models.draft("world/draft"),
                      _spec(cfg, glimpse=0, tree_width=width, tree_branch=branch, tree_budget=budget,
                            adaptive_tree=name == "sparrow-tree-auto"), prefix_cache=cache)
    if name == "sparrow-adaptive":       # k chosen per step from measured costs and acceptance (scheduler.DraftPolicy)
        return Engine(target, models.draft("world/draft"), _spec(cfg, glimpse=0, adaptive_k=True), prefix_cache=cache)
    if name == "sparrow-glimpse":
        return Engine(target, models.draft("world/draft"), _spec(cfg, glimpse=cfg.glimpse), prefix_cache=cache)
    if name == "eagle":
        return Engine(target, models.draft("bench/draft-eagle"), _spec(cfg, draft_context="all"), prefix_cache=cache)
    if name == "specvlm-eagle":
        return Engine(target, models.draft("bench/draft-eagle"),
                      _spec(cfg, draft_context="pruned", prune_keep=0.1), prefix_cache=cache)
    if name == "specvlm":
        from sparrow.speculative.specvlm import SpecVLMProposer

        # Its small VLM reads the video's pixels, which a cached prefix drops: a prefix-cache hit
        # needs the small VLM's visual tokens kept from the video's first request (keyed_videos).
        proposer = SpecVLMProposer(target, models.small_target(), keep_ratio=0.1, mass=0.5,
                                   video_cache_entries=keyed_videos)
        return Engine(target, spec=SpecConfig(method="specvlm", num_draft_tokens=cfg.k), proposer=EndProbe(proposer),
                      prefix_cache=cache if keyed_videos else None)
    if name.startswith("ablation-"):
        kind = name.removeprefix("ablation-")
        return Engine(target, models.draft(f"bench/ablation/{kind}"), _spec(cfg, draft_context=ABLATIONS[kind]),
                      prefix_cache=cache)
    raise ValueError(name)


class EndProbe:
    """Wraps a proposer whose draft memory is only known from its per-request state (SpecVLM's
    small-VLM KV cache): reads it when the engine ends the request, then delegates."""

    def __init__(self, inner):
        self.inner = inner
        self.last_bytes: int | None = None      # the benchmark runs one request at a time

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def end(self, state) -> None:
        from sparrow.speculative.specvlm import draft_memory_bytes
        self.last_bytes = draft_memory_bytes(state)
        if hasattr(self.inner, "end"):
            self.inner.end(state)


def draft_kv_bytes(engine: Engine, metrics) -> int | None:
    """Draft memory per request: SpecVLM's small-VLM KV cache (draft_memory_bytes), or for a
    Sparrow-architecture draft (Sparrow, EAGLE-style) the most keys one draft query attended
    to x the bytes of one key and value over the draft's layers."""
    proposer = engine.proposer
    if proposer is None:
        return None
    if isinstance(proposer, EndProbe):
        return proposer.last_bytes
    draft = getattr(proposer, "draft", None)
    if not isinstance(draft, SparrowDraft):
        return None
    c = draft.config
    per_key = 2 * c.num_layers * c.num_kv_heads * c.head_dim * next(draft.parameters()).element_size()
    return metrics.draft_max_keys * per_key


# ----- videos and the shared prefix -------------------------------------------------------------
def world_video(side: int, frames: int, seed: int):
    """A fresh world video as mp4 bytes (a SyntheticVideo) and the options that keep every frame."""
    from sparrow.training.world import WorldVideo

    world = WorldVideo(num_frames=frames, size=side)
    return world.make(seed), dataclasses.replace(world.options(), max_visual_tokens=10**6)   # the ladder goes past 24,576


def make_video(target: TargetModel, side: int, frames: int, seed: int) -> tuple[ProcessedVideo, float]:
    """A fresh world video as mp4 bytes, decoded and patchified as serving does; every frame kept."""
    video, options = world_video(side, frames, seed)
    t0 = time.perf_counter()
    processed = prepare_video(video.source, target.processor, options)
    return processed, time.perf_counter() - t0


def uses_prefix(engine: Engine) -> bool:
    """Engines whose proposer re-reads the video (begin_request) prefill it themselves."""
    return not hasattr(engine.proposer, "begin_request")


def _signature(engine: Engine) -> tuple[tuple[int, ...], int | None, bool]:
    """What the engine's prefill reads from a video prefix: feature layers, bridge layer, and
    whether it needs features at the visual positions (draft context "all" / "pruned")."""
    p = engine.proposer
    if p is None:
        return (), None, False
    layers = tuple(p.needs.feature_layers or ())
    return layers, p.needs.bridge_layer, bool(layers) and engine.spec.draft_context != "text"


def _select_features(prefix: VideoPrefix, union: tuple[int, ...], layers: tuple[int, ...], hidden: int) -> VideoPrefix:
    """The prefix as if prefilled for `layers`: its feature columns are `union`'s, concatenated."""
    if layers == union:
        return prefix
    if not layers:
        return dataclasses.replace(prefix, features=None, visual_features=None)
    cols = torch.cat([torch.arange(union.index(i) * hidden, (union.index(i) + 1) * hidden) for i in layers])
    pick = lambda t: t[:, cols.to(t.device)] if t is not None else None   # noqa: E731
    return dataclasses.replace(prefix, features=pick(prefix.features), visual_features=pick(prefix.visual_features))


def share_prefix(target: TargetModel, processed: ProcessedVideo, prompt: str, engines: dict[str, Engine],
                 cache: PrefixCache, tag: str) -> tuple[dict[str, str], dict[str, float]]:
    """Prefill the video's prefix (system prompt + video) once per bridge layer, with the
    union of the feature layers the engines read (and visual-position features if one needs
    them), and cache one entry per engine signature. Returns each engine's video key and the
    seconds of the prefill it starts from."""
    sigs = {name: _signature(e) for name, e in engines.items() if uses_prefix(e)}
    bridges = sorted({b for _, b, _ in sigs.values() if b is not None}) or [None]
    inputs = target.build_inputs(processed, prompt)
    keys, seconds = {}, {}
    for bridge in bridges:                           # signatures without a bridge go with the first
        group = {n: s for n, s in sigs.items() if s[1] == bridge or (s[1] is None and bridge == bridges[0])}
        union = tuple(sorted({i for layers, _, _ in group.values() for i in layers}))
        visual = any(v for _, _, v in group.values())
        t0 = time.perf_counter()
        prefix = target.prefill_prefix(inputs, union, bridge, visual)
        elapsed = time.perf_counter() - t0
        for name, (layers, _, _) in group.items():
            key = f"{tag}|{layers}|{bridge}|{visual}"
            if cache.get(key) is None:
                cache.put(key, PrefixEntry.of(processed, _select_features(prefix, union, layers, target.hidden_size)))
            keys[name], seconds[name] = key, elapsed
    return keys, seconds


def no_video():
    raise RuntimeError("benchmark prefix missing from the prefix cache (evicted?): refusing to re-prefill")


# ----- one request --------------------------------------------------------------------------------
def run_one(engine: Engine, prompt: str, sampling: SamplingParams, video_key: str | None,
            video: ProcessedVideo):
    """One timed request: from the shared prefix when it has a key, else from the processed
    video (its own prefill). (The test wraps this to corrupt an output.)"""
    if video_key is None:
        return engine.generate(video, prompt, sampling)
    return engine.generate(no_video, prompt, sampling, video_key=video_key)


def _record(out, engine: Engine) -> dict:
    m = out.metrics
    return {"token_ids": list(out.token_ids), "metrics": m.to_dict(), "draft_kv_bytes": draft_kv_bytes(engine, m)}


# ----- the benchmark --------------------------------------------------------------------------------
def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run every (rep, video, temperature, method), interleaved; return raw runs, per-cell
    summaries, identity mismatches (T=0) and skipped methods. JSON-serialisable."""
    models = Models(cfg.models)
    target = models.target
    cache = PrefixCache(max_bytes=64 << 30, max_entries=64)
    engines, skipped = {}, {}
    for name in cfg.methods:
        try:
            engines[name] = build_engine(name, models, cfg, cache)
        except Skip as e:
            skipped[name] = str(e)
            log(f"skip {name}: {e}")
    runs, videos, mismatches = [], [], []
    warmup = cfg.warmup_tokens
    for rep in range(cfg.reps):
        order = list(engines)
        order = order[rep % len(order):] + order[: rep % len(order)]     # rotated: no method always first
        for vi in range(len(cfg.videos)):
            video = run_video(cfg, target, {n: engines[n] for n in order}, cache, rep, vi, warmup, log)
            warmup = 0
            videos.append(video["video"])
            runs += video["runs"]
            mismatches += video["mismatches"]
    summary = summarize(runs)
    for line in _mismatch_lines(mismatches):
        log(line)
    return {"config": dataclasses.asdict(cfg), "machine": machine(), "target": describe_target(target),
            "skipped": skipped, "videos": videos, "runs": runs, "summary": summary,
            "mismatches": mismatches, "identical": not mismatches}


def run_video(cfg: BenchConfig, target: TargetModel, engines: dict[str, Engine], cache: PrefixCache,
              rep: int, vi: int, warmup: int, log: Callable[[str], None]) -> dict:
    """One fresh video of the ladder in one rep: decode it, prefill its prefix once, then
    every temperature x method (in the given order) from that prefix."""
    side, frames = cfg.videos[vi]
    processed, video_s = make_video(target, side, frames, cfg.seed + 1000 * rep + vi)
    prompt = _prompts()[(rep + vi) % len(_prompts())]
    keys, prefix_s = share_prefix(target, processed, prompt, engines, cache, f"r{rep}v{vi}")
    n_vis = processed.num_visual_tokens
    shared_s = max(prefix_s.values(), default=0.0)
    log(f"rep {rep}: {side}px x {frames} frames = {n_vis} visual tokens (video {video_s:.2f} s, "
        f"prefix prefill {shared_s:.2f} s)")
    for name, engine in engines.items() if warmup else ():     # untimed: first-call costs
        run_one(engine, prompt, SamplingParams(max_new_tokens=warmup, ignore_eos=True), keys.get(name), processed)
    runs, mismatches = [], []
    for temp in cfg.temperatures:
        # The answer as a user gets it: it ends at the model's end of turn (at T=0 every method
        # gives plain's tokens, so the same count; at T=1 time per token is what is compared).
        sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=temp,
                                  seed=cfg.seed + 7919 * rep + vi)
        cell = {}
        for name, engine in engines.items():
            if METHODS[name].ablation and (temp != 0.0 or (side, frames) not in _ends(cfg.videos)):
                continue
            out = run_one(engine, prompt, sampling, keys.get(name), processed)
            r = _record(out, engine)
            m = r["metrics"]
            # end to end: video decode + the prefix prefill it starts from (none for an engine
            # that prefills the whole prompt itself) + its own prefill + decode
            r.update(rep=rep, side=side, frames=frames, visual_tokens=n_vis, temperature=temp, method=name,
                     e2e_seconds=video_s + prefix_s.get(name, 0.0) + m["video_seconds"] + m["prefill_seconds"]
                     + m["decode_seconds"])
            runs.append(r)
            cell[name] = r
        if temp == 0.0:
            mismatches += check_identity(cell)
    cache.clear()
    return {"video": {"rep": rep, "side": side, "frames": frames, "visual_tokens": n_vis, "video_seconds": video_s,
                      "prefix_seconds": shared_s}, "runs": runs, "mismatches": mismatches}


def _prompts() -> tuple[str, ...]:
    from sparrow.training.world import CAPTION_PROMPTS
    return CAPTION_PROMPTS


def _ends(videos) -> tuple:
    return (videos[0], videos[-1])


def check_identity(cell: dict[str, dict]) -> list[dict]:
    """At T=0 every method must emit plain decoding's tokens, token for token."""
    ref = cell["plain"]["token_ids"]
    bad = []
    for name, r in cell.items():
        diff = first_difference(ref, r["token_ids"])
        if diff is not None:
            bad.append({"method": name, "rep": r["rep"], "visual_tokens": r["visual_tokens"], **diff})
    return bad


def first_difference(ref: list[int], got: list[int]) -> dict | None:
    """Where two token sequences first differ (None: equal), with the 8 tokens from there on."""
    if got == ref:
        return None
    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return {"index": first, "expected": ref[first: first + 8], "got": got[first: first + 8],
            "lengths": [len(ref), len(got)]}


def _mismatch_lines(mismatches: list[dict]) -> list[str]:
    return [f"MISMATCH at T=0: {b['method']} (rep {b['rep']}, {b['visual_tokens']} visual tokens) differs from "
            f"plain at token {b['index']}: expected {b['expected']}, got {b['got']} (lengths {b['lengths']})"
            for b in mismatches]


# ----- summaries ------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> list[dict]:
    """Per (temperature, visual tokens, method): medians over reps of the timings, pooled
    acceptance counts, and ratios against plain of the same cell (ratio of medians)."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["temperature"], r["visual_tokens"], r["method"]), []).append(r)
    rows = []
    order = list(METHODS)
    for (temp, n_vis, method), rs in sorted(cells.items(), key=lambda kv: (kv[0][:2], order.index(kv[0][2]))):
        ms = [r["metrics"] for r in rs]
        steps = sum(m["steps"] for m in ms)
        accepted = sum(m["accepted_tokens"] for m in ms)
        width = max(len(m["accepted_per_position"]) for m in ms)
        per_pos = [sum(m["accepted_per_position"][i] for m in ms if i < len(m["accepted_per_position"])) / steps
                   for i in range(width)] if steps else []
        mem = [r["draft_kv_bytes"] for r in rs if r["draft_kv_bytes"] is not None]
        rows.append({
            "temperature": temp, "visual_tokens": n_vis, "method": method, "reps": len(rs),
            "decode_ms_per_token": statistics.median(m["decode_seconds"] * 1e3 / max(1, m["completion_tokens"] - 1)
                                                     for m in ms),
            "e2e_seconds": statistics.median(r["e2e_seconds"] for r in rs),
            "tau": 1 + accepted / steps if steps else 0.0,
            "accepted_per_step": accepted / steps if steps else 0.0,
            "acceptance_per_position": per_pos,
            "draft_ms_per_step": statistics.median(m["draft_seconds"] * 1e3 / max(1, m["steps"]) for m in ms),
            "verify_ms_per_step": statistics.median((m["verify_seconds"] or m["decode_seconds"]) * 1e3
                                                    / max(1, m["steps"]) for m in ms),
            "draft_kv_bytes": max(mem) if mem else None,
            "draft_max_keys": max(m["draft_max_keys"] for m in ms),
        })
    plain = {(r["temperature"], r["visual_tokens"]): r for r in rows if r["method"] == "plain"}
    for r in rows:
        p = plain.get((r["temperature"], r["visual_tokens"]))
        r["decode_speedup"] = p["decode_ms_per_token"] / r["decode_ms_per_token"] if p else None
        r["e2e_speedup"] = p["e2e_seconds"] / r["e2e_seconds"] if p else None
    return rows


def _find(summary: list[dict], method: str, temp: float, n_vis: int) -> dict | None:
    return next((r for r in summary if r["method"] == method and r["temperature"] == temp
                 and r["visual_tokens"] == n_vis), None)


def bars(result: dict) -> list[dict]:
    """The acceptance bars of issue 6, at T=0, smallest vs largest video of the run."""
    summary = result["summary"]
    sizes = sorted({r["visual_tokens"] for r in summary if r["temperature"] == 0.0})
    if not sizes:
        return []
    lo, hi = sizes[0], sizes[-1]
    s_lo, s_hi = _find(summary, "sparrow", 0.0, lo), _find(summary, "sparrow", 0.0, hi)

    def bar(name, measured, need, ok_if_ge=True, unit=""):
        if measured is None or need is None:
            return {"bar": name, "measured": None, "needed": need, "margin": None, "pass": None}
        margin = measured - need if ok_if_ge else need - measured
        return {"bar": name, "measured": measured, "needed": need, "margin": margin, "pass": margin >= 0, "unit": unit}

    get = lambda r, k: r[k] if r is not None else None   # noqa: E731
    out = [
        bar(f"Sparrow tau @{_k(hi)} >= 95% of tau @{_k(lo)}", get(s_hi, "tau"),
            0.95 * s_lo["tau"] if s_lo else None),
        bar(f"Sparrow draft ms/step @{_k(hi)} <= 1.1x @{_k(lo)}", get(s_hi, "draft_ms_per_step"),
            1.1 * s_lo["draft_ms_per_step"] if s_lo else None, ok_if_ge=False, unit=" ms"),
        bar(f"Sparrow decode speedup @{_k(hi)} >= 2.5x", get(s_hi, "decode_speedup"), 2.5, unit="x"),
    ]
    for other in ("eagle", "specvlm"):
        o = _find(summary, other, 0.0, hi)
        out.append(bar(f"Sparrow speedup @{_k(hi)} >= 1.3x {other}'s", get(s_hi, "decode_speedup"),
                       1.3 * o["decode_speedup"] if o else None, unit="x"))
    return out


# ----- report -----------------------------------------------------------------------------------------
def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def report(result: dict, plot_path: str | None = None) -> str:
    cfg, summary = result["config"], result["summary"]
    shown = [m for m in cfg["methods"] if m in {r["method"] for r in summary} and not METHODS[m].ablation]
    lines = [f"Machine: {result['machine']}.", f"Target: {result['target']}. k = {cfg['k']}, window {cfg['window']}, "
             f"anchors {cfg['anchors']}, glimpse (sparrow-glimpse) {cfg['glimpse']}; {cfg['max_new_tokens']} new "
             f"tokens (answers end at the end of turn), {cfg['reps']} reps, methods interleaved per rep, medians; fresh world "
             f"videos (seeds from {cfg['seed']}), caption prompts.", ""]
    if result["skipped"]:
        lines += ["Skipped: " + "; ".join(f"{m} ({why})" for m, why in result["skipped"].items()) + ".", ""]
    ident = "all methods' tokens equal plain decoding's" if result["identical"] else \
        f"**{len(result['mismatches'])} MISMATCHES**"
    lines += [f"Output identity at T=0: {ident}.", ""]
    for temp in cfg["temperatures"]:
        sizes = sorted({r["visual_tokens"] for r in summary if r["temperature"] == temp})
        lines += [f"**T = {temp:g}.** Cell: decode speedup / tau / draft ms per step / verify ms per step "
                  f"(plain: its decode step) / draft KV per request.", "",
                  "| visual tokens | " + " | ".join(METHODS[m].label for m in shown) + " |",
                  "|---|" + "---|" * len(shown)]
        for n in sizes:
            cells = []
            for m in shown:
                r = _find(summary, m, temp, n)
                draft_ms = "-" if m == "plain" else f"{r['draft_ms_per_step']:.2f}" if r else ""
                cells.append("-" if r is None else f"{_x(r['decode_speedup'])} / {r['tau']:.2f} / {draft_ms} / "
                             f"{r['verify_ms_per_step']:.2f} / {_bytes(r['draft_kv_bytes'])}")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += ["", "| visual tokens | method | decode ms/token | decode speedup | end-to-end s | end-to-end speedup "
                  "| tau | accepted/step | acceptance per position | draft keys |", "|---" * 10 + "|"]
        for n in sizes:
            for m in shown:
                r = _find(summary, m, temp, n)
                if r is not None:
                    pos = " ".join(f"{p:.2f}" for p in r["acceptance_per_position"]) or "-"
                    lines.append(f"| {n} | {m} | {r['decode_ms_per_token']:.2f} | {_x(r['decode_speedup'])} | "
                                 f"{r['e2e_seconds']:.2f} | {_x(r['e2e_speedup'])} | {r['tau']:.2f} | "
                                 f"{r['accepted_per_step']:.2f} | {pos} | {r['draft_max_keys'] or '-'} |")
        lines.append("")
    lines += ablation_table(result) + bars_table(result)
    if result.get("gpu"):
        lines += gpu_lines(result["gpu"])
    if plot_path:
        lines += [f"![decode speedup and tau vs visual tokens]({plot_path})", ""]
    return "\n".join(lines).rstrip("\n")


def ablation_table(result: dict) -> list[str]:
    summary = result["summary"]
    sizes = sorted({r["visual_tokens"] for r in summary if r["temperature"] == 0.0})
    rows = [(kind, f"ablation-{kind}") for kind in ABLATIONS] + [("all three", "sparrow")]
    if not sizes or not any(_find(summary, m, 0.0, sizes[0]) for _, m in rows[:-1]):
        return ["Ablation: no ablation draft ran (models under bench/ablation/ missing or not selected).", ""]
    lo, hi = sizes[0], sizes[-1]
    lines = [f"Ablation (T = 0): tau at {lo} and {hi} visual tokens. none: full attention, no MTP, no bridging; "
             "window: text-anchored window only; mtp: window + multi-token unrolling; bridge: bridging without "
             "window; all three: the world draft. Paper column: DESIGN.md's secondary-source figures (0.5k / 25k).",
             "", f"| draft | tau @{_k(lo)} | tau @{_k(hi)} | @{_k(hi)} / @{_k(lo)} | paper 0.5k / 25k |",
             "|---|---|---|---|---|"]
    for kind, m in rows:
        a, b = _find(summary, m, 0.0, lo), _find(summary, m, 0.0, hi)
        ratio = f"{b['tau'] / a['tau']:.2f}" if a and b and a["tau"] else "-"
        paper = PAPER_ABLATION_TAU[kind]
        lines.append(f"| {kind} | {a['tau'] if a else float('nan'):.2f} | {b['tau'] if b else float('nan'):.2f} | "
                     f"{ratio} | {paper[0]} / {paper[1]} |")
    return lines + [""]


def bars_table(result: dict) -> list[str]:
    lines = ["Bars (T = 0, smallest vs largest video of this run):", "",
             "| bar | measured | needed | margin | result |", "|---|---|---|---|---|"]
    for b in bars(result):
        if b["pass"] is None:
            measured = "-" if b["measured"] is None else f"{b['measured']:.2f}"
            needed = "-" if b["needed"] is None else f"{b['needed']:.2f}"
            lines.append(f"| {b['bar']} | {measured} | {needed} | - | n/a (not measured) |")
        else:
            u = b["unit"]
            lines.append(f"| {b['bar']} | {b['measured']:.2f}{u} | {b['needed']:.2f}{u} | {b['margin']:+.2f}{u} | "
                         f"{'pass' if b['pass'] else 'miss'} |")
    return lines + [""]


def plot(result: dict, path: str | Path) -> None:
    """Decode speedup and tau vs visual tokens (log x), one line per method; T=0 solid, others dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    methods = [m for m in result["config"]["methods"] if not METHODS[m].ablation]
    for temp in result["config"]["temperatures"]:
        for i, m in enumerate(methods):
            rows = sorted((r for r in summary if r["method"] == m and r["temperature"] == temp),
                          key=lambda r: r["visual_tokens"])
            if not rows:
                continue
            x = [r["visual_tokens"] for r in rows]
            style = dict(color=f"C{i}", marker="o", linestyle="-" if temp == 0.0 else "--",
                         label=f"{METHODS[m].label} (T={temp:g})")
            ax1.plot(x, [r["decode_speedup"] for r in rows], **style)
            ax2.plot(x, [r["tau"] for r in rows], **style)
    for ax, title in ((ax1, "decode speedup vs plain"), (ax2, "mean acceptance length tau")):
        ax.set_xscale("log")
        ax.set_xlabel("visual tokens")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax1.axhline(1.0, color="grey", linewidth=0.8)
    ax2.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----- machine --------------------------------------------------------------------------------------
def machine() -> str:
    try:
        model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                     platform.processor())
    except OSError:
        model = platform.processor() or platform.machine()
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", CPU only"
    return (f"{model}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), load average "
            f"{os.getloadavg()[0]:.1f} at start, torch {torch.__version__}{gpu}")


def describe_target(target: TargetModel) -> str:
    c = target.text_config
    return (f"{target.hf.config.model_type} (hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
            f"vocab {target.vocab_size}), {str(target.hf.dtype).removeprefix('torch.')}")


# ----- GPU: a 7B-shaped target, step costs, projection --------------------------------------------------
QWEN7B = dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064)


def step_costs(device: torch.device, dtype: torch.dtype, shape: dict, context: int | list[int], k: int,
               reps: int = 20, sizes: tuple[int, ...] = (), tree: tuple[int, int, int] | None = None,
               batch: int = 1) -> dict | list[dict]:
    """Random text decoder of `shape` with `context` tokens cached: ms of a plain decode step,
    a verify step of k+1 tokens, and Sparrow's k draft steps + commit (a draft of that hidden size);
    `sizes`: also the target step scoring that many tokens at once ("verify_curve", ms by size:
    a tree of N nodes is verified as N + 1 tokens; its mask costs what a causal one does);
    `tree` (width, branch, budget): also the draft growing such a tree of depth k ("draft_tree_ms").
    `batch` > 1: the target steps score that many rows at once (each with `context` cached);
    the draft is timed for one request. A list of contexts builds the models once and returns one dict per context."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sparrow.models.draft import DraftConfig

    contexts = context if isinstance(context, list) else [context]
    h = shape["hidden"]
    config = Qwen2Config(hidden_size=h, num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate"],
                         vocab_size=shape["vocab"], max_position_embeddings=max(contexts) + 1024,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config).eval()
            draft = SparrowDraft(DraftConfig(
                hidden_size=h, intermediate_size=shape["intermediate"], num_layers=1, num_heads=shape["heads"],
                num_kv_heads=shape["kv_heads"], head_dim=h // shape["heads"], vocab_size=shape["vocab"],
                feature_layers=(2, shape["layers"] // 2, shape["layers"] - 3),
                bridge_layer=shape["layers"] // 2)).eval()
    finally:
        torch.set_default_dtype(old)

    class _Shim:          # what SparrowDraft.bind reads from a target
        num_layers = shape["layers"]
        embed_tokens = staticmethod(lambda: model.model.embed_tokens)
        lm_head = staticmethod(lambda: model.lm_head)
    draft.bind(_Shim())

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = [_costs_at(model, draft, device, dtype, shape, n, k, reps, sizes, tree, batch, sync, gen) for n in contexts]
    return out if isinstance(context, list) else out[0]


def _costs_at(model, draft, device, dtype, shape, context, k, reps, sizes, tree, batch, sync, gen) -> dict:
    from sparrow.models.kv_cache import new_kv_cache
    from sparrow.speculative.sparrow_proposer import DraftContext, SparrowProposer

    h = shape["hidden"]
    kv = new_kv_cache("static", shape["layers"], context + max((k + 1, *sizes)) + 8)
    with torch.inference_mode():
        for start in range(0, context, 2048):
            ids = torch.randint(0, shape["vocab"], (batch, min(2048, context - start)), generator=gen).to(device)
            model(input_ids=ids, past_key_values=kv, use_cache=True, logits_to_keep=1)

        def timed(fn) -> float:
            fn()                                      # warm-up
            times = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)

        def target_step(n):
            def run():
                model(input_ids=torch.randint(0, shape["vocab"], (batch, n), generator=gen).to(device),
                      past_key_values=kv, use_cache=True)
                kv.crop(-n)
            return run

        decode_ms, verify_ms = timed(target_step(1)), timed(target_step(k + 1))
        curve = {n: timed(target_step(n)) for n in sizes}
        # Eager HF steps on a GPU are bound by kernel launches from the host: the GPU's own busy
        # time per step (kernels summed, what CUDA graphs / a compiled step would approach).
        profiled = max(2, reps // 4)       # the profiler's own cost per step is large; kernel times are steady
        busy = ({n: kernel_ms(target_step(n), profiled) for n in sorted({1, k + 1, *sizes})}
                if device.type == "cuda" else {})
        nf = len(draft.config.feature_layers) * h
        ctx = DraftContext(torch.randint(0, shape["vocab"], (96,), generator=gen).to(device),   # 64 prompt + 32 more
                           torch.randn(96, nf, generator=gen).to(device, dtype), 64,
                           torch.zeros(0, h, device=device, dtype=dtype))
        proposer = SparrowProposer(draft, SpecConfig(num_draft_tokens=k))
        state = proposer.begin_context(ctx)
        sampling = SamplingParams()
        propose_ms = timed(lambda: proposer.propose_one(state, k, sampling, gen))
        tree_ms = None
        if tree is not None:
            width, branch, budget = tree
            grower = SparrowProposer(draft, SpecConfig(num_draft_tokens=k, tree_width=width, tree_branch=branch,
                                                       tree_budget=budget))
            grown = grower.begin_context(ctx)
            def grow():
                grower.propose_one(grown, k, sampling, gen)
                grown.kv.truncate(grown.committed)          # what the commit would drop first
            tree_ms = timed(grow)
        feats = torch.randn(2, nf, generator=gen).to(device, dtype)
        commit_ms = timed(lambda: proposer.commit_one(state, [1, 2], feats))
        if device.type == "cuda":
            busy["draft_chain"] = kernel_ms(lambda: proposer.propose_one(state, k, sampling, gen), profiled)
            busy["draft_commit"] = kernel_ms(lambda: proposer.commit_one(state, [1, 2], feats), profiled)
            if tree is not None:
                busy["draft_tree"] = kernel_ms(grow, profiled)
    print(f"  {context} cached tokens x {batch}: decode {decode_ms:.2f} ms, kernels {busy}", flush=True)
    return {"decode_ms": decode_ms, "verify_ms": verify_ms, "draft_propose_ms": propose_ms,
            "draft_step_ms": propose_ms / k, "draft_commit_ms": commit_ms, "context": context, "k": k,
            "verify_curve": curve, "draft_tree_ms": tree_ms, "batch": batch, "kernel_ms": busy}


def kernel_ms(fn, reps: int) -> float:
    """ms of GPU kernel time per call of fn (CUDA kernels summed over reps calls, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(getattr(e, "device_time", 0.0) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / 1e3 / reps


def gpu_mode(k: int, taus: list[float], context: int = 25_000) -> dict:
    if not torch.cuda.is_available():
        print("--gpu: skipped (torch.cuda.is_available() is False)")
        return {"skipped": "torch.cuda.is_available() is False"}
    costs = step_costs(torch.device("cuda"), torch.bfloat16, QWEN7B, context, k)
    costs["device"] = torch.cuda.get_device_name(0)
    costs["ratio"] = costs["draft_step_ms"] / costs["decode_ms"]
    round_ms = costs["draft_propose_ms"] + costs["verify_ms"] + costs["draft_commit_ms"]
    costs["projection"] = {f"{t:.2f}": t * costs["decode_ms"] / round_ms for t in taus}
    return costs


def gpu_lines(g: dict) -> list[str]:
    if "skipped" in g:
        return [f"GPU mode: skipped ({g['skipped']}).", ""]
    lines = [f"GPU ({g['device']}): random Qwen2.5-VL-7B-shaped text decoder, bf16, {g['context']} tokens in the KV "
             f"cache; Sparrow draft of that hidden size, 1 layer, k = {g['k']}.", "",
             "| plain decode step ms | verify (k+1) ms | draft step ms | draft commit ms | draft / target step |",
             "|---|---|---|---|---|",
             f"| {g['decode_ms']:.2f} | {g['verify_ms']:.2f} | {g['draft_step_ms']:.2f} | {g['draft_commit_ms']:.2f} "
             f"| {g['ratio']:.3f} |", "",
             "Projection (not a measurement): decode speedup = tau x decode step / (k draft steps + verify + commit): "
             + ", ".join(f"tau {t}: {s:.2f}x" for t, s in g["projection"].items()) + ".", ""]
    return lines


# ----- CLI ------------------------------------------------------------------------------------------
def _videos(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in text.split(","):
        side, frames = item.lower().split("x")
        out.append((int(side), int(frames)))
    return tuple(out)


def run_timed(run: Callable[[], dict]) -> dict | None:
    """run() with its wall time added as "wall_seconds"; None, the reason on stderr, when a
    model it needs is missing (the CLI's exit status 2)."""
    t0 = time.perf_counter()
    try:
        result = run()
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="models", help="DIR with world/{target,draft} and bench/ baselines")
    ap.add_argument("--quick", action="store_true", help="0.5k and 25k tokens, T=0, 2 reps, 48 new tokens")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {list(METHODS)}")
    ap.add_argument("--videos", default=None, help="comma list of SIDExFRAMES (default: the ladder; quick: its ends)")
    ap.add_argument("--temperatures", default=None, help="comma list (default 0,1; quick 0)")
    ap.add_argument("--reps", type=int, default=None, help="default 5 (quick 2)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 96 (quick 48)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--glimpse", type=int, default=16, help="glimpse of sparrow-glimpse")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--tree", default="4,2,16", help="sparrow-tree: WIDTH,BRANCH,BUDGET (depth is --k)")
    ap.add_argument("--seed", type=int, default=BENCH_SEED)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared 2-core box)")
    ap.add_argument("--out", default=None, help="write the 'speculative' section of this markdown file")
    ap.add_argument("--plot", default="benchmarks/speculative.png", help="PNG written with --out")
    ap.add_argument("--json", default=None, help="raw results")
    ap.add_argument("--gpu", action="store_true", help="also time a 7B-shaped target on CUDA (projection)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    q = args.quick
    cfg = BenchConfig(
        models=args.models,
        videos=_videos(args.videos) if args.videos else (QUICK_LADDER if q else LADDER),
        temperatures=tuple(float(t) for t in args.temperatures.split(",")) if args.temperatures else
        ((0.0,) if q else (0.0, 1.0)),
        reps=args.reps or (2 if q else 5), max_new_tokens=args.max_new_tokens or (48 if q else 96),
        k=args.k, glimpse=args.glimpse, window=args.window, anchors=args.anchors,
        tree=tuple(int(x) for x in args.tree.split(",")),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()), seed=args.seed)
    result = run_timed(lambda: run_benchmark(cfg))
    if result is None:
        return 2
    if args.gpu:
        taus = sorted({round(r["tau"], 2) for r in result["summary"] if r["method"] == "sparrow"}) or [3.0]
        result["gpu"] = gpu_mode(cfg.k, [3.0, 3.8] + taus)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    command = "python -m benchmarks.speculative " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(result, args.plot if args.out else None)
    print(text)
    print(f"({result['wall_seconds']:.0f} s)")
    if not result["identical"]:
        print("\n".join(_mismatch_lines(result["mismatches"])), file=sys.stderr)
        print("FAILED: speculative output differs from plain decoding at T=0 (nothing written)", file=sys.stderr)
        return 1
    if args.out:
        plot(result, args.plot)
        write_section(args.out, "speculative", "Speculative decoding side by side (world models)", command, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
