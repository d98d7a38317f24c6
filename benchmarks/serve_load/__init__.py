"""The load benchmark, in the terms serving engines are judged by (vLLM's `bench serve`):
requests arrive at a rate (Poisson) or from N clients in a closed loop, about a mix of world
videos at ~0.5k, 8k and 25k visual tokens with repeat questions about each, answered to their
natural end through gRPC against an embedded server per method (plain and Sparrow, same run).
Per rate: TTFT, ITL, TPOT and end-to-end p50/p95/p99, output tokens/s, goodput at a stated
objective, and the highest rate each method sustains; a plot per run.

    python -m benchmarks.serve_load --rates 0.25,0.5,1 --out BENCHMARKS.md
    python -m benchmarks.serve_load --concurrency 1,4,8
    python -m benchmarks.serve_load --smoke          # tiny random models, a few requests at two rates

Modules: load_config (configuration, objective, workload), load_driver (servers, videos, open
and closed loop), load_stats (the measures), load_table (markdown, plot), load_run (one run).
"""
