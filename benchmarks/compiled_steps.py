"""Compiled target steps against eager ones, side by side in one run: plain decoding and
Sparrow's default engine, each with the target's decode/verify steps eager and compiled
(TargetModel.target_step), on fresh world videos.

    python -m benchmarks.compiled_steps [--videos 168x28,168x1392] [--reps 5] [--seed S] [--out BENCHMARKS.md]

One target and one prefix cache; the four runs of a video start from the same cached prefix,
their order rotated per rep, the compiled graphs (every bucket a run can use) built before
timing. Every run's tokens must equal eager plain decoding's (T = 0): a mismatch fails the
run. Reported per length, min / median / max over the videos: decode ms per token, and each
run's speedup over eager plain decoding; "Sparrow / plain" is the ratio within one step mode.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from benchmarks.bench_args import parse_videos, run_timed  # noqa: E402
from benchmarks.engines import BenchConfig, Models, build_engine, compile_target_steps  # noqa: E402
from benchmarks.machine import machine  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from benchmarks.shared_prefix import no_video, share_prefix  # noqa: E402
from benchmarks.world_videos import make_video  # noqa: E402
from sparrow import SamplingParams  # noqa: E402
from sparrow.prefix_cache import PrefixCache  # noqa: E402

RUNS = (("plain", "eager"), ("plain", "compiled"), ("sparrow", "eager"), ("sparrow", "compiled"))
PROMPT = "describe the video ."


def run_benchmark(videos, reps: int, seed: int, max_new_tokens: int, models_dir: str = "models", log=print) -> dict:
    models = Models(models_dir)
    target = models.target
    cache = PrefixCache(max_bytes=64 << 30, max_entries=8)
    cfg = BenchConfig(models=models_dir, methods=("plain", "sparrow"))
    engines = {name: build_engine(name, models, cfg, cache) for name in ("plain", "sparrow")}
    compile_target_steps(target, engines, cfg.k + 1, log)
    graph = target.step_graph
    rows, mismatches = [], []
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    for rep in range(reps):
        for vi, (side, frames) in enumerate(videos):
            processed, _ = make_video(target, side, frames, seed + 1000 * rep + vi)
            keys, _ = share_prefix(target, processed, PROMPT, engines, cache, f"r{rep}v{vi}")
            order = RUNS[rep % len(RUNS):] + RUNS[:rep % len(RUNS)]
            if rep == 0 and vi == 0:          # untimed: first-call costs of every run
                for name, step in RUNS:
                    target.step_graph = graph if step == "compiled" else None
                    engines[name].generate(no_video, PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True),
                                           video_key=keys[name])
            outs = {}
            for name, step in order:
                target.step_graph = graph if step == "compiled" else None
                out = engines[name].generate(no_video, PROMPT, sampling, video_key=keys[name])
                outs[(name, step)] = out
                m = out.metrics
                rows.append({"rep": rep, "visual_tokens": processed.num_visual_tokens, "method": name, "step": step,
                             "ms_per_token": 1e3 * m.decode_seconds / max(1, len(out.token_ids) - 1),
                             "tau": m.tau})
            want = outs[("plain", "eager")].token_ids
            mismatches += [f"rep {rep}, {processed.num_visual_tokens} tokens: {n} {s}" for (n, s), o in outs.items()
                           if o.token_ids != want]
            log(f"rep {rep}: {processed.num_visual_tokens} visual tokens: " + ", ".join(
                f"{r['method']} {r['step']} {r['ms_per_token']:.2f} ms" for r in rows[-len(RUNS):]))
            cache.clear()
    target.step_graph = None
    return {"rows": rows, "mismatches": mismatches, "machine": machine(), "load": os.getloadavg(),
            "graphs": len(graph.compile_seconds)}


def report(result: dict) -> str:
    def spread(xs):
        return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"
    lines = [f"Machine: {result['machine']}; load average {result['load'][0]:.1f} at the end. World pair, one torch "
             "thread, T = 0, answers to their end of turn; per length min / median / max over the videos. "
             "Every run's tokens equal eager plain decoding's." if not result["mismatches"] else "MISMATCHES", "",
             "| visual tokens | run | decode ms/token | speedup over eager plain | Sparrow / plain, same steps | tau |",
             "|---|---|---|---|---|---|"]
    rows = result["rows"]
    for n in sorted({r["visual_tokens"] for r in rows}):
        at = [r for r in rows if r["visual_tokens"] == n]
        by = {(r["rep"], r["method"], r["step"]): r["ms_per_token"] for r in at}
        taus = {(r["rep"], r["method"], r["step"]): r["tau"] for r in at}
        reps = sorted({r["rep"] for r in at})
        for name, step in RUNS:
            ms = [by[(rep, name, step)] for rep in reps]
            speed = [by[(rep, "plain", "eager")] / by[(rep, name, step)] for rep in reps]
            within = [by[(rep, "plain", step)] / by[(rep, name, step)] for rep in reps] if name == "sparrow" else None
            lines.append(f"| {n:,} | {name}, {step} steps | {spread(ms)} | {spread(speed)}x | "
                         + (f"{spread(within)}x |" if within else "- |")
                         + f" {spread([taus[(rep, name, step)] for rep in reps])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models")
    ap.add_argument("--videos", default="168x28,168x1392", help="comma list of SIDExFRAMES")
    ap.add_argument("--reps", type=int, default=5, help="fresh videos a length")
    ap.add_argument("--seed", type=int, default=41000)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", help="write the 'compiled-steps' section of this markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = run_timed(lambda: run_benchmark(parse_videos(args.videos), args.reps, args.seed, args.max_new_tokens,
                                             args.models))
    if result is None:
        return 2
    text = report(result)
    print(text)
    if result["mismatches"]:
        print("FAILED: " + "; ".join(result["mismatches"]), file=sys.stderr)
        return 1
    if args.out:
        command = "python -m benchmarks.compiled_steps " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(args.out, "compiled-steps", "Compiled target steps", command, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
