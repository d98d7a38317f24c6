"""Serving overhead: the same requests through the in-process engine, the embedded gRPC
server, and Ray Serve (draft colocated, and draft as its own deployment).

Per path: time to first token (TTFT) of a first question about a video (cold: decode +
whole prefill) and of a second question about the same video (warm: the prefix cache holds
the video's prefill), and decode tokens/s after the first token; then each as a ratio to the
in-process engine. Tiny random models (the answers are noise; the costs around them are not).

    python -m benchmarks.serving [--runs 3] [--tokens 64] [--frames 16] [--no-ray] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Before torch loads: OpenMP threads that spin while they wait make torch many times slower
# whenever the CPU is shared with anything else (a server's own threads, Ray's processes).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402

PROMPTS = ("What happens in the video?", "Which shape moves first, and where does it go?")


def trace(stream) -> tuple[float, list[float], list[list[int]], float]:
    """(start, arrival time of each chunk that carries tokens, those chunks, end) of an iterator
    of token lists, timed with perf_counter. A lazy iterator's setup counts: it runs on the first next()."""
    start, times, chunks = time.perf_counter(), [], []
    for token_ids in stream:
        if token_ids:
            times.append(time.perf_counter())
            chunks.append(list(token_ids))
    return start, times, chunks, time.perf_counter()


def timed(stream) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s after it) of an iterator of token lists."""
    start, times, chunks, end = trace(stream)
    first, count = times[0], sum(map(len, chunks))
    return first - start, (count - 1) / (end - first) if end > first else 0.0


def engine_stream(engine, video: bytes, prompt: str, sampling):
    key = hashlib.sha256(video).hexdigest()           # keyed like the service keys inline bytes
    return (d.token_ids for d in engine.stream(video, prompt, sampling, video_key=key))


def grpc_stream(client, video: bytes, prompt: str, tokens: int):
    for response in client.stream(prompt, data=video, max_new_tokens=tokens, ignore_eos=True):
        yield list(response.chunk.token_ids) if response.HasField("chunk") else []


def measure(run, videos: list[bytes]) -> dict:
    """Median TTFT (cold, warm) and decode tokens/s over the videos, one cold + one warm each."""
    cold, warm, rates = [], [], []
    for video in videos:
        ttft, rate = timed(run(video, PROMPTS[0]))
        cold.append(ttft)
        rates.append(rate)
        ttft, rate = timed(run(video, PROMPTS[1]))
        warm.append(ttft)
        rates.append(rate)
    return {"cold": statistics.median(cold), "warm": statistics.median(warm), "rate": statistics.median(rates)}


def table(rows: dict[str, dict]) -> str:
    base = rows["in-process engine"]
    lines = ["| path | TTFT first question ms | TTFT second question ms | second / first | decode tok/s | "
             "TTFT vs engine | tok/s vs engine |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {1000 * r['cold']:.1f} | {1000 * r['warm']:.1f} | {r['warm'] / r['cold']:.2f} | "
                     f"{r['rate']:.1f} | {r['cold'] / base['cold']:.2f} | {r['rate'] / base['rate']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="videos per path (each asked two questions)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--out", help="write the table into this markdown file (BENCHMARKS.md)")
    args = ap.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from sparrow import Engine, SamplingParams, SpecConfig
    from sparrow.prefix_cache import PrefixCache
    from sparrow.services.client import SparrowClient
    from sparrow.services.models import load_draft, load_target
    from sparrow.services.server import BackgroundServer
    from sparrow.services.config import ServiceConfig
    from sparrow.services.servicer import SparrowService
    from sparrow.services.settings import AppSettings, build_engine
    from sparrow.tiny import tiny_draft, tiny_target
    from sparrow.video import write_synthetic_video

    spec = SpecConfig(num_draft_tokens=args.k)
    sampling = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    tmp = Path(tempfile.mkdtemp(prefix="sparrow-bench-"))
    target = tiny_target("qwen2_5_vl", seed=0)
    target.save_pretrained(tmp / "target")
    tiny_draft(target, seed=0).save_pretrained(tmp / "draft")

    def videos(offset: int) -> list[bytes]:      # fresh videos per path: every first question is cold
        return [write_synthetic_video(None, num_frames=args.frames, width=args.size, height=args.size, fps=4.0,
                                      seed=offset + i).data for i in range(args.runs)]

    def settings(**extra) -> AppSettings:
        return AppSettings(target=str(tmp / "target"), draft=str(tmp / "draft"), spec=spec,
                           service=ServiceConfig(max_new_tokens=max(2048, args.tokens)), **extra)

    rows = {}
    loaded = load_target(str(tmp / "target"))
    engine = Engine(loaded, load_draft(str(tmp / "draft"), loaded), spec, prefix_cache=PrefixCache())
    timed(engine_stream(engine, videos(900)[0], PROMPTS[0], sampling))                  # warm-up
    rows["in-process engine"] = measure(lambda v, p: engine_stream(engine, v, p, sampling), videos(0))

    service = SparrowService(*build_engine(settings()))
    with BackgroundServer(service) as server, SparrowClient(server.address) as client:
        timed(grpc_stream(client, videos(901)[0], PROMPTS[0], args.tokens))
        rows["gRPC, embedded"] = measure(lambda v, p: grpc_stream(client, v, p, args.tokens), videos(100))

    if not args.no_ray:
        rows.update(ray_rows(settings, videos, args.tokens))

    machine = (f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
               f"{'CUDA' if torch.cuda.is_available() else 'CPU only'}. Tiny random Qwen2.5-VL target + Sparrow "
               f"draft, k = {args.k}; {args.frames} frames {args.size}x{args.size}; {args.tokens} new tokens "
               f"(ignore_eos); median of {args.runs} videos.")
    body = machine + "\n\n" + table(rows)
    print(body)
    if args.out:
        from benchmarks.report import write_section
        write_section(args.out, "serving", "Serving overhead (gRPC embedded, Ray Serve)",
                      "python -m benchmarks.serving " + " ".join(sys.argv[1:]), body)
    return 0


def ray_rows(settings, videos, tokens: int) -> dict:
    import ray
    from ray import serve

    from sparrow.services import ray_app, ray_bind
    from sparrow.services.client import SparrowClient

    rows = {}
    ray_bind.patient_proxies()          # as `sparrow serve --ray` starts its cluster
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    no_cpu = {"ray_actor_options": {"num_cpus": 0}}
    try:
        for i, (name, placement) in enumerate([("Ray Serve, draft colocated", "colocated"),
                                               ("Ray Serve, draft deployment", "remote")]):
            port = 50551 + i
            ray_app.start(settings(draft_placement=placement, target_deployment=no_cpu, draft_deployment=no_cpu),
                          grpc_port=port, http_port=8551 + i, name=f"bench{i}")
            with SparrowClient(f"127.0.0.1:{port}") as client:
                timed(grpc_stream(client, videos(902 + i)[0], PROMPTS[0], tokens))
                rows[name] = measure(lambda v, p: grpc_stream(client, v, p, tokens), videos(200 + 100 * i))
            serve.delete(f"bench{i}")
            serve.shutdown()
    finally:
        ray.shutdown()
    return rows


if __name__ == "__main__":
    sys.exit(main())
