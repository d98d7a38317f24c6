"""Which verify attention path serves on this machine, and what every path costs.

For each (query rows, cached keys), one layer of the world target's shape (4 query heads, 2 kv
heads, head dim 32; --heads/--kv-heads/--head-dim for others): every CPU path of
kernels/packed.py (dense: one SDPA call; flash: the split with torch's flash op; kernel: the
split with the compiled C++ kernel) timed here, interleaved within each repetition, and the
path the tuner chose (kernels/autotune.py, measured first by its own worker as a server's would
be) with its time against the fastest here. Timed as the tuner times them: each call reads its
keys cold (kernels/packed.py `_bench`).

    python -m benchmarks.attention_paths [--rows 1,5,13] [--keys 504,8064,25056] [--reps 200]
                                         [--dtype float32] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ["SPARROW_AUTOTUNE"] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks.machine import machine  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from sparrow.kernels import cpu_prefix, packed  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,13", help="tokens a step scores")
    ap.add_argument("--keys", default="504,8064,25056", help="cached keys (the world videos' prompt lengths)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=200,
                    help="timed calls a path (30 left near-ties to noise: two runs put the chosen path 1.05x-1.06x the fastest)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    built = cpu_prefix.load() is not None
    print(f"CPU prefix kernel {'ready' if built else 'not built'} in {time.perf_counter() - t0:.1f} s", flush=True)
    packed.TUNER.forget()                 # measured afresh in this run, as a new machine would
    paths = packed.cpu_paths()
    rows = [int(x) for x in args.rows.split(",")]
    keys = [int(x) for x in args.keys.split(",")]
    g = torch.Generator().manual_seed(0)
    table = ["| rows | cached keys | " + " | ".join(f"{p} (ms)" for p in paths) + " | chosen | chosen / fastest |",
             "|---|---|" + "---|" * len(paths) + "---|---|"]
    worst = 0.0
    for nq in rows:
        for p in keys:
            q = torch.randn(1, args.heads, nq, args.head_dim, generator=g).to(dtype)
            k = torch.randn(1, args.kv_heads, p + nq, args.head_dim, generator=g).to(dtype)
            v = torch.randn(k.shape, generator=g).to(dtype)
            packed.packed_attention(q, k, v, p)              # the first use queues the tuner's measurement
            packed.TUNER.wait(300)
            chosen = packed.cpu_path(q, k, p)
            runners = packed._bench(tuple(q.shape), tuple(k.shape), dtype, p)   # the tuner's own: keys read cold
            runs = {name: runners(name) for name in paths}
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.reps + 2):
                for name in paths:
                    s = time.perf_counter()
                    runs[name]()
                    times[name].append(time.perf_counter() - s)
            ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
            best = min(ms.values())
            fastest = min(ms, key=ms.get)
            # Paired: the chosen path's time over the fastest's in the same round, the median of those
            # (a load that comes and goes moves both calls of a round alike).
            ratio = statistics.median(a / b for a, b in zip(times[chosen][2:], times[fastest][2:]))
            worst = max(worst, ratio)
            print(f"{nq:>3} rows, {p:>6} keys: " + ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items())
                  + f"; chosen {chosen} ({ratio:.3f}x the fastest)", flush=True)
            table.append(f"| {nq} | {p:,} | " + " | ".join(f"{ms[n]:.3f}" for n in paths)
                         + f" | {chosen} | {ratio:.3f}x |")
    print(f"worst chosen / fastest: {worst:.3f}x", flush=True)
    if args.out:
        load = os.getloadavg()[0]
        body = "\n".join([
            f"Machine: {machine()}; load average {load:.1f} at the end; {args.threads} torch thread(s), {args.dtype}. "
            f"One layer of {args.heads} query heads / {args.kv_heads} kv heads / dim {args.head_dim}; medians of "
            f"{args.reps}, paths interleaved, each call over the next of several copies of the keys filling "
            f"{packed.cold_bytes() >> 20} MiB (twice the last-level cache): read from memory, as a serving step "
            "reads them (the tuner's own timing). `chosen` is what the tuner (kernels/autotune.py) measured on its own "
            "worker before these timings, the path a server on this machine serves; the ratio is the median, over "
            "rounds, of its time over the fastest path's in the same round (paired, so a load that comes and goes "
            f"moves both alike). Worst: {worst:.3f}x.", "", *table])
        write_section(args.out, "attention-paths", "Attention paths chosen by measurement (this machine)",
                      "python -m benchmarks.attention_paths " + " ".join(argv if argv is not None else sys.argv[1:]),
                      body)


if __name__ == "__main__":
    main()
