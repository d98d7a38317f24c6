"""Concurrent streams: what N requests at once get from one engine, against the same N one
after another. Issue 15's serving benchmark.

    python -m benchmarks.concurrency --out BENCHMARKS.md           # 0.5k and 8k videos, 1-16 streams, 5 reps
    python -m benchmarks.concurrency --quick                       # 0.5k only, 1-8 streams, 2 reps, 32 tokens
    python -m benchmarks.concurrency --streams 1,8 --lengths 168x28 --paths in-process --no-prefill
    python -m benchmarks.concurrency --tiny                        # tiny random models: a smoke run
    python -m benchmarks.concurrency --streams 1,8 --paths in-process --no-prefill --share-prefill \
        --methods plain,eagle,specvlm,sparrow,sparrow-tree,sparrow-tree-auto --temperatures 0,1 \
        --lengths 168x28 --json a.json                             # issue 17's table at batch 1 and 8, a length a run
    python -m benchmarks.concurrency --from-json a.json,b.json --out BENCHMARKS.md   # those runs as one report

For each video length, each method (batched plain decoding, SpecConfig(method="none"); the
EAGLE-style and SpecVLM-style baselines of benchmarks.speculative; batched Sparrow: chain,
adaptive k, fixed tree, tree cut by cost), each path (in-process: a thread per stream
iterating `engine.stream`; gRPC: a thread per stream reading the embedded server on
loopback) and each temperature:

    one at a time   the requests one after another (once, the largest N of them); N's
                    baseline is its first N
    N streams       requests 0..N-1 started together (a barrier), for N in --streams

Reported per configuration, as median (min-max) over reps: aggregate tokens/s (all tokens /
from the first start to the last end), its ratio to one at a time, Sparrow's tokens/s over
plain's, p50/p95 time to first token and p50/p95 inter-token latency (the gap between two
chunks of a stream that carry tokens; a speculative chunk holds several tokens), and tau.

Protocol: every rep makes fresh world videos, one per stream (seeds from --seed, clear of
training and of the other benchmarks); stream i asks caption prompt i mod 3 with --tokens new
tokens (EOS ignored, so every stream does the same work), at T > 0 seeded with seed + i. Each
method and path has its own engine and prefix cache (as separate deployments), and every
engine caches every video's prefill before anything is timed, through the public API: a
1-token request naming the video (in-process by a video key; over gRPC by its upload id).
With --share-prefill the in-process engines instead answer from one cache holding one prefill
per video (speculative.share_prefix, as the side-by-side benchmark does: the same target, so
the same prefix; 5x fewer 25k prefills); SpecVLM keeps its own cache and 1-token request (its
small VLM reads the video's pixels once, and keeps its visual tokens for the video's later
requests). A timed request that misses the cache fails the run. Methods are interleaved per
rep, their order rotated. At T=0 every output must equal plain decoding's one-at-a-time
in-process output, token for token (lossless, and independent of its neighbours); at T > 0 its
own method's one-at-a-time in-process output with the same seed (independent of its neighbours
and of the path). A mismatch fails the run (exit status 1, nothing written).

Prefill scenario: --prefill-streams streams on the shortest videos decode (in-process) while
a request with an uncached --prefill-video (~25k visual tokens, decoded beforehand so only
its prefill competes) arrives; their inter-token latency in the --before-s seconds before it
arrives vs while it prefills (until its first token).

Cost on the shared 2-core CPU (world pair, load average 3-5): --quick 80 s (half of it the two
25k prefills); with 8k videos too (--lengths 168x28,168x448) 7.5 min. The full run is not
measured yet: expect ~30 min, mostly 8k prefills (16 videos x 4 engines x 5 reps) and 25k ones.
"""

from __future__ import annotations

import os

# Before torch is imported: OpenMP threads that spin while waiting distort timings on 2 shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import speculative as sb  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from benchmarks.serving import trace  # noqa: E402
from sparrow import Engine, SamplingParams  # noqa: E402
from sparrow.prefix_cache import PrefixCache  # noqa: E402
from sparrow.services.client import SparrowClient  # noqa: E402
from sparrow.services.protos import pb  # noqa: E402
from sparrow.services.server import BackgroundServer  # noqa: E402
from sparrow.services.servicer import ServiceConfig, SparrowService  # noqa: E402
from sparrow.state_cache import open_cache  # noqa: E402
from sparrow.training.world import CAPTION_PROMPTS, LADDER  # noqa: E402
from sparrow.video import ProcessedVideo, prepare_video  # noqa: E402

METHODS = {"plain": "plain", "eagle": "EAGLE-style (all tokens)", "specvlm": "SpecVLM-style", "sparrow": "Sparrow",
           "sparrow-adaptive": "Sparrow, adaptive k", "sparrow-tree": "Sparrow tree",
           "sparrow-tree-auto": "Sparrow tree, cut by cost"}
PATHS = {"in-process": "in-process", "grpc": "gRPC"}
SEED = 3 * 10**9                 # world videos: training < 1e9, world eval 4e9, speculative 2e9
TINY_LENGTHS = ((84, 8), (112, 8))    # 36 and 64 visual tokens with the world-style processor


