"""`sparrow live`: play a video file (or have the server read a URL) into a live session on a
server, with standing and timed questions, and print every answer as it streams, tagged with
its question id and the stream time range it saw. Exits 0 when the stream ends cleanly (the
file played out, or the URL's source ended), 1 when the session failed (e.g. the server could
not reach the URL: UNAVAILABLE), 130 on Ctrl-C."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sparrow.errors import InvalidRequest


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


def _rule(spec: str, rule_id: str):
    """"EVERY_S:FIRE_AT:QUESTION" -> a pb.AlertRule."""
    from sparrow.services.protos import pb

    every, fire_at, question = (spec.split(":", 2) + ["", ""])[:3]
    try:
        every_s, fire = float(every), float(fire_at)
    except ValueError:
        every_s = fire = float("nan")
    if not question.strip() or not (0 < every_s < float("inf") and 0 < fire <= 1):
        raise InvalidRequest(f"--rule takes EVERY_S:FIRE_AT:QUESTION with EVERY_S > 0 and FIRE_AT in (0, 1], got {spec!r}")
    return pb.AlertRule(rule_id=rule_id, question=question, every_s=every_s, fire_at=fire)


def run(args: argparse.Namespace) -> int:
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
    rules = [_rule(spec, f"r{i + 1}") for i, spec in enumerate(args.rule)]
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
                           evict_mode=args.evict_mode, stale_after_s=args.stale_after,
                           min_pixels=args.min_pixels, max_pixels=args.max_pixels, url=url, timeout=args.timeout,
                           stats_every_s=stats_every, standing_sampling=sampling,
                           standing=[(f"s{i + 1}", text, every) for i, (every, text) in enumerate(standing)],
                           rules=rules, webhook_url=args.webhook)
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
                        stop.wait()       # the URL plays until its source ends (the server ends the stream) or Ctrl-C
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
        from sparrow.services.protos import pb

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
        elif kind == "incident":
            self.end_line()
            i = response.incident
            what = "fired" if i.kind == pb.INCIDENT_KIND_FIRED else "cleared"
            print(f"[{i.rule_id} {what} {i.start_s:.1f}-{i.end_s:.1f}s] P(yes) {i.probability:.2f}: {i.question}",
                  flush=True)
        elif kind == "event":
            self.end_line()
            e = response.event
            what = _code_name(e.code) if e.code else pb.LiveEventKind.Name(e.kind).removeprefix(
                "LIVE_EVENT_KIND_").lower().replace("_", " ")
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


def add_command(sub, common) -> None:
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
    p.add_argument("--rule", action="append", default=[], metavar="EVERY_S:FIRE_AT:QUESTION",
                   help="an alert rule: the yes/no QUESTION checked every EVERY_S seconds of stream, firing when "
                        "P(yes) >= FIRE_AT (repeat); ids r1, r2, ...; incidents printed as they happen")
    p.add_argument("--webhook", default="", help="the server also POSTs the rules' incidents here (JSON; under its "
                                                 "--allow-webhook prefixes)")
    p.add_argument("--speed", type=float, default=1.0,
                   help="play the file this many times faster than real time (default 1; e.g. 20 for a quick demo)")
    p.add_argument("--duration", type=float, help="stop after this many seconds of stream (a URL: of wall time; "
                                                  "default: the whole file, a URL until its source ends)")
    p.add_argument("--window", type=float, help="seconds of stream the session keeps (default: the server's, 30)")
    p.add_argument("--fps", type=float, help="frames sampled per second of stream (default: the server's, 2)")
    p.add_argument("--evict", type=float, help="the oldest frames leave the window in steps of this many seconds "
                                               "(default: window / 8)")
    p.add_argument("--evict-mode", choices=("shift", "refresh"), default="",
                   help="shift: evicted frames leave and the kept ones are re-positioned (default); "
                        "refresh: the kept frames are prefilled again after each eviction step (exact, costlier)")
    p.add_argument("--max-lag", type=float, help="seconds ingest may fall behind before frames are dropped "
                                                 "(default: the server's, 10)")
    p.add_argument("--stale-after", type=float, help="seconds without a frame before the source is reported stale "
                                                     "and answers are marked stale (default: the server's, 5)")
    p.add_argument("--min-pixels", type=int, help="smallest frame size in pixels the model sees")
    p.add_argument("--max-pixels", type=int, help="largest frame size in pixels the model sees")
    p.add_argument("--max-new-tokens", type=int, default=0, help="longest answer in tokens (0: the server's default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--stats-every", type=float, help="print the session's stats every this many seconds "
                                                     "(default: only the final stats)")
    p.add_argument("--json", action="store_true", help="print every server message as one JSON line on stdout")
    p.add_argument("--timeout", type=float, help="deadline for the whole session in seconds")
    p.add_argument("--application", help="Ray Serve application name (gRPC metadata), when several run")
    p.set_defaults(func=run)
