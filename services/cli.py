"""The `sparrow` command line.

    sparrow demo                 a fresh world video -> the committed world pair -> streamed answers + speed
    sparrow demo --long          the same on a ~25k-visual-token video, with plain vs EAGLE-style vs Sparrow
    sparrow serve [--ray]        the gRPC service (embedded: grpc.aio + in-process engine;
                                 --ray: Ray Serve, the target as a deployment, and the draft as its
                                 own deployment with --draft-placement remote)
    sparrow generate --server HOST:PORT VIDEO "question"    stream an answer from a server
    sparrow train-draft ...      train a Sparrow draft for a target (sparrow.training)
    sparrow world ...            the synthetic world: make-data, train-target, train-draft, eval, demo

Every command takes --verbose (third-party progress bars and notices, which are off otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from sparrow.errors import InvalidRequest


def _demo(args: argparse.Namespace) -> int:
    """The committed synthetic-world pair when it is there (a trained target and draft: a right
    answer and real acceptance), else tiny random models (plumbing only). Every option is
    honoured by the mode that runs, or refused: none is silently ignored."""
    from sparrow.training.world_demo import DEFAULT_MODELS

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
    from sparrow.training.world_demo import run_world_demo

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
    from sparrow.training.world_long_demo import config_from, describe, run_long_demo

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
        target=_target_spec(args), draft=_draft_spec(args),
        draft_placement=args.draft_placement, spec=SpecConfig(num_draft_tokens=args.k), cache=args.cache,
        service=service, target_deployment=deployments.get("target", {}), draft_deployment=deployments.get("draft", {}),
        dtype=args.dtype, device=args.device, device_map=args.device_map)



def _target_spec(args: argparse.Namespace) -> str:
    """--target, else the committed world pair's target (random tiny: models only by name)."""
    if args.target is not None:
        return args.target
    from sparrow.training.world_demo import DEFAULT_MODELS

    if not (DEFAULT_MODELS / "target" / "config.json").is_file():
        raise InvalidRequest(f"no --target given and no committed world pair at {DEFAULT_MODELS}: "
                             f"name a model directory (or tiny:qwen2_5_vl for random weights)")
    return str(DEFAULT_MODELS / "target")


def _draft_spec(args: argparse.Namespace) -> str | None:
    """--draft; without it the world pair's draft for the default target, a tiny draft for a
    tiny target, and none for a target given by directory (a draft trained for it must be named)."""
    if args.draft is not None:
        return None if args.draft == "none" else args.draft
    if args.target is None:
        from sparrow.training.world_demo import DEFAULT_MODELS

        return str(DEFAULT_MODELS / "draft")
    return "tiny" if args.target.startswith("tiny:") else None


def models_line(settings) -> str:
    """What a server says at startup about the models it serves."""
    target = settings.target + (" (RANDOM WEIGHTS: answers are noise)" if settings.target.startswith("tiny:") else "")
    if settings.draft is None:
        return f"sparrow: models: target {target}; no draft (plain decoding)"
    draft = settings.draft + (" (random)" if settings.draft.startswith("tiny") else "")
    return (f"sparrow: models: target {target}; draft {draft} ({settings.spec.method}, "
            f"k={settings.spec.num_draft_tokens}, {settings.draft_placement})")


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
    print(models_line(settings), flush=True)
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
    print(models_line(settings), flush=True)
    ray.init(address=args.ray_address, runtime_env=ray_bind.runtime_env(args.host, env))
    ray_app.start(settings, grpc_port=args.port, http_host=args.host, http_port=args.http_port)
    deployments = "TargetDeployment" + (" + DraftDeployment" if settings.placement == "remote" else "")
    print(f"sparrow: serving sparrow.v1.Sparrow on {args.host}:{args.port} (Ray Serve gRPC proxy: {deployments}); "
          f"draft {settings.placement}; Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def _add_serve(sub, common) -> None:
    from sparrow.models.placement import add_placement_arguments

    p = sub.add_parser("serve", parents=[common], help="serve sparrow.v1 over gRPC (embedded, or --ray)",
                       description="Serve sparrow.v1 over gRPC. With no model options: the committed world pair "
                                   "(models/world/target and models/world/draft).")
    p.add_argument("--ray", action="store_true", help="run as a Ray Serve application (TargetDeployment; "
                                                      "DraftDeployment too with --draft-placement remote)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (--ray: of Serve's gRPC and HTTP proxies; an existing "
                                                              "cluster's proxies keep theirs)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051; 0: any free port)")
    p.add_argument("--target", help="target model directory, or tiny:<arch>[:seed] for random weights "
                                    "(default: the committed world target, models/world/target)")
    p.add_argument("--draft", help="Sparrow draft directory, tiny[:seed], or none (default: the world draft for the "
                                   "default target, tiny for a tiny target, none for a target given by directory)")
    p.add_argument("--draft-placement", choices=("colocated", "remote"), default="colocated",
                   help="colocated: the draft runs in the target's process; remote (--ray only): a DraftDeployment")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (default 4)")
    add_placement_arguments(p, device_map=True)
    p.add_argument("--cache", default="memory", help="state cache: memory or redis://host:port/db")
    p.add_argument("--media-root", help="directory the server may read video paths from (default: no paths)")
    p.add_argument("--allow-url-scheme", action="append", default=[], help="http, https or rtsp (repeat)")
    p.add_argument("--allow-url-host", action="append", default=[], help="allowed URL host (repeat)")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="most new tokens a request may ask for (default 2048)")
    p.add_argument("--max-video-mb", type=int, default=2048, help="largest video accepted, in MiB (default 2048)")
    p.add_argument("--max-message-mb", type=int, default=64, help="largest gRPC message, in MiB (default 64; "
                                                                 "larger videos go through UploadVideo in chunks)")
    p.add_argument("--max-concurrent", type=int, default=16, help="requests running at once; more get "
                                                                 "RESOURCE_EXHAUSTED (default 16)")
    p.add_argument("--ray-address", default=None, help="an existing cluster (default: start or join a local one)")
    p.add_argument("--ray-config", help='JSON: {"target": {deployment options}, "draft": {...}}, e.g. '
                                        'autoscaling_config, num_replicas, ray_actor_options')
    p.add_argument("--http-port", type=int, default=8000, help="--ray: Serve's HTTP proxy port (default 8000)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="embedded: /metrics bind address")
    p.add_argument("--metrics-port", type=int, default=None, help="embedded: serve Prometheus /metrics here")
    p.add_argument("--log-format", choices=("json", "text"), default="json", help="server log lines (default json)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
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


def _add_generate(sub, common) -> None:
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
    p.set_defaults(func=_generate)


def _add_demo(sub, common) -> None:
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
    demo.set_defaults(func=_demo)


def build_parser() -> argparse.ArgumentParser:
    from sparrow.progress import verbose_option

    parser = argparse.ArgumentParser(prog="sparrow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = verbose_option()
    _add_demo(sub, common)
    _add_serve(sub, common)
    _add_generate(sub, common)
    from sparrow.training.cli import add_commands as _add_training   # train-draft, world
    _add_training(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    from sparrow.progress import quiet_third_party

    args = build_parser().parse_args(argv)
    quiet_third_party(args.verbose)
    try:
        return args.func(args)
    except InvalidRequest as exc:         # a request the command cannot honour: say why, no traceback
        print(f"sparrow {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
