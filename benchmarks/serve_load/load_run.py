"""One load run: the servers, fresh videos, then every rate (open loop) and every concurrency
(closed loop), each method in turn on the same schedule with cold prefix caches."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable

from benchmarks.machine import describe_target, machine as describe_machine
from benchmarks.serve_load.load_config import LoadConfig, asks, fresh_seed, poisson
from benchmarks.serve_load.load_driver import Servers, call_for, make_videos, run_closed, run_open
from benchmarks.serve_load.load_stats import summarize_run, sustained


def run_benchmark(cfg: LoadConfig, log: Callable[[str], None] = print) -> dict:
    """Every rate and concurrency, each method on the same requests. JSON-serialisable."""
    seed = cfg.seed if cfg.seed is not None else fresh_seed()
    load_before, machine = os.getloadavg(), describe_machine()
    runs = []
    with contextlib.ExitStack() as stack:
        servers = Servers(cfg, stack)
        videos = make_videos(cfg, seed, servers.clients)
        log(f"{len(videos)} videos ({', '.join(str(v.visual_tokens) for v in videos)} visual tokens), seed {seed}")
        requests = asks(len(videos), cfg.questions, seed, cfg.world, cfg.long_share)
        if cfg.warmup_tokens:                     # untimed: each server's first call, on the smallest video
            for m, client in servers.clients.items():
                call_for(cfg, client, m, videos[0], requests[0].prompt, cfg.warmup_tokens)()
        loads = [("rate", r) for r in cfg.rates] + [("concurrency", c) for c in cfg.concurrency]
        for i, (mode, load) in enumerate(loads):
            schedule = poisson(requests, load, seed + 7 * i + 1) if mode == "rate" else requests
            order = cfg.methods[i % len(cfg.methods):] + cfg.methods[:i % len(cfg.methods)]   # rotated per load
            for method in order:
                servers.clear()
                client = servers.clients[method]
                if mode == "rate":
                    records, start, end = run_open(cfg, client, method, videos, schedule)
                else:
                    records, start, end = run_closed(cfg, client, method, videos, schedule, load)
                row = {"mode": mode, "load": load, "method": method,
                       **summarize_run(records, start, end, cfg.objective)}
                runs.append(row)
                log(f"  {mode} {load:g} {method:8s}: {row['out_tok_s']:7.1f} tok/s, TTFT p95 "
                    f"{row['ttft_ms_p95']:.0f} ms, ITL p95 {row['itl_ms_p95']:.1f} ms, goodput "
                    f"{row['goodput_req_s']:.2f} req/s ({100 * row['good_share']:.0f}%), failed {row['failed']}")
        target = describe_target(servers.models.target)
    return {"config": dataclasses.asdict(cfg), "seed": seed, "machine": machine, "target": target,
            "load_before": load_before, "load_after": os.getloadavg(), "runs": runs,
            "sustained": {m: sustained(runs, m, cfg.objective) for m in cfg.methods},
            "objective": cfg.objective.describe()}
