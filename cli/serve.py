"""`sparrow serve`: sparrow.v1 over gRPC, embedded (grpc.aio around the in-process engine) or
--ray (Ray Serve: the target as a deployment, and the draft as its own with --draft-placement
remote). With no model options: the committed world pair."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from sparrow.errors import InvalidRequest


def app_settings(args: argparse.Namespace):
    """The serve options as the AppSettings both hosts run."""
    from sparrow import SpecConfig
    from sparrow.config import EngineConfig
    from sparrow.services.config import ServiceConfig
    from sparrow.services.settings import AppSettings

    MiB = 1 << 20
    service = ServiceConfig(
        max_new_tokens=args.max_new_tokens, default_max_new_tokens=min(128, args.max_new_tokens),
        max_video_bytes=args.max_video_mb * MiB, max_message_bytes=args.max_message_mb * MiB,
        max_concurrent=args.max_concurrent, media_root=args.media_root, max_live_sessions=args.max_live_sessions,
        max_live_session_s=args.max_live_session_s, max_live_bytes=args.max_live_mb * MiB,
        max_uploads=args.max_uploads, max_upload_bytes_in_flight=args.max_upload_mb_in_flight * MiB,
        upload_dir=args.upload_dir, max_stored_upload_bytes=args.max_stored_upload_mb * MiB,
        allowed_url_schemes=tuple(args.allow_url_scheme), allowed_url_hosts=tuple(args.allow_url_host),
        live_webhook_prefixes=tuple(args.allow_webhook))
    deployments = json.loads(Path(args.ray_config).read_text()) if args.ray_config else {}
    return AppSettings(
        target=_target_spec(args), draft=_draft_spec(args),
        draft_placement=args.draft_placement, cache=args.cache,
        spec=SpecConfig(draft_step=args.draft_step) if args.k is None else
        SpecConfig(num_draft_tokens=args.k, draft_step=args.draft_step),
        spec_given=frozenset() if args.k is None else frozenset({"num_draft_tokens"}),
        service=service, engine=EngineConfig(kv_cache_bytes=args.kv_cache_mb * MiB, kv_prefault=not args.no_kv_prefault),
        target_deployment=deployments.get("target", {}), draft_deployment=deployments.get("draft", {}),
        dtype=args.dtype, device=args.device, device_map=args.device_map, verify_attention=args.verify_attention,
        target_step=args.target_step, served_model_name=args.served_model_name)


def _target_spec(args: argparse.Namespace) -> str:
    """--target, else the committed world pair's target (random tiny: models only by name)."""
    if args.target is not None:
        return args.target
    from sparrow.world.pair_demo import DEFAULT_MODELS

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
        from sparrow.world.pair_demo import DEFAULT_MODELS

        return str(DEFAULT_MODELS / "draft")
    return "tiny" if args.target.startswith("tiny:") else None


def models_line(settings) -> str:
    """What a server says at startup about the models it serves."""
    target = settings.target + (" (RANDOM WEIGHTS: answers are noise)" if settings.target.startswith("tiny:") else "")
    target += f", {settings.target_step} target steps"
    if settings.draft is None:
        return f"sparrow: models: target {target}; no draft (plain decoding)"
    draft = settings.draft + (" (random)" if settings.draft.startswith("tiny") else "")
    from sparrow.models.draft import GEOMETRY_KEYS

    trained = [key for key in GEOMETRY_KEYS if key not in settings.spec_given]
    geometry = ("" if "num_draft_tokens" in trained else f"k={settings.spec.num_draft_tokens}, ") + \
        (f"{'/'.join(trained)} as the draft was trained (its checkpoint's, else the defaults)" if trained else "")
    return (f"sparrow: models: target {target}; draft {draft} ({settings.spec.method}, {geometry.rstrip(', ')}, "
            f"{settings.spec.draft_step} draft steps, {settings.draft_placement})")


def http_port(args: argparse.Namespace) -> int:
    """--http-port; unset: 8000, or a free port beside a gRPC port 0 (tests, several servers)."""
    if args.http_port is not None:
        return args.http_port
    return 0 if args.port == 0 else 8000


def run(args: argparse.Namespace) -> int:
    settings = app_settings(args)
    if args.no_http and args.no_grpc:
        print("sparrow serve: --no-http and --no-grpc leave nothing to serve", file=sys.stderr)
        return 2
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
    asyncio.run(serve_forever(service, args.host, None if args.no_grpc else args.port,       # until Ctrl-C or SIGTERM
                              http_port=None if args.no_http else http_port(args),
                              model_name=settings.model_name))
    from sparrow.services import stopping
    # Served and stopped: no interpreter teardown, which aborts the process (SIGABRT, "terminate
    # called without an active exception") when a background step compile is still inside torch.
    stopping.exit_now(0)


