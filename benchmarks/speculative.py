"""Speculative decoding side by side: plain, EAGLE-style, SpecVLM, Sparrow, one engine.

    python -m benchmarks.speculative --quick --out BENCHMARKS.md        # world v2, 0.5k and 25k visual tokens
    python -m benchmarks.speculative --out BENCHMARKS.md --json r.json  # the ladder, T=0 and T=1
    python -m benchmarks.speculative --methods plain,sparrow --videos 224x8,224x125 --reps 2
    python -m benchmarks.speculative --world v1 --out BENCHMARKS.md     # world v1's captions (section speculative-v1)

Every method runs through `sparrow.engine.Engine` and its one acceptance path:

    plain            SpecConfig(method="none"): the reference for every ratio and for output identity
    eagle            EAGLE-style draft attending to all tokens (draft_context="all")
    specvlm          SpecVLM: the small target drafts over ~10% of the visual tokens (specvlm_engine)
    specvlm-eagle    the EAGLE draft over SpecVLM-pruned visual tokens (draft_context="pruned")
    sparrow          the Sparrow draft, text-anchored window attention and the glimpse it was trained
                     with (its checkpoint's trained_with), adaptive k: the default engine
    sparrow-glimpse  the same draft with --glimpse G bridge-layer visual states
    sparrow-text     the same draft with glimpse 0 (the text-anchored window alone; opt-in)
    ablation-*       ablation drafts (T=0, smallest and largest video only; see ABLATIONS)

Models (`--models DIR`): DIR/world/{target,draft} (the committed world pair), DIR/bench/draft-eagle,
DIR/bench/small-target, DIR/bench/ablation/{none,window,mtp,bridge}. A missing optional model
skips its methods with the reason printed; a missing target is an error. Trained or random
weights are all the same to the harness.

Protocol: fresh synthetic world videos (one per rep and length, never a training seed);
per rep, per video the video is decoded and its prefix (system prompt + video) prefilled ONCE,
then every method answers from a copy of that prefix through the engine's prefix cache
(except SpecVLM, whose small VLM re-reads the pixels: it prefills the whole prompt itself);
methods are interleaved within each rep (each two reps run every pair in both orders: rep_order)
and medians taken over reps.
Decode speedup = plain decode time per token / the method's (prefill excluded); end-to-end adds
video decode, the shared prefix prefill and the method's own prompt prefill. Every method's
tokens must equal plain decoding's (T=0: greedy; T > 0: the same seed, as seeded sampling is
keyed by position): a mismatch fails the run (exit status 1).
"""

from __future__ import annotations

import os

# Before torch is imported: OpenMP threads that spin while waiting distort timings on 2 shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

from benchmarks.bench_args import parse_videos, run_timed  # noqa: E402
from benchmarks.engines import (BENCH_SEED, METHODS, POLICIES, BenchConfig, Models, Skip,  # noqa: E402
                               build_engine, compile_target_steps, is_adaptive, method_of)
from benchmarks.identity import first_difference  # noqa: E402
from benchmarks.machine import describe_target, machine  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from benchmarks.shared_prefix import no_video, share_prefix  # noqa: E402
from benchmarks.speculative_report import plot, report  # noqa: E402
from benchmarks.step_cost_projection import gpu_mode  # noqa: E402
from benchmarks.world_videos import (DEFAULT_WORLD, WORLD_MODELS, WORLDS, make_video, world_ladder,  # noqa: E402
                                     world_prompts)
from sparrow import Engine, SamplingParams  # noqa: E402
from sparrow.models.target import TargetModel  # noqa: E402
from sparrow.prefix_cache import PrefixCache  # noqa: E402
from sparrow.video import ProcessedVideo  # noqa: E402


# ----- one request --------------------------------------------------------------------------------
def run_one(engine: Engine, prompt: str, sampling: SamplingParams, video_key: str | None,
            video: ProcessedVideo):
    """One timed request: from the shared prefix when it has a key, else from the processed
    video (its own prefill). (The test wraps this to corrupt an output.)"""
    if video_key is None:
        return engine.generate(video, prompt, sampling)
    return engine.generate(no_video, prompt, sampling, video_key=video_key)


