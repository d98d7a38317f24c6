"""The demo with the committed world pair: a fresh synthetic video, a streamed answer that is
right for that video, then tau, accepted per step and the decode speedup over plain decoding
measured in the same run.   sparrow world demo [--seed N] [--models DIR]
(`sparrow demo --long` is the same story on a ~25k-visual-token video: world_long_demo.py)"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path

import torch

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.errors import InvalidRequest
from sparrow.models.draft import SparrowDraft
from sparrow.models.target import TargetModel

from sparrow.world.scenes import CAPTION_PROMPTS, LONGEST_VIDEO_TOKENS, WorldVideo, caption, questions

DEFAULT_MODELS = Path(__file__).resolve().parents[1] / "models" / "world"


def check_world_video(frames: int, size: int, max_visual_tokens: int) -> int:
    """The visual tokens of a world video of `frames` frames of `size` px, or InvalidRequest
    when the world's processor could not give it at that size: a visual token covers 28 px
    of a frame pair, and a video over the token budget would be shrunk."""
    if frames < 2 or frames % 2:
        raise InvalidRequest(f"--frames must be an even number >= 2 (frames go in pairs), got {frames}")
    if size < 28 or size % 28:
        raise InvalidRequest(f"--size must be a multiple of 28 px (one visual token per 28 px), got {size}")
    tokens = (frames // 2) * (size // 28) ** 2
    if tokens > max_visual_tokens:
        raise InvalidRequest(f"{frames} frames at {size} px are {tokens:,} visual tokens, over the world videos' "
                             f"budget of {max_visual_tokens:,} (the processor would shrink them)")
    return tokens


def run_world_demo(seed: int | None = None, models: str | Path = DEFAULT_MODELS, k: int = 4,
                   num_frames: int = 8, print_fn=print, dtype: str = "float32", device: str = "cpu",
                   size: int = 84, max_new_tokens: int = 96, threads: int = 1, adaptive_k: bool = True) -> dict:
    """Stream answers about a fresh world video with Sparrow beside plain decoding; adaptive_k:
    False drafts k every step (tau then depends on the tokens alone, not on this machine's timings)."""
    check_world_video(num_frames, size, LONGEST_VIDEO_TOKENS)
    models = Path(models)
    torch.set_num_threads(threads)      # a tiny model: a second thread costs more in sync than it gives
    seed = random.SystemRandom().randrange(10**6, 10**9) if seed is None else seed
    target = TargetModel.from_pretrained(models / "target", dtype=dtype, device=device)
    draft = SparrowDraft.from_pretrained(models / "draft", target)        # on the target's device, in its dtype
    spec = SpecConfig.as_trained(draft.trained_with, k, adaptive_k=adaptive_k)
    fast, plain = Engine(target, draft, spec), Engine(target, spec=SpecConfig(method="none"))
    world = WorldVideo(num_frames=num_frames, size=size)
    with tempfile.TemporaryDirectory() as tmp:
        video = world.make(seed, Path(tmp) / "world.mp4")
        rng = random.Random(seed)
        asks = [(rng.choice(CAPTION_PROMPTS), caption(video.events))]
        asks += [(q, a) for _, q, a in rng.sample(questions(video.events, rng), 2)]
        print_fn(f"video: seed {seed}, {video.num_frames} frames {video.width}x{video.height} at {video.fps:g} fps, "
                 f"{len(video.events)} events; models: {models} (trained world pair)")
        for engine in (fast, plain):     # untimed: first calls pay one-off costs (allocations, caches)
            engine.generate(video.path, asks[0][0], SamplingParams(max_new_tokens=8), world.options())
        results = [_ask(fast, plain, video.path, q, a, world, print_fn, max_new_tokens) for q, a in asks]
    return {"seed": seed, "results": results}


def _ask(fast: Engine, plain: Engine, path: Path, question: str, truth: str, world: WorldVideo, print_fn,
         max_new_tokens: int, timing_reps: int = 3) -> dict:
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    print_fn(f"\nQ: {question}\nA: ", end="")
    gen = fast.stream(path, question, sampling, world.options())
    for delta in gen:
        print_fn(delta.text, end="")
    out = gen.output
    ref = plain.generate(path, question, sampling, world.options())
    m = out.metrics
    correct = out.text.strip() == truth
    print_fn(f"\n   correct: {correct}{'' if correct else f' (truth: {truth})'}; identical to plain decoding: "
             f"{out.token_ids == ref.token_ids}")
    # Decode time per token, median of a few runs of each (one-off costs and noise on a shared
    # CPU otherwise dominate answers this short); a one-word answer is too short to time.
    speedup = None
    if len(out.token_ids) >= 8:
        runs = [(fast.generate(path, question, sampling, world.options()).metrics,
                 plain.generate(path, question, sampling, world.options()).metrics) for _ in range(timing_reps)]
        spec_ms = statistics.median(a.decode_seconds / max(1, a.completion_tokens - 1) for a, _ in runs) * 1e3
        plain_ms = statistics.median(b.decode_seconds / max(1, b.completion_tokens - 1) for _, b in runs) * 1e3
        speedup = plain_ms / spec_ms
        timing = f"decode {spec_ms:.2f} ms/token vs plain {plain_ms:.2f} ms/token = {speedup:.2f}x (median of {timing_reps})"
    else:
        timing = "answer too short to time"
    print_fn(f"   tau {m.mean_acceptance_length:.2f}, accepted/step {m.accepted_per_step:.2f}, {timing}")
    return {"question": question, "answer": out.text, "correct": correct, "tau": m.mean_acceptance_length,
            "accepted_per_step": m.accepted_per_step, "decode_speedup": speedup,
            "lossless": out.token_ids == ref.token_ids}
