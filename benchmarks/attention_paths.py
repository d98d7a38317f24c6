"""Which verify attention path serves on this machine, and what every path costs.

For each (query rows, cached keys), one layer of the world target's shape (4 query heads, 2 kv
heads, head dim 32; --heads/--kv-heads/--head-dim for others): every CPU path of
kernels/packed.py (dense: one SDPA call; flash: the split with torch's flash op; kernel: the
split with the compiled C++ kernel) timed here, interleaved within each repetition, and the
path the tuner chose (kernels/autotune.py, measured first by its own worker as a server's would
be) with its time against the fastest here. Timed as the tuner times them: each call reads its
keys cold (kernels/packed.py `_bench`). Then a ragged batch of --batch requests alike (each its
rows over its own cache): one call of the compiled kernel for all of them against one call a
request by its measured path (`packed.ragged_form`), the form the tuner chose beside them.

    python -m benchmarks.attention_paths [--rows 1,5,13] [--keys 504,8064,25056] [--reps 200]
                                         [--batch 8] [--dtype float32] [--out BENCHMARKS.md]
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
    ap.add_argument("--batch", type=int, default=8, help="requests in the ragged batch (0: no batch table)")
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
    batch = [f"| rows a request | cached keys | one call (ms) | each (ms) | each / one | chosen | chosen / fastest |",
             "|---|---|---|---|---|---|---|"]
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
            ms, ratio = _timed({name: runners(name) for name in paths}, chosen, args.reps)
            worst = max(worst, ratio)
            print(f"{nq:>3} rows, {p:>6} keys: " + ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items())
                  + f"; chosen {chosen} ({ratio:.3f}x the fastest)", flush=True)
            table.append(f"| {nq} | {p:,} | " + " | ".join(f"{ms[n]:.3f}" for n in paths)
                         + f" | {chosen} | {ratio:.3f}x |")
            if args.batch and built:
                ms, ratio, chosen = _ragged(q, k, v, p, args.batch, dtype, args.reps)
                worst = max(worst, ratio)
                print(f"    {args.batch} requests: one call {ms['one']:.3f} ms, each {ms['each']:.3f} ms; "
                      f"chosen {chosen} ({ratio:.3f}x the fastest)", flush=True)
                batch.append(f"| {nq} | {p:,} | {ms['one']:.3f} | {ms['each']:.3f} | {ms['each'] / ms['one']:.2f}x "
                             f"| {chosen} | {ratio:.3f}x |")
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
            f"moves both alike). Worst: {worst:.3f}x.", "", *table,
            *(["", f"A ragged batch of {args.batch} requests alike, each its rows over its own cache (cold, as "
               "above): the whole layer in one call of the compiled kernel against one call a request by its "
               "measured path (the rows above); `chosen` is the form the tuner measured for the batch "
               "(`packed.ragged_form`).", "", *batch] if len(batch) > 2 else [])])
        write_section(args.out, "attention-paths", "Attention paths chosen by measurement (this machine)",
                      "python -m benchmarks.attention_paths " + " ".join(argv if argv is not None else sys.argv[1:]),
                      body)


def _timed(runs: dict, chosen: str, reps: int) -> tuple[dict[str, float], float]:
    """Median ms of each run (interleaved, two warm-ups dropped) and the chosen one's time over the
    fastest's, paired: the median over rounds (a load that comes and goes moves both calls of a
    round alike)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps + 2):
        for name, run in runs.items():
            s = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - s)
    ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
    fastest = min(ms, key=ms.get)
    return ms, statistics.median(a / b for a, b in zip(times[chosen][2:], times[fastest][2:]))


def _ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, requests: int, dtype: torch.dtype,
            reps: int) -> tuple[dict[str, float], float, str]:
    """The batch's forms timed (the tuner's own runner), their ratio, and the form the tuner chose."""
    nq = q.shape[2]
    query = torch.cat([q] * requests, dim=2)
    views = [(k, v)] * requests
    bounds = [(r * nq, (r + 1) * nq) for r in range(requests)]
    packed.ragged_form(query, views, bounds)               # queues the tuner's measurement of the batch
    packed.TUNER.wait(300)
    chosen = packed.ragged_form(query, views, bounds)
    runners = packed._bench_ragged(tuple(q.shape), (1, k.shape[1], v.shape[-1]), dtype, prefix, requests)
    ms, ratio = _timed({name: runners(name) for name in packed.RAGGED_FORMS}, chosen, reps)
    return ms, ratio, chosen


if __name__ == "__main__":
    main()
