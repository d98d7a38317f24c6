"""`sparrow demo`: a fresh synthetic world video, streamed answers and their speed: the
committed world pair (a trained target and draft), --long on a ~25k-visual-token video with
plain vs EAGLE-style vs Sparrow, or --random tiny random-weight models (plumbing only)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from sparrow.errors import InvalidRequest


def run(args: argparse.Namespace) -> int:
    """The committed synthetic-world pair when it is there (a trained target and draft: a right
    answer and real acceptance), else tiny random models (plumbing only). Every option is
    honoured by the mode that runs, or refused: none is silently ignored."""
    from sparrow.world.pair_demo import DEFAULT_MODELS

    _check_demo_options(args)
    models = Path(args.models) if args.models else DEFAULT_MODELS
    has_pair = (models / "target" / "config.json").is_file()
    if args.long:
        return _long_demo(args, models)
    if args.random:
        return _random_demo(args)
    if not has_pair:
        if args.models:
            raise InvalidRequest(f"no trained world pair at {models} (no target/config.json)")
        print(f"no trained world pair at {models}: falling back to random weights (--random)")
        return _random_demo(args)
    from sparrow.world.pair_demo import run_world_demo

    report = run_world_demo(args.seed, models, k=args.k or 4, print_fn=lambda *a, **kw: print(*a, **kw, flush=True),
                            dtype=args.dtype, device=args.device, num_frames=args.frames or 8, size=args.size or 84,
                            max_new_tokens=args.max_new_tokens or 96, threads=args.threads or 1)
    return 0 if all(r["lossless"] for r in report["results"]) else 1


LONG_ONLY = ("reps", "plot", "eagle_draft")


def _check_demo_options(args: argparse.Namespace) -> None:
    """Refuse combinations the demo cannot honour."""
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    if args.random and args.long:
        raise InvalidRequest("--random and --long exclude each other: the long demo needs the trained world pair "
                             "and the EAGLE-style draft")
    if args.random and args.models:
        raise InvalidRequest("--random builds tiny random models: it takes no --models")
    if not args.long:
        given = [flag(n) for n in LONG_ONLY if getattr(args, n) is not None]
        if given:
            raise InvalidRequest(f"{', '.join(given)} belong to the long demo: add --long")
    if args.k is not None and not 1 <= args.k <= 32:
        raise InvalidRequest(f"--k must be in [1, 32], got {args.k}")
    if args.threads is not None and args.threads < 1:
        raise InvalidRequest(f"--threads must be >= 1, got {args.threads}")
    if args.max_new_tokens is not None and args.max_new_tokens < 2:
        raise InvalidRequest(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")


def _long_demo(args: argparse.Namespace, models: Path) -> int:
    from sparrow.world.long_demo import config_from, describe, run_long_demo

    cfg = config_from(frames=args.frames, size=args.size, k=args.k, max_new_tokens=args.max_new_tokens,
                      seed=args.seed, reps=args.reps, plot=args.plot,
                      models=models, eagle=Path(args.eagle_draft) if args.eagle_draft else None,
                      dtype=args.dtype, device=args.device, threads=args.threads)
    print(describe(cfg), flush=True)
    report = run_long_demo(cfg, print_fn=lambda *a, **kw: print(*a, **kw, flush=True))
    return 0 if report["lossless"] else 1


def _random_demo(args: argparse.Namespace) -> int:
    from sparrow import Engine, SamplingParams, SpecConfig
    from sparrow.services.models import load_target
    from sparrow.tiny import tiny_draft
    from sparrow.video import VideoOptions, write_synthetic_video

    import torch

    torch.set_num_threads(args.threads or 1)
    seed = args.seed or 0
    with tempfile.TemporaryDirectory() as tmp:
        video_path = Path(tmp) / "shapes.mp4"
        video = write_synthetic_video(video_path, num_frames=args.frames or 32, width=args.size or 112,
                                      height=args.size or 112, fps=8.0, seed=seed)
        print(f"video: {video.num_frames} frames {video.width}x{video.height} at {video.fps:g} fps, "
              f"{len(video.events)} scripted events (moving coloured shapes)")
        print("models: tiny Qwen2.5-VL target + Sparrow draft, RANDOM WEIGHTS - the answer is noise and "
              "acceptance is low until a trained pair is used (see README).")
        target = load_target(f"tiny:qwen2_5_vl:{seed}", args.dtype, args.device)
        spec = SpecConfig(method="sparrow", num_draft_tokens=args.k or 4)
        engine = Engine(target, tiny_draft(target, seed=seed), spec)
        plain = Engine(target, spec=SpecConfig(method="none"))
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens or 48)
        # Every frame sampled, so --frames is the number of frames the model sees.
        n = video.num_frames
        options = VideoOptions(num_frames=n, max_frames=max(768, n), max_decoded_frames=max(1024, n))
        prompt = "What happens in the video?"

        print(f"\nQ: {prompt}\nA: ", end="", flush=True)
        gen = engine.stream(video_path, prompt, sampling, options)
        for delta in gen:
            print(delta.text, end="", flush=True)
        spec_out = gen.output
        plain_out = plain.generate(video_path, prompt, sampling, options)

    same = spec_out.token_ids == plain_out.token_ids
    sm, pm = spec_out.metrics, plain_out.metrics
    print(f"\n\nfinish: {spec_out.finish_reason}, {sm.completion_tokens} tokens, "
          f"{sm.visual_tokens} visual tokens, identical to plain decoding: {same}")
    rows = [
        ("mean acceptance length (tau)", f"{sm.mean_acceptance_length:.2f}", "1.00"),
        ("accepted per step", f"{sm.accepted_per_step:.2f}", "-"),
        ("decode tokens/s", f"{sm.decode_tokens_per_second:.1f}", f"{pm.decode_tokens_per_second:.1f}"),
        ("prefill seconds", f"{sm.prefill_seconds:.3f}", f"{pm.prefill_seconds:.3f}"),
    ]
    print(f"\n{'':32}{'speculative':>14}{'plain':>10}")
    for name, a, b in rows:
        print(f"{name:32}{a:>14}{b:>10}")
    if pm.decode_tokens_per_second and sm.decode_tokens_per_second:
        print(f"{'decode speedup':32}{sm.decode_tokens_per_second / pm.decode_tokens_per_second:>13.2f}x")
    return 0 if same else 1


def add_command(sub, common) -> None:
    from sparrow.models.placement import add_placement_arguments

    demo = sub.add_parser("demo", parents=[common], help="stream answers about a fresh synthetic video with the "
                                                         "committed world pair (--long: a ~25k-visual-token video)")
    demo.add_argument("--long", action="store_true",
                      help="a ~25k-visual-token video (168 px x 1392 frames): streamed answer with progress, then "
                           "plain vs EAGLE-style vs Sparrow side by side and a plot")
    demo.add_argument("--models", help="folder with target/ and draft/ (default: models/world)")
    demo.add_argument("--random", action="store_true", help="tiny random-weight models instead (plumbing only)")
    demo.add_argument("--frames", type=int, help="video frames, all of them seen (default 8; --long 1392; --random 32)")
    demo.add_argument("--size", type=int, help="frame side in px, a multiple of 28 for the world pair "
                                               "(default 84; --long 168; --random 112)")
    demo.add_argument("--k", type=int, help="draft tokens per step (default 4)")
    demo.add_argument("--max-new-tokens", type=int, help="longest answer in tokens (default 96; --random 48)")
    demo.add_argument("--seed", type=int, help="video seed (default: a fresh one, 0 with --random)")
    demo.add_argument("--threads", type=int, help="torch intra-op threads (default 1: steady timings on a shared CPU)")
    demo.add_argument("--reps", type=int, help="--long: timed answers per method, median reported (default 3)")
    demo.add_argument("--plot", help="--long: where the plot goes (default sparrow-demo-long.png; '' for none)")
    demo.add_argument("--eagle-draft", help="--long: the EAGLE-style draft (default models/bench/draft-eagle)")
    add_placement_arguments(demo)
    demo.set_defaults(func=run)
