"""Requests as their clients see them (in-process or over gRPC), run one after another or all
at once, and what they measure: tokens/s, time to first token, inter-token latency, tau."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from benchmarks.serving import trace
from benchmarks.shared_prefix import no_video
from sparrow import Engine, SamplingParams
from sparrow.services.client import SparrowClient
from sparrow.services.protos import pb


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
    prompt_tokens: int = 0           # the server's count (gRPC only), video included
    completion_tokens: int = 0       # the server's count of the answer (gRPC only)

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
            gen.append(engine.stream(no_video, prompt, sampling, video_key=key))
            for delta in gen[0]:
                yield delta.token_ids
        start, times, got, end = trace(chunks())
        m = gen[0].output.metrics
        return Trace(start, times, got, end, m.steps, m.accepted_tokens, m.cached_prompt_tokens)
    return call


def grpc_call(client: SparrowClient, video_id: str, prompt: str, tokens: int, fps: float, temperature: float = 0.0,
              seed: int | None = None, ignore_eos: bool = True, max_visual_tokens: int | None = None,
              timeout: float | None = None) -> Callable[[], Trace]:
    """A request through the gRPC server about an uploaded video (timeout: its gRPC deadline, s)."""
    sampling = {"temperature": temperature, **({"seed": seed} if seed is not None else {})}
    options = pb.VideoOptions(fps=fps, **({"max_visual_tokens": max_visual_tokens} if max_visual_tokens else {}))

    def call() -> Trace:
        done = []

        def chunks():
            for response in client.stream(prompt, video_id=video_id, max_new_tokens=tokens, ignore_eos=ignore_eos,
                                          video_options=options, timeout=timeout, **sampling):
                if response.HasField("chunk"):
                    yield response.chunk.token_ids
                else:
                    done.append(response.completion)
        start, times, got, end = trace(chunks())
        c = done[0]
        if c.error:
            raise RuntimeError(f"gRPC request failed after streaming: {c.error}")
        return Trace(start, times, got, end, c.metrics.steps, c.metrics.accepted_tokens, c.usage.cached_prompt_tokens,
                     c.usage.prompt_tokens, c.usage.completion_tokens)
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
def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def measure(traces: list[Trace]) -> dict:
    """Aggregate tokens/s over the run's wall time, TTFT and inter-token percentiles (ms), tau."""
    tokens = sum(len(t.token_ids) for t in traces)
    wall = max(t.end for t in traces) - min(t.start for t in traces)
    ttft = [t.ttft for t in traces]
    gaps = [g for t in traces for g in t.gaps]
    steps = sum(t.steps for t in traces)
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p95_ms": 1e3 * pct(ttft, 95),
            "itl_p50_ms": 1e3 * pct(gaps, 50), "itl_p95_ms": 1e3 * pct(gaps, 95),
            "tau": 1 + sum(t.accepted for t in traces) / steps if steps else 0.0}


def one_at_a_time_tok_s(traces: list[Trace]) -> float:
    """Tokens/s of requests run one after another: their tokens over the sum of their times."""
    return sum(len(t.token_ids) for t in traces) / sum(t.end - t.start for t in traces)


# ----- one configuration: one at a time, then N streams -----------------------------------------------
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
