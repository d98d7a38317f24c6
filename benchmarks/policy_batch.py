"""The draft policy at batch (issue 46): the engine's adaptive k against fixed k, paired.

One Sparrow engine (the committed world pair, in process, one thread) with N world videos'
prefixes cached; each repetition asks one caption question about every video at once (a burst of
N streams, answers to their end) once per arm, the arms in turn (the order reversed every other
repetition), on the same videos and questions. An arm is a draft policy of its own, kept from
burst to burst (its acceptance record and its cost fit), swapped into the engine's scheduler
between bursts while it is idle: `adaptive` (the engine's default: k in [0, k] chosen per request
per step from measured costs and acceptance) or `fixed-K` (K drafts every step, never adapted).
Each arm runs two untimed bursts first. Tokens a second count from the burst's start to its last
token, so they hold the questions' prefills, as a client of N streams sees them. Paired ratios
are each repetition's arm over the first arm's.

    python -m benchmarks.policy_batch [--frames 1392] [--streams 8] [--reps 6] [--seed S]
                                      [--arms adaptive,fixed-2,fixed-4] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

from benchmarks.engines import SERVED, BenchConfig, Models, build_engine
from benchmarks.machine import load_average, machine
from benchmarks.report import write_section
from benchmarks.world_videos import world_prompts, world_video
from sparrow import SamplingParams
from sparrow.draft_policy import DraftPolicy
from sparrow.prefix_cache import PrefixCache
from sparrow.step_costs import MeasuredCosts


class CountedPolicy(DraftPolicy):
    """A policy that counts the ks it chose (request-steps and drafts), and caps them at `cap`."""

    def __init__(self, k_max: int, adaptive: bool, cap: int | None = None):
        super().__init__(k_max, adaptive, MeasuredCosts(), measure=adaptive)
        self.cap, self.request_steps, self.drafts = cap, 0, 0

    def choose(self, batch):
        ks = super().choose(batch)
        if self.cap is not None:
            ks = [min(k, self.cap) for k in ks]
        self.request_steps += len(ks)
        self.drafts += sum(ks)
        return ks


def arm_policy(arm: str, k_max: int) -> CountedPolicy:
    if arm == "adaptive":
        return CountedPolicy(k_max, True)
    if arm.startswith("fixed-") and arm[6:].isdigit() and 1 <= int(arm[6:]) <= k_max:
        return CountedPolicy(k_max, False, int(arm[6:]))
    raise ValueError(f"arm {arm!r}: adaptive or fixed-K with K in 1..{k_max}")


def burst(engine, videos, prompt: str, tokens: int) -> tuple[float, int]:
    """N streams at once, one a video; (tokens a second from the start to the last token, tokens)."""
    counts = [0] * len(videos)

    def one(i: int) -> None:
        _, options = videos[i]
        for delta in engine.stream(None, prompt, SamplingParams(max_new_tokens=tokens), options, video_key=f"v{i}"):
            counts[i] += len(delta.token_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(videos))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0), sum(counts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="models", help="the models folder (world/target, world/draft)")
    ap.add_argument("--side", type=int, default=168, help="world video frame side in px")
    ap.add_argument("--frames", type=int, default=1392, help="frames a video (1392: ~25k visual tokens; 448: ~8k)")
    ap.add_argument("--streams", type=int, default=8, help="videos, one stream each, in a burst")
    ap.add_argument("--reps", type=int, default=6, help="timed bursts an arm")
    ap.add_argument("--tokens", type=int, default=96, help="the most new tokens a stream (answers end at their end)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first video (the next ones follow it)")
    ap.add_argument("--arms", default="adaptive,fixed-2,fixed-4", help="comma list: adaptive, fixed-K")
    ap.add_argument("--out", help="write the table into this report (BENCHMARKS.md), section policy-batch")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    arms = args.arms.split(",")
    prompts = world_prompts("v1")
    videos = [world_video(args.side, args.frames, args.seed + i) for i in range(args.streams)]
    engine = build_engine("sparrow", Models(args.models), BenchConfig(models=args.models, methods=("plain", "sparrow")),
                          PrefixCache(max_bytes=8 << 30, max_entries=args.streams + 4), config=SERVED)
    scheduler = engine.scheduler
    policies = {arm: arm_policy(arm, scheduler.policy.k_max) for arm in arms}

    def use(arm: str) -> None:
        while not scheduler.idle():      # between bursts
            time.sleep(0.01)
        scheduler.policy = policies[arm]

    load_before = load_average()
    for i, (video, options) in enumerate(videos):      # the prefixes, cached before anything is timed
        engine.generate(video.source, prompts[0], SamplingParams(max_new_tokens=1), options, video_key=f"v{i}")
    for arm in arms:
        use(arm)
        for p in (1, 2):
            burst(engine, videos, prompts[p % len(prompts)], args.tokens)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    counted = {arm: (p.request_steps, p.drafts) for arm, p in policies.items()}
    for rep in range(args.reps):
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            use(arm)
            rates[arm].append(burst(engine, videos, prompts[(1 + rep) % len(prompts)], args.tokens)[0])
        print(f"rep {rep}: " + ", ".join(f"{arm} {rates[arm][-1]:.0f}" for arm in arms), flush=True)
    engine.close()
    table = [f"| arm | tok/s median (min-max) | x {arms[0]} (paired median; min-max) | mean k a request-step |",
             "|---|---|---|---|"]
    for arm in arms:
        ratios = [x / y for x, y in zip(rates[arm], rates[arms[0]])]
        steps, drafts = (a - b for a, b in zip((policies[arm].request_steps, policies[arm].drafts), counted[arm]))
        table.append(f"| {arm} | {statistics.median(rates[arm]):.0f} ({min(rates[arm]):.0f}-{max(rates[arm]):.0f}) | "
                     f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
                     f"{drafts / max(1, steps):.2f} |")
    head = (f"Machine: {machine()}; load average {load_before} before, {load_average()} after (1 / 5 / 15 min). "
            f"{args.streams} world v1 videos of {args.frames} frames at {args.side} px (seeds from {args.seed}), "
            f"prefixes cached; "
            f"{args.reps} bursts an arm of {args.streams} caption questions at once, answers to their end (at most "
            f"{args.tokens} tokens), T = 0; the arms alternated on the same videos.")
    print("\n" + head + "\n\n" + "\n".join(table))
    if args.out:
        write_section(args.out, "policy-batch", "The draft policy at batch 8 against fixed k (issue 46): paired, in process",
                      "python -m benchmarks.policy_batch " + " ".join(argv if argv is not None else sys.argv[1:]),
                      head + "\n\n" + "\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
