"""What one propose of k draft tokens costs through each way the Sparrow draft can run its
steps (SpecConfig.draft_step): "reference" (per request and level), "static" (the batch's levels
over keys gathered once, eager) and "compiled" (the same, torch.compile), at batch 1 and 4, with
the world draft over text contexts of a few hundred entries. Median of `--reps` proposes after
the first (which compiles, for "compiled": its time is shown apart). One thread.

    python -m benchmarks.draft_steps [--reps 30] [--batches 1,4] [--k 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparrow import SamplingParams, SpecConfig  # noqa: E402
from sparrow.config import DRAFT_STEPS  # noqa: E402
from sparrow.models.draft import SparrowDraft  # noqa: E402
from sparrow.models.target import TargetModel  # noqa: E402
from sparrow.speculative.proposer import DraftRequest  # noqa: E402
from sparrow.speculative.sampling import new_generator  # noqa: E402
from sparrow.speculative.sparrow_proposer import DraftContext, SparrowProposer  # noqa: E402

from benchmarks.machine import machine  # noqa: E402


def contexts(draft: SparrowDraft, n: int, seed: int = 0) -> list[DraftContext]:
    """n random draft contexts of 200 + 37 i prompt entries (what build_context makes)."""
    g, cfg = torch.Generator().manual_seed(seed), draft.config
    out = []
    for i in range(n):
        length = 200 + 37 * i
        ids = torch.randint(0, cfg.vocab_size, (length + 1,), generator=g)
        feats = torch.randn(length + 1, len(cfg.feature_layers) * cfg.hidden_size, generator=g)
        out.append(DraftContext(ids, feats, length, torch.randn(4, cfg.hidden_size, generator=g)))
    return out


def propose_ms(draft: SparrowDraft, spec: SpecConfig, batch: int, reps: int) -> tuple[float, float]:
    """(first propose, median of the next `reps`) in ms, greedy, k = spec.num_draft_tokens."""
    proposer = SparrowProposer(draft, spec)
    states = [proposer.begin_context(c, 400) for c in contexts(draft, batch)]

    def once() -> float:
        t0 = time.perf_counter()
        proposer.propose([DraftRequest(s, spec.num_draft_tokens, SamplingParams(), new_generator(0)) for s in states])
        return 1e3 * (time.perf_counter() - t0)

    first = once()
    return first, statistics.median(once() for _ in range(reps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="models")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = TargetModel.from_pretrained(Path(args.models) / "world" / "target")
    draft = SparrowDraft.from_pretrained(Path(args.models) / "world" / "draft", target)
    geometry = {k: v for k, v in draft.trained_with.items() if k in ("window", "anchors")}
    print(f"Machine: {machine()}. World draft, k = {args.k}, {geometry}, greedy, one thread; "
          f"median of {args.reps} proposes after the first.\n")
    print("| batch | draft_step | ms per propose | first propose (compiles) |\n|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for step in DRAFT_STEPS:
            spec = SpecConfig(num_draft_tokens=args.k, adaptive_k=False, draft_step=step, **geometry)
            first, median = propose_ms(draft, spec, batch, args.reps)
            print(f"| {batch} | {step} | {median:.2f} | {first:.1f} ms |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
