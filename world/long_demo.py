"""`sparrow demo --long`: the product's case in one command. A fresh world video of ~25k
visual tokens (168 px x 1392 frames by default); the answer to a caption request streams
while the video decodes and the prefill advances (with the time left); then plain decoding,
an EAGLE-style draft (the same draft architecture attending to every token, visual ones
included) and Sparrow answer the same question, timed in this run, side by side: decode
ms/token, speedup over plain, tau, and how many keys one draft query read. A small plot too.

Each method's engine prefills the video once (with progress) and keeps the video's prefix in
its own prefix cache; the timed answers then start from it, so they differ only in decoding.
At temperature 0 the three answers must be identical (lossless), or the demo fails.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

import torch

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.output import GenerationOutput
from sparrow.errors import InvalidRequest
from sparrow.models.draft import CONFIG_NAME as DRAFT_CONFIG, SparrowDraft
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixCache
from sparrow.progress import ProgressLine, watch_prefill
from sparrow.video import ProcessedVideo, prepare_video

from sparrow.world.scenes import CAPTION_PROMPTS, LONGEST_VIDEO_TOKENS, WorldVideo, caption
from sparrow.world.pair_demo import DEFAULT_MODELS, check_world_video

DEFAULT_EAGLE = DEFAULT_MODELS.parent / "bench" / "draft-eagle"
METHODS = ("plain", "eagle-style", "sparrow")
LABELS = {"plain": "plain (no draft)", "eagle-style": "EAGLE-style (all tokens)", "sparrow": "Sparrow"}
# The EAGLE-style draft is trained with this window and these anchors (world/draft_data.py);
# the Sparrow draft runs the geometry saved with it (window, anchors, glimpse).
WINDOW, ANCHORS = 16, 32


@dataclass(frozen=True)
class LongDemoConfig:
    """frames x size: the world video (168 x 1392 = 25,056 visual tokens). reps: timed answers
    per method after its first (which pays the prefill); the median is reported. plot: where
    the figure goes (None: none)."""

    frames: int = 1392
    size: int = 168
    k: int = 4
    max_new_tokens: int = 96
    seed: int | None = None
    reps: int = 3
    plot: str | None = "sparrow-demo-long.png"
    models: Path = DEFAULT_MODELS
    eagle: Path = DEFAULT_EAGLE
    dtype: str = "float32"
    device: str = "cpu"
    # torch intra-op threads. One, as the benchmarks use: the tiny target's decode steps are too
    # small to share, and on a shared 2-core machine a second thread makes timings erratic.
    threads: int = 1

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise InvalidRequest(f"--threads must be >= 1, got {self.threads}")
        check_world_video(self.frames, self.size, LONGEST_VIDEO_TOKENS)
        if not 1 <= self.k <= 32:
            raise InvalidRequest(f"--k must be in [1, 32], got {self.k}")
        if self.max_new_tokens < 2 or self.reps < 1:
            raise InvalidRequest("need --max-new-tokens >= 2 and --reps >= 1")
        for what, path, marker in (("target", Path(self.models) / "target", "config.json"),
                                   ("Sparrow draft", Path(self.models) / "draft", DRAFT_CONFIG),
                                   ("EAGLE-style draft", Path(self.eagle), DRAFT_CONFIG)):
            if not (path / marker).is_file():
                raise InvalidRequest(f"no {what} at {path} (no {marker})")


def run_long_demo(cfg: LongDemoConfig, print_fn: Callable[..., None] = print,
                  progress: TextIO | None = None) -> dict:
    """Runs the demo, prints as it goes; returns the measurements (and 'lossless')."""
    progress = progress or sys.stderr
    torch.set_num_threads(cfg.threads)
    seed = random.SystemRandom().randrange(10**6, 10**9) if cfg.seed is None else cfg.seed
    target = TargetModel.from_pretrained(Path(cfg.models) / "target", dtype=cfg.dtype, device=cfg.device)
    engines = _engines(target, cfg)
    world = WorldVideo(num_frames=cfg.frames, size=cfg.size)

    t0 = time.perf_counter()
    video = world.make(seed)
    print_fn(f"video: seed {seed}, {video.num_frames} frames {video.width}x{video.height} at {video.fps:g} fps "
             f"({len(video.data) / 1e3:,.0f} kB mp4, {len(video.events)} events), rendered in "
             f"{time.perf_counter() - t0:.1f} s")
    processed = _decode(video.data, target, world, print_fn)
    prompt = random.Random(seed).choice(CAPTION_PROMPTS)
    truth = caption(video.events)
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    target.check_fits(len(target.prompt_ids(prompt, processed.num_visual_tokens)), cfg.max_new_tokens, cfg.k + 1)
    print_fn(f"models: {cfg.models} (target, Sparrow draft), {cfg.eagle} (EAGLE-style draft); k={cfg.k}")

    print_fn(f"\nQ: {prompt}")
    first = {"sparrow": _stream_first(engines["sparrow"], processed, prompt, sampling, print_fn, progress)}
    correct = first["sparrow"].text.strip() == truth
    print_fn(f"   correct: {correct}" + ("" if correct else f" (truth: {truth})"))

    print_fn("\nThe same question with the other methods (each prefills the video once, then answers "
             f"{cfg.reps}x from its cached prefix, timed):")
    for name in ("plain", "eagle-style"):
        first[name] = _prefill_run(name, engines[name], processed, prompt, sampling, progress)
    runs = {name: [] for name in METHODS}
    for _ in range(cfg.reps):               # interleaved, so machine noise falls on every method alike
        for name in METHODS:
            runs[name].append(engines[name].generate(_cached_only, prompt, sampling, video_key=_KEY))
    for engine in engines.values():
        engine.close()

    rows = _rows(first, runs)
    lossless = all(out.token_ids == first["plain"].token_ids for outs in runs.values() for out in [*outs])
    lossless = lossless and all(out.token_ids == first["plain"].token_ids for out in first.values())
    print_fn("")
    for line in table(rows, processed.num_visual_tokens, cfg.reps):
        print_fn(line)
    print_fn(f"identical answers from all three (lossless): {lossless}")
    plot_note = save_plot(rows, processed.num_visual_tokens, cfg.plot) if cfg.plot else "no plot (--plot '')"
    print_fn(plot_note)
    return {"seed": seed, "visual_tokens": processed.num_visual_tokens, "prompt": prompt,
            "answer": first["sparrow"].text, "correct": correct, "rows": rows, "lossless": lossless}


# ----- pieces -----------------------------------------------------------------------------------
_KEY = "demo-long-video"


def _cached_only(cancelled=None):
    raise RuntimeError("the video's prefix left the prefix cache: refusing to decode it again")


def _engines(target: TargetModel, cfg: LongDemoConfig) -> dict[str, Engine]:
    spec = dict(num_draft_tokens=cfg.k, window=WINDOW, anchors=ANCHORS)
    sparrow_draft = SparrowDraft.from_pretrained(Path(cfg.models) / "draft", target)
    eagle_draft = SparrowDraft.from_pretrained(cfg.eagle, target)
    # One prefix cache each: the engines read different features from the prefill.
    return {"plain": Engine(target, spec=SpecConfig(method="none"), prefix_cache=PrefixCache(max_entries=1)),
            "eagle-style": Engine(target, eagle_draft, SpecConfig(method="eagle-style", **spec),
                                  prefix_cache=PrefixCache(max_entries=1)),
            "sparrow": Engine(target, sparrow_draft,
                              SpecConfig.as_trained(sparrow_draft.trained_with, cfg.k, method="sparrow"),
                              prefix_cache=PrefixCache(max_entries=1))}


def _decode(data: bytes, target: TargetModel, world: WorldVideo, print_fn) -> ProcessedVideo:
    """PyAV decode and patchify, as serving does (the demo passes the result to every engine)."""
    t0 = time.perf_counter()
    processed = prepare_video(data, target.processor, world.options())
    print_fn(f"decoded {len(processed.timestamps)} frames -> {processed.num_visual_tokens:,} visual tokens "
             f"in {time.perf_counter() - t0:.1f} s")
    return processed


def _stream_first(engine: Engine, processed: ProcessedVideo, prompt: str, sampling: SamplingParams,
                  print_fn, progress: TextIO) -> GenerationOutput:
    """Sparrow's answer, streamed; the prefill's progress on `progress` until the first token."""
    line = ProgressLine("prefill (Sparrow)", processed.num_visual_tokens, " positions", progress)
    gen = engine.stream(lambda cancelled: processed, prompt, sampling, video_key=_KEY)
    stop = watch_prefill(gen, line)
    started = False
    try:
        for delta in gen:
            if not started:
                stop()
                started = True
                line.finish(f"{gen.request.metrics.prefill_seconds:.1f} s")
                print_fn("A: ", end="")
            print_fn(delta.text, end="")
    finally:
        if not started:
            stop()
    out = gen.output
    m = out.metrics
    print_fn(f"\n   {m.completion_tokens} tokens; prompt {m.prompt_tokens:,} tokens ({m.visual_tokens:,} visual); "
             f"prefill {m.prefill_seconds:.1f} s, decode {m.decode_seconds:.2f} s, tau {m.mean_acceptance_length:.2f}")
    return out


def _prefill_run(name: str, engine: Engine, processed: ProcessedVideo, prompt: str, sampling: SamplingParams,
                 progress: TextIO) -> GenerationOutput:
    line = ProgressLine(f"prefill ({LABELS[name]})", processed.num_visual_tokens, " positions", progress)
    gen = engine.stream(lambda cancelled: processed, prompt, sampling, video_key=_KEY)
    stop = watch_prefill(gen, line)
    try:
        for _ in gen:
            break                          # the first token: the prefill is done
    finally:
        stop()
    line.finish(f"{gen.request.metrics.prefill_seconds:.1f} s")
    for _ in gen:
        pass
    return gen.output


def _ms_per_token(out: GenerationOutput) -> float:
    # decode_seconds runs from the first token (made by the prefill) to the last
    return out.metrics.decode_seconds / max(1, out.metrics.completion_tokens - 1) * 1e3


def _rows(first: dict[str, GenerationOutput], runs: dict[str, list[GenerationOutput]]) -> list[dict]:
    plain_ms = statistics.median(_ms_per_token(o) for o in runs["plain"])
    rows = []
    for name in METHODS:
        ms = statistics.median(_ms_per_token(o) for o in runs[name])
        m = runs[name][-1].metrics
        rows.append({"method": name, "label": LABELS[name], "ms_per_token": ms, "speedup": plain_ms / ms,
                     "tau": m.mean_acceptance_length if name != "plain" else 1.0,
                     "accepted_per_step": m.accepted_per_step if name != "plain" else 0.0,
                     "draft_keys": m.draft_max_keys if name != "plain" else None,
                     "prefill_s": first[name].metrics.prefill_seconds, "tokens": m.completion_tokens})
    return rows


def table(rows: list[dict], visual_tokens: int, reps: int) -> list[str]:
    lines = [f"Decoding one answer about {visual_tokens:,} visual tokens (median of {reps}, prefill excluded):",
             f"{'method':26}{'ms/token':>10}{'speedup':>9}{'tau':>7}{'draft keys read':>17}{'prefill s':>11}"]
    for r in rows:
        keys = "-" if r["draft_keys"] is None else f"{r['draft_keys']:,}"
        lines.append(f"{r['label']:26}{r['ms_per_token']:>10.2f}{r['speedup']:>8.2f}x{r['tau']:>7.2f}"
                     f"{keys:>17}{r['prefill_s']:>11.1f}")
    lines.append("draft keys read: the most keys one draft query attended to (Sparrow: anchors + window + "
                 "glimpse, whatever the video's length)")
    return lines


def save_plot(rows: list[dict], visual_tokens: int, path: str | Path) -> str:
    """Decode ms/token and draft keys read per method, as a PNG; says where, or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (it comes with the dev extra: pip install -e .[dev])"
    names = [r["label"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.bar(names, [r["ms_per_token"] for r in rows], color=["#888888", "#d08c3c", "#3c7bd0"])
    left.set_ylabel("decode ms / token")
    left.set_ylim(0, 1.2 * max(r["ms_per_token"] for r in rows))
    for i, r in enumerate(rows):
        left.text(i, r["ms_per_token"], f"{r['speedup']:.2f}x", ha="center", va="bottom")
    drafts = [r for r in rows if r["draft_keys"] is not None]
    right.bar([r["label"] for r in drafts], [r["draft_keys"] for r in drafts], color=["#d08c3c", "#3c7bd0"])
    right.set_yscale("log")
    right.set_ylim(1, 5 * max(r["draft_keys"] for r in drafts))     # bars from 1 key, so heights compare
    for i, r in enumerate(drafts):
        right.text(i, r["draft_keys"], f"{r['draft_keys']:,}", ha="center", va="bottom")
    right.set_ylabel("keys one draft query reads")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"One answer about a {visual_tokens:,}-visual-token video (measured in one run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def describe(cfg: LongDemoConfig) -> str:
    """What will run, before the models load (for the command line)."""
    n = (cfg.frames // 2) * (cfg.size // 28) ** 2
    return f"long demo: {cfg.frames} frames at {cfg.size} px = {n:,} visual tokens, k={cfg.k}, " \
           f"max {cfg.max_new_tokens} new tokens, {cfg.reps} timed answers per method, {cfg.threads} torch thread(s)"


def config_from(**given) -> LongDemoConfig:
    """A LongDemoConfig from the options that were given (None: the default)."""
    return LongDemoConfig(**{k: v for k, v in given.items() if v is not None})