@dataclass(frozen=True, slots=True)
class ConcurrencyConfig:
    models: str = "models"                               # DIR with world/{target,draft}
    lengths: tuple[tuple[int, int], ...] = (LADDER[0], LADDER[2])    # (side px, frames): 504 and 8,064 tokens
    streams: tuple[int, ...] = (1, 2, 4, 8, 16)
    tokens: int = 64
    reps: int = 5
    temperatures: tuple[float, ...] = (0.0,)            # T > 0: request i seeded with seed + i
    methods: tuple[str, ...] = ("plain", "sparrow")        # "sparrow-adaptive" on request (--methods)
    paths: tuple[str, ...] = tuple(PATHS)
    k: int = 4
    tree: tuple[int, int, int] = (2, 2, 12)      # sparrow-tree: width, branch, node budget
    seed: int = SEED
    warmup_tokens: int = 8                               # one untimed request per method and path first
    prefill_video: tuple[int, int] | None = LADDER[-1]   # 25,056 tokens; None: no prefill scenario
    prefill_streams: int = 8
    prefill_reps: int = 5
    prefill_stream_tokens: int = 2048                    # enough to outlast the prefill (checked)
    before_s: float = 2.0
    share_prefill: bool = False          # in-process engines read one cached prefill per video (not one each)

    def __post_init__(self) -> None:
        if not self.streams or list(self.streams) != sorted(set(self.streams)) or self.streams[0] < 1:
            raise ValueError(f"streams must be increasing counts >= 1, got {self.streams}")
        for name, given, known in (("methods", self.methods, METHODS), ("paths", self.paths, PATHS)):
            if not given or any(x not in known for x in given):
                raise ValueError(f"{name} must be a non-empty subset of {list(known)}, got {given}")
        if not self.lengths or self.reps < 1 or self.tokens < 2 or self.prefill_streams < 1:
            raise ValueError("need lengths, reps >= 1, tokens >= 2 and prefill_streams >= 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {self.temperatures}")

    @property
    def videos_per_rep(self) -> int:
        """One video per stream; the prefill scenario's streams use the shortest length's."""
        return max(self.streams[-1], self.prefill_streams if self.prefill_video else 0)


# ----- one request, as its client sees it ------------------------------------------------------------
@dataclass(slots=True)
class Trace:
    """One request as its client saw it: when it started, each chunk of tokens and when it came."""

    start: float
    times: list[float]               # arrival of each chunk that carries tokens (perf_counter)
    chunks: list[list[int]]
    end: float
    steps: int = 0
    accepted: int = 0
    cached_prompt_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def engine_call(engine: Engine, key: str, prompt: str, sampling: SamplingParams) -> Callable[[], Trace]:
    """A request on the in-process engine from the cached prefix `key` (a miss raises)."""
    def call() -> Trace:
        gen = []

        def chunks():                 # lazy: the request starts inside trace()'s clock
            gen.append(engine.stream(sb.no_video, prompt, sampling, video_key=key))
            for delta in gen[0]:
                yield delta.token_ids
        start, times, got, end = trace(chunks())
        m = gen[0].output.metrics
        return Trace(start, times, got, end, m.steps, m.accepted_tokens, m.cached_prompt_tokens)
    return call


def grpc_call(client: SparrowClient, video_id: str, prompt: str, tokens: int, fps: float, temperature: float = 0.0,
              seed: int | None = None) -> Callable[[], Trace]:
    """A request through the gRPC server about an uploaded video."""
    sampling = {"temperature": temperature, **({"seed": seed} if seed is not None else {})}

    def call() -> Trace:
        done = []

        def chunks():
            for response in client.stream(prompt, video_id=video_id, max_new_tokens=tokens, ignore_eos=True,
                                          video_options=pb.VideoOptions(fps=fps), **sampling):
                if response.HasField("chunk"):
                    yield response.chunk.token_ids
                else:
                    done.append(response.completion)
        start, times, got, end = trace(chunks())
        c = done[0]
        if c.error:
            raise RuntimeError(f"gRPC request failed after streaming: {c.error}")
        return Trace(start, times, got, end, c.metrics.steps, c.metrics.accepted_tokens, c.usage.cached_prompt_tokens)
    return call


def run_sequential(calls: list[Callable[[], Trace]]) -> list[Trace]:
    return [call() for call in calls]


def run_concurrent(calls: list[Callable[[], Trace]]) -> list[Trace]:
    """Every call on its own thread, released together; results in call order (an error re-raises)."""
    barrier = threading.Barrier(len(calls))       # no request gets a head start while threads spawn

    def go(call):
        barrier.wait()
        return call()
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(go, calls))


# ----- measures ----------------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def measure(traces: list[Trace]) -> dict:
    """Aggregate tokens/s over the run's wall time, TTFT and inter-token percentiles (ms), tau."""
    tokens = sum(len(t.token_ids) for t in traces)
    wall = max(t.end for t in traces) - min(t.start for t in traces)
    ttft = [t.ttft for t in traces]
    gaps = [g for t in traces for g in t.gaps]
    steps = sum(t.steps for t in traces)
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "ttft_p50_ms": 1e3 * _pct(ttft, 50), "ttft_p95_ms": 1e3 * _pct(ttft, 95),
            "itl_p50_ms": 1e3 * _pct(gaps, 50), "itl_p95_ms": 1e3 * _pct(gaps, 95),
            "tau": 1 + sum(t.accepted for t in traces) / steps if steps else 0.0}


