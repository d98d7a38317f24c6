"""Live sessions: time to first token of a question after 10 s, 1 min and 10 min of stream,
against re-prefilling the window for each question; and the real-time factor ingest sustains.

    python -m benchmarks.live_sessions --out BENCHMARKS.md                  # 5 streams, 10 s / 1 min / 10 min
    python -m benchmarks.live_sessions --points 10,60 --reps 2              # quick
    python -m benchmarks.live_sessions --alerts --out BENCHMARKS.md         # alert rules: recall, precision
    python -m benchmarks.live_sessions --cameras 1,2,4,6,8 --out BENCHMARKS.md   # N cameras at real time (live_cameras.py)

Each rep is a fresh live-world stream (2 fps frames at the world's 84 px: 9 visual tokens a
frame pair, one pair a second). For each --window (seconds kept), one LiveSession ingests the
stream as fast as it can (raw frames pushed a second at a time); at each --points time it
waits until everything so far is prefilled, then:

    live        session.ask(question): a copy of the window's cache + the question's prefill
    re-prefill  the same question about the same window's frames as a fresh one-shot request
                (patchify + vision tower + prefill of the whole window; the frames are given
                decoded, so container decoding is not even counted against it)

Time to first token = from the call to the first streamed token (greedy, 8 new tokens).
Ingest: stream seconds / wall seconds spent pushing and prefilling (raw frames), and the
same for MPEG-TS chunks fed through the session's decoder (--ts-seconds of stream, encoded
beforehand). A ratio > 1 is faster than real time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.live.session import LiveSession
from sparrow.live.window import LiveConfig
from sparrow.models.target import TargetModel
from sparrow.video import VideoOptions
from sparrow.video.options import Frames
from sparrow.video.encode import encode_ts

from benchmarks.report import write_section

QUESTION = "what is in view now ?"
SAMPLING = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
FPS = 2.0


def live_stream(seed: int, size: int = 84):
    """(render(first, count) -> uint8 frames at FPS) for a live-world stream of this seed
    (frames of another side than the world's: moving squares, for timing only)."""
    if size == 84:
        from sparrow.world.live_stream import LiveStream

        world = LiveStream(seed=seed)
        step = max(1, int(round(world.fps / FPS)))

        def render(first: int, count: int) -> np.ndarray:
            return world.frames(first * step, (first + count) * step, step)
        return render
    from sparrow.tiny import synthetic_frames

    def render(first: int, count: int) -> np.ndarray:
        return synthetic_frames(count, size, size, seed=seed * 100_003 + first)
    return render


def _first_token_s(gen) -> float:
    t0 = time.perf_counter()
    first = None
    for _ in gen:
        if first is None:
            first = time.perf_counter() - t0
    return first


def run_stream(engine: Engine, seed: int, window_s: float, points: list[float], size: int = 84) -> dict:
    render = live_stream(seed, size)
    options = VideoOptions(min_pixels=28 * 28)
    session = LiveSession(engine, LiveConfig(fps=FPS, window_s=window_s, max_lag_s=1e9, options=options))
    kept: list[np.ndarray] = []               # the window's frames, for the re-prefill baseline
    ingest_s, stream_s, out = 0.0, 0.0, {}
    per_push = int(FPS)                       # a second of frames per push
    frame = 0
    for point in sorted(points):
        while stream_s < point:
            frames = render(frame, per_push)
            times = (frame + np.arange(per_push)) / FPS
            t0 = time.perf_counter()
            session.push_frames(frames, times)
            session.wait_ingested()
            ingest_s += time.perf_counter() - t0
            kept.extend(frames)
            frame += per_push
            stream_s = frame / FPS
        stats = session.stats
        window_frames = 2 * stats.window_pairs
        kept = kept[-window_frames:]
        t_live = _first_token_s(session.ask(QUESTION, SAMPLING).generation)
        clip = Frames(np.stack(kept), np.arange(len(kept)) / FPS, FPS, options)
        t_full = _first_token_s(engine.stream(clip, QUESTION, SAMPLING, options))
        out[point] = dict(live=t_live, reprefill=t_full, tokens=stats.visual_tokens, kv_bytes=stats.kv_bytes)
    out["ingest_rtf"] = stream_s / ingest_s
    session.close()
    return out


def ts_rtf(engine: Engine, seed: int, seconds: int) -> float:
    render = live_stream(seed)
    frames = render(0, int(seconds * FPS))
    data = encode_ts(frames, int(FPS), "libx264")
    chunk = max(188, len(data) // seconds // 188 * 188)      # about a second a chunk
    session = LiveSession(engine, LiveConfig(fps=FPS, window_s=60, max_lag_s=1e9,
                                             options=VideoOptions(min_pixels=28 * 28)))
    t0 = time.perf_counter()
    for i in range(0, len(data), chunk):
        session.feed(data[i:i + chunk])
    session.end_of_stream()
    session.wait_ingested()
    wall = time.perf_counter() - t0
    pairs = session.stats.pairs_prefilled
    session.close()
    return pairs * 2 / FPS / wall


STANDING = {            # kind -> question ({c}: the colour a presence question names)
    "colour_now": "what colour is the shape now ?",
    "what_now": "what is in view now ?",
    "present_now": "is a {c} shape in view ?",
}


def _truth(kind: str, view, colour: str) -> str:
    if kind == "colour_now":
        return view.color if view else "none"
    if kind == "what_now":
        return view.text if view else "nothing"
    return "yes" if view is not None and view.color == colour else "no"


def standing_accuracy(engine: Engine, seed: int, seconds: float, window_s: float, every_s: float,
                      colours: tuple[str, ...] = ("red", "blue"), one_shot: bool = False,
                      evict_mode: str = "shift") -> list[dict]:
    """One live-world stream played into a session (as fast as it ingests) with the standing
    questions asked every `every_s` seconds of stream; each answer checked against what is in
    view in the session's newest sampled frame. The window (window_s) is evicted and
    re-positioned as the stream goes on, so most answers come after eviction.
    Returns one row per answer: kind, end_s, answer, truth, evicted (pairs gone by then);
    with one_shot, also the answer to the same question about the same window's frames
    prefilled at once as a fresh request ("one_shot"): what eviction's approximation (kept
    pairs prefilled beside evicted ones) is measured against."""
    import threading

    from sparrow.world.live_stream import LiveStream

    stream = LiveStream(seed=seed)
    done, lock = [], threading.Lock()

    def on_event(event):
        if event.kind in ("done", "error"):
            with lock:
                done.append(event)

    session = LiveSession(engine, LiveConfig(fps=FPS, window_s=window_s, max_lag_s=1e9, evict_mode=evict_mode,
                                             options=VideoOptions(min_pixels=28 * 28)), on_event=on_event)
    asked = {}
    t_ingest = 0.0
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    for kind, question in STANDING.items():
        for colour in (colours if "{c}" in question else ("",)):
            qid = session.add_standing(question.format(c=colour), every_s, greedy)
            asked[qid] = (kind, colour)
    per_push = int(stream.fps)                   # a second of stream frames a push
    evicted_at = []
    for second in range(int(seconds)):
        first = second * per_push
        frames, times = stream.frames(first, first + per_push), stream.times(first, first + per_push)
        t0 = time.perf_counter()
        session.push_frames(frames, times)
        session.wait_ingested()
        t_ingest += time.perf_counter() - t0
        evicted_at.append((session.stats.window_end_s, session.stats.pairs_evicted))
    want = len(asked) * int(seconds // every_s)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with lock:
            if len(done) >= want:
                break
        time.sleep(0.05)
    session.close()
    questions = {qid: STANDING[kind].format(c=colour) for qid, (kind, colour) in asked.items()}
    options = VideoOptions(min_pixels=28 * 28)
    rows = []
    for event in done:
        kind, colour = asked[event.question_id]
        if event.kind == "error":
            rows.append(dict(kind=kind, end_s=event.end_s, answer=f"error: {event.error}", truth="", evicted=0))
            continue
        last_frame = stream.frame_at(event.end_s - 1.0 / FPS)        # the newest sampled frame
        truth = _truth(kind, stream.view(last_frame), colour)
        evicted = max((n for end, n in evicted_at if end <= event.end_s + 1e-9), default=0)
        row = dict(kind=kind, end_s=event.end_s, answer=event.output.text.strip(), truth=truth, evicted=evicted,
                   mode=evict_mode, ingest_rtf=seconds / t_ingest)
        if one_shot:
            times = np.arange(event.start_s, event.end_s - 1e-9, 1.0 / FPS)       # the window's sampled frames
            frames = np.stack([stream.frame(stream.frame_at(t)) for t in times])
            clip = Frames(frames, times - times[0], FPS, options)
            row["one_shot"] = engine.generate(clip, questions[event.question_id], greedy, options).text.strip()
        rows.append(row)
    return rows


def _accuracy_table(rows: list[dict], args) -> str:
    def acc(sel: list[dict], key: str = "truth") -> str:
        return f"{sum(r['answer'] == r[key] for r in sel) / len(sel):.3f} ({len(sel)})" if sel else "-"

    lines = []
    for mode in ("shift", "refresh"):
        for kind in [*STANDING, "all"]:
            sel = [r for r in rows if r["mode"] == mode and kind in ("all", r["kind"])]
            before = [r for r in sel if r["evicted"] == 0]
            after = [r for r in sel if r["evicted"] > 0]
            rtf = sorted({r["ingest_rtf"] for r in sel})
            lines.append(f"| {mode} | {kind} | {acc(sel)} | {acc(before)} | {acc(after)} | {acc(after, 'one_shot')} | "
                         f"{acc([r for r in after if r['truth'] == 'yes']) if kind == 'present_now' else ''} | "
                         f"{statistics.median(rtf):.0f} |")
    return (f"\nStanding questions on the live world ({args.accuracy_streams} streams of {args.accuracy_seconds:.0f} s "
            f"per eviction mode, seeds {args.seed + 200}+, window {args.accuracy_window:.0f} s evicted in steps of "
            f"{args.accuracy_window / 8:g} s, every {args.every:.0f} s of stream; presence asks about red and blue; "
            f"truth: what is in view in the session's newest sampled frame). Accuracy (answers); 'same as one-shot': "
            f"the answer equals the one to the same question about the same window's frames prefilled at once "
            f"(what eviction approximates); ingest: stream seconds per wall second, answers running beside it:\n\n"
            f"| eviction | question | all | before any eviction | after eviction | after eviction: same as one-shot | "
            f"presence after eviction, truth yes | ingest x real time |\n|---|---|---|---|---|---|---|---|\n"
            + "\n".join(lines) + "\n")


def _mmm(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    v = sorted(x * scale for x in values)
    return f"{fmt.format(statistics.median(v))} ({fmt.format(v[0])}-{fmt.format(v[-1])})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="models/live/target", help="a target with real-time positions")
    parser.add_argument("--points", default="10,60,600", help="stream seconds at which a question is asked")
    parser.add_argument("--windows", default="60,600", help="session windows in seconds, comma-separated")
    parser.add_argument("--reps", type=int, default=5, help="fresh streams per window")
    parser.add_argument("--seed", type=int, default=7100, help="first stream seed")
    parser.add_argument("--ts-seconds", type=int, default=60, help="stream seconds fed as MPEG-TS chunks")
    parser.add_argument("--size", type=int, default=84, help="frame side in px (84: the live world's)")
    parser.add_argument("--accuracy-streams", type=int, default=5, help="live-world streams for standing-question accuracy")
    parser.add_argument("--accuracy-seconds", type=float, default=300, help="stream seconds each")
    parser.add_argument("--accuracy-window", type=float, default=16, help="the session window for accuracy, seconds")
    parser.add_argument("--every", type=float, default=5, help="standing questions every N stream seconds")
    parser.add_argument("--alerts", action="store_true", help="only the alert rules' recall and precision "
                                                               "(benchmarks/alert_recall.py)")
    parser.add_argument("--alert-streams", type=int, default=5, help="held-out streams for --alerts")
    parser.add_argument("--alert-seconds", type=float, default=180, help="stream seconds each (--alerts)")
    parser.add_argument("--alert-every", type=float, default=3, help="rule checks every N stream seconds (--alerts)")
    parser.add_argument("--fire-at", type=float, default=0.5, help="the rules' fire_at (--alerts)")
    parser.add_argument("--alert-thresholds", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.3, 0.7],
                        help="other P(yes) thresholds read off the same checks (--alerts)")
    parser.add_argument("--cameras", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                        help="only N cameras at real time, for each N (live_cameras.py), e.g. 1,2,4,6,8")
    parser.add_argument("--camera-seconds", type=float, default=180, help="stream seconds per camera (--cameras)")
    parser.add_argument("--camera-every", type=float, default=3, help="standing question every N s (--cameras)")
    parser.add_argument("--camera-window", type=float, default=16, help="each session's window, s (--cameras)")
    parser.add_argument("--out", help="write the table into this BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.alerts:
        return _alerts(args, argv)
    if args.cameras:
        return _cameras(args, argv)
    points = [float(p) for p in args.points.split(",")]
    windows = [float(w) for w in args.windows.split(",")]
    target = TargetModel.from_pretrained(args.target)
    engine = Engine(target, spec=SpecConfig(method="none"))
    load = os.getloadavg()
    rows, rtf = [], []
    for window in windows:
        runs = [run_stream(engine, args.seed + r, window, points, args.size) for r in range(args.reps)]
        rtf += [run["ingest_rtf"] for run in runs]
        base = [run[points[0]]["live"] for run in runs]
        for p in points:
            live = [run[p]["live"] for run in runs]
            full = [run[p]["reprefill"] for run in runs]
            rows.append(f"| {window:.0f} s | {p:.0f} s | {runs[0][p]['tokens']} | {_mmm(live, 1e3)} | "
                        f"{_mmm([a / b for a, b in zip(live, base)], fmt='{:.2f}')} | {_mmm(full, 1e3)} | "
                        f"{_mmm([b / a for a, b in zip(live, full)], fmt='{:.1f}')} |")
            print(rows[-1], flush=True)
    ts = [ts_rtf(engine, args.seed + 100 + r, args.ts_seconds) for r in range(min(args.reps, 3))]
    accuracy = ""
    if args.accuracy_streams > 0 and args.size == 84:
        rows_acc = [row for mode in ("shift", "refresh") for r in range(args.accuracy_streams)
                    for row in standing_accuracy(engine, args.seed + 200 + r, args.accuracy_seconds,
                                                 args.accuracy_window, args.every, one_shot=True, evict_mode=mode)]
        accuracy = _accuracy_table(rows_acc, args)
        print(accuracy)
    load_after = os.getloadavg()
    body = (
        f"Target `{args.target}`, {args.reps} fresh streams per window (seeds {args.seed}+), {args.size} px frames "
        f"at 2 fps ({(args.size // 28) ** 2} visual tokens a pair, a pair a second), greedy, 8 new tokens; time to first token as median "
        f"(min-max) over the streams. Machine: {os.cpu_count()} CPU cores, no GPU; load average "
        f"{load[0]:.2f} before, {load_after[0]:.2f} after.\n\n"
        "| window | stream so far | visual tokens held | live TTFT ms | vs at the first point | "
        "re-prefill TTFT ms | re-prefill / live |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) +
        f"\n\nIngest real-time factor (stream seconds per wall second, whole streams, raw frames): {_mmm(rtf)}; "
        f"MPEG-TS chunks through the session's decoder ({args.ts_seconds} s of stream, libx264): {_mmm(ts)}.\n"
        + accuracy)
    print(body)
    if args.out:
        write_section(args.out, "live", "Live sessions: time to first token over a stream's life, ingest rate",
                      "python -m benchmarks.live_sessions " + " ".join(argv if argv is not None else sys.argv[1:]), body)


def _alerts(args, argv) -> None:
    from benchmarks.alert_recall import alert_stream, alerts_table

    engine = Engine(TargetModel.from_pretrained(args.target), spec=SpecConfig(method="none"))
    load = os.getloadavg()
    rows = [row for r in range(args.alert_streams)
            for row in alert_stream(engine, args.seed + 300 + r, args.alert_seconds, args.accuracy_window,
                                    args.alert_every, args.fire_at)]
    engine.close()
    body = (f"Target `{args.target}`; machine: {os.cpu_count()} CPU cores, no GPU; load average {load[0]:.2f} "
            f"before, {os.getloadavg()[0]:.2f} after.\n" + alerts_table(rows, args))
    print(body)
    if args.out:
        write_section(args.out, "live-alerts", "Live sessions: alert rules' recall and precision",
                      "python -m benchmarks.live_sessions " + " ".join(argv if argv is not None else sys.argv[1:]), body)


def _cameras(args, argv) -> None:
    from benchmarks.live_cameras import cameras_table, run_cameras

    engine = Engine(TargetModel.from_pretrained(args.target), spec=SpecConfig(method="none"))
    load = os.getloadavg()
    rows = [row for n in args.cameras
            for row in run_cameras(engine, n, args.camera_seconds, args.seed + 400, args.camera_window, args.camera_every,
                                   stream=live_stream, fps=FPS, question=QUESTION, sampling=SAMPLING)]
    engine.close()
    body = (f"Target `{args.target}`; {args.camera_seconds:.0f} s streams, a standing question every "
            f"{args.camera_every:g} s, window {args.camera_window:g} s; machine: {os.cpu_count()} CPU cores, no GPU; "
            f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after.\n" + cameras_table(rows))
    print(body)
    if args.out:
        write_section(args.out, "live-cameras", "Live sessions: cameras at real time",
                      "python -m benchmarks.live_sessions " + " ".join(argv if argv is not None else sys.argv[1:]), body)


if __name__ == "__main__":
    main()
