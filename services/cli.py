"""The `sparrow` command line.

    sparrow demo                 synthetic video -> tiny models -> streamed answer + speed table
    sparrow serve [--ray]        the gRPC service (embedded: grpc.aio + in-process engine;
                                 --ray: Ray Serve, target and draft as separate deployments)
    sparrow generate --server HOST:PORT VIDEO "question"    stream an answer from a server
    sparrow train-draft ...      train a Sparrow draft for a target (sparrow.training)
    sparrow world ...            the synthetic world: make-data, train-target, train-draft, eval, demo
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    """The committed synthetic-world pair when it is there (a trained target and draft: a right
    answer and real acceptance), else tiny random models (plumbing only)."""
    from sparrow.training.world_demo import DEFAULT_MODELS, run_world_demo

    models = Path(args.models) if args.models else DEFAULT_MODELS
    if not args.random and (models / "target" / "config.json").is_file():
        report = run_world_demo(None if args.seed is None else args.seed, models, k=args.k,
                                print_fn=lambda *a, **kw: print(*a, **kw, flush=True),
                                dtype=args.dtype, device=args.device)
        return 0 if all(r["lossless"] for r in report["results"]) else 1
    if not args.random:
        print(f"no trained world pair at {models}: falling back to random weights (--random)")
    return _random_demo(args)


def _random_demo(args: argparse.Namespace) -> int:
    from sparrow import Engine, SamplingParams, SpecConfig
    from sparrow.services.models import load_target
    from sparrow.tiny import tiny_draft
    from sparrow.video import VideoOptions, write_synthetic_video

    with tempfile.TemporaryDirectory() as tmp:
        video_path = Path(tmp) / "shapes.mp4"
        video = write_synthetic_video(video_path, num_frames=args.frames, width=args.size, height=args.size,
                                      fps=8.0, seed=args.seed or 0)
        print(f"video: {video.num_frames} frames {video.width}x{video.height} at {video.fps:g} fps, "
              f"{len(video.events)} scripted events (moving coloured shapes)")
        print("models: tiny Qwen2.5-VL target + Sparrow draft, RANDOM WEIGHTS - the answer is noise and "
              "acceptance is low until a trained pair is used (see README).")
        target = load_target(f"tiny:qwen2_5_vl:{args.seed or 0}", args.dtype, args.device)
        spec = SpecConfig(method="sparrow", num_draft_tokens=args.k)
        engine = Engine(target, tiny_draft(target, spec, seed=args.seed or 0), spec)
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


# ----- serve -------------------------------------------------------------------------------------
def _settings(args: argparse.Namespace):
    from sparrow import SpecConfig
    from sparrow.services.servicer import ServiceConfig
    from sparrow.services.settings import AppSettings

    MiB = 1 << 20
    service = ServiceConfig(
        max_new_tokens=args.max_new_tokens, default_max_new_tokens=min(128, args.max_new_tokens),
        max_video_bytes=args.max_video_mb * MiB, max_message_bytes=args.max_message_mb * MiB,
        max_concurrent=args.max_concurrent, media_root=args.media_root,
        allowed_url_schemes=tuple(args.allow_url_scheme), allowed_url_hosts=tuple(args.allow_url_host))
    deployments = json.loads(Path(args.ray_config).read_text()) if args.ray_config else {}
    return AppSettings(
        target=args.target, draft=_draft_spec(args),
        draft_placement=args.draft_placement, spec=SpecConfig(num_draft_tokens=args.k), cache=args.cache,
        service=service, target_deployment=deployments.get("target", {}), draft_deployment=deployments.get("draft", {}),
        dtype=args.dtype, device=args.device, device_map=args.device_map)



def _draft_spec(args: argparse.Namespace) -> str | None:
    if args.draft is None:      # a tiny target gets a tiny draft; a real one runs without, unless given
        return "tiny" if args.target.startswith("tiny:") else None
    return None if args.draft == "none" else args.draft


def _serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.ray:
        return _serve_ray(args, settings)
    if settings.draft_placement == "remote":
        print("sparrow serve: --draft-placement remote needs --ray", file=sys.stderr)
        return 2
    import asyncio

    from sparrow.services.server import serve_forever
    from sparrow.services.servicer import SparrowService
    from sparrow.services.settings import build_engine

    from sparrow.services import logs, prom

    logs.configure_logging(args.log_level, json_format=args.log_format == "json")
    prom.configure(prom.PrometheusSink(), model_name=settings.target)
    if args.metrics_port is not None:
        prom.start_metrics_server(args.metrics_host, args.metrics_port)
    engine, cache = build_engine(settings)
    service = SparrowService(engine, cache, settings.service, host="embedded", draft_placement=settings.placement)
    try:
        asyncio.run(serve_forever(service, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


def _serve_ray(args: argparse.Namespace, settings) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from sparrow.services import ray_app, ray_bind

    # Serve's gRPC proxy reads its message limit from the environment of its process, and
    # binds --host through the job's setup hook (services.ray_bind).
    env = {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(settings.service.max_message_bytes)}
    ray.init(address=args.ray_address, runtime_env=ray_bind.runtime_env(args.host, env))
    ray_app.start(settings, grpc_port=args.port, http_host=args.host, http_port=args.http_port)
    print(f"sparrow: serving sparrow.v1.Sparrow on {args.host}:{args.port} (Ray Serve gRPC proxy); "
          f"draft {settings.placement}; Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def _add_serve(sub) -> None:
    from sparrow.models.placement import add_placement_arguments

    p = sub.add_parser("serve", help="serve sparrow.v1 over gRPC (embedded, or --ray)")
    p.add_argument("--ray", action="store_true", help="run as a Ray Serve application")
    p.add_argument("--host", default="127.0.0.1", help="bind address (--ray: of Serve's gRPC and HTTP proxies; an existing "
                                                              "cluster's proxies keep theirs)")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--target", default="tiny:qwen2_5_vl", help="model directory, or tiny:<arch>[:seed]")
    p.add_argument("--draft", help="Sparrow draft directory, tiny[:seed], or none (default: tiny for a tiny target)")
    p.add_argument("--draft-placement", choices=("colocated", "remote"), default="colocated")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    add_placement_arguments(p, device_map=True)
    p.add_argument("--cache", default="memory", help="state cache: memory or redis://host:port/db")
    p.add_argument("--media-root", help="directory the server may read video paths from")
    p.add_argument("--allow-url-scheme", action="append", default=[], help="http, https or rtsp (repeat)")
    p.add_argument("--allow-url-host", action="append", default=[], help="allowed URL host (repeat)")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--max-video-mb", type=int, default=2048)
    p.add_argument("--max-message-mb", type=int, default=64)
    p.add_argument("--max-concurrent", type=int, default=16)
    p.add_argument("--ray-address", default=None, help="an existing cluster (default: start or join a local one)")
    p.add_argument("--ray-config", help='JSON: {"target": {deployment options}, "draft": {...}}, e.g. '
                                        'autoscaling_config, num_replicas, ray_actor_options')
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-host", default="127.0.0.1", help="embedded: /metrics bind address")
    p.add_argument("--metrics-port", type=int, default=None, help="embedded: serve Prometheus /metrics here")
    p.add_argument("--log-format", choices=("json", "text"), default="json")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_serve)


# ----- generate ------------------------------------------------------------------------------------
def _generate(args: argparse.Namespace) -> int:
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
                                          **source, **sampling):
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


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="ask a server about a video; prints tokens as they arrive")
    p.add_argument("--server", required=True, help="HOST:PORT")
    p.add_argument("video", help="a local file (uploaded), a URL, or with --server-path a path on the server")
    p.add_argument("question")
    p.add_argument("--server-path", action="store_true", help="VIDEO is a path on the server (its media root)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: the server's default")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--fps", type=float)
    p.add_argument("--num-frames", type=int)
    p.add_argument("--no-spec", action="store_true", help="decode without the draft")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--application", help="Ray Serve application name (gRPC metadata), when several run")
    p.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    from sparrow.models.placement import add_placement_arguments

    parser = argparse.ArgumentParser(prog="sparrow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream answers about a fresh synthetic video with the committed world pair")
    demo.add_argument("--models", help="folder with target/ and draft/ (default: models/world)")
    demo.add_argument("--random", action="store_true", help="tiny random-weight models instead (plumbing only)")
    demo.add_argument("--frames", type=int, default=32)
    demo.add_argument("--size", type=int, default=112)
    demo.add_argument("--k", type=int, default=4, help="draft tokens per step")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--seed", type=int, help="video seed (default: a fresh one for the world demo, 0 with --random)")
    add_placement_arguments(demo)
    demo.set_defaults(func=_demo)
    _add_serve(sub)
    _add_generate(sub)
    from sparrow.training.cli import add_commands as _add_training   # train-draft, world
    _add_training(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
