"""What a target step costs by the number of tokens it scores: a decode step (1 token) against
verify steps (k + 1 tokens) at a short and a long world video, with transformers' `sdpa`
attention and with Sparrow's `sparrow_sdpa` (grouped K/V read in place; sparrow/models/gqa.py).
World target, one thread, medians.

    python -m benchmarks.verify_cost [--reps 20] [--tokens 1,3,5] [--out BENCHMARKS.md]

The ratio verify / decode bounds any draft's speedup: with tau accepted tokens per step, a
perfect-draft speedup is at most tau * decode / (verify + draft).
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
from benchmarks.speculative import machine  # noqa: E402
from benchmarks.world import ladder_ends  # noqa: E402
from sparrow.models import gqa  # noqa: E402
from sparrow.models.target import TargetModel  # noqa: E402


def step_ms(target: TargetModel, state, n: int, reps: int) -> float:
    tokens = torch.full((n,), int(target.tokenizer.convert_tokens_to_ids("the")))
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        target.step(state, tokens)
        times.append(time.perf_counter() - t0)
        target.rollback(state, n)
    return statistics.median(times[2:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models/world")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", default="1,3,5")
    ap.add_argument("--out", help="BENCHMARKS.md to write the section into")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = TargetModel.from_pretrained(f"{args.models}/target")
    sizes = [int(x) for x in args.tokens.split(",")]
    rows = ["| visual tokens | attention | " + " | ".join(f"{n} tokens" for n in sizes) + " |",
            "|---|---|" + "---|" * len(sizes)]
    for video, pre in ladder_ends(target, 16):
        for impl in ("sdpa", gqa.NAME):
            target.hf.set_attn_implementation({"text_config": impl})
            ms = {n: step_ms(target, pre.state, n, args.reps) for n in sizes}
            cells = ", ".join(f"{n} tokens {ms[n]:.2f} ms ({ms[n] / ms[sizes[0]]:.2f}x)" for n in sizes)
            print(f"{video.num_visual_tokens:>6} visual tokens, {impl:>12}: {cells}", flush=True)
            rows.append(f"| {video.num_visual_tokens:,} | `{impl}` | "
                        + " | ".join(f"{ms[n]:.2f} ms ({ms[n] / ms[sizes[0]]:.2f}x)" for n in sizes) + " |")
        target.hf.set_attn_implementation({"text_config": gqa.NAME})
    if args.out:
        body = "\n".join([f"Machine: {machine()}. World target, one thread, medians of {args.reps}; "
                          "ms per target step scoring that many tokens on top of the prompt's KV cache "
                          "(a decode step is 1 token, a k = 4 verify step 5).", "", *rows])
        write_section(args.out, "verify-cost", "What a verify step costs (target step by tokens scored)",
                      "python -m benchmarks.verify_cost " + " ".join(argv if argv is not None else sys.argv[1:]), body)


if __name__ == "__main__":
    main()
