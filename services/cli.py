"""The `sparrow` command line.

    sparrow demo                 synthetic video -> tiny models -> streamed answer + speed table
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from sparrow import Engine, SamplingParams, SpecConfig
    from sparrow.testing import tiny_draft, tiny_target
    from sparrow.video import VideoOptions, write_synthetic_video

    with tempfile.TemporaryDirectory() as tmp:
        video_path = Path(tmp) / "shapes.mp4"
        video = write_synthetic_video(video_path, num_frames=args.frames, width=args.size, height=args.size,
                                      fps=8.0, seed=args.seed)
        print(f"video: {video.num_frames} frames {video.width}x{video.height} at {video.fps:g} fps, "
              f"{len(video.events)} scripted events (moving coloured shapes)")
        print("models: tiny Qwen2.5-VL target + Sparrow draft, RANDOM WEIGHTS - the answer is noise and "
              "acceptance is low until a trained pair is used (see README).")
        target = tiny_target("qwen2_5_vl", seed=args.seed)
        spec = SpecConfig(method="sparrow", num_draft_tokens=args.k)
        engine = Engine(target, tiny_draft(target, spec, seed=args.seed), spec)
        plain = Engine(target, spec=SpecConfig(method="none"))
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
        options = VideoOptions(fps=4.0)
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
    ratio = sm.decode_tokens_per_second / pm.decode_tokens_per_second if pm.decode_tokens_per_second else 0.0
    print(f"{'decode speedup':32}{ratio:>13.2f}x")
    return 0 if same else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparrow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream an answer about a synthetic video with tiny models")
    demo.add_argument("--frames", type=int, default=32)
    demo.add_argument("--size", type=int, default=112)
    demo.add_argument("--k", type=int, default=4, help="draft tokens per step")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