def _record(out, engine: Engine) -> dict:
    m = out.metrics
    return {"token_ids": list(out.token_ids), "metrics": m.to_dict(), "draft_kv_bytes": m.draft_kv_bytes if engine.proposer is not None else None}


# ----- the benchmark --------------------------------------------------------------------------------
def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run every (rep, video, temperature, method), interleaved; return raw runs, per-cell
    summaries, identity mismatches and skipped methods. JSON-serialisable."""
    models = Models(cfg.models)
    target = models.target
    cache = PrefixCache(max_bytes=64 << 30, max_entries=64)
    engines, skipped = {}, {}
    for name in cfg.keys:
        try:
            engines[name] = build_engine(name, models, cfg, cache)
        except Skip as e:
            skipped[name] = str(e)
            log(f"skip {name}: {e}")
    if cfg.target_step == "compiled":
        compile_target_steps(target, engines, max(cfg.k + 1, 1 + cfg.tree[2]), log)
    runs, videos, mismatches = [], [], []
    warmup = cfg.warmup_tokens
    for rep in range(cfg.reps):
        order = rep_order(list(engines), rep)
        for vi in range(len(cfg.videos)):
            video = run_video(cfg, target, {n: engines[n] for n in order}, cache, rep, vi, warmup, log)
            warmup = 0
            videos.append(video["video"])
            runs += video["runs"]
            mismatches += video["mismatches"]
    summary = summarize(runs, cfg.k)
    for line in _mismatch_lines(mismatches):
        log(line)
    return {"config": dataclasses.asdict(cfg), "machine": machine(), "target": describe_target(target),
            "skipped": skipped, "videos": videos, "runs": runs, "summary": summary,
            "mismatches": mismatches, "identical": not mismatches}


def rep_order(keys: list[str], rep: int) -> list[str]:
    """The methods' order in rep `rep`: rotated every two reps, and reversed in odd reps, so each
    two reps run every pair of methods once in each order. Measured, the method that answers a
    fresh video first verifies 5-28% slower than the one after it (the same engine and shape at
    8k, five runs); rotated alone, Sparrow ran before Sparrow at fixed k in 4 of 5 reps."""
    shift = (rep // 2) % len(keys)
    order = keys[shift:] + keys[:shift]
    return order[::-1] if rep % 2 else order


def run_video(cfg: BenchConfig, target: TargetModel, engines: dict[str, Engine], cache: PrefixCache,
              rep: int, vi: int, warmup: int, log: Callable[[str], None]) -> dict:
    """One fresh video of the ladder in one rep: decode it, prefill its prefix once, then
    every temperature x method (in the given order) from that prefix."""
    side, frames = cfg.videos[vi]          # frames: seconds in world v2
    processed, video_s = make_video(target, side, frames, cfg.seed + 1000 * rep + vi, cfg.world)
    prompts = world_prompts(cfg.world)
    prompt = prompts[(rep + vi) % len(prompts)]
    keys, prefix_s = share_prefix(target, processed, prompt, engines, cache, f"r{rep}v{vi}")
    n_vis = processed.num_visual_tokens
    shared_s = max(prefix_s.values(), default=0.0)
    log(f"rep {rep}: {side}px x {frames} {'s' if cfg.world == 'v2' else 'frames'} = {n_vis} visual tokens (video {video_s:.2f} s, "
        f"prefix prefill {shared_s:.2f} s)")
    # untimed: first-call costs (a compiled draft compiles its greedy chain and its sampled level here)
    for name, engine in engines.items() if warmup else ():
        for temp in cfg.temperatures:
            run_one(engine, prompt, SamplingParams(max_new_tokens=warmup, ignore_eos=True, temperature=temp, seed=0),
                    keys.get(name), processed)
    runs, mismatches = [], []
    for temp in cfg.temperatures:
        # The answer as a user gets it: it ends at the model's end of turn (at T=0 every method
        # gives plain's tokens, so the same count; at T=1 time per token is what is compared).
        sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=temp,
                                  seed=cfg.seed + 7919 * rep + vi)
        cell = {}
        for name, engine in engines.items():
            if method_of(name).ablation and (temp != 0.0 or (side, frames) not in _ends(cfg.videos)):
                continue
            out = run_one(engine, prompt, sampling, keys.get(name), processed)
            r = _record(out, engine)
            m = r["metrics"]
            # end to end: video decode + the prefix prefill it starts from (none for an engine
            # that prefills the whole prompt itself) + its own prefill + decode
            r.update(rep=rep, side=side, frames=frames, visual_tokens=n_vis, temperature=temp, method=name,
                     e2e_seconds=video_s + prefix_s.get(name, 0.0) + m["video_seconds"] + m["prefill_seconds"]
                     + m["decode_seconds"])
            runs.append(r)
            cell[name] = r
        mismatches += check_identity(cell)
    cache.clear()
    return {"video": {"rep": rep, "side": side, "frames": frames, "visual_tokens": n_vis, "video_seconds": video_s,
                      "prefix_seconds": shared_s}, "runs": runs, "mismatches": mismatches}


def _ends(videos) -> tuple:
    return (videos[0], videos[-1])


def check_identity(cell: dict[str, dict]) -> list[dict]:
    """Every method must emit plain decoding's tokens, token for token: at T=0 its greedy
    tokens, at T > 0 those of the same seed (seeded sampling is keyed by position)."""
    ref = cell["plain"]["token_ids"]
    bad = []
    for name, r in cell.items():
        diff = first_difference(ref, r["token_ids"])
        if diff is not None:
            bad.append({"method": name, "rep": r["rep"], "visual_tokens": r["visual_tokens"],
                        "temperature": r["temperature"], **diff})
    return bad


def _mismatch_lines(mismatches: list[dict]) -> list[str]:
    return [f"MISMATCH at T={b.get('temperature', 0.0):g}: {b['method']} (rep {b['rep']}, {b['visual_tokens']} visual tokens) differs from "
            f"plain at token {b['index']}: expected {b['expected']}, got {b['got']} (lengths {b['lengths']})"
            for b in mismatches]


# ----- summaries ------------------------------------------------------------------------------------
def answer_tau(metrics: list[dict]) -> float:
    """Tokens a decode step over the answers, pooled: each answer's tokens after the prefill's
    first over its steps (1.0 for plain decoding); at most tau_ceiling."""
    steps = sum(m["steps"] for m in metrics)
    return sum(m["completion_tokens"] - 1 for m in metrics) / steps if steps else 0.0


def tau_ceiling(answer_tokens: list[int], k: int) -> float:
    """The most tau a step of k drafts allows for these answers: after the prefill's first token,
    each answer's other n - 1 come at most k + 1 a step, so in no fewer than ceil((n - 1) / (k + 1))
    steps (pooled as tau is: tokens over steps). Short answers cap tau below k + 1."""
    steps = sum(-(-(n - 1) // (k + 1)) for n in answer_tokens if n > 1)
    return sum(n - 1 for n in answer_tokens if n > 1) / steps if steps else 0.0


def summarize(runs: list[dict], k: int) -> list[dict]:
    """Per (temperature, visual tokens, method key): medians over reps of the timings, pooled
    acceptance counts, tau's ceiling for the answers' lengths, and ratios against plain of the
    same cell: the median over reps of each rep's ratio (the methods of a rep ran interleaved on
    one video, so a rep pairs them; a ratio of medians mixed reps whose plain step differed by up
    to 1.5x on a drifting box)."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["temperature"], r["visual_tokens"], r["method"]), []).append(r)
    rows = []
    order = list(METHODS)
    for (temp, n_vis, method), rs in sorted(cells.items(), key=lambda kv: (kv[0][:2], order.index(method_of(kv[0][2]).name),
                                                                           not is_adaptive(kv[0][2]))):
        ms = [r["metrics"] for r in rs]
        steps = sum(m["steps"] for m in ms)
        accepted = sum(m["accepted_tokens"] for m in ms)
        width = max(len(m["accepted_per_position"]) for m in ms)
        per_pos = [sum(m["accepted_per_position"][i] for m in ms if i < len(m["accepted_per_position"])) / steps
                   for i in range(width)] if steps else []
        mem = [r["draft_kv_bytes"] for r in rs if r["draft_kv_bytes"] is not None]
        rows.append({
            "temperature": temp, "visual_tokens": n_vis, "method": method, "reps": len(rs),
            "tau_ceiling": tau_ceiling([m["completion_tokens"] for m in ms], k),
            "decode_ms_per_token": statistics.median(m["decode_seconds"] * 1e3 / max(1, m["completion_tokens"] - 1)
                                                     for m in ms),
            "e2e_seconds": statistics.median(r["e2e_seconds"] for r in rs),
            # the answer's tokens a step (each step commits its accepted drafts and one of the
            # target's): acceptance past the answer's end (drafts after its EOS or its last
            # token, which the engine's acceptance counts, accepted_per_step) is not the user's
            "tau": answer_tau(ms),
            "accepted_per_step": accepted / steps if steps else 0.0,
            "acceptance_per_position": per_pos,
            "draft_ms_per_step": statistics.median(m["draft_seconds"] * 1e3 / max(1, m["steps"]) for m in ms),
            "policy_ms_per_step": statistics.median(m.get("policy_seconds", 0.0) * 1e3 / max(1, m["steps"]) for m in ms),
            "verify_ms_per_step": statistics.median((m["verify_seconds"] or m["decode_seconds"]) * 1e3
                                                    / max(1, m["steps"]) for m in ms),
            "draft_kv_bytes": max(mem) if mem else None,
            "draft_max_keys": max(m["draft_max_keys"] for m in ms),
        })
    plain = {(r["temperature"], r["visual_tokens"], r.get("rep", 0)): r for r in runs if r["method"] == "plain"}

    def decode_ms(run: dict) -> float:
        return run["metrics"]["decode_seconds"] * 1e3 / max(1, run["metrics"]["completion_tokens"] - 1)

    for row in rows:
        pairs = [(plain[key], r) for r in cells[row["temperature"], row["visual_tokens"], row["method"]]
                 if (key := (r["temperature"], r["visual_tokens"], r.get("rep", 0))) in plain]
        row["decode_speedup"] = statistics.median(decode_ms(p) / decode_ms(r) for p, r in pairs) if pairs else None
        row["e2e_speedup"] = statistics.median(p["e2e_seconds"] / r["e2e_seconds"] for p, r in pairs) if pairs else None
    return rows


