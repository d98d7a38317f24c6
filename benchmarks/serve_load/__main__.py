"""python -m benchmarks.serve_load: see the package's docstring."""

from __future__ import annotations

import os

# Before torch is imported: OpenMP threads that spin while waiting distort timings on shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.bench_args import run_timed  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from benchmarks.serve_load.load_config import METHODS, SMOKE_MIX, LoadConfig, Objective  # noqa: E402
from benchmarks.serve_load.load_run import run_benchmark  # noqa: E402
from benchmarks.serve_load.load_table import plot, report  # noqa: E402
from benchmarks.tiny_models import save_tiny_models  # noqa: E402
from benchmarks.world_videos import WORLD_MODELS, WORLDS  # noqa: E402

PLOT, PLOT_V2 = "benchmarks/serve_load.png", "benchmarks/serve_load_v2.png"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _mix(text: str) -> tuple[tuple[int, int, int], ...]:
    """'168x28:4,168x448:2' -> ((168, 28, 4), (168, 448, 2))."""
    out = []
    for item in text.split(","):
        size, _, count = item.partition(":")
        side, frames = size.lower().split("x")
        out.append((int(side), int(frames), int(count or 1)))
    return tuple(out)


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    smoke = args.smoke
    objective = Objective(args.slo_ttft_s, args.slo_prefill_s_per_1k, args.slo_tpot_ms, args.attain)
    defaults = LoadConfig()
    return LoadConfig(
        models=args.models or WORLD_MODELS[args.world], world=args.world,
        mix=_mix(args.mix) if args.mix else SMOKE_MIX if smoke else defaults.mix,
        questions=args.questions or (2 if smoke else defaults.questions), long_share=args.long_share,
        rates=_floats(args.rates) if args.rates is not None else (2.0, 8.0) if smoke else defaults.rates,
        concurrency=tuple(int(c) for c in _floats(args.concurrency)) if args.concurrency else (),
        methods=tuple(m for m in args.methods.split(",") if m),
        max_new_tokens=args.max_new_tokens or (12 if smoke else 320 if args.world == "v2" else defaults.max_new_tokens),
        temperature=args.temperature, seed=args.seed, objective=objective,
        request_timeout_s=args.request_timeout_s, warmup_tokens=2 if smoke else defaults.warmup_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_load", description=__doc__)
    ap.add_argument("--models", help=f"DIR with world/{{target,draft}} (default: the world's pair, {WORLD_MODELS})")
    ap.add_argument("--smoke", action="store_true", help="tiny random models, 4 requests at two rates: seconds")
    ap.add_argument("--world", choices=WORLDS, default="v1",
                    help="v2: world v2 videos (--mix lengths in seconds) and questions, a narration first; its "
                         "own section (serve-load-v2)")
    ap.add_argument("--mix", help="videos as SIDExFRAMES:COUNT,... (default 168x28:4,168x448:2,168x1392:1; "
                                  "v2: SIDExSECONDS)")
    ap.add_argument("--questions", type=int, help="questions per video (default 3)")
    ap.add_argument("--long-share", type=float, help="a repeat question's chance of a long answer (a caption or "
                                                     "narration; default: drawn from every prompt alike)")
    ap.add_argument("--rates", help="request rates per second, increasing (default 0.25,0.5,1); '' for none")
    ap.add_argument("--concurrency", help="closed-loop client counts, e.g. 1,4,8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--max-new-tokens", type=int, help="the cap of an answer (default 256; v2 320)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, help="video and arrival seed (default: fresh each run)")
    ap.add_argument("--slo-ttft-s", type=float, default=2.0)
    ap.add_argument("--slo-prefill-s-per-1k", type=float, default=1.0, help="TTFT allowance per 1k uncached tokens")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--attain", type=float, default=0.9, help="share of requests meeting the objective")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    ap.add_argument("--plot", help=f"the plot's path (default {PLOT} with --out, else none)")
    ap.add_argument("--out", help="write the serve-load section of this markdown file (BENCHMARKS.md)")
    ap.add_argument("--json", help="raw results, every request's measures included")
    ap.add_argument("--from-json", help="report (and --out, --plot) a run saved with --json instead of running")
    args = ap.parse_args(argv)
    command = "python -m benchmarks.serve_load " + " ".join(argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(args.threads)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="sparrow-tiny-") as tmp:
            if args.smoke:
                args.models = str(save_tiny_models(tmp))
            result = run_timed(lambda: run_benchmark(config_from_args(args)))
        if result is None:
            return 2
        result["command"] = command
    v2 = result["config"].get("world") == "v2"
    figure = args.plot or ((PLOT_V2 if v2 else PLOT) if args.out else None)
    if figure:
        plot(result, figure)
    text = report(result, os.path.relpath(figure, Path(args.out).parent) if figure and args.out else figure)
    print(text)
    print(f"({result['wall_seconds']:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.out:
        write_section(args.out, "serve-load-v2" if v2 else "serve-load",
                      f"Serving under load (issue 46): plain vs Sparrow at request rates{', world v2' if v2 else ''}",
                      result["command"], text)
    return 0 if not any(r["failed"] for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
