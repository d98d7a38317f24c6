"""Autoscaling on a local multi-node Ray cluster: Serve adds target replicas under load and
removes them when idle, every answer right throughout, and video-affine routing still finds
a video's prefill after the scale event.

A Ray cluster of `--nodes` nodes on loopback (ray.cluster_utils.Cluster, 1 CPU each), the
sparrow app with TargetDeployment autoscaled between 1 and `--nodes` replicas (1 CPU each, so
one a node; target_ongoing_requests 1), Serve's proxy on the head. Phases:

    up      `--streams` clients stream answers back to back until the deployment runs
            `--nodes` replicas; then, load still on, `--videos` fresh videos asked two questions
            each (the second must reuse the first one's prefill: same replica)
    down    the load stops; one client asks short questions one after another until the
            deployment is back to one replica and `--settle` more answers came: requests keep
            arriving while replicas drain and stop

Every answer is compared token for token with the in-process engine's. Replicas are sampled
from serve.status() every half second. Tiny random models (the answers are noise; routing,
scaling and draining are not).

    python -m benchmarks.autoscale [--nodes 3] [--streams 6] [--tokens 160] [--json PATH] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Before torch and Ray load: passive OpenMP waits (a shared CPU), and loopback nodes stay on
# loopback (services.ray_bind).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

PROMPTS = ("What happens in the video?", "Which shape moves first, and where does it go?")
DEPLOYMENT = "TargetDeployment"


@dataclass
class Run:
    """What the run saw; `timeline` rows are (seconds, phase, running replicas, streams in flight)."""

    timeline: list[tuple[float, str, int, int]] = field(default_factory=list)
    answered: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    up_s: float | None = None            # load start -> all replicas running
    down_s: float | None = None          # load stop -> one replica
    reused: int = 0                      # second questions that found the first one's prefill
    videos: int = 0
    max_replicas: int = 0
    final_replicas: int = 0


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get("sparrow")
    if app is None or DEPLOYMENT not in app.deployments:
        return 0
    return sum(n for state, n in app.deployments[DEPLOYMENT].replica_states.items() if str(state).endswith("RUNNING"))


class Sampler(threading.Thread):
    def __init__(self, run: Run, in_flight):
        super().__init__(daemon=True)
        self.run_, self.in_flight, self.phase, self.stop = run, in_flight, "start", threading.Event()
        self.t0 = time.monotonic()
        self.replicas = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.replicas = running_replicas()
            self.run_.timeline.append((round(time.monotonic() - self.t0, 1), self.phase, self.replicas,
                                       self.in_flight()))
            self.stop.wait(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3, help="Ray nodes (1 CPU each) = the most target replicas")
    ap.add_argument("--streams", type=int, default=6, help="concurrent clients during the load")
    ap.add_argument("--tokens", type=int, default=160, help="new tokens per load answer")
    ap.add_argument("--videos", type=int, default=6, help="fresh videos asked twice after the scale-up")
    ap.add_argument("--settle", type=int, default=3, help="answers after the deployment is back to one replica")
    ap.add_argument("--downscale-delay", type=float, default=4.0, help="Serve's downscale_delay_s")
    ap.add_argument("--timeout", type=float, default=150.0, help="most seconds each scale event may take")
    ap.add_argument("--json", help="write the run here")
    ap.add_argument("--out", help="write the table into this markdown file (BENCHMARKS.md)")
    args = ap.parse_args(argv)
    run = measure(args)
    body = report(args, run)
    print(body)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(run)))
    if args.out:
        from benchmarks.report import write_section
        write_section(args.out, "autoscale", "Autoscaling on a local multi-node Ray cluster",
                      "python -m benchmarks.autoscale " + " ".join(argv if argv is not None else sys.argv[1:]), body)
    return 0 if not (run.wrong or run.errors) else 1


def measure(args) -> Run:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from sparrow import Engine, SamplingParams, SpecConfig
    from sparrow.services import ray_app
    from sparrow.services.client import SparrowClient
    from sparrow.services.config import ServiceConfig
    from sparrow.services.models import load_draft, load_target
    from sparrow.services.settings import AppSettings
    from sparrow.tiny import tiny_draft, tiny_target
    from sparrow.video import write_synthetic_video

    tmp = Path(tempfile.mkdtemp(prefix="sparrow-autoscale-"))
    target = tiny_target("qwen2_5_vl", seed=0)
    target.save_pretrained(tmp / "target")
    tiny_draft(target, seed=0).save_pretrained(tmp / "draft")
    spec = SpecConfig(num_draft_tokens=4, adaptive_k=False)
    loaded = load_target(str(tmp / "target"))
    engine = Engine(loaded, load_draft(str(tmp / "draft"), loaded), spec)

    def video(seed: int) -> bytes:
        return write_synthetic_video(None, num_frames=4, width=56, height=56, fps=4.0, seed=seed).data

    def expected(data: bytes, prompt: str, tokens: int) -> list[int]:
        return engine.generate(data, prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True)).token_ids

    load_videos = [video(700 + i) for i in range(args.streams)]
    load_answers = [expected(v, PROMPTS[0], args.tokens) for v in load_videos]
    short = (video(800), PROMPTS[1], 24)
    short_answer = expected(*short)

    from sparrow.services import ray_bind

    ray_bind.patient_proxies()          # as `sparrow serve --ray` starts its cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    run, in_flight = Run(), [0]
    lock = threading.Lock()
    sampler = Sampler(run, lambda: in_flight[0])
    try:
        settings = AppSettings(
            target=str(tmp / "target"), draft=str(tmp / "draft"), spec=spec,
            service=ServiceConfig(max_new_tokens=max(2048, args.tokens)),
            target_deployment={"ray_actor_options": {"num_cpus": 1}, "graceful_shutdown_timeout_s": 60,
                               "autoscaling_config": {
                                   "min_replicas": 1, "max_replicas": args.nodes, "target_ongoing_requests": 1,
                                   "upscale_delay_s": 1.0, "downscale_delay_s": args.downscale_delay,
                                   "metrics_interval_s": 0.5, "look_back_period_s": 2.0}})
        port = free_port()
        ray_app.start(settings, grpc_port=port, http_port=free_port(), proxy_location="HeadOnly")
        address = f"127.0.0.1:{port}"
        sampler.start()

        def ask(client, data: bytes, prompt: str, tokens: int, answer: list[int], phase: str):
            with lock:
                in_flight[0] += 1
            try:
                got = client.generate(prompt, data=data, max_new_tokens=tokens, ignore_eos=True, timeout=300)
                run.answered[phase] += 1
                if got.token_ids != answer:
                    run.wrong.append(f"{phase}: {prompt!r}")
                return got
            except Exception as exc:  # noqa: BLE001 - every failure is a finding, counted
                run.errors.append(f"{phase}: {type(exc).__name__}: {exc}")
            finally:
                with lock:
                    in_flight[0] -= 1

        # ----- up: load until every node runs a replica; affinity checked while it lasts -------------
        stop_load = threading.Event()

        def load(i: int) -> None:
            with SparrowClient(address) as client:
                while not stop_load.is_set():
                    ask(client, load_videos[i], PROMPTS[0], args.tokens, load_answers[i], "up")

        sampler.phase, sampler.t0 = "up", time.monotonic()          # the timeline counts from the load's start
        with ThreadPoolExecutor(args.streams) as pool:
            loads = [pool.submit(load, i) for i in range(args.streams)]
            try:
                run.up_s = round(wait_for(lambda: sampler.replicas >= args.nodes, args.timeout, "scale up"), 1)
                sampler.phase = "up: affinity"
                with SparrowClient(address) as client:
                    for i in range(args.videos):
                        data = video(900 + i)
                        first = ask(client, data, PROMPTS[0], 4, expected(data, PROMPTS[0], 4), "up")
                        second = ask(client, data, PROMPTS[1], 4, expected(data, PROMPTS[1], 4), "up")
                        run.videos += 1
                        run.reused += bool(first and second and second.completion.usage.cached_prompt_tokens > 0)
            finally:
                stop_load.set()
                for f in loads:
                    f.result()
        run.max_replicas = max(r for _, _, r, _ in run.timeline)

        # ----- down: short questions one after another until one replica is left ------------------
        sampler.phase = "down"
        stopped, settled = time.monotonic(), 0
        with SparrowClient(address) as client:
            while settled < args.settle:
                ask(client, *short, short_answer, "down")
                if run.down_s is None and sampler.replicas == 1 and running_replicas() == 1:
                    run.down_s = round(time.monotonic() - stopped, 1)
                settled += run.down_s is not None
                if time.monotonic() - stopped > args.timeout + args.downscale_delay:
                    run.errors.append("scale down: not within the timeout")
                    break
        run.final_replicas = running_replicas()
    finally:
        sampler.stop.set()
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return run


def report(args, run: Run) -> str:
    """The replicas over time (one row per change) and what was answered."""
    rows, last = [], None
    for t, phase, replicas, streams in run.timeline:
        if (phase, replicas) != last:
            rows.append(f"| {t:.1f} | {phase} | {replicas} | {streams} |")
            last = (phase, replicas)
    head = (f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, CPU only. "
            f"{args.nodes} Ray nodes on loopback (ray.cluster_utils.Cluster, 1 CPU each, one host), TargetDeployment "
            f"autoscaled 1..{args.nodes} (target_ongoing_requests 1, upscale_delay_s 1, downscale_delay_s "
            f"{args.downscale_delay:g}); {args.streams} clients x {args.tokens} tokens of load; tiny random models.")
    summary = (f"Scale-up to {run.max_replicas} replicas {run.up_s} s after the load began; back to "
               f"{run.final_replicas} replica {run.down_s} s after it stopped. Answered {run.answered['up']} during "
               f"the load and {run.answered['down']} during the scale-down: {len(run.wrong)} wrong, "
               f"{len(run.errors)} failed. Second questions that reused the first one's prefill after the scale-up: "
               f"{run.reused} of {run.videos}.")
    table = "| s | phase | running replicas | requests in flight |\n|---|---|---|---|\n" + "\n".join(rows)
    return "\n\n".join([head, table, summary])


if __name__ == "__main__":
    sys.exit(main())