def one_at_a_time_tok_s(traces: list[Trace]) -> float:
    """Tokens/s of requests run one after another: their tokens over the sum of their times."""
    return sum(len(t.token_ids) for t in traces) / sum(t.end - t.start for t in traces)


# ----- models, videos, prefills --------------------------------------------------------------------------
@dataclass(slots=True)
class Video:
    processed: ProcessedVideo | None                      # dropped once every engine cached its prefill
    visual_tokens: int
    data: bytes
    fps: float                                            # sent over gRPC: sampled as in-process
    prompt: str
    keys: dict[str, str] = dataclasses.field(default_factory=dict)   # method -> in-process prefix cache key
    video_id: str | None = None                           # gRPC upload


def make_videos(target, side: int, frames: int, count: int, seed: int) -> list[Video]:
    videos = []
    for i in range(count):
        video, options = sb.world_video(side, frames, seed + i)
        processed = prepare_video(video.source, target.processor, options)
        videos.append(Video(processed, processed.num_visual_tokens, video.data, video.fps,
                            CAPTION_PROMPTS[i % len(CAPTION_PROMPTS)]))
    return videos


def cache_prefills(videos: list[Video], engines: dict[str, Engine], clients: dict[str, SparrowClient],
                   tag: str, shared: PrefixCache | None = None, target=None) -> None:
    """Before timing, every engine caches every video's prefill, through the public API: a
    1-token request naming the video (in-process by a key, over gRPC by its upload id). With a
    `shared` cache, the in-process engines answering from it get one prefill per video, made
    once for all of them (speculative.share_prefix: one per bridge layer, every engine's features)."""
    sharing = {m: e for m, e in engines.items() if shared is not None and e.prefix_cache is shared}
    for i, v in enumerate(videos):
        if sharing:
            keys, _ = sb.share_prefix(target, v.processed, v.prompt, sharing, shared, f"{tag}v{i}")
            v.keys.update(keys)
        for method, engine in engines.items():
            if method not in sharing:
                v.keys[method] = f"{tag}v{i}"
                engine.generate(v.processed, v.prompt, SamplingParams(max_new_tokens=1), video_key=v.keys[method])
        for client in clients.values():
            v.video_id = client.upload(v.data)
            grpc_call(client, v.video_id, v.prompt, 1, v.fps)()
        v.processed = None          # its pixels (~150 MB at 8k) are not needed again


# ----- the benchmark ---------------------------------------------------------------------------------------
def run_benchmark(cfg: ConcurrencyConfig, log: Callable[[str], None] = print) -> dict:
    """Every (rep, length, method, path): one at a time, then each N. Returns raw per-rep
    measures, summaries, the prefill scenario and identity mismatches. JSON-serialisable."""
    load_before, machine = os.getloadavg(), sb.machine()
    models = sb.Models(cfg.models)
    spec_cfg = sb.BenchConfig(models=cfg.models, k=cfg.k, methods=tuple(METHODS), tree=cfg.tree)
    entries = cfg.videos_per_rep + 8
    caches: list[PrefixCache] = []

    def new_cache() -> PrefixCache:
        caches.append(PrefixCache(max_bytes=64 << 30, max_entries=entries))
        return caches[-1]

    # An engine per method and path, each with its own prefix cache, as separate deployments
    # would be; with share_prefill the in-process ones read one (SpecVLM keeps its own: its
    # small VLM reads the pixels on a video's first request).
    shared = new_cache() if cfg.share_prefill else None
    engines = {m: sb.build_engine(m, models, spec_cfg, shared if shared is not None and m != "specvlm" else new_cache(),
                                  keyed_videos=entries) for m in cfg.methods}
    result = {"runs": [], "prefill_scenario": [], "mismatches": []}
    with contextlib.ExitStack() as stack:
        clients = {}
        if "grpc" in cfg.paths:
            for m in cfg.methods:
                service = SparrowService(sb.build_engine(m, models, spec_cfg, new_cache(), keyed_videos=entries),
                                         open_cache("memory"), ServiceConfig(max_new_tokens=max(2048, cfg.tokens),
                                                                             max_concurrent=cfg.videos_per_rep + 8))
                server = stack.enter_context(BackgroundServer(service))
                clients[m] = stack.enter_context(SparrowClient(server.address))
        for rep in range(cfg.reps):
            for li in range(len(cfg.lengths)):
                for name, rows in run_length(cfg, models.target, engines, clients, rep, li, log, shared).items():
                    result[name] += rows
                for c in caches:
                    c.clear()
    return {"config": dataclasses.asdict(cfg), "machine": machine, "target": sb.describe_target(models.target),
            "load_before": load_before, "load_after": os.getloadavg(), **result,
            "summary": summarize(result["runs"]), "prefill_summary": summarize_scenario(result["prefill_scenario"]),
            "identical": not result["mismatches"]}


