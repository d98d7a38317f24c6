"""Driving the load: one embedded gRPC server per method (plain, Sparrow) over the same target,
the workload's videos uploaded to each, and a schedule of requests sent at their arrival times
(open loop) or by N clients one after another (closed loop), each request traced as its client
sees it."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from benchmarks.concurrency.streams import Trace, grpc_call
from benchmarks.engines import SERVED, BenchConfig, Models, build_engine
from benchmarks.serve_load.load_config import Ask, LoadConfig
from benchmarks.world_videos import visual_tokens, world_video
from sparrow.prefix_cache import PrefixCache
from sparrow.services.client import SparrowClient
from sparrow.services.config import ServiceConfig
from sparrow.services.server import BackgroundServer
from sparrow.services.servicer import SparrowService
from sparrow.services.state_cache import open_cache

MAX_CLIENT_THREADS = 64        # open loop: requests in flight at once, at most


@dataclass(slots=True)
class LoadVideo:
    data: bytes
    fps: float
    visual_tokens: int            # the ladder's count for its size (the server's count is in each trace)
    ids: dict[str, str]           # method -> its server's upload id


@dataclass(slots=True)
class Record:
    """One request's outcome: the trace (None: it failed, `error` says why) and what it asked."""

    ask: Ask
    video_tokens: int
    trace: Trace | None
    error: str = ""


class Servers:
    """An embedded gRPC server per method, its engine's prefix cache, and a client to it."""

    def __init__(self, cfg: LoadConfig, stack: contextlib.ExitStack):
        self.models = Models(cfg.models)
        bench = BenchConfig(models=cfg.models, methods=("plain", *cfg.methods))
        videos = sum(n for _, _, n in cfg.mix)
        self.caches: dict[str, PrefixCache] = {}
        self.clients: dict[str, SparrowClient] = {}
        for m in cfg.methods:
            self.caches[m] = PrefixCache(max_bytes=64 << 30, max_entries=videos + 4)
            engine = build_engine(m, self.models, bench, self.caches[m], config=SERVED)
            service = SparrowService(engine, open_cache("memory"), ServiceConfig(
                max_new_tokens=max(2048, cfg.max_new_tokens), max_concurrent=videos * cfg.questions + 8,
                max_visual_tokens=max(32768, 2 * max_tokens(cfg))))
            server = stack.enter_context(BackgroundServer(service))
            self.clients[m] = stack.enter_context(SparrowClient(server.address))

    def clear(self) -> None:
        """Every engine forgets every video's prefill: each rate starts cold."""
        for cache in self.caches.values():
            cache.clear()


def max_tokens(cfg: LoadConfig) -> int:
    return max(visual_tokens(side, length, cfg.world) for side, length, _ in cfg.mix)


def make_videos(cfg: LoadConfig, seed: int, clients: dict[str, SparrowClient]) -> list[LoadVideo]:
    """Fresh world videos of the mix (seeds from `seed`), uploaded to every server."""
    out = []
    for i, (side, length, count) in enumerate(cfg.mix):
        for j in range(count):
            video, _ = world_video(side, length, seed + 1000 * i + j, cfg.world)
            ids = {m: c.upload(video.data, timeout=cfg.request_timeout_s) for m, c in clients.items()}
            out.append(LoadVideo(video.data, video.fps, visual_tokens(side, length, cfg.world), ids))
    return out


def call_for(cfg: LoadConfig, client: SparrowClient, method: str, video: LoadVideo, prompt: str,
             tokens: int | None = None) -> Callable[[], Trace]:
    """A request about an uploaded video, answered to its end of turn (or the cap)."""
    return grpc_call(client, video.ids[method], prompt, tokens or cfg.max_new_tokens, video.fps, cfg.temperature,
                     ignore_eos=False, max_visual_tokens=2 * max_tokens(cfg), timeout=cfg.request_timeout_s)


def _traced(call: Callable[[], Trace], ask: Ask, video: LoadVideo) -> Record:
    try:
        return Record(ask, video.visual_tokens, call())
    except Exception as exc:  # noqa: BLE001 - a failed request counts against goodput, not the run
        return Record(ask, video.visual_tokens, None, f"{type(exc).__name__}: {exc}")


def run_open(cfg: LoadConfig, client: SparrowClient, method: str, videos: list[LoadVideo],
             schedule: list[Ask]) -> tuple[list[Record], float, float]:
    """Every request sent at its arrival time (Poisson: the schedule's `at`), whatever is in
    flight. Returns the records in schedule order, and the run's start and end (perf_counter)."""
    workers = min(MAX_CLIENT_THREADS, len(schedule))
    with ThreadPoolExecutor(workers, thread_name_prefix="load") as pool:
        start = time.perf_counter()
        futures = []
        for ask in schedule:
            delay = start + ask.at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            v = videos[ask.video]
            futures.append(pool.submit(_traced, call_for(cfg, client, method, v, ask.prompt), ask, v))
        records = [f.result(timeout=cfg.request_timeout_s + 30) for f in futures]
    return records, start, time.perf_counter()


def run_closed(cfg: LoadConfig, client: SparrowClient, method: str, videos: list[LoadVideo], requests: list[Ask],
               clients: int) -> tuple[list[Record], float, float]:
    """`clients` clients, each sending the next request of the list as soon as its last ends."""
    todo: queue.Queue[tuple[int, Ask]] = queue.Queue()
    for i, ask in enumerate(requests):
        todo.put((i, ask))
    records: list[Record | None] = [None] * len(requests)

    def client_loop() -> None:
        while True:
            try:
                i, ask = todo.get_nowait()
            except queue.Empty:
                return
            v = videos[ask.video]
            records[i] = _traced(call_for(cfg, client, method, v, ask.prompt), ask, v)

    threads = [threading.Thread(target=client_loop, name=f"load-client-{n}", daemon=True) for n in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    deadline = start + len(requests) * (cfg.request_timeout_s + 30)
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"closed-loop clients still running {deadline - start:.0f} s in")
    return [r for r in records if r is not None], start, time.perf_counter()
