"""The CPU prefix kernel against another revision of itself, paired in one process.

Two builds of kernels/csrc/cpu_prefix.cpp, this tree's and the one at git revision --against,
each built (or loaded from the extension cache) under its own build key, then timed call for
call: for each row count a round runs both on the next of several copies of the keys (cold, as
a serving step reads them: kernels/packed.py `_bench`), in alternating order, and the ratio is
the median over rounds of this tree's time over the other's in the same round. A machine whose
speed drifts minute to minute (a shared VM: two runs of benchmarks.attention_paths five minutes
apart differed by 20-30%) moves both alike within a round, so a change to the kernel is read off
the ratio, not off two runs.

    python -m benchmarks.kernel_ab --against REV [--rows 2,4,6,7,8,10,12,18,26] [--keys 25024]
                                   [--rounds 60] [--out BENCHMARKS.md]

Rows are the kernel's query rows of one kv head (a step's tokens times the GQA group: the world
target's 5-token verify is 10 rows).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.machine import machine
from benchmarks.report import write_section
from sparrow.kernels import cpu_prefix
from sparrow.kernels.native import NativeExtension


def build_at(revision: str, workdir: Path) -> object:
    """The kernel built from its source at a git revision (cached like any build: by its key)."""
    source, root = workdir / "cpu_prefix.cpp", Path(__file__).resolve().parents[1]
    rel = cpu_prefix.EXTENSION.source.resolve().relative_to(root)
    source.write_bytes(subprocess.run(["git", "show", f"{revision}:{rel}"], check=True, capture_output=True,
                                      cwd=root).stdout)
    ext = NativeExtension(cpu_prefix.EXTENSION.name, source, cpu_prefix.EXTENSION.cflags, f"CPU prefix kernel at {revision}")
    module = ext.load()
    if module is None:
        raise SystemExit(f"the kernel at {revision} did not build")
    return module


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="git revision of the other kernel source")
    ap.add_argument("--rows", default="2,4,6,7,8,10,12,18,26", help="query rows of one kv head")
    ap.add_argument("--keys", type=int, default=25024, help="cached keys")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=60, help="paired rounds a row count (the first 4 warm up)")
    ap.add_argument("--out", help="BENCHMARKS.md to write the section into")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    this = cpu_prefix.load()
    if this is None:
        raise SystemExit("this tree's kernel did not build")
    with tempfile.TemporaryDirectory() as tmp:
        other = build_at(args.against, Path(tmp))
    g = torch.Generator().manual_seed(0)
    shape = (1, args.kv_heads, args.keys, args.head_dim)
    sets = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(8)]   # ~50 MB at 25k
    turn = itertools.count()
    rows = [int(x) for x in args.rows.split(",")]
    scale = args.head_dim ** -0.5
    lines = [f"| rows | {args.against} (ms) | this tree (ms) | this / {args.against} |", "|---|---|---|---|"]
    for r in rows:
        q = torch.randn(1, args.kv_heads, r, args.head_dim, generator=g)
        times: dict[str, list[float]] = {"this": [], "other": []}
        ratios = []
        for rnd in range(args.rounds):
            got = {}
            for name, module in ((("this", this), ("other", other)) if rnd % 2 else (("other", other), ("this", this))):
                k, v = sets[next(turn) % len(sets)]
                t0 = time.perf_counter()
                module.prefix_attention(q, k, v, scale)
                got[name] = time.perf_counter() - t0
            if rnd >= 4:
                ratios.append(got["this"] / got["other"])
                for name in got:
                    times[name].append(got[name])
        this_ms, other_ms = (statistics.median(times[n]) * 1e3 for n in ("this", "other"))
        ratio = statistics.median(ratios)
        print(f"{r:3d} rows: {args.against} {other_ms:.2f} ms, this tree {this_ms:.2f} ms, ratio {ratio:.3f}", flush=True)
        lines.append(f"| {r} | {other_ms:.2f} | {this_ms:.2f} | {ratio:.3f}x |")
    if args.out:
        body = (f"Machine: {machine()}, one thread. The prefix pass of one layer: {args.kv_heads} kv heads of dim "
                f"{args.head_dim} over {args.keys:,} cached keys, each call over the next of 8 copies of the keys (cold); "
                f"medians of {args.rounds - 4} paired rounds, the two builds in alternating order; the ratio is the "
                "median of the rounds' ratios.\n\n" + "\n".join(lines) + "\n")
        write_section(args.out, "kernel-ab", f"The CPU prefix kernel against {args.against}, paired in one process",
                      "python -m benchmarks.kernel_ab " + " ".join(argv if argv is not None else sys.argv[1:]),
                      body)


if __name__ == "__main__":
    main()
