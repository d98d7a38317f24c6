"""What the draft costs a decode step through each way the Sparrow draft can run its steps
(SpecConfig.draft_step): "reference" (per request and level), "static" (the batch's levels over
keys gathered once, eager: by torch's ops, by the C++ kernel, and by whichever of the two the
tuner measured faster here, kernels/draft_chain.py) and "compiled" (the same, torch.compile), at
batch 1 and 4, with the
world draft (its trained window, anchors and glimpse) over text contexts of a few hundred
entries. A step is what the engine runs: the commit of the last step's emitted tokens
(`--emitted`, about tau) and a greedy propose of k tokens; with a static runner the commit
waits for the propose's call. Median of `--reps` steps after the first propose (which compiles, for
"compiled": its time is shown apart). One thread.

With --decode-at SIDExFRAMES the world target's decode step at a video of that size (a
caption request, prefilled once) is timed in the same run, and each draft step is given as a
share of it (issue: <= 0.12x at 25k visual tokens, 168x1392).

The tuner's own measurement (CPU ms of one draft call by each path, on its worker) and its choice
are printed below the table; --out writes both into a BENCHMARKS.md section (draft-paths).

    python -m benchmarks.draft_steps [--reps 30] [--batches 1,4] [--k 4] [--emitted 3] [--decode-at 168x1392]
                                     [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparrow import SamplingParams, SpecConfig  # noqa: E402
from sparrow.config import DRAFT_STEPS  # noqa: E402
from sparrow.kernels import autotune, draft_chain  # noqa: E402
from sparrow.models.draft import SparrowDraft  # noqa: E402
from sparrow.models.target import TargetModel  # noqa: E402
from sparrow.speculative.proposer import DraftRequest, StepResult  # noqa: E402
from sparrow.speculative.sampling import new_generator  # noqa: E402
from sparrow.speculative.sparrow_proposer import SparrowProposer  # noqa: E402
from sparrow.speculative.draft_context import DraftContext

from benchmarks.machine import machine  # noqa: E402
from benchmarks.report import write_section  # noqa: E402

# The static step's paths: forced by draft_chain.IMPL ("auto": the tuner's choice).
STATIC_PATHS = (("torch", "static, torch's levels"), ("kernel", "static, C++ levels"),
                ("auto", "static, measured choice"))


def contexts(draft: SparrowDraft, n: int, glimpse: int, seed: int = 0) -> list[DraftContext]:
    """n random draft contexts of 200 + 37 i prompt entries and `glimpse` glimpse states (what
    build_context makes)."""
    g = torch.Generator().manual_seed(seed)
    return [DraftContext.synthetic(draft, 200 + 37 * i, glimpse, g) for i in range(n)]


def stepper(draft: SparrowDraft, spec: SpecConfig, batch: int, reps: int, emitted: int,
            impl: str) -> tuple[float, Callable[[], tuple[float, float]]]:
    """(the first propose's ms, a function running one more step and returning its ms and its
    commit's); a step: the commit of `emitted` tokens (the last step's draft tokens and the target's
    features before them, random) then a greedy propose of k = spec.num_draft_tokens. impl: the
    draft_chain.IMPL the proposer's calls run under (set before each, so steppers interleave)."""
    draft_chain.IMPL = impl
    proposer = SparrowProposer(draft, spec)
    states = [proposer.begin_context(c, 4 * reps * emitted + 400) for c in contexts(draft, batch, spec.glimpse)]
    width = len(draft.config.feature_layers) * draft.config.hidden_size
    features = torch.randn(emitted, width, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    proposals = proposer.propose([DraftRequest(s, spec.num_draft_tokens, SamplingParams(), new_generator(0))
                                  for s in states])
    first = 1e3 * (time.perf_counter() - t0)

    def once() -> tuple[float, float]:
        nonlocal proposals
        draft_chain.IMPL = impl
        t0 = time.perf_counter()
        proposer.commit(states, [StepResult(None, p.tokens[:emitted].tolist(), features) for p in proposals])
        t1 = time.perf_counter()
        proposals = proposer.propose([DraftRequest(s, spec.num_draft_tokens, SamplingParams(), new_generator(0))
                                      for s in states])
        return 1e3 * (time.perf_counter() - t0), 1e3 * (t1 - t0)

    once()                  # (the first with a commit waiting: compiled, its own shape)
    if impl == "auto":
        draft_chain.TUNER.wait(300)      # the tuner's measurement of these shapes, before the timed steps
        once()
    return first, once


def decode_ms(target: TargetModel, side: int, frames: int, reps: int) -> tuple[int, float]:
    """(cached tokens, median ms of a decode step) of the world target on a caption request
    for a world video of side x frames (benchmarks.verify_cost's prefill and step)."""
    from benchmarks.verify_cost import prefills, step_times

    _, prefill = next(prefills(target, [(side, frames)], reps + 8))
    state = prefill.state
    ms = step_times(target, state, [target.verify_attention], [1], reps, False, time.perf_counter)
    return state.length, next(iter(ms.values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="models")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--emitted", type=int, default=3, help="tokens each step commits (about tau)")
    ap.add_argument("--decode-at", help="SIDExFRAMES: time the target's decode step at this world video too")
    ap.add_argument("--out", help="write the tables into this report (BENCHMARKS.md), section draft-paths")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    draft_chain.EXTENSION.load()          # the static steps' C++ levels built before anything is timed
    target = TargetModel.from_pretrained(Path(args.models) / "world" / "target")
    draft = SparrowDraft.from_pretrained(Path(args.models) / "world" / "draft", target)
    geometry = {k: v for k, v in draft.trained_with.items() if k in ("window", "anchors", "glimpse")}
    decode = None
    if args.decode_at:
        side, frames = (int(x) for x in args.decode_at.split("x"))
        cached, decode = decode_ms(target, side, frames, args.reps)
    autotune.ENABLED = True
    draft_chain.TUNER.forget()            # measured afresh in this run, as on a new machine
    head = (f"Machine: {machine()}. World draft, k = {args.k}, {geometry}, greedy, {args.emitted} tokens committed "
            f"a step, one thread; median of {args.reps} steps (one of each path in turn) after the first propose "
            "and one step."
            + (f" World target decode step at {cached} cached tokens ({args.decode_at}): {decode:.2f} ms."
               if decode else ""))
    print(head + "\n")
    table = ["| batch | draft path | ms per step (commit + propose) | of which the commit call | "
             "x a decode step | first propose (compiles) |", "|---|---|---|---|---|---|"]
    print("\n".join(table), flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        runs = {}                         # every path's stepper, then their steps interleaved
        for step in DRAFT_STEPS:
            for impl, name in STATIC_PATHS if step == "static" else (("auto", step),):
                spec = SpecConfig(num_draft_tokens=args.k, adaptive_k=False, draft_step=step, **geometry)
                runs[name] = stepper(draft, spec, batch, args.reps, args.emitted, impl)
        timed: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for _ in range(args.reps):
            for name, (_, once) in runs.items():
                timed[name].append(once())
        for name, (first, _) in runs.items():
            median = statistics.median(t for t, _ in timed[name])
            commit = statistics.median(c for _, c in timed[name])
            share = f"{median / decode:.3f}x" if decode else "-"
            table.append(f"| {batch} | {name} | {median:.2f} | {commit:.2f} | {share} | {first:.1f} ms |")
            print(table[-1], flush=True)
    draft_chain.IMPL = "auto"
    tuned = ["| call | batch rows (bucket) | key slots | kernel (CPU ms a call) | torch (CPU ms a call) | chosen |",
             "|---|---|---|---|---|---|"]
    for full, (choice, ms) in sorted(draft_chain.TUNER.measured().items(), key=lambda kv: kv[0][-2]):
        call, rows, slots = full[-3], full[-2], full[-4]
        tuned.append(f"| {call} | {rows} | {slots} | {ms['kernel']:.3f} | {ms['torch']:.3f} | {choice} |")
    print("\nThe tuner's measurement (kernels/draft_chain.py), per key:\n\n" + "\n".join(tuned), flush=True)
    if args.out:
        load = os.getloadavg()
        body = "\n".join([
            head + f" Load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end. "
            "\"static, measured choice\" is what a server here serves: the path the tuner measured faster for "
            "the shape (its measurement below, taken before the timed steps). The paths' steps are interleaved "
            "(one step of each in turn, every round), so a load that comes and goes moves them alike.", "",
            *table, "", "The tuner's measurement: CPU time of one draft call on its worker thread, medians, "
            "paths interleaved.", "", *tuned])
        write_section(args.out, "draft-paths", "Draft paths chosen by measurement (this machine)",
                      "python -m benchmarks.draft_steps " + " ".join(argv if argv is not None else sys.argv[1:]),
                      body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
