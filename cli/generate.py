"""`sparrow generate`: ask a server about a video (a local file, uploaded; a URL; or a path on
the server) and print the answer's tokens as they arrive, then its completion."""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    import grpc

    from sparrow.services.client import SparrowClient
    from sparrow.services.protos import pb

    metadata = (("application", args.application),) if args.application else ()
    with SparrowClient(args.server, metadata=metadata) as client:
        if args.video.split("://", 1)[0] in ("http", "https", "rtsp"):
            source = {"url": args.video}
        elif args.server_path:
            source = {"path": args.video}
        else:
            source = {"video_id": client.upload(args.video, timeout=args.timeout)}
        options = pb.VideoOptions(**({"fps": args.fps} if args.fps else {}),
                                  **({"num_frames": args.num_frames} if args.num_frames else {}))
        spec = pb.SpecOptions(enabled=False) if args.no_spec else None
        sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, **({"seed": args.seed} if args.seed is not None else {}))
        try:
            for response in client.stream(args.question, timeout=args.timeout, video_options=options, spec=spec,
                                          history=[tuple(turn) for turn in args.turn], **source, **sampling):
                if response.HasField("chunk"):
                    print(response.chunk.text, end="", flush=True)
                else:
                    _print_completion(response.completion)
        except grpc.RpcError as exc:
            print(f"\nsparrow generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def _print_completion(c) -> None:
    from sparrow.services.protos import pb

    m, u = c.metrics, c.usage
    reason = pb.FinishReason.Name(c.finish_reason).removeprefix("FINISH_REASON_").lower()
    print(f"\n[{reason}] {u.completion_tokens} tokens, prompt {u.prompt_tokens} ({u.visual_tokens} visual, "
          f"{u.cached_prompt_tokens} cached), tau {m.mean_acceptance_length:.2f}, "
          f"{m.decode_tokens_per_second:.1f} tok/s" + (f", error: {c.error}" if c.error else ""), file=sys.stderr)


def add_command(sub, common) -> None:
    p = sub.add_parser("generate", parents=[common], help="ask a server about a video; prints tokens as they arrive")
    p.add_argument("--server", required=True, help="HOST:PORT")
    p.add_argument("video", help="a local file (uploaded), a URL, or with --server-path a path on the server")
    p.add_argument("question", help="the question about the video")
    p.add_argument("--turn", nargs=2, action="append", default=[], metavar=("ROLE", "TEXT"),
                   help="an earlier turn of the conversation, oldest first (repeat): --turn user 'What happens?' "
                        "--turn assistant 'A red circle appears.'; the server reuses the video's prefill")
    p.add_argument("--server-path", action="store_true", help="VIDEO is a path on the server (its media root)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: the server's default")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass (0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    p.add_argument("--seed", type=int, help="seed of the request's own sampling generator")
    p.add_argument("--fps", type=float, help="frames sampled per second of video (default: the server's)")
    p.add_argument("--num-frames", type=int, help="frames sampled over the whole video (overrides --fps)")
    p.add_argument("--no-spec", action="store_true", help="decode without the draft")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--application", help="Ray Serve application name (gRPC metadata), when several run")
    p.set_defaults(func=run)
