"""What a target step costs by the number of tokens it scores: a decode step (1 token) against
verify steps of a chain (k + 1 tokens, causal) and of a draft tree of the same size (the root
+ nodes, ancestor masks, positions root + depth), at world videos of several lengths, through
the engine's ragged verify. World target, one thread, medians.

    python -m benchmarks.verify_cost [--reps 20] [--tokens 1,2,5,9,17,33,65] [--attention packed,sdpa]
                                     [--videos-at 168x28,168x448,168x1392] [--clock wall|thread] [--out BENCHMARKS.md]
                                     [--prefix kernel,torch]

--attention compares the target's verify attention paths (TargetModel.verify_attention) side by
side; every ratio is against the first path's decode step. Paths and step sizes are interleaved
within each repetition (a shared machine's load moves all of them alike). --clock thread times
the CPU time of the calling thread (with one torch thread a step runs on it alone), which
leaves out time that other processes take on a loaded machine. --prefix runs each path once per
CPU prefix implementation of the packed path (kernels/cpu_prefix.py: "kernel", the compiled
kernel; "torch", torch's CPU flash-attention op), labelled path:prefix, interleaved the same way;
--target-step eager,compiled each path once per target step (TargetModel.target_step), labelled
path@step.

The ratio verify / decode bounds any draft's speedup: with tau tokens emitted per step, a
perfect-draft speedup is at most tau * decode / (verify + draft). It is what the tree's node
budget is chosen from (README: trees).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks.report import write_section  # noqa: E402
from benchmarks.machine import machine  # noqa: E402
from sparrow.kernels import cpu_prefix  # noqa: E402
from sparrow.models.target import TargetModel  # noqa: E402
from sparrow.speculative.tree import DraftTree  # noqa: E402
from sparrow.world.scenes import LADDER, WorldVideo  # noqa: E402
from sparrow.world.target_model import world_sample  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def binary_tree(nodes: int) -> DraftTree:
    """A tree of `nodes` nodes, two children per node, breadth first."""
    parents = [-1, -1] + [(i - 2) // 2 for i in range(2, nodes)]
    return DraftTree(torch.zeros(nodes, dtype=torch.long), None, torch.tensor(parents[:nodes], dtype=torch.long))


def prefills(target: TargetModel, videos_at: list[tuple[int, int]], new_tokens: int, seed: int = 7):
    """(video, prefill) of a caption request on a world video of each (side, frames), with room
    for new_tokens more."""
    for side, frames in videos_at:
        video, _ = world_sample(target, WorldVideo(num_frames=frames, size=side), seed)
        inputs = target.build_inputs(video, "describe the video .")
        yield video, target.prefill(inputs, inputs["input_ids"].shape[1] + new_tokens)


def step_times(target: TargetModel, state, paths: list[str], sizes: list[int], reps: int, tree: bool,
               clock, graph=None) -> dict[tuple[str, int], float]:
    """Median ms of one step per (path, tokens), paths and sizes interleaved in every repetition
    (the first two repetitions are warm-up); a path@compiled runs through `graph` (a StepGraph)."""
    token = int(target.tokenizer.convert_tokens_to_ids("the"))
    times: dict[tuple[str, int], list[float]] = {(p, n): [] for p in paths for n in sizes}
    for _ in range(reps + 2):
        for path in paths:
            path_prefix, _, step = path.partition("@")
            attention, _, prefix = path_prefix.partition(":")
            target.verify_attention = attention
            if graph is not None:
                target.step_graph = graph if step == "compiled" else None
            cpu_prefix.IMPL = prefix or cpu_prefix.IMPL
            for n in sizes:
                shape = [binary_tree(n - 1)] if tree and n > 2 else None
                t0 = clock()
                target.verify([state], [torch.full((n,), token)], trees=shape)
                times[(path, n)].append(clock() - t0)
                target.rollback(state, n)
    return {key: statistics.median(t[2:]) * 1e3 for key, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models/world")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", default="1,2,5,9,17,33,65", help="tokens scored per step (root + draft nodes)")
    ap.add_argument("--attention", default="auto",
                    help="comma list of verify attention paths (auto, packed, sdpa, split, ...)")
    ap.add_argument("--videos-at", default=",".join(f"{s}x{f}" for s, f in (LADDER[0], LADDER[-1])),
                    help="world videos, side x frames (168x28: ~0.5k visual tokens, 168x448: ~8k, 168x1392: ~25k)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--prefix", help="comma list of CPU prefix implementations for the packed path "
                                     "(kernel, torch), each run with every --attention path")
    ap.add_argument("--target-step", default="eager",
                    help="comma list of target steps (eager, compiled: TargetModel.target_step), each run with "
                         "every path, labelled path@step; compiled graphs are built before timing")
    ap.add_argument("--out", help="BENCHMARKS.md to write the section into")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = TargetModel.from_pretrained(f"{args.models}/target")
    sizes = [int(x) for x in args.tokens.split(",")]
    paths = [x.strip() for x in args.attention.split(",") if x.strip()]
    if args.prefix:
        if set(x.strip() for x in args.prefix.split(",")) - {"kernel", "torch", ""}:
            ap.error(f"--prefix: kernel or torch, not {args.prefix!r}")
        paths = [f"{p}:{x.strip()}" for p in paths for x in args.prefix.split(",") if x.strip()]
        if "kernel" in args.prefix and cpu_prefix.load() is not None:   # built before any timing
            print(f"CPU prefix kernel ready in {cpu_prefix.EXTENSION.build_seconds:.1f} s", flush=True)
    steps = [x.strip() for x in args.target_step.split(",") if x.strip()]
    if set(steps) - {"eager", "compiled"}:
        ap.error(f"--target-step: eager or compiled, not {args.target_step!r}")
    if steps != ["eager"]:
        paths = [f"{p}@{step}" for p in paths for step in steps]
    graph = None
    if "compiled" in steps:
        target.target_step = "compiled"
        graph = target.step_graph
        print(f"target steps compiled in {graph.warm(tuple(sizes)):.0f} s", flush=True)
    videos_at = [tuple(int(x) for x in part.split("x")) for part in args.videos_at.split(",")]
    rows = ["| visual tokens | draft | attention | " + " | ".join(f"{n} tokens" for n in sizes) + " |",
            "|---|---|---|" + "---|" * len(sizes)]
    for video, pre in prefills(target, videos_at, max(sizes) + 8):
        for tree in (False, True):
            kind = "tree" if tree else "chain"
            ms = step_times(target, pre.state, paths, sizes, args.reps, tree, CLOCKS[args.clock], graph)
            base = ms[(paths[0], sizes[0])]
            for path in paths:
                cells = [f"{ms[(path, n)]:.2f} ms ({ms[(path, n)] / base:.2f}x)" for n in sizes]
                print(f"{video.num_visual_tokens:>6} visual tokens, {kind}, {path}: "
                      + ", ".join(f"{n} tokens {c}" for n, c in zip(sizes, cells)), flush=True)
                rows.append(f"| {video.num_visual_tokens:,} | {kind} | {path} | " + " | ".join(cells) + " |")
    if args.out:
        clock = "wall time" if args.clock == "wall" else "CPU time of the stepping thread"
        body = "\n".join([f"Machine: {machine()}. World target, one thread, medians of {args.reps} ({clock}), "
                          "paths and step sizes interleaved; ms per target step scoring that many tokens on top "
                          "of the prompt's KV cache (a decode step is 1 token, a k = 4 chain 5; a tree of N "
                          "nodes N + 1); ratios against the first path's decode step.", "", *rows])
        write_section(args.out, "verify-cost", "What a verify step costs (target step by tokens scored)",
                      "python -m benchmarks.verify_cost " + " ".join(argv if argv is not None else sys.argv[1:]), body)


if __name__ == "__main__":
    main()