def run_length(cfg: ConcurrencyConfig, target, engines: dict[str, Engine], clients: dict[str, SparrowClient],
               rep: int, li: int, log: Callable[[str], None], shared: PrefixCache | None = None) -> dict[str, list[dict]]:
    """One rep of one video length: fresh videos, their prefills cached, then every method, path
    and temperature (methods in an order rotated per rep), the identity check, and the prefill
    scenario."""
    side, frames = cfg.lengths[li]
    videos = make_videos(target, side, frames, cfg.videos_per_rep, cfg.seed + 10_000 * rep + 1000 * li)
    cache_prefills(videos, engines if "in-process" in cfg.paths else {}, clients, f"r{rep}l{li}", shared, target)
    n_vis = videos[0].visual_tokens
    log(f"rep {rep}: {len(videos)} videos of {side}px x {frames} frames = {n_vis} visual tokens, prefills cached")
    runs, outputs = [], {}
    for method in cfg.methods[rep % len(cfg.methods):] + cfg.methods[:rep % len(cfg.methods)]:
        for path in cfg.paths:
            for temp in cfg.temperatures:
                calls = _calls(path, engines[method], clients.get(method), videos, cfg.tokens, method, temp, cfg.seed)
                if rep == 0 and li == 0 and cfg.warmup_tokens and temp == cfg.temperatures[0]:   # untimed: first calls
                    _calls(path, engines[method], clients.get(method), videos[:1], cfg.warmup_tokens, method)[0]()
                got = run_configuration(calls, cfg.streams)
                for r in got["runs"]:
                    r.update(rep=rep, visual_tokens=n_vis, method=method, path=path, temperature=temp)
                    log(f"  {method:8s} {path:10s} T={temp:g} {r['streams']:2d} streams: {r['tok_s']:8.1f} tok/s "
                        f"({r['x_one_at_a_time']:.2f}x one at a time), TTFT p95 {r['ttft_p95_ms']:.1f} ms, "
                        f"ITL p95 {r['itl_p95_ms']:.1f} ms, tau {r['tau']:.2f}")
                runs += got["runs"]
                outputs[(method, path, temp)] = got["outputs"]
    mismatches = check_identity(outputs, rep, n_vis)
    for line in mismatch_lines(mismatches):
        log(line)
    scenario = []
    if li == 0 and cfg.prefill_video and rep < cfg.prefill_reps and "in-process" in cfg.paths:
        scenario = prefill_scenario(target, engines, videos[:cfg.prefill_streams], cfg, rep, log)
    return {"runs": runs, "mismatches": mismatches, "prefill_scenario": scenario}


def _calls(path: str, engine: Engine, client: SparrowClient | None, videos: list[Video], tokens: int, method: str,
           temperature: float = 0.0, seed: int = SEED) -> list[Callable[[], Trace]]:
    """Request i of the list: video i; at T > 0 seeded with seed + i (the same in every run)."""
    seeds = [seed + i if temperature > 0 else None for i in range(len(videos))]
    if path == "grpc":
        return [grpc_call(client, v.video_id, v.prompt, tokens, v.fps, temperature, s) for v, s in zip(videos, seeds)]
    return [engine_call(engine, v.keys[method], v.prompt,
                        SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=temperature, seed=s))
            for v, s in zip(videos, seeds)]


def run_configuration(calls: list[Callable[[], Trace]], streams: tuple[int, ...]) -> dict:
    """One at a time over the largest N, then each N concurrently. Returns per-N measures and
    every output: {"sequential": [ids per request], N: [ids per request]}."""
    one = run_sequential(calls[: streams[-1]])
    _check_cached(one)
    runs, outputs = [], {"sequential": [t.token_ids for t in one]}
    for n in streams:
        traces = run_concurrent(calls[:n])
        _check_cached(traces)
        base = one_at_a_time_tok_s(one[:n])
        m = measure(traces)
        runs.append({"streams": n, **m, "one_at_a_time_tok_s": base, "x_one_at_a_time": m["tok_s"] / base})
        outputs[n] = [t.token_ids for t in traces]
    return {"runs": runs, "outputs": outputs}


def _check_cached(traces: list[Trace]) -> None:
    if any(t.cached_prompt_tokens == 0 for t in traces):
        raise RuntimeError("a timed request prefilled its video (prefix cache miss): the protocol caches every "
                           "prefill first; is the prefix cache too small?")


def reference_key(outputs: dict[tuple[str, str, float], dict], method: str, path: str,
                  temp: float) -> tuple[str, str, float]:
    """At T=0 every output must equal plain decoding's one-at-a-time in-process output (lossless
    and independent of its neighbours); at T > 0, with a seed, the method's own one-at-a-time
    in-process output (independent of its neighbours and of the path). Falls back to the first
    configuration run when that reference did not run."""
    for key in ((("plain", "in-process", temp),) if temp == 0 else ()) + ((method, "in-process", temp),):
        if key in outputs:
            return key
    return next(k for k in outputs if k[2] == temp)


def check_identity(outputs: dict[tuple[str, str, float], dict], rep: int, n_vis: int) -> list[dict]:
    """Every output equals its reference (reference_key), request by request."""
    bad = []
    for (method, path, temp), runs in outputs.items():
        ref_key = reference_key(outputs, method, path, temp)
        ref = outputs[ref_key]["sequential"]
        for streams, ids in runs.items():
            for i, got in enumerate(ids):
                diff = sb.first_difference(ref[i], got)
                if diff is not None:
                    bad.append({"rep": rep, "visual_tokens": n_vis, "method": method, "path": path, "temperature": temp,
                                "streams": streams, "request": i, "reference": "/".join(ref_key[:2]), **diff})
    return bad


