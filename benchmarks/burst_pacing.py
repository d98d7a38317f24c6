"""A burst of questions about cached videos under two prefill pacings (sparrow/pacing.py): strict
alternation (`prefill_burst_s` 0: after each slice a decode step) against a balance that lets a
burst prefill back to back (the default). In process, one engine a method, 8 world videos whose
prefills are cached first; then bursts of 8 questions at once (one a video, each on its own
thread, as 8 gRPC streams arrive), the two pacings alternated on the same videos, the order
swapped every repetition. Per arm: aggregate tokens/s from the burst's start to its last token,
the burst's TTFT p50 and its last first token; and the paired ratio of the arms' tokens/s.

    python -m benchmarks.burst_pacing [--sizes 168x448,168x1392] [--methods plain,sparrow] [--reps 10]
                                      [--bursts 0,0.05] [--seed S] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

from benchmarks.engines import SERVED, BenchConfig, Models, build_engine
from benchmarks.machine import machine
from benchmarks.report import write_section
from benchmarks.world_videos import WORLD_MODELS, world_prompts, world_video
from sparrow import SamplingParams
from sparrow.pacing import PrefillPacer
from sparrow.prefix_cache import PrefixCache

STREAMS = 8


def burst(engine, videos, prompt: str, tokens: int) -> tuple[float, float, float]:
    """One burst: every video's question at once. Returns (tokens/s, TTFT p50 s, last TTFT s)."""
    firsts, counts = [0.0] * len(videos), [0] * len(videos)
    start = time.perf_counter()

    def ask(i: int) -> None:
        video, options = videos[i]
        for delta in engine.stream(None, prompt, SamplingParams(max_new_tokens=tokens), options, video_key=f"v{i}"):
            if not counts[i] and delta.token_ids:
                firsts[i] = time.perf_counter() - start
            counts[i] += len(delta.token_ids)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(videos))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    wall = time.perf_counter() - start
    return sum(counts) / wall, statistics.median(firsts), max(firsts)


def run(method: str, size: tuple[int, int], bursts: list[float], reps: int, tokens: int, seed: int,
        models: str) -> dict[float, list[tuple[float, float, float]]]:
    engine = build_engine(method, Models(models), BenchConfig(models=models, methods=("plain", method)),
                          PrefixCache(max_bytes=8 << 30, max_entries=STREAMS + 4), config=SERVED)
    prompts = world_prompts("v1")
    videos = [world_video(size[0], size[1], seed + i) for i in range(STREAMS)]
    for i, (video, options) in enumerate(videos):     # each video's prefill cached (and its draft's begin)
        engine.generate(video.source, prompts[0], SamplingParams(max_new_tokens=8), options, video_key=f"v{i}")
    share = engine.config.prefill_share
    for b in bursts:                                    # untimed: every arm's first burst
        engine.scheduler._pacer = PrefillPacer(share, b)
        burst(engine, videos, prompts[1], tokens)
    out = {b: [] for b in bursts}
    for r in range(reps):
        for b in (bursts if r % 2 == 0 else bursts[::-1]):
            engine.scheduler._pacer = PrefillPacer(share, b)
            out[b].append(burst(engine, videos, prompts[1 + r % (len(prompts) - 1)], tokens))
    engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.burst_pacing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="168x448,168x1392", help="world v1 videos as SIDExFRAMES (default 8k, 25k)")
    ap.add_argument("--methods", default="plain,sparrow", help="comma list (default plain,sparrow)")
    ap.add_argument("--bursts", default="0,0.05", help="prefill_burst_s arms, comma list (the first is the baseline)")
    ap.add_argument("--reps", type=int, default=10, help="bursts a arm (default 10)")
    ap.add_argument("--tokens", type=int, default=96, help="the most new tokens an answer (default 96)")
    ap.add_argument("--seed", type=int, required=True, help="video seed (fresh each run)")
    ap.add_argument("--models", default=WORLD_MODELS["v1"], help="DIR with world/{target,draft}")
    ap.add_argument("--out", help="write the burst-pacing section of this markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bursts = [float(b) for b in args.bursts.split(",")]
    rows = ["| visual tokens | method | prefill_burst_s | tok/s median (min-max) | x the first arm (paired, median; "
            "min-max) | TTFT p50 ms | last first token ms |", "|---|---|---|---|---|---|---|"]
    for n, spec in enumerate(args.sizes.split(",")):
        side, frames = (int(x) for x in spec.split("x"))
        tokens = (side // 28) ** 2 * frames // 2
        for method in args.methods.split(","):
            out = run(method, (side, frames), bursts, args.reps, args.tokens, args.seed + 100 * n, args.models)
            base = out[bursts[0]]
            for b in bursts:
                tps = [x[0] for x in out[b]]
                ratios = [x[0] / y[0] for x, y in zip(out[b], base)]
                rows.append(f"| {tokens:,} | {method} | {b:g} | {statistics.median(tps):.0f} ({min(tps):.0f}-"
                            f"{max(tps):.0f}) | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
                            f"{1e3 * statistics.median(x[1] for x in out[b]):.0f} | "
                            f"{1e3 * statistics.median(x[2] for x in out[b]):.0f} |")
            print("\n".join(rows[-len(bursts):]), flush=True)
    body = (f"Machine: {machine()}. In process, one thread; {STREAMS} fresh world v1 videos a size (seed "
            f"{args.seed}, +100 a size), prefills cached; {args.reps} bursts of {STREAMS} questions an arm, the "
            f"arms alternated on the same videos; answers to their end (at most {args.tokens} tokens), T = 0.\n\n"
            + "\n".join(rows) + "\n")
    print(body)
    if args.out:
        write_section(args.out, "burst-pacing", "A burst of questions under two prefill pacings (issue 46)",
                      "python -m benchmarks.burst_pacing " + " ".join(argv if argv is not None else sys.argv[1:]), body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
