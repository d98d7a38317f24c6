"""What a fresh server's path tuner costs the streams it serves, with the tuning gate and without.

A served 25k-token answer streams (its prefix warm); 2 s in, a question about an 8k-token video
arrives. The path tuner starts from nothing (every choice forgotten, as on a new pod), so it
times the shapes both requests meet while they run. Per arm: the 25k stream's longest gaps
between chunks and the 8k request's TTFT, through gRPC on one embedded server.

    python -m benchmarks.tuning_stall [--method sparrow] [--seed N] [--out BENCHMARKS.md]

Arms, interleaved by round: "gated" (sparrow/tuning_gate.py: timed calls between scheduler turns,
at most a quarter of a busy engine's time) and "ungated" (the gate never waits nor pauses: the
tuner times beside serving, as before the gate).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

ARMS = ("ungated", "gated")


def use_gate(gate) -> None:
    """The gate the scheduler's turns and the tuner's timed calls go through, for what follows."""
    from sparrow import scheduler
    from sparrow.kernels import autotune

    scheduler.TUNING_GATE = autotune.GATE = gate


def one_round(client, ids: dict, fps: dict, tokens: int) -> dict:
    from benchmarks.concurrency.streams import grpc_call

    out = {}

    def second():
        time.sleep(2.0)
        out["mid"] = grpc_call(client, ids["mid"], "What happens in the video?", 4, fps["mid"],
                               max_visual_tokens=65536)()
    th = threading.Thread(target=second)
    th.start()
    long = grpc_call(client, ids["long"], "What happens in the video?", tokens, fps["long"], max_visual_tokens=65536)()
    th.join()
    gaps = sorted(long.gaps)
    return {"longest_gap_s": gaps[-1], "p99_gap_s": gaps[int(0.99 * (len(gaps) - 1))], "mid_ttft_s": out["mid"].ttft}


def per_round(rows: list[dict], key: str, digits: int) -> str:
    return " / ".join(f"{row[key]:.{digits}f}" for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="sparrow", help="the engine (benchmarks.engines): sparrow or plain")
    ap.add_argument("--models", default="models")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each arm once a round (fresh videos each)")
    ap.add_argument("--tokens", type=int, default=300, help="new tokens of the 25k answer")
    ap.add_argument("--seed", type=int, default=None, help="video seeds start here (default: fresh)")
    ap.add_argument("--out", help="write the section into this markdown file")
    args = ap.parse_args(argv)

    from benchmarks.concurrency.streams import grpc_call
    from benchmarks.engines import BenchConfig, Models, build_engine
    from benchmarks.machine import machine
    from benchmarks.world_videos import world_video
    from sparrow import tuning_gate
    from sparrow.kernels import autotune
    from sparrow.prefix_cache import PrefixCache
    from sparrow.services.client import SparrowClient
    from sparrow.services.config import ServiceConfig
    from sparrow.services.server import BackgroundServer
    from sparrow.services.servicer import SparrowService
    from sparrow.services.state_cache import open_cache

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    load_before = os.getloadavg()
    models = Models(args.models)
    cache = PrefixCache(max_bytes=64 << 30, max_entries=8)
    engine = build_engine(args.method, models, BenchConfig(models=args.models, methods=("plain", args.method)), cache)
    service = SparrowService(engine, open_cache("memory"),
                             ServiceConfig(max_new_tokens=2048, max_concurrent=8, max_visual_tokens=65536))
    gated = tuning_gate.GATE
    ungated = tuning_gate.TuningGate(share=1.0, max_wait_s=0.0)        # never waits, never pauses
    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with BackgroundServer(service) as server, SparrowClient(server.address) as client:
        for r in range(args.rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                videos = {"long": world_video(168, 1392, seed + 10 * len(rows[arm]) + (0 if arm == "gated" else 5)),
                          "mid": world_video(168, 448, seed + 10 * len(rows[arm]) + (1 if arm == "gated" else 6))}
                ids = {k: client.upload(v.data) for k, (v, _) in videos.items()}
                fps = {k: v.fps for k, (v, _) in videos.items()}
                grpc_call(client, ids["long"], "What happens in the video?", 1, fps["long"], max_visual_tokens=65536)()
                for t in autotune.TUNERS:          # a new pod: nothing measured yet
                    t.wait(120)
                    t.forget()
                use_gate(gated if arm == "gated" else ungated)
                try:
                    row = one_round(client, ids, fps, args.tokens)
                    for t in autotune.TUNERS:
                        t.wait(120)
                finally:
                    use_gate(gated)
                rows[arm].append(row)
                print(f"round {r} {arm:8s}: longest gap {row['longest_gap_s']:.2f} s, p99 gap "
                      f"{row['p99_gap_s']:.3f} s, 8k TTFT {row['mid_ttft_s']:.2f} s", flush=True)
    command = "python -m benchmarks.tuning_stall " + " ".join(argv if argv is not None else sys.argv[1:])
    body = "\n".join([
        f"Machine: {machine()}; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after. "
        f"Method {args.method}, committed world pair, one embedded gRPC server; video seeds from {seed}. "
        f"Each round: a 25k-token answer ({args.tokens} tokens, prefix warm) streams and 2 s in an "
        "8k-token question arrives; the path tuner forgets every choice first (a new pod). Arms "
        "interleaved by round.", "",
        "| arm | longest gap (s) | p99 gap (s) | 8k TTFT (s) |", "|---|---|---|---|",
        *[f"| {arm} | {per_round(rows[arm], 'longest_gap_s', 2)} | {per_round(rows[arm], 'p99_gap_s', 3)} | "
          f"{per_round(rows[arm], 'mid_ttft_s', 2)} |" for arm in ARMS],
        "", "Values per round, in order."])
    print(body)
    if args.out:
        from benchmarks.report import write_section
        write_section(args.out, "tuning-stall", "The path tuner beside serving: gated and ungated", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
