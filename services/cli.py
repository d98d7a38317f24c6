"""The `sparrow` command line.

    sparrow demo                 a fresh world video -> the committed world pair -> streamed answers + speed
    sparrow demo --long          the same on a ~25k-visual-token video, with plain vs EAGLE-style vs Sparrow
    sparrow serve [--ray]        the gRPC service (embedded: grpc.aio + in-process engine;
                                 --ray: Ray Serve, the target as a deployment, and the draft as its
                                 own deployment with --draft-placement remote)
    sparrow generate --server HOST:PORT VIDEO "question"    stream an answer from a server
    sparrow live --server HOST:PORT SOURCE    play a file (or have the server read a URL) into a live
                                 session; standing questions and timed questions, answers as they stream
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
        max_concurrent=args.max_concurrent, media_root=args.media_root, max_live_sessions=args.max_live_sessions,
        max_live_session_s=args.max_live_session_s, max_live_bytes=args.max_live_mb * MiB,
        allowed_url_schemes=tuple(args.allow_url_scheme), allowed_url_hosts=tuple(args.allow_url_host))
    deployments = json.loads(Path(args.ray_config).read_text()) if args.ray_config else {}
    return AppSettings(
        target=_target_spec(args), draft=_draft_spec(args),
        draft_placement=args.draft_placement, spec=SpecConfig(num_draft_tokens=args.k), cache=args.cache,
        service=service, target_deployment=deployments.get("target", {}), draft_deployment=deployments.get("draft", {}),
        dtype=args.dtype, device=args.device, device_map=args.device_map, verify_attention=args.verify_attention)



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
    from sparrow.models.ragged import VERIFY_KERNELS
    p.add_argument("--verify-attention", choices=("auto", "sdpa", *VERIFY_KERNELS), default="auto",
                   help="decode/verify attention over the cache: auto (Triton split-KV on CUDA, ragged SDPA on "
                        "CPU), sdpa, split or triton")
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
    p.add_argument("--max-live-sessions", type=int, default=4, help="live sessions open at once; more get "
                                                                   "RESOURCE_EXHAUSTED (default 4; 0: none)")
    p.add_argument("--max-live-session-s", type=float, default=4 * 3600.0,
                   help="seconds a live session may stay open before it ends with RESOURCE_EXHAUSTED (default 14400)")
    p.add_argument("--max-live-mb", type=int, default=16384, help="MiB of video a live session may send before it "
                                                                  "ends with RESOURCE_EXHAUSTED (default 16384)")
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


# ----- live ----------------------------------------------------------------------------------------
def _timed(spec: str, option: str) -> tuple[float, str]:
    """"SECONDS:TEXT" -> (seconds, text)."""
    seconds, sep, text = spec.partition(":")
    try:
        value = float(seconds)
    except ValueError:
        value = float("nan")
    if not sep or not text.strip() or not (value >= 0 and value < float("inf")):
        raise InvalidRequest(f"{option} takes SECONDS:QUESTION with SECONDS a number >= 0, got {spec!r}")
    return value, text


def _live(args: argparse.Namespace) -> int:
    import queue
    import threading

    import grpc

    from sparrow.services.client import SparrowClient
    from sparrow.services.player import play
    from sparrow.video.policy import is_url

    standing = [_timed(spec, "--standing") for spec in args.standing]
    if any(every <= 0 for every, _ in standing):
        raise InvalidRequest("--standing needs EVERY_S > 0")
    asks = [_timed(spec, "--ask") for spec in args.ask]
    if not args.speed > 0:
        raise InvalidRequest(f"--speed must be > 0, got {args.speed}")
    url = args.source if is_url(args.source) else ""
    if not url and not Path(args.source).is_file():
        raise InvalidRequest(f"{args.source} is not a file (nor an http, https or rtsp URL)")
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    metadata = (("application", args.application),) if args.application else ()
    # With timed questions the server reports progress often: a question waits until the
    # window has taken in the stream up to its time (shown only with --stats-every).
    stats_every = args.stats_every if args.stats_every is not None else (0.2 if asks and not url else 0.0)
    printer = _LivePrinter(json_lines=args.json, stats=args.stats_every is not None)
    with SparrowClient(args.server, metadata=metadata) as client:
        live = client.live(fps=args.fps, window_s=args.window, evict_s=args.evict, max_lag_s=args.max_lag,
                           evict_mode=args.evict_mode,
                           min_pixels=args.min_pixels, max_pixels=args.max_pixels, url=url, timeout=args.timeout,
                           stats_every_s=stats_every, standing_sampling=sampling,
                           standing=[(f"s{i + 1}", text, every) for i, (every, text) in enumerate(standing)])
        stop = threading.Event()
        due: queue.SimpleQueue = queue.SimpleQueue()      # (stream time, id, question) as the stream reaches it

        def ask_when_ingested() -> None:
            """Asks each due question once the window has taken in the stream up to its time
            (its end trails the newest frame by up to a frame slot), without holding up the media."""
            while (item := due.get()) is not None:
                at_s, question_id, text = item
                printer.window.wait_until(at_s - 1.0 / live.opened().fps, stop)
                live.ask(text, question_id=question_id, **sampling)

        def feed() -> None:
            """Plays the file (or waits out the URL's --duration), asking each --ask on time, then half-closes."""
            timed = [(at, lambda when, i=i, text=text: due.put((when, f"q{i + 1}", text)))
                     for i, (at, text) in enumerate(asks)]
            asker = threading.Thread(target=ask_when_ingested, name="sparrow-live-ask", daemon=True)
            try:
                if url:
                    start = time.monotonic()
                    for i, (at, text) in sorted(enumerate(asks), key=lambda a: a[1][0]):
                        if stop.wait(max(0.0, start + at - time.monotonic())):
                            return
                        live.ask(text, question_id=f"q{i + 1}", **sampling)
                    if args.duration is None:
                        stop.wait()       # the URL plays until Ctrl-C (or the session ends)
                    else:
                        stop.wait(max(0.0, start + args.duration - time.monotonic()))
                else:
                    asker.start()
                    played, left = play(args.source, live.send_chunk, speed=args.speed, duration_s=args.duration,
                                        at=timed, stopped=stop.is_set)
                    live.end()
                    for _, action in left:              # past the end: about the whole stream
                        action(played)
                    due.put(None)
                    asker.join()
                live.close()
            except ValueError:            # the stream was closed under us (the session ended)
                pass
            except Exception as exc:  # noqa: BLE001 - said, and the session is ended
                printer.failed(exc)
                live.cancel()

        try:
            with live:
                printer.handle_opened(live.opened())
                feeder = threading.Thread(target=feed, name="sparrow-live-feed", daemon=True)
                feeder.start()
                for response in live:
                    printer.handle(response)
        except grpc.RpcError as exc:
            printer.end_line()
            if exc.code() != grpc.StatusCode.CANCELLED or printer.error is None:
                print(f"sparrow live: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            printer.end_line()
            print("sparrow live: stopped", file=sys.stderr)
            return 130
        finally:
            stop.set()
    printer.end_line()
    return 0 if printer.error is None else 1


class _LivePrinter:
    """Live responses on the terminal: answers on stdout, each tagged [id start-end s] and
    printed as it streams; events and stats on stderr. --json: every response as one JSON line."""

    def __init__(self, json_lines: bool, stats: bool):
        self.json_lines, self.stats = json_lines, stats
        self.current = None          # the answer whose text the current stdout line holds
        self.error: BaseException | None = None
        self.window = _WindowProgress()

    def _json(self, response) -> None:
        from google.protobuf import json_format

        print(json.dumps(json_format.MessageToDict(response)), flush=True)

    def handle_opened(self, opened) -> None:
        from sparrow.services.protos import pb

        if self.json_lines:
            self._json(pb.LiveResponse(opened=opened))
            return
        print(f"sparrow live: session {opened.session_id}: window {opened.window_s:g} s ({opened.window_pairs} frame "
              f"pairs of {opened.pair_s:g} s) at {opened.fps:g} fps, draft {opened.spec_method}", file=sys.stderr)

    def handle(self, response) -> None:
        if response.HasField("stats"):
            self.window.update(response.stats.window_end_s)
        if self.json_lines:
            self._json(response)
            return
        kind = response.WhichOneof("kind")
        if kind == "chunk":
            c = response.chunk
            if c.text:              # a chunk without text (part of a character) changes no line
                self._start((c.question_id, c.start_s, c.end_s))
                print(c.text, end="", flush=True)
        elif kind == "done":
            self._done(response.done)
        elif kind == "event":
            self.end_line()
            e = response.event
            what = "frames dropped" if e.frames_dropped else _code_name(e.code)
            about = f" (question {e.question_id})" if e.question_id else ""
            print(f"sparrow live: {what}{about}: {e.message}", file=sys.stderr)
        elif kind == "stats" and (self.stats or response.stats.final):
            self.end_line()
            st = response.stats
            print(f"sparrow live: {'final ' if st.final else ''}stats: {st.frames_received} frames received, "
                  f"{st.pairs_prefilled} pairs prefilled, {st.frames_dropped} dropped, window "
                  f"[{st.window_start_s:.1f}, {st.window_end_s:.1f}) s, lag {st.lag_s:.1f} s, "
                  f"{st.kv_bytes / (1 << 20):.1f} MiB KV", file=sys.stderr)

    def _start(self, key) -> None:
        if self.current != key:
            self.end_line()
            print(f"[{key[0]} {key[1]:.1f}-{key[2]:.1f}s] ", end="", flush=True)
            self.current = key

    def _done(self, done) -> None:
        from sparrow.services.protos import pb

        self._start((done.question_id, done.start_s, done.end_s))
        c = done.completion
        reason = pb.FinishReason.Name(c.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(f"  [{reason}, {c.usage.completion_tokens} tokens" + (f": {c.error}" if c.error else "") + "]", flush=True)
        self.current = None

    def end_line(self) -> None:
        if self.current is not None:
            print(flush=True)
            self.current = None

    def failed(self, exc: BaseException) -> None:
        self.error = exc
        self.end_line()
        print(f"sparrow live: {exc}", file=sys.stderr)


class _WindowProgress:
    """How far the session's window reaches (stream seconds), from its stats messages."""

    STALL_S = 30.0        # no progress this long: stop waiting (the stream may end before the time)

    def __init__(self):
        import threading

        self._cv = threading.Condition()
        self.end_s = 0.0
        self._moved = time.monotonic()

    def update(self, end_s: float) -> None:
        with self._cv:
            if end_s > self.end_s:
                self.end_s, self._moved = end_s, time.monotonic()
                self._cv.notify_all()

    def wait_until(self, end_s: float, stop) -> None:
        with self._cv:
            while self.end_s < end_s and not stop.is_set() and time.monotonic() - self._moved < self.STALL_S:
                self._cv.wait(0.1)


def _code_name(code: int) -> str:
    import grpc

    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


def _add_live(sub, common) -> None:
    p = sub.add_parser("live", parents=[common], help="play a video into a live session on a server; prints answers "
                                                       "as they stream",
                       description="Open a live session on a server, play SOURCE into it at real time (a file, "
                                   "remuxed to MPEG-TS without re-encoding, or a URL the server reads itself), ask "
                                   "the standing and timed questions, and print every answer tagged with its "
                                   "question id and the stream time range it saw.")
    p.add_argument("--server", required=True, help="HOST:PORT of a sparrow server")
    p.add_argument("source", metavar="SOURCE",
                   help="a local video file (H.264, HEVC, MPEG-4 or MPEG-2 video), or an http(s)/rtsp URL the "
                        "server reads under its URL allowlists")
    p.add_argument("--standing", action="append", default=[], metavar="EVERY_S:QUESTION",
                   help="a standing question asked every EVERY_S seconds of stream (repeat); ids s1, s2, ...")
    p.add_argument("--ask", action="append", default=[], metavar="AT_S:QUESTION",
                   help="ask QUESTION when the stream reaches AT_S seconds (repeat; a URL: seconds after opening); "
                        "ids q1, q2, ...")
    p.add_argument("--speed", type=float, default=1.0,
                   help="play the file this many times faster than real time (default 1; e.g. 20 for a quick demo)")
    p.add_argument("--duration", type=float, help="stop after this many seconds of stream (a URL: of wall time; "
                                                  "default: the whole file, a URL until Ctrl-C)")
    p.add_argument("--window", type=float, help="seconds of stream the session keeps (default: the server's, 30)")
    p.add_argument("--fps", type=float, help="frames sampled per second of stream (default: the server's, 2)")
    p.add_argument("--evict", type=float, help="the oldest frames leave the window in steps of this many seconds "
                                               "(default: window / 8)")
    p.add_argument("--evict-mode", choices=("shift", "refresh"), default="",
                   help="shift: evicted frames leave and the kept ones are re-positioned (default); "
                        "refresh: the kept frames are prefilled again after each eviction step (exact, costlier)")
    p.add_argument("--max-lag", type=float, help="seconds ingest may fall behind before frames are dropped "
                                                 "(default: the server's, 10)")
    p.add_argument("--min-pixels", type=int, help="smallest frame size in pixels the model sees")
    p.add_argument("--max-pixels", type=int, help="largest frame size in pixels the model sees")
    p.add_argument("--max-new-tokens", type=int, default=0, help="longest answer in tokens (0: the server's default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--stats-every", type=float, help="print the session's stats every this many seconds "
                                                     "(default: only the final stats)")
    p.add_argument("--json", action="store_true", help="print every server message as one JSON line on stdout")
    p.add_argument("--timeout", type=float, help="deadline for the whole session in seconds")
    p.add_argument("--application", help="Ray Serve application name (gRPC metadata), when several run")
    p.set_defaults(func=_live)


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
    _add_live(sub, common)
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