def mismatch_lines(mismatches: list[dict]) -> list[str]:
    return [f"MISMATCH at T={b.get('temperature', 0.0):g}: {b['method']} {b['path']} "
            f"({b['streams']}{'' if b['streams'] == 'sequential' else ' streams'},"
            f" request {b['request']}, rep {b['rep']}, {b['visual_tokens']} visual tokens) differs from {b['reference']}"
            f" one at a time at token {b['index']}: expected {b['expected']}, got {b['got']} (lengths {b['lengths']})"
            for b in mismatches]


# ----- the prefill scenario ----------------------------------------------------------------------------------
def prefill_scenario(target, engines: dict[str, Engine], videos: list[Video], cfg: ConcurrencyConfig, rep: int,
                     log: Callable[[str], None]) -> list[dict]:
    """Per method: len(videos) streams decoding, then a request with a fresh uncached long video."""
    side, frames = cfg.prefill_video
    long_video, _ = sb.make_video(target, side, frames, cfg.seed + 10_000 * rep + 999)
    rows = []
    for method, engine in engines.items():
        row = streams_under_prefill(engine, [(v.keys[method], v.prompt) for v in videos], long_video, cfg)
        row.update(rep=rep, method=method, streams=len(videos), prefill_visual_tokens=long_video.num_visual_tokens)
        log(f"  prefill scenario, {method}: {row['streams']} streams, inter-token p95 {row['before_p95_ms']:.1f} ms "
            f"before, {row['during_p95_ms']:.1f} ms during a {row['prefill_visual_tokens']}-token prefill "
            f"({row['long_ttft_s']:.2f} s to its first token){'' if row['covered'] else ' (NOT COVERED)'}")
        rows.append(row)
    return rows


def streams_under_prefill(engine: Engine, requests: list[tuple[str, str]], long_video: ProcessedVideo,
                          cfg: ConcurrencyConfig) -> dict:
    sampling = SamplingParams(max_new_tokens=cfg.prefill_stream_tokens, ignore_eos=True)
    gens = [engine.stream(sb.no_video, prompt, sampling, video_key=key) for key, prompt in requests]
    times: list[list[float]] = [[] for _ in gens]

    def follow(i: int) -> None:
        for delta in gens[i]:
            if delta.token_ids:
                times[i].append(time.perf_counter())
    with ThreadPoolExecutor(len(gens)) as pool:
        followers = [pool.submit(follow, i) for i in range(len(gens))]
        try:
            while not all(times) and not any(f.done() for f in followers):
                time.sleep(0.01)
            t_before = time.perf_counter()      # every stream is decoding
            time.sleep(cfg.before_s)
            t_arrive = time.perf_counter()
            long = engine.stream(long_video, CAPTION_PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
            next(long)
            t_first = time.perf_counter()
            for _ in long:
                pass
        finally:
            for gen in gens:                    # the streams have served their purpose
                gen.abort()
        for f in followers:
            f.result()
    before = [b - a for ts in times for a, b in zip(ts, ts[1:]) if a >= t_before and b <= t_arrive]
    during = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > t_arrive and a < t_first]
    # A stream that ran out of tokens before the long request's first token leaves the window
    # partly unmeasured: flagged, not hidden.
    covered = all(ts and ts[-1] >= t_first for ts in times)
    return {"before_p50_ms": 1e3 * _pct(before, 50), "before_p95_ms": 1e3 * _pct(before, 95),
            "before_max_ms": 1e3 * max(before, default=float("nan")), "before_gaps": len(before),
            "during_p50_ms": 1e3 * _pct(during, 50), "during_p95_ms": 1e3 * _pct(during, 95),
            "during_max_ms": 1e3 * max(during, default=float("nan")), "during_gaps": len(during),
            "long_ttft_s": t_first - t_arrive, "long_prefill_s": long.output.metrics.prefill_seconds,
            "covered": covered}


