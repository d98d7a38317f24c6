"""Concurrent streams (`python -m benchmarks.concurrency`): N requests at once against the same N
one after another, in-process and over gRPC.

    harness.py           the command: configurations run and reported
    plan.py              methods, paths, seeds and options
    streams.py           requests as their clients see them, and what they measure
    stream_videos.py     fresh world videos, their prefills cached before timing
    prefill_scenario.py  streams decoding while a long uncached video prefills
    results.py           summaries over reps, merged runs, the markdown report"""
