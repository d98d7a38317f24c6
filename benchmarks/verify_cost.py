"""What a target step costs by the number of tokens it scores: a decode step (1 token) against
verify steps of a chain (k + 1 tokens, causal) and of a draft tree of the same size (the root
+ nodes, ancestor masks, positions root + depth), at a short and a long world video, through
the engine's ragged verify (grouped K/V read in place). World target, one thread, medians.

    python -m benchmarks.verify_cost [--reps 20] [--tokens 1,2,5,9,17,33,65] [--attention sdpa,split] [--out BENCHMARKS.md]

--attention compares the target's verify attention paths (TargetModel.verify_attention) side by
side, interleaved per video; every ratio is against the first path's decode step.

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
from benchmarks.world import ladder_ends  # noqa: E402
from sparrow.models.target import TargetModel  # noqa: E402
from sparrow.speculative.tree import DraftTree  # noqa: E402


def binary_tree(nodes: int) -> DraftTree:
    """A tree of `nodes` nodes, two children per node, breadth first."""
    parents = [-1, -1] + [(i - 2) // 2 for i in range(2, nodes)]
    return DraftTree(torch.zeros(nodes, dtype=torch.long), None, torch.tensor(parents[:nodes], dtype=torch.long))


def step_ms(target: TargetModel, state, n: int, reps: int, tree: bool) -> float:
    tokens = torch.full((n,), int(target.tokenizer.convert_tokens_to_ids("the")))
    shape = [binary_tree(n - 1)] if tree and n > 2 else None
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        target.verify([state], [tokens], trees=shape)
        times.append(time.perf_counter() - t0)
        target.rollback(state, n)
    return statistics.median(times[2:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models/world")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", default="1,2,5,9,17,33,65", help="tokens scored per step (root + draft nodes)")
    ap.add_argument("--attention", default="sdpa", help="comma list of verify attention paths (sdpa, split, ...)")
    ap.add_argument("--out", help="BENCHMARKS.md to write the section into")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = TargetModel.from_pretrained(f"{args.models}/target")
    sizes = [int(x) for x in args.tokens.split(",")]
    paths = [x.strip() for x in args.attention.split(",") if x.strip()]
    rows = ["| visual tokens | draft | attention | " + " | ".join(f"{n} tokens" for n in sizes) + " |",
            "|---|---|---|" + "---|" * len(sizes)]
    for video, pre in ladder_ends(target, max(sizes) + 8):
        for tree in (False, True):
            kind = "tree" if tree else "chain"
            base = None
            for path in paths:
                target.verify_attention = path
                ms = {n: step_ms(target, pre.state, n, args.reps, tree) for n in sizes}
                base = base or ms[sizes[0]]
                cells = ", ".join(f"{n} tokens {ms[n]:.2f} ms ({ms[n] / base:.2f}x)" for n in sizes)
                print(f"{video.num_visual_tokens:>6} visual tokens, {kind}, {path}: {cells}", flush=True)
                rows.append(f"| {video.num_visual_tokens:,} | {kind} | {path} | "
                            + " | ".join(f"{ms[n]:.2f} ms ({ms[n] / base:.2f}x)" for n in sizes) + " |")
    if args.out:
        body = "\n".join([f"Machine: {machine()}. World target, one thread, medians of {args.reps}; "
                          "ms per target step scoring that many tokens on top of the prompt's KV cache "
                          "(a decode step is 1 token, a k = 4 chain 5; a tree of N nodes N + 1).", "", *rows])
        write_section(args.out, "verify-cost", "What a verify step costs (target step by tokens scored)",
                      "python -m benchmarks.verify_cost " + " ".join(argv if argv is not None else sys.argv[1:]), body)


if __name__ == "__main__":
    main()