# ----- summaries and report ------------------------------------------------------------------------------------
SUMMARY_KEYS = ("tok_s", "one_at_a_time_tok_s", "x_one_at_a_time", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms",
                "itl_p95_ms", "tau")


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(runs: list[dict]) -> list[dict]:
    """Per (temperature, visual tokens, path, method, streams): min/median/max over reps of each
    measure, and the method's median tokens/s over plain's of the same cell."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r.get("temperature", 0.0), r["visual_tokens"], r["path"], r["method"], r["streams"]),
                         []).append(r)
    rows = [{"temperature": t, "visual_tokens": n, "path": p, "method": m, "streams": s, "reps": len(rs),
             **{k: _spread([r[k] for r in rs]) for k in SUMMARY_KEYS}}
            for (t, n, p, m, s), rs in sorted(cells.items(), key=lambda kv: (
                kv[0][0], kv[0][1], list(PATHS).index(kv[0][2]), list(METHODS).index(kv[0][3]), kv[0][4]))]
    plain = {(r["temperature"], r["visual_tokens"], r["path"], r["streams"]): r for r in rows if r["method"] == "plain"}
    for r in rows:
        p = plain.get((r["temperature"], r["visual_tokens"], r["path"], r["streams"]))
        r["x_plain"] = r["tok_s"]["median"] / p["tok_s"]["median"] if p else None
    return rows


def summarize_scenario(rows: list[dict]) -> list[dict]:
    keys = ("before_p50_ms", "before_p95_ms", "during_p50_ms", "during_p95_ms", "during_max_ms", "long_ttft_s",
            "long_prefill_s")
    out = []
    for method in METHODS:
        rs = [r for r in rows if r["method"] == method]
        if rs:
            # a window without a gap (a prefill shorter than one step) is nan: spread over the others
            out.append({"method": method, "streams": rs[0]["streams"], "reps": len(rs),
                        "prefill_visual_tokens": rs[0]["prefill_visual_tokens"],
                        "covered": all(r["covered"] for r in rs),
                        **{k: _spread([r[k] for r in rs if r[k] == r[k]] or [float("nan")]) for k in keys}})
    return out


def _cell(s: dict, fmt: str = ".1f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def _loads(result: dict) -> str:
    parts = result.get("parts") or [result]
    return "; ".join(f"{'lengths ' + ', '.join(f'{a}x{b}' for a, b in p['lengths']) + ': ' if 'parts' in result else ''}"
                     f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in p['load_before'])}, "
                     f"after {'/'.join(f'{x:.2f}' for x in p['load_after'])}" for p in parts)


def _reps(result: dict) -> str:
    parts = result.get("parts") or [{"lengths": result["config"]["lengths"], "reps": result["config"]["reps"]}]
    counts = sorted({p["reps"] for p in parts}, reverse=True)
    if len(counts) == 1:
        return f"{counts[0]} reps"
    fewer = [f"{a}x{b}: {p['reps']}" for p in parts if p["reps"] != counts[0] for a, b in p["lengths"]]
    return f"{counts[0]} reps ({', '.join(fewer)})"


def report(result: dict) -> str:
    cfg = result["config"]
    temps = ", ".join(f"{t:g}" for t in cfg.get("temperatures", (0.0,)))
    lines = [f"Machine: {result['machine']}; {_loads(result)}.",
             f"Target: {result['target']}; Sparrow draft k = {cfg['k']}, window 16, anchors 32, glimpse 0; trees "
             f"{'x'.join(map(str, cfg['tree'][:2]))}, at most {cfg['tree'][2]} nodes. "
             f"{cfg['tokens']} new tokens a stream (EOS ignored), T = {temps} (T > 0: request i seeded), caption "
             f"prompts; {_reps(result)}, each with fresh world videos, one per stream (seeds from {cfg['seed']}); "
             f"prefills cached before timing{' (one shared prefill per video in-process)' if cfg.get('share_prefill') else ''}. "
             "Cells: median (min-max) over reps. One at a time: the same requests one after another. ITL: the gap "
             "between two chunks of a stream (a speculative chunk holds tau tokens on average).", ""]
    ident = ("every output (every method and path, one at a time and concurrent) equals plain decoding's "
             "one-at-a-time output at T=0, and its own method's one-at-a-time output with the same seed at T > 0"
             if result["identical"] else f"**{len(result['mismatches'])} MISMATCHES**")
    lines += [f"Output identity: {ident}.", ""]
    lines += goal_lines(result)
    lines += method_table_lines(result)
    lines += ["| T | visual tokens | path | method | streams | tok/s | one at a time tok/s | x one at a time | "
              "x plain | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | tau |", "|---" * 14 + "|"]
    for r in result["summary"]:
        vs = f"{r['x_plain']:.2f}x" if r["method"] != "plain" and r["x_plain"] is not None else "-"
        lines.append(f"| {r['temperature']:g} | {r['visual_tokens']} | {PATHS[r['path']]} | {METHODS[r['method']]} | "
                     f"{r['streams']} | "
                     f"{_cell(r['tok_s'])} | {r['one_at_a_time_tok_s']['median']:.1f} | "
                     f"{_cell(r['x_one_at_a_time'], '.2f')} | {vs} | {_cell(r['ttft_p50_ms'])} | "
                     f"{_cell(r['ttft_p95_ms'])} | {_cell(r['itl_p50_ms'])} | {_cell(r['itl_p95_ms'])} | "
                     f"{r['tau']['median']:.2f} |")
    lines += [""] + scenario_lines(result)
    return "\n".join(lines).rstrip("\n")


def goal_lines(result: dict) -> list[str]:
    """Issue 15's goal: 8 streams >= 3x the tokens/s of one at a time on the shortest videos."""
    rows = [r for r in result["summary"] if r["streams"] == 8 and r["temperature"] == 0]
    if not rows:
        return []
    n = min(r["visual_tokens"] for r in rows)
    got = ", ".join(f"{PATHS[r['path']]} {METHODS[r['method']]} {r['x_one_at_a_time']['median']:.2f}x"
                    for r in rows if r["visual_tokens"] == n)
    return [f"Goal (issue 15): 8 streams >= 3x the tokens/s of one at a time on {n}-token videos. Measured: {got}.",
            ""]


