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
training and of the other benchmarks); stream i asks caption prompt i mod 3 (world v2, --world v2:
a v2 video and narration prompt i mod 6) with --tokens new
tokens (EOS ignored, so every stream does the same work; --stop-at-eos: each ends at its answer's
end, as a user's stream does), at T > 0 seeded with seed + i. Each
method and path has its own engine and prefix cache (as separate deployments), and every
engine caches every video's prefill before anything is timed, through the public API: a
1-token request naming the video (in-process by a video key; over gRPC by its upload id).
With --share-prefill the in-process engines instead answer from one cache holding one prefill
per video (shared_prefix.share_prefix, as the side-by-side benchmark does: the same target, so
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
arrives vs while it prefills (until its first token), and the time to first token of
--prefill-shorts short requests on uncached videos of the shortest length asked meanwhile.

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
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

from benchmarks.bench_args import parse_videos, run_timed  # noqa: E402
from benchmarks.concurrency.plan import METHODS, PATHS, SEED, TINY_LENGTHS, ConcurrencyConfig  # noqa: E402
from benchmarks.concurrency.prefill_scenario import prefill_scenario  # noqa: E402
from benchmarks.concurrency.results import merge, report, summarize, summarize_scenario  # noqa: E402
from benchmarks.concurrency.streams import Trace, engine_call, grpc_call, run_configuration  # noqa: E402
from benchmarks.concurrency.stream_videos import Video, cache_prefills, make_videos  # noqa: E402
from benchmarks.engines import SERVED, BenchConfig, Models, build_engine, compile_target_steps, method_of  # noqa: E402
from benchmarks.identity import first_difference  # noqa: E402
from benchmarks.machine import describe_target, machine as describe_machine  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from benchmarks.tiny_models import save_tiny_models  # noqa: E402
from benchmarks.world_videos import WORLD_MODELS, WORLDS, world_ladder  # noqa: E402
from sparrow import Engine, SamplingParams  # noqa: E402
from sparrow.prefix_cache import PrefixCache  # noqa: E402
from sparrow.services.client import SparrowClient  # noqa: E402
from sparrow.services.server import BackgroundServer  # noqa: E402
from sparrow.services.config import ServiceConfig  # noqa: E402
from sparrow.services.servicer import SparrowService  # noqa: E402
from sparrow.services.state_cache import open_cache  # noqa: E402


# ----- the benchmark ---------------------------------------------------------------------------------------
def run_benchmark(cfg: ConcurrencyConfig, log: Callable[[str], None] = print) -> dict:
    """Every (rep, length, method, path): one at a time, then each N. Returns raw per-rep
    measures, summaries, the prefill scenario and identity mismatches. JSON-serialisable."""
    load_before, machine = os.getloadavg(), describe_machine()
    models = Models(cfg.models)
    spec_cfg = BenchConfig(models=cfg.models, k=cfg.k, methods=tuple(dict.fromkeys(method_of(m).name for m in METHODS)),
                           tree=cfg.tree)
    entries = cfg.videos_per_rep + 8
    caches: list[PrefixCache] = []

    def new_cache() -> PrefixCache:
        caches.append(PrefixCache(max_bytes=64 << 30, max_entries=entries))
        return caches[-1]

    # An engine per method and path, each with its own prefix cache, as separate deployments
    # would be; with share_prefill the in-process ones read one (SpecVLM keeps its own: its
    # small VLM reads the pixels on a video's first request).
    shared = new_cache() if cfg.share_prefill else None
    engines = {m: build_engine(m, models, spec_cfg, shared if shared is not None and m != "specvlm" else new_cache(),
                               keyed_videos=entries) for m in cfg.methods}
    if cfg.target_step == "compiled":       # a step of every stream's k + 1 tokens, or its tree
        compile_target_steps(models.target, engines, cfg.streams[-1] * max(cfg.k + 1, 1 + cfg.tree[2]), log)
    result = {"runs": [], "prefill_scenario": [], "mismatches": []}
    with contextlib.ExitStack() as stack:
        clients = {}
        if "grpc" in cfg.paths:
            for m in cfg.methods:
                service = SparrowService(build_engine(m, models, spec_cfg, new_cache(), keyed_videos=entries, config=SERVED),
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
    return {"config": dataclasses.asdict(cfg), "machine": machine, "target": describe_target(models.target),
            "load_before": load_before, "load_after": os.getloadavg(), **result,
            "summary": summarize(result["runs"]), "prefill_summary": summarize_scenario(result["prefill_scenario"]),
            "identical": not result["mismatches"]}


def run_length(cfg: ConcurrencyConfig, target, engines: dict[str, Engine], clients: dict[str, SparrowClient],
               rep: int, li: int, log: Callable[[str], None], shared: PrefixCache | None = None) -> dict[str, list[dict]]:
    """One rep of one video length: fresh videos, their prefills cached, then every method, path
    and temperature (methods in an order rotated per rep), the identity check, and the prefill
    scenario."""
    side, frames = cfg.lengths[li]
    if rep == 0 and cfg.warm_lengths:       # first: its prefills must not evict the rep's from a shared cache
        warm_round(cfg, target, engines, clients, li, log, shared)
    videos = make_videos(target, side, frames, cfg.videos_per_rep, cfg.seed + 10_000 * rep + 1000 * li, cfg.world)
    cache_prefills(videos, engines if "in-process" in cfg.paths else {}, clients, f"r{rep}l{li}", shared, target)
    n_vis = videos[0].visual_tokens
    log(f"rep {rep}: {len(videos)} videos of {side}px x {frames} frames = {n_vis} visual tokens, prefills cached")
    runs, outputs = [], {}
    for method in cfg.methods[rep % len(cfg.methods):] + cfg.methods[:rep % len(cfg.methods)]:
        for path in cfg.paths:
            for temp in cfg.temperatures:
                calls = _calls(path, engines[method], clients.get(method), videos, cfg.tokens, method, temp, cfg.seed,
                               not cfg.stop_at_eos)
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


def warm_round(cfg: ConcurrencyConfig, target, engines: dict[str, Engine], clients: dict[str, SparrowClient],
               li: int, log: Callable[[str], None], shared: PrefixCache | None = None) -> None:
    """Every method, path and stream count once on fresh videos of length li (seeds no rep uses),
    untimed and unchecked: the shapes a length brings (attention over its keys at each batch) are
    timed by the path tuner and fitted by the policy here, not inside rep 0's timed runs."""
    side, frames = cfg.lengths[li]
    videos = make_videos(target, side, frames, cfg.streams[-1], cfg.seed + 10_000 * cfg.reps + 1000 * li + 500,
                         cfg.world)
    cache_prefills(videos, engines if "in-process" in cfg.paths else {}, clients, f"w{li}", shared, target)
    t0 = time.perf_counter()
    for method in cfg.methods:
        for path in cfg.paths:
            run_configuration(_calls(path, engines[method], clients.get(method), videos, cfg.tokens, method,
                                     cfg.temperatures[0], cfg.seed, not cfg.stop_at_eos), cfg.streams)
    log(f"warm round at {videos[0].visual_tokens} visual tokens: {time.perf_counter() - t0:.1f} s, untimed")


def _calls(path: str, engine: Engine, client: SparrowClient | None, videos: list[Video], tokens: int, method: str,
           temperature: float = 0.0, seed: int = SEED, ignore_eos: bool = True) -> list[Callable[[], Trace]]:
    """Request i of the list: video i; at T > 0 seeded with seed + i (the same in every run)."""
    seeds = [seed + i if temperature > 0 else None for i in range(len(videos))]
    if path == "grpc":
        return [grpc_call(client, v.video_id, v.prompt, tokens, v.fps, temperature, s, ignore_eos)
                for v, s in zip(videos, seeds)]
    return [engine_call(engine, v.keys[method], v.prompt,
                        SamplingParams(max_new_tokens=tokens, ignore_eos=ignore_eos, temperature=temperature, seed=s))
            for v, s in zip(videos, seeds)]


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
                diff = first_difference(ref[i], got)
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


# ----- CLI ---------------------------------------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def config_from_args(args: argparse.Namespace) -> ConcurrencyConfig:
    quick, tiny = args.quick, args.tiny
    defaults = ConcurrencyConfig()
    # quick: the 0.5k videos only; at 8k each video's prefill (one per engine: 4) costs seconds
    ladder = world_ladder(args.world)
    world_lengths = defaults.lengths if args.world == "v1" else (ladder[0], ladder[2])    # 0.5k and 8k tokens
    lengths = parse_videos(args.lengths) if args.lengths else TINY_LENGTHS[:1] if tiny else \
        world_lengths[:1] if quick else world_lengths
    prefill = None if args.no_prefill else (
        parse_videos(args.prefill_video)[0] if args.prefill_video else (112, 16) if tiny else
        defaults.prefill_video if args.world == "v1" else ladder[3])
    reps = args.reps or (1 if tiny else 2 if quick else defaults.reps)
    return ConcurrencyConfig(
        models=args.models or WORLD_MODELS[args.world], lengths=lengths,
        streams=_ints(args.streams) if args.streams else (1, 2) if tiny else (1, 2, 4, 8) if quick else defaults.streams,
        tokens=args.tokens or (8 if tiny else 32 if quick else defaults.tokens), reps=reps,
        temperatures=tuple(float(x) for x in args.temperatures.split(",")), share_prefill=args.share_prefill,
        stop_at_eos=args.stop_at_eos, target_step=args.target_step, warm_lengths=not args.no_warm_lengths,
        methods=_names(args.methods), paths=_names(args.paths), k=args.k, seed=args.seed,
        tree=tuple(int(x) for x in args.tree.split(",")),
        prefill_video=prefill, prefill_streams=args.prefill_streams or (2 if tiny else defaults.prefill_streams),
        prefill_reps=min(reps, args.prefill_reps or (1 if quick else reps)),
        prefill_stream_tokens=args.prefill_stream_tokens or (256 if tiny else defaults.prefill_stream_tokens),
        before_s=args.before_s if args.before_s is not None else 0.2 if tiny else defaults.before_s,
        prefill_shorts=args.prefill_shorts if args.prefill_shorts is not None else 2 if tiny else defaults.prefill_shorts,
        short_gap_s=0.05 if tiny else defaults.short_gap_s, world=args.world)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help=f"DIR with world/{{target,draft}} (default: the world's pair, {WORLD_MODELS})")
    ap.add_argument("--quick", action="store_true", help="0.5k videos, 1-8 streams, 2 reps, 32 tokens, 1 prefill rep")
    ap.add_argument("--tiny", action="store_true", help="tiny random models in a temp dir, tiny videos (a smoke run)")
    ap.add_argument("--streams", help="comma list of concurrent stream counts (default 1,2,4,8,16)")
    ap.add_argument("--world", choices=WORLDS, default="v1",
                    help="whose videos and prompts: v1 (captions of ~20 tokens) or v2 (timed narrations of 60-270 "
                         "tokens; --models then holds a v2 pair)")
    ap.add_argument("--lengths", help="comma list of SIDExFRAMES world videos (v2: SIDExSECONDS) (default 168x28,"
                                      "168x448: 0.5k, 8k; v2 224x8,224x125)")
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
    ap.add_argument("--prefill-shorts", type=int,
                    help="short uncached requests asked one after another during the long prefill, their TTFT "
                         "measured (default 6)")
    ap.add_argument("--before-s", type=float, help="seconds of decoding measured before the prefill (default 2)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill scenario")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="a stream ends at its answer's end (or --tokens), as a user's does; default: every stream "
                         "runs --tokens, past the answer's end")
    ap.add_argument("--no-warm-lengths", action="store_true",
                    help="no untimed round of the whole configuration before each length's first rep")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch intra-op threads (default: every core, as a server would run)")
    ap.add_argument("--target-step", choices=("eager", "compiled"), default="eager",
                    help="the target's decode/verify steps (TargetModel.target_step); compiled: built before timing")
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
            result = run_timed(lambda: run_benchmark(config_from_args(args)))
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
