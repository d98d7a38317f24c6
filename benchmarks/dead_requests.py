"""Requests that end before their video is ready cost nothing: the expired-requests scenario.

    python -m benchmarks.dead_requests [--requests 50] [--files 10] [--video 168x1392] [--out BENCHMARKS.md]

The embedded gRPC server with the world models serves --requests questions about long videos
on disk (--files distinct world videos, ~25k visual tokens each at 168x1392), every one with a
20 ms deadline, all at once; then, right after the last of them has ended for its client, a short
question about a short uncached video. Measured, per deadline kind (the gRPC deadline; the
`sparrow-timeout-ms` metadata alone, as a proxy that drops the gRPC deadline would leave it):

- when the last expired request's status reached its client (s after sending);
- the server process's CPU seconds over the scenario, less an idle baseline of the same length
  (the work spent on requests that had already ended, plus the gRPC handling of 50 refusals);
- the scheduler's counters: requests never prepared, stopped mid-decode, prepared though dead;
- the short question's time to first token, against the same question on an idle server.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import grpc  # noqa: E402
import torch  # noqa: E402

from benchmarks.world_videos import world_video  # noqa: E402
from sparrow.services.protos import pb  # noqa: E402
from sparrow.services.client import SparrowClient  # noqa: E402
from sparrow.services.config import ServiceConfig  # noqa: E402
from sparrow.services.server import BackgroundServer  # noqa: E402
from sparrow.services.servicer import SparrowService  # noqa: E402
from sparrow.services.settings import AppSettings, build_engine  # noqa: E402

SEED = 5 * 10**9 + 7              # fresh world videos (training < 1e9, evals 2e9-4e9)
PROMPT = "describe the video ."
COUNTERS = ("ended_before_prepare", "ended_while_preparing", "prepared_dead")


def short_ttft(client: SparrowClient, data: bytes) -> float:
    start = time.perf_counter()
    for response in client.stream(PROMPT, data=data, max_new_tokens=2, timeout=120):
        if response.HasField("chunk"):
            return time.perf_counter() - start
    raise RuntimeError("the short request ended without a token")


def expire_all(client: SparrowClient, paths: list[str], n: int, deadline_s: float, how: str) -> list[float]:
    """n requests at once, each with a deadline_s deadline given `how`; when each status arrived."""
    arrived = [float("nan")] * n
    codes: list[tuple[grpc.StatusCode, str] | None] = [None] * n
    start = time.perf_counter()

    def one(i: int) -> None:
        request = pb.GenerateRequest(prompt=PROMPT, video=pb.VideoSource(path=paths[i % len(paths)]),
                                     sampling=pb.SamplingParams(max_new_tokens=8))
        metadata = (("sparrow-timeout-ms", str(int(deadline_s * 1000))),)
        try:
            # "grpc": the gRPC deadline (and the metadata the client always adds); "metadata": only
            # the metadata, the call itself without a deadline, as behind a proxy that drops it
            for _ in client.stub.Generate(request, metadata=metadata,
                                          timeout=deadline_s if how == "grpc" else None):
                pass
        except grpc.RpcError as exc:
            codes[i] = (exc.code(), exc.details())
        arrived[i] = time.perf_counter() - start

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrong = [c for c in codes if c is None or c[0] != grpc.StatusCode.DEADLINE_EXCEEDED]
    if wrong:
        raise RuntimeError(f"{len(wrong)} requests ended otherwise than DEADLINE_EXCEEDED: {wrong[:3]}")
    return arrived


def idle_cpu(seconds: float) -> float:
    c0 = time.process_time()
    time.sleep(seconds)
    return time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models/world", help="DIR with target/ and draft/")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--files", type=int, default=10, help="distinct long videos the requests name")
    ap.add_argument("--video", default="168x1392", help="SIDExFRAMES of the long videos")
    ap.add_argument("--deadline-ms", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=3.0, help="CPU still counted after the last status")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the section into this markdown file (BENCHMARKS.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    side, frames = (int(x) for x in args.video.split("x"))
    tmp = Path(tempfile.mkdtemp(prefix="sparrow-dead-"))
    t0 = time.perf_counter()
    print(f"writing {2 * args.files} world videos of {side}x{side} x {frames} frames ...", flush=True)
    for kind in ("grpc", "metadata"):
        for i in range(args.files):
            video, _ = world_video(side, frames, SEED + (0 if kind == "grpc" else 1000) + i)
            (tmp / f"{kind}-{i}.mp4").write_bytes(video.data)
    shorts = [world_video(168, 28, SEED + 2000 + i)[0].data for i in range(4)]
    print(f"  {time.perf_counter() - t0:.0f} s", flush=True)

    settings = AppSettings(target=f"{args.models}/target", draft=f"{args.models}/draft",
                           service=ServiceConfig(media_root=str(tmp), max_concurrent=2 * args.requests))
    service = SparrowService(*build_engine(settings), settings.service)
    stats = service.engine.scheduler.stats
    rows = []
    load_before = os.getloadavg()
    with BackgroundServer(service) as server, SparrowClient(server.address) as client:
        short_ttft(client, shorts[0])                               # warm-up
        alone = short_ttft(client, shorts[1])
        for kind in ("grpc", "metadata"):
            paths = [str(tmp / f"{kind}-{i}.mp4") for i in range(args.files)]
            before = {k: stats[k] for k in COUNTERS}
            c0 = time.process_time()
            arrived = expire_all(client, paths, args.requests, args.deadline_ms / 1000, kind)
            ttft = short_ttft(client, shorts[2] if kind == "grpc" else shorts[3])      # uncached too
            time.sleep(args.settle_s)
            cpu = time.process_time() - c0
            wall = max(arrived) + ttft + args.settle_s
            baseline = idle_cpu(wall)
            rows.append(dict(kind=kind, last_status_s=max(arrived), cpu_s=cpu, baseline_s=baseline,
                             short_ttft_s=ttft, alone_s=alone, **{k: stats[k] - before[k] for k in COUNTERS}))
            print(rows[-1], flush=True)
    load_after = os.getloadavg()
    service.close()

    lines = [f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch "
             f"thread(s), torch {torch.__version__}; load average (1/5/15 min) before "
             f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)}. "
             f"World target + draft ({args.models}); {args.requests} requests on {args.files} distinct "
             f"{side}x{side} x {frames}-frame world videos on disk (never cached), each with a "
             f"{args.deadline_ms:g} ms deadline, sent at once; then one short question about an uncached "
             f"168x168 x 28-frame video. CPU: the server process's CPU seconds from sending to "
             f"{args.settle_s:g} s after the short question's first token, less an idle baseline as long "
             "(what is left: the gRPC handling of the refusals and the short question itself).", "",
             "| deadline given as | last status at client s | process CPU s | idle baseline s | CPU over idle s "
             "| never prepared | stopped mid-decode | prepared though dead | short TTFT s | short TTFT alone s |",
             "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {'gRPC deadline' if r['kind'] == 'grpc' else '`sparrow-timeout-ms` metadata only'} | "
                     f"{r['last_status_s']:.3f} | {r['cpu_s']:.2f} | {r['baseline_s']:.2f} | "
                     f"{r['cpu_s'] - r['baseline_s']:.2f} | {r['ended_before_prepare']} | "
                     f"{r['ended_while_preparing']} | {r['prepared_dead']} | {r['short_ttft_s']:.3f} | "
                     f"{r['alone_s']:.3f} |")
    body = "\n".join(lines) + "\n"
    print(body)
    if args.out:
        from benchmarks.report import write_section
        write_section(args.out, "dead-requests", "Requests that ended before their video was ready",
                      "python -m benchmarks.dead_requests " + " ".join(argv if argv is not None else sys.argv[1:]),
                      body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
