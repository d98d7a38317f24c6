"""Core engine micro-benchmarks on the tiny model (the baseline later work improves on).

    python -m benchmarks.core [--quick] [--out BENCHMARKS.md]

1. verify step of k draft tokens vs one plain decode step, at a short and a long video;
2. the loop's own overhead per round (time not spent in the draft or the target);
3. target decode step with the preallocated ("static") vs HF DynamicCache ("dynamic") KV
   cache at 1k / 8k / 25k cached tokens.
Methods are interleaved in one process and medians reported, so ratios are side by side.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from benchmarks.report import write_section
from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.models.kv_cache import new_kv_cache
from sparrow.models.prefill import TargetState
from sparrow.tiny import synthetic_frames, tiny_draft, tiny_target
from sparrow.video import VideoOptions


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def verify_vs_decode(target, frames, k: int, reps: int) -> dict:
    engine = Engine(target, spec=SpecConfig(method="none"))
    inputs = engine.prepare(frames, "What happens in the video?", VideoOptions(fps=None, num_frames=len(frames)))
    n = inputs["input_ids"].shape[1]
    pre = target.prefill(inputs, capacity=n + 64)
    state = pre.state
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.vocab_size, (k + 1,), generator=gen)

    def step(m):
        def run():
            target.step(state, tokens[:m])
            target.rollback(state, m)
        return run

    decode, verify = [], []
    for _ in range(reps):   # interleave so drift hits both alike
        decode.append(_median_ms(step(1), 1))
        verify.append(_median_ms(step(k + 1), 1))
    d, v = statistics.median(decode), statistics.median(verify)
    return {"prompt_tokens": n, "decode_ms": d, "verify_ms": v, "ratio": v / d}


def loop_overhead(target, frames, k: int, new_tokens: int) -> dict:
    spec = SpecConfig(num_draft_tokens=k)
    engine = Engine(target, tiny_draft(target), spec)
    out = engine.generate(frames, "What happens in the video?", SamplingParams(max_new_tokens=new_tokens),
                          VideoOptions(fps=None, num_frames=len(frames)))
    m = out.metrics
    other = m.decode_seconds - m.draft_seconds - m.verify_seconds
    return {"steps": m.steps, "round_ms": m.decode_seconds / m.steps * 1e3,
            "draft_ms": m.draft_seconds / m.steps * 1e3, "verify_ms": m.verify_seconds / m.steps * 1e3,
            "overhead_ms": other / m.steps * 1e3}


def kv_cache_kinds(target, lengths: list[int], reps: int, chunk: int = 2048) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for length in lengths:
        states = {}
        for kind in ("static", "dynamic"):
            st = TargetState(new_kv_cache(kind, target.num_layers, length + reps + 8), 0, 0)
            for start in range(0, length, chunk):   # fill the cache with text tokens, a chunk at a time
                target.step(st, torch.randint(0, target.vocab_size, (min(chunk, length - start),), generator=gen))
            states[kind] = st
        tok = torch.tensor([1])
        times = {"static": [], "dynamic": []}
        for _ in range(reps):   # decode steps that really grow the cache, interleaved
            for kind, st in states.items():
                t0 = time.perf_counter()
                target.step(st, tok)
                times[kind].append((time.perf_counter() - t0) * 1e3)
        s, d = statistics.median(times["static"]), statistics.median(times["dynamic"])
        rows.append({"cached": length, "static_ms": s, "dynamic_ms": d, "ratio": d / s})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared 2-core box)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reps = 5 if args.quick else 15
    target = tiny_target("qwen2_5_vl", seed=0)
    videos = {"short": synthetic_frames(8, 112, 112), "long": synthetic_frames(64 if args.quick else 192, 224, 224)}

    lines = [f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
             f"CPU only. Model: tiny random Qwen2.5-VL (hidden 64, 4 layers), fp32. k = {args.k}.", "",
             "| video | prompt tokens | decode step ms | verify step (k+1 tokens) ms | verify / decode |",
             "|---|---|---|---|---|"]
    for name, frames in videos.items():
        r = verify_vs_decode(target, frames, args.k, reps)
        lines.append(f"| {name} | {r['prompt_tokens']} | {r['decode_ms']:.2f} | {r['verify_ms']:.2f} | {r['ratio']:.2f} |")
    lines += ["", "Loop per round (random draft, greedy): where a round's time goes.", "",
              "| video | rounds | round ms | draft ms | verify ms | loop overhead ms |", "|---|---|---|---|---|---|"]
    for name, frames in videos.items():
        r = loop_overhead(target, frames, args.k, 32)
        lines.append(f"| {name} | {r['steps']} | {r['round_ms']:.2f} | {r['draft_ms']:.2f} | {r['verify_ms']:.2f} "
                     f"| {r['overhead_ms']:.2f} |")
    lines += ["", "Target decode step by KV cache kind (text tokens in the cache, 1 new token per step).", "",
              "| cached tokens | static (preallocated) ms | dynamic (HF DynamicCache) ms | dynamic / static |",
              "|---|---|---|---|"]
    for r in kv_cache_kinds(target, [1024, 8192] if args.quick else [1024, 8192, 25000], reps * 2):
        lines.append(f"| {r['cached']} | {r['static_ms']:.2f} | {r['dynamic_ms']:.2f} | {r['ratio']:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        cmd = f"python -m benchmarks.core --threads {args.threads}" + (" --quick" if args.quick else "")
        write_section(args.out, "core", "Core engine (tiny model)", cmd, text)


if __name__ == "__main__":
    main()