def method_table_lines(result: dict) -> list[str]:
    """The methods side by side, one table per temperature and path: rows (visual tokens, streams),
    a column per method: aggregate tokens/s median (min-max), tau, x plain at the same batch."""
    summary = result["summary"]
    methods = [m for m in METHODS if any(r["method"] == m for r in summary)]
    if len(methods) < 2:
        return []
    lines = []
    for temp in sorted({r["temperature"] for r in summary}):
        for path in [p for p in PATHS if any(r["path"] == p for r in summary)]:
            cells = {(r["visual_tokens"], r["streams"], r["method"]): r for r in summary
                     if r["temperature"] == temp and r["path"] == path}
            most = max(s for _, s, _ in cells)
            lines += [f"**T = {temp:g}, {PATHS[path]}.** Cell: aggregate tokens/s, median (min-max) over reps; tau; "
                      f"x plain at the same batch. Row \"one at a time\": the {most} requests of each rep one after "
                      "another (tokens over the sum of their times; tau not recorded for it).", "",
                      "| visual tokens | streams | " + " | ".join(METHODS[m] for m in methods) + " |",
                      "|---" * (2 + len(methods)) + "|"]
            for n in sorted({n for n, _, _ in cells}):
                plain = cells.get((n, most, "plain"))
                row = []
                for m in methods:
                    r = cells.get((n, most, m))
                    x = f"; {r['one_at_a_time_tok_s']['median'] / plain['one_at_a_time_tok_s']['median']:.2f}x" \
                        if r is not None and plain is not None else ""
                    row.append("-" if r is None else _cell(r["one_at_a_time_tok_s"], ".0f") + x)
                lines.append(f"| {n:,} | one at a time | " + " | ".join(row) + " |")
                for streams in sorted({s for k, s, _ in cells if k == n}):
                    row = []
                    for m in methods:
                        r = cells.get((n, streams, m))
                        row.append("-" if r is None else f"{_cell(r['tok_s'], '.0f')}"
                                   + ("" if m == "plain" else f", tau {r['tau']['median']:.2f}")
                                   + (f"; {r['x_plain']:.2f}x" if r["x_plain"] is not None else ""))
                    lines.append(f"| {n:,} | {streams} | " + " | ".join(row) + " |")
            lines.append("")
    return lines


def merge(results: list[dict]) -> dict:
    """Runs of the same configuration over different lengths (one command per length, so a
    long benchmark keeps what it measured; the longest may run fewer reps) as one result: runs
    concatenated, summaries redone, each part's lengths, reps, load and command kept."""
    first = results[0]
    free = ("lengths", "reps", "prefill_reps")
    for r in results[1:]:
        a = {k: v for k, v in first["config"].items() if k not in free}
        b = {k: v for k, v in r["config"].items() if k not in free}
        if a != b:
            diff = sorted(k for k in a if a[k] != b.get(k))
            raise ValueError(f"cannot merge runs whose configurations differ beyond their lengths: {diff}")
    merged = {"config": {**first["config"], "lengths": [x for r in results for x in r["config"]["lengths"]]},
              "machine": first["machine"], "target": first["target"],
              "load_before": first["load_before"], "load_after": results[-1]["load_after"],
              "parts": [{"lengths": r["config"]["lengths"], "reps": r["config"]["reps"], "load_before": r["load_before"],
                         "load_after": r["load_after"], "command": r.get("command", ""),
                         "wall_seconds": r.get("wall_seconds", 0.0)} for r in results],
              "wall_seconds": sum(r.get("wall_seconds", 0.0) for r in results)}
    for key in ("runs", "prefill_scenario", "mismatches"):
        merged[key] = [x for r in results for x in r[key]]
    merged.update(summary=summarize(merged["runs"]), prefill_summary=summarize_scenario(merged["prefill_scenario"]),
                  identical=not merged["mismatches"])
    return merged


def scenario_lines(result: dict) -> list[str]:
    rows = result["prefill_summary"]
    if not rows:
        return ["Prefill scenario: not run.", ""]
    lines = [f"Streams decoding while a {rows[0]['prefill_visual_tokens']}-token prefill arrives (in-process; the "
             f"long video decoded beforehand, its prefill uncached; streams on the shortest videos): inter-token "
             f"latency in the {result['config']['before_s']:g} s before it arrives vs until its first token. "
             "Median (min-max) over reps.", "",
             "| method | streams | ITL p50 before ms | ITL p95 before ms | ITL p50 during ms | ITL p95 during ms | "
             "ITL max during ms | long request TTFT s | its prefill s | reps |", "|---" * 10 + "|"]
    for r in rows:
        flag = "" if r["covered"] else " (streams ended before the prefill: raise --prefill-stream-tokens)"
        lines.append(f"| {METHODS[r['method']]} | {r['streams']} | {_cell(r['before_p50_ms'])} | "
                     f"{_cell(r['before_p95_ms'])} | {_cell(r['during_p50_ms'])} | {_cell(r['during_p95_ms'])} | "
                     f"{_cell(r['during_max_ms'])} | {_cell(r['long_ttft_s'], '.2f')} | "
                     f"{_cell(r['long_prefill_s'], '.2f')} | {r['reps']}{flag} |")
    return lines + [""]


# ----- tiny models ------------------------------------------------------------------------------------------------
def save_tiny_models(root: str | Path) -> Path:
    """Tiny random models in the --models layout (root/world/{target,draft}, root/bench/draft-eagle,
    root/bench/small-target), with the world target's processor rule (frames not upscaled: one
    visual token per 28x28 px), so small world videos stay small."""
    from sparrow.models.target import TargetModel
    from sparrow.tiny import tiny_draft, tiny_target
    from sparrow.video import processor_for

    def world_style(hf) -> TargetModel:
        return TargetModel(hf.hf, hf.tokenizer, processor_for(hf.hf.config, min_pixels=28 * 28))

    root = Path(root)
    target = world_style(tiny_target("qwen2_5_vl", seed=0))
    target.save_pretrained(root / "world" / "target")
    tiny_draft(target, seed=0).save_pretrained(root / "world" / "draft")
    tiny_draft(target, seed=1).save_pretrained(root / "bench" / "draft-eagle")
    world_style(tiny_target("qwen2_5_vl", seed=1, hidden=32, layers=2)).save_pretrained(root / "bench" / "small-target")
    return root


