"""What a load run measured, in the terms serving engines are judged by (vLLM's `bench serve`):
per run (a method at a rate or a concurrency) TTFT, inter-token latency (ITL: the gap between
two chunks of a stream that carry tokens; a speculative chunk holds several tokens), time per
output token (TPOT) and end-to-end latency at p50/p95/p99, output tokens/s, request throughput,
goodput (requests/s that meet the objective), prefix reuse and tau; and the highest rate each
method sustains within the objective."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.serve_load.load_config import Objective
from benchmarks.serve_load.load_driver import Record

PCTS = (50, 95, 99)
LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
COLUMNS = ("requests", "failed", "duration_s", "req_s", "output_tokens", "out_tok_s",
           *(f"{m}_p{q}" for m in LATENCIES for q in PCTS), "good", "goodput_req_s", "good_share",
           "prefix_hits", "tau")


def _pcts(values: list[float], name: str) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    return {f"{name}_p{q}": float(np.percentile(arr, q)) if arr.size else math.nan for q in PCTS}


def request_row(r: Record, objective: Objective) -> dict:
    """One request's measures (ms), what it asked, and whether it met the objective."""
    t, asked = r.trace, {"video": r.ask.video, "prompt": r.ask.prompt}
    if t is None or not t.times:
        return {**asked, "ok": False, "good": False, "tokens": 0, "error": r.error or "no tokens"}
    tokens = len(t.token_ids)
    ttft = t.ttft
    tpot = (t.end - t.times[0]) / (tokens - 1) if tokens > 1 else 0.0
    uncached = max(0, t.prompt_tokens - t.cached_prompt_tokens)
    ttft_bound = objective.ttft_s + objective.prefill_s_per_1k * uncached / 1000
    return {**asked, "ok": True, "tokens": tokens, "server_tokens": t.completion_tokens, "ttft_ms": 1e3 * ttft,
            "tpot_ms": 1e3 * tpot, "e2e_ms": 1e3 * (t.end - t.start), "itl_ms": [1e3 * g for g in t.gaps],
            "uncached_prompt_tokens": uncached, "cached": t.cached_prompt_tokens > 0, "steps": t.steps,
            "accepted": t.accepted, "good": ttft <= ttft_bound and 1e3 * tpot <= objective.tpot_ms}


def summarize_run(records: list[Record], start: float, end: float, objective: Objective) -> dict:
    """A run's row (every name in COLUMNS) and its per-request rows."""
    rows = [request_row(r, objective) for r in records]
    done = [x for x in rows if x["ok"]]
    duration = end - start
    tokens = sum(x["tokens"] for x in done)
    steps = sum(x["steps"] for x in done)
    good = sum(x["good"] for x in rows)
    out = {"requests": len(rows), "failed": len(rows) - len(done), "duration_s": duration,
           "req_s": len(done) / duration, "output_tokens": tokens, "out_tok_s": tokens / duration,
           "good": good, "goodput_req_s": good / duration, "good_share": good / len(rows) if rows else 0.0,
           "prefix_hits": sum(x["cached"] for x in done),
           "tau": 1 + sum(x["accepted"] for x in done) / steps if steps else math.nan}
    for name in LATENCIES:
        values = [g for x in done for g in x[name]] if name == "itl_ms" else [x[name] for x in done]
        out.update(_pcts(values, name))
    return {**out, "per_request": rows}


def sustained(runs: list[dict], method: str, objective: Objective) -> float | None:
    """The highest request rate at which `method` sustains the objective: that rate and every
    lower one measured have at least `attain` of their requests meeting it. None: not even the
    lowest rate."""
    best = None
    for r in sorted((r for r in runs if r["method"] == method and r["mode"] == "rate"), key=lambda r: r["load"]):
        if r["good_share"] < objective.attain:
            break
        best = r["load"]
    return best