# ----- CLI ------------------------------------------------------------------------------------------
# each world's run has a section of its own; the default world's carries the README's headline
SECTIONS = {"v2": ("speculative", "Speculative decoding side by side (world v2 pair)"),
            "v1": ("speculative-v1", "Speculative decoding side by side (world v1 pair)")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None, help="DIR with world/{target,draft} and bench/ baselines (default: "
                                                   f"the world's pair, {WORLD_MODELS})")
    ap.add_argument("--quick", action="store_true", help="0.5k and 25k tokens, T=0, 2 reps, 48 new tokens")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {list(METHODS)}")
    ap.add_argument("--world", choices=WORLDS, default=DEFAULT_WORLD,
                    help="whose videos, prompts and pair (--models names another): v2 (timed narrations of 60-270 "
                         "tokens; the default, the README's headline) or v1 (captions of ~20 tokens, where tau is "
                         "at its ceiling; its own section, speculative-v1)")
    ap.add_argument("--videos", default=None, help="comma list of SIDExFRAMES (v2: SIDExSECONDS) (default: the "
                                                   "world's ladder; quick: its ends)")
    ap.add_argument("--temperatures", default=None, help="comma list (default 0,1; quick 0)")
    ap.add_argument("--reps", type=int, default=None, help="default 5 (quick 2)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 96 (quick 48); world v2 320 (160)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="each drafting method under these, comma list of adaptive (k chosen per step: the "
                         "engine's default) and fixed (k every step); both by default, both reported")
    ap.add_argument("--glimpse", type=int, default=16, help="glimpse of sparrow-glimpse")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--tree", default="4,2,16", help="sparrow-tree: WIDTH,BRANCH,BUDGET (depth is --k)")
    ap.add_argument("--seed", type=int, default=BENCH_SEED)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared 2-core box)")
    ap.add_argument("--out", default=None, help="write the 'speculative' section of this markdown file")
    ap.add_argument("--plot", default=None, help="PNG written with --out (default benchmarks/<its section>.png)")
    ap.add_argument("--json", default=None, help="raw results")
    ap.add_argument("--target-step", choices=("eager", "compiled"), default="eager",
                    help="the target's decode/verify steps (TargetModel.target_step); compiled: built before timing")
    ap.add_argument("--gpu", action="store_true", help="also time a 7B-shaped target on CUDA (projection)")
    ap.add_argument("--from-json", default=None, help="no run: summarise and report the raw results a --json wrote")
    args = ap.parse_args(argv)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        result["summary"] = summarize(result["runs"], result["config"]["k"])
        args.world = result["config"].get("world", "v1")
        return _report(result, args, argv)
    torch.set_num_threads(args.threads)
    q, ladder = args.quick, world_ladder(args.world)
    cfg = BenchConfig(
        models=args.models or WORLD_MODELS[args.world],
        videos=parse_videos(args.videos) if args.videos else ((ladder[0], ladder[-1]) if q else ladder),
        temperatures=tuple(float(t) for t in args.temperatures.split(",")) if args.temperatures else
        ((0.0,) if q else (0.0, 1.0)),
        reps=args.reps or (2 if q else 5),
        max_new_tokens=args.max_new_tokens or {("v1", True): 48, ("v1", False): 96, ("v2", True): 160,
                                                 ("v2", False): 320}[args.world, q],
        k=args.k, glimpse=args.glimpse, window=args.window, anchors=args.anchors,
        tree=tuple(int(x) for x in args.tree.split(",")),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()), seed=args.seed,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        target_step=args.target_step, world=args.world)
    result = run_timed(lambda: run_benchmark(cfg))
    if result is None:
        return 2
    if args.gpu:
        taus = sorted({round(r["tau"], 2) for r in result["summary"] if r["method"] == "sparrow"}) or [3.0]
        result["gpu"] = gpu_mode(cfg.k, [3.0, 3.8] + taus)
    result["command"] = _command(argv)
    result["date"] = time.strftime("%Y-%m-%d")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return _report(result, args, argv)


def _command(argv: list[str] | None) -> str:
    return "python -m benchmarks.speculative " + " ".join(argv if argv is not None else sys.argv[1:])


def _report(result: dict, args, argv: list[str] | None) -> int:
    command = _command(argv)
    if args.from_json and "command" in result:       # the run's own command and day, then how it was reported
        command = f"{result['command']}` (run {result['date']}), reported by `{command}"
    plot_path = args.plot or f"benchmarks/{SECTIONS[args.world][0]}.png"
    text = report(result, plot_path if args.out else None)
    print(text)
    print(f"({result['wall_seconds']:.0f} s)")
    if not result["identical"]:
        print("\n".join(_mismatch_lines(result["mismatches"])), file=sys.stderr)
        print("FAILED: speculative output differs from plain decoding (nothing written)", file=sys.stderr)
        return 1
    if args.out:
        plot(result, plot_path)
        write_section(args.out, *SECTIONS[args.world], command, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