def _stop_on_sigterm() -> None:
    """Under --ray, SIGTERM (Kubernetes stopping the pod, `kill`) stops the server as Ctrl-C
    does: Serve shuts down and a local Ray cluster it started goes with it. Python's default for
    SIGTERM exits at once: no shutdown, the local cluster's processes left running. (Raising in
    the handler suits this path, whose main thread only sleeps; the embedded server's event loop
    takes both signals itself: `serve_forever`.)"""
    def interrupt(signum, frame):
        from sparrow.services import stopping
        stopping.arm()          # the shutdown below within the grace, whatever runs
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


def _serve_ray(args: argparse.Namespace, settings) -> int:
    from sparrow.services import ray_bind

    # A local cluster is started for --host (every Ray server on it; services.ray_bind), with
    # Ray's token authentication unless RAY_AUTH_MODE says otherwise; both read by Ray at import.
    # A cluster joined keeps its own (RAY_AUTH_MODE and its token must match it).
    if args.ray_address is None:
        auth, cluster = ray_bind.token_auth(), ray_bind.local_cluster(args.host)
        where = f"a local cluster on {args.host}; Ray token authentication " + \
            ("on" if auth == "token" else "OFF (RAY_AUTH_MODE)")
    else:
        cluster, where = {"address": args.ray_address}, f"the cluster at {args.ray_address} (its own authentication)"
    import ray
    from ray import serve

    from sparrow.services import ray_app

    # Serve's gRPC proxy reads its message limit from the environment of its process, and
    # binds --host through the job's setup hook (services.ray_bind).
    env = {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(settings.service.max_message_bytes)}
    print(models_line(settings), flush=True)
    ray.init(**cluster, runtime_env=ray_bind.runtime_env(args.host, env))
    _stop_on_sigterm()          # after ray.init, which sets its own (exit at once, its core worker aborting)
    print(f"sparrow: Ray: {where}", flush=True)
    web = 8000 if args.http_port is None else args.http_port        # Serve's proxies take no port 0
    ray_app.start(settings, grpc_port=args.port, http_host=args.host, http_port=web)
    deployments = "TargetDeployment" + (" + DraftDeployment" if settings.placement == "remote" else "")
    print(f"sparrow: serving the OpenAI-compatible API on http://{args.host}:{web}/v1 (Ray Serve HTTP proxy)",
          flush=True)
    print(f"sparrow: serving sparrow.v1.Sparrow on {args.host}:{args.port} (Ray Serve gRPC proxy: {deployments}); "
          f"draft {settings.placement}; Ctrl-C or SIGTERM stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from sparrow.services import stopping
        if args.ray_address is None:
            ray.shutdown()      # our own local cluster: its processes (Serve's actors too) go, in ~1 s
        else:
            serve.shutdown()    # a cluster joined: take our application off it
        stopping.exit_now(0)    # nothing left to wait for: no interpreter teardown (Ray's threads)
    return 0


def add_command(sub, common) -> None:
    from sparrow.models.placement import add_placement_arguments

    p = sub.add_parser("serve", parents=[common], help="serve sparrow.v1 over gRPC (embedded, or --ray)",
                       description="Serve sparrow.v1 over gRPC. With no model options: the committed world pair "
                                   "(models/world/target and models/world/draft).")
    p.add_argument("--ray", action="store_true", help="run as a Ray Serve application (TargetDeployment; "
                                                      "DraftDeployment too with --draft-placement remote)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (--ray: of Serve's proxies and of the local cluster "
                                                              "it starts; an existing cluster's proxies keep theirs)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051; 0: any free port)")
    p.add_argument("--target", help="target model directory, or tiny:<arch>[:seed] for random weights "
                                    "(default: the committed world target, models/world/target)")
    p.add_argument("--draft", help="Sparrow draft directory, tiny[:seed], or none (default: the world draft for the "
                                   "default target, tiny for a tiny target, none for a target given by directory)")
    p.add_argument("--draft-placement", choices=("colocated", "remote"), default="colocated",
                   help="colocated: the draft runs in the target's process; remote (--ray only): a DraftDeployment")
    p.add_argument("--k", type=int, default=None,
                   help="draft tokens per step (default: the draft's trained k, else 4)")
    from sparrow.config import DRAFT_STEPS
    p.add_argument("--draft-step", choices=DRAFT_STEPS, default="static",
                   help="how the Sparrow draft runs its k steps (SpecConfig.draft_step): static (default, eager), "
                        "compiled (torch.compile on a CPU, CUDA graphs on a GPU: ~2.5x faster on a CPU; each batch "
                        "bucket compiles on its first step, seconds, logged) or reference")
    add_placement_arguments(p, device_map=True)
    from sparrow.config import TARGET_STEPS, VERIFY_KERNELS
    p.add_argument("--verify-attention", choices=("auto", "sdpa", *VERIFY_KERNELS), default="auto",
                   help="decode/verify attention over the cache: auto (Triton split-KV on CUDA, packed on a CPU), "
                        "packed, sdpa, split or triton")
    p.add_argument("--target-step", choices=TARGET_STEPS, default="compiled",
                   help="how the target's decode/verify steps run: compiled (default: torch.compile, one graph per "
                        "token bucket, each compiled on a background thread the first time a step needs it, 1-8 s "
                        "on a CPU, logged; eager until then) or eager")
    p.add_argument("--cache", default="memory", help="state cache: memory or redis://host:port/db")
    p.add_argument("--media-root", help="directory the server may read video paths from (default: no paths)")
    p.add_argument("--allow-url-scheme", action="append", default=[], help="http, https or rtsp (repeat)")
    p.add_argument("--allow-url-host", action="append", default=[], help="allowed URL host (repeat)")
    p.add_argument("--allow-webhook", action="append", default=[], metavar="PREFIX",
                   help="URL prefix a live session's alert webhook may start with (repeat; none: no webhooks)")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="most new tokens a request may ask for (default 2048)")
    p.add_argument("--kv-cache-mb", type=int, default=2048, help="the target's KV memory, in MiB: requests are admitted "
                   "while their KV fits (default 2048)")
    p.add_argument("--no-kv-prefault", action="store_true", help="leave the KV memory unwritten until requests use it "
                   "(default: written at start, so no request pays the first touch of its pages)")
    p.add_argument("--max-video-mb", type=int, default=2048, help="largest video accepted, in MiB (default 2048)")
    p.add_argument("--max-message-mb", type=int, default=64, help="largest gRPC message, in MiB (default 64; "
                                                                 "larger videos go through UploadVideo in chunks)")
    p.add_argument("--max-concurrent", type=int, default=16, help="requests running at once; more get "
                                                                 "RESOURCE_EXHAUSTED (default 16)")
    p.add_argument("--max-uploads", type=int, default=4, help="uploads in progress at once; more get "
                                                            "RESOURCE_EXHAUSTED (default 4; 0: no uploads)")
    p.add_argument("--max-upload-mb-in-flight", type=int, default=4096,
                   help="MiB the uploads in progress may hold together; past it RESOURCE_EXHAUSTED (default 4096)")
    p.add_argument("--upload-dir", help="where uploads are received and, without Redis, stored (default: a fresh "
                                        "temporary directory)")
    p.add_argument("--max-stored-upload-mb", type=int, default=16384,
                   help="without Redis: MiB of stored uploads kept in --upload-dir; the oldest go first "
                        "(default 16384)")
    p.add_argument("--max-live-sessions", type=int, default=4, help="live sessions open at once; more get "
                                                                   "RESOURCE_EXHAUSTED (default 4; 0: none)")
    p.add_argument("--max-live-session-s", type=float, default=4 * 3600.0,
                   help="seconds a live session may stay open before it ends with RESOURCE_EXHAUSTED (default 14400)")
    p.add_argument("--max-live-mb", type=int, default=16384, help="MiB of video a live session may send before it "
                                                                  "ends with RESOURCE_EXHAUSTED (default 16384)")
    p.add_argument("--ray-address", default=None, help="join this cluster ('auto': the local one running; default: "
                                                        "start a new local cluster listening on --host only)")
    p.add_argument("--ray-config", help='JSON: {"target": {deployment options}, "draft": {...}}, e.g. '
                                        'autoscaling_config, num_replicas, ray_actor_options')
    p.add_argument("--http-port", type=int, default=None,
                   help="the OpenAI-compatible HTTP API's port (/v1/chat/completions, /v1/models, /health, /metrics; "
                        "--ray: Serve's HTTP proxy). Default 8000, or any free port when --port is 0")
    p.add_argument("--no-http", action="store_true", help="embedded: serve gRPC only")
    p.add_argument("--no-grpc", action="store_true", help="embedded: serve the HTTP API only")
    p.add_argument("--served-model-name", default=None,
                   help="the model name /v1/models lists and requests give (default: the --target spec)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="embedded: /metrics bind address")
    p.add_argument("--metrics-port", type=int, default=None, help="embedded: serve Prometheus /metrics here")
    p.add_argument("--log-format", choices=("json", "text"), default="json", help="server log lines (default json)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.set_defaults(func=run)