# ----- CLI ---------------------------------------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def config_from_args(args: argparse.Namespace) -> ConcurrencyConfig:
    quick, tiny = args.quick, args.tiny
    defaults = ConcurrencyConfig()
    # quick: the 0.5k videos only; at 8k each video's prefill (one per engine: 4) costs seconds
    lengths = sb._videos(args.lengths) if args.lengths else TINY_LENGTHS[:1] if tiny else \
        defaults.lengths[:1] if quick else defaults.lengths
    prefill = None if args.no_prefill else (
        sb._videos(args.prefill_video)[0] if args.prefill_video else (112, 16) if tiny else defaults.prefill_video)
    reps = args.reps or (1 if tiny else 2 if quick else defaults.reps)
    return ConcurrencyConfig(
        models=args.models, lengths=lengths,
        streams=_ints(args.streams) if args.streams else (1, 2) if tiny else (1, 2, 4, 8) if quick else defaults.streams,
        tokens=args.tokens or (8 if tiny else 32 if quick else defaults.tokens), reps=reps,
        temperatures=tuple(float(x) for x in args.temperatures.split(",")), share_prefill=args.share_prefill,
        methods=_names(args.methods), paths=_names(args.paths), k=args.k, seed=args.seed,
        tree=tuple(int(x) for x in args.tree.split(",")),
        prefill_video=prefill, prefill_streams=args.prefill_streams or (2 if tiny else defaults.prefill_streams),
        prefill_reps=min(reps, args.prefill_reps or (1 if quick else reps)),
        prefill_stream_tokens=args.prefill_stream_tokens or (256 if tiny else defaults.prefill_stream_tokens),
        before_s=args.before_s if args.before_s is not None else 0.2 if tiny else defaults.before_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="models", help="DIR with world/{target,draft}")
    ap.add_argument("--quick", action="store_true", help="0.5k videos, 1-8 streams, 2 reps, 32 tokens, 1 prefill rep")
    ap.add_argument("--tiny", action="store_true", help="tiny random models in a temp dir, tiny videos (a smoke run)")
    ap.add_argument("--streams", help="comma list of concurrent stream counts (default 1,2,4,8,16)")
    ap.add_argument("--lengths", help="comma list of SIDExFRAMES world videos (default 168x28,168x448: 0.5k, 8k)")
    ap.add_argument("--tokens", type=int, help="new tokens a stream (default 64; quick 32)")
    ap.add_argument("--reps", type=int, help="fresh video sets per length (default 5; quick 2)")
    ap.add_argument("--methods", default="plain,sparrow", help=f"comma list of {list(METHODS)}")
    ap.add_argument("--temperatures", default="0", help="comma list (default 0; T > 0: request i seeded)")
    ap.add_argument("--share-prefill", action="store_true",
                    help="in-process engines answer from one cached prefill per video (fewer prefills; SpecVLM "
                         "keeps its own)")
    ap.add_argument("--from-json", help="comma list of --json files of one configuration over different lengths: "
                                        "report them as one run (nothing is run)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tree", default="2,2,12", help="sparrow-tree: WIDTH,BRANCH,BUDGET (depth is --k)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--prefill-video", help="SIDExFRAMES of the prefill scenario's long video (default 168x1392: 25k)")
    ap.add_argument("--prefill-streams", type=int, help="streams decoding during it (default 8)")
    ap.add_argument("--prefill-reps", type=int, help="default: --reps (quick: 1)")
    ap.add_argument("--prefill-stream-tokens", type=int, help="their max new tokens (default 2048)")
    ap.add_argument("--before-s", type=float, help="seconds of decoding measured before the prefill (default 2)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill scenario")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch intra-op threads (default: every core, as a server would run)")
    ap.add_argument("--out", help="write the --section section of this markdown file")
    ap.add_argument("--section", default="concurrency", help="its marker key (default concurrency)")
    ap.add_argument("--title", default="Concurrent streams (world models): batched plain vs batched Sparrow")
    ap.add_argument("--json", help="raw results")
    args = ap.parse_args(argv)
    command = "python -m benchmarks.concurrency " + " ".join(argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(args.threads)
    if args.from_json:
        result = merge([json.loads(Path(f).read_text()) for f in _names(args.from_json)])
        command += "` over the runs `" + "`, `".join(p["command"] for p in result["parts"])
    else:
        with tempfile.TemporaryDirectory(prefix="sparrow-tiny-") as tmp:
            if args.tiny:
                args.models = str(save_tiny_models(tmp))
            result = sb.run_timed(lambda: run_benchmark(config_from_args(args)))
        if result is None:
            return 2
        result["command"] = command
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    print(text)
    print(f"({result['wall_seconds']:.0f} s)")
    if not result["identical"]:
        print("\n".join(mismatch_lines(result["mismatches"])), file=sys.stderr)
        print("FAILED: concurrent outputs differ from one-at-a-time plain decoding at T=0 (nothing written)",
              file=sys.stderr)
        return 1
    if args.out:
        write_section(args.out, args.section, args.title, command, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
