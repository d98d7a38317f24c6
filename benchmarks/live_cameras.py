"""Many cameras on one engine at real time (`python -m benchmarks.live_sessions --cameras 2,4`).

For each N: N live sessions on one engine, each fed its own live-world stream at real time
(a thread per camera pushes each 2 fps frame when its wall time comes), each with a standing
question every --camera-every seconds of stream; the sessions' questions are bounded as the
service bounds them (max_live_questions / max_live_queued_questions). Per session: frames
dropped (ingest behind real time by more than max_lag_s), the largest lag, and each answer's
latency = the wall time its last token came - the wall time its newest frame arrived.
The sweep's answer: the largest N whose sessions dropped nothing with answer latency p90 <= 2 s.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from sparrow.config import SamplingParams
from sparrow.engine import Engine
from sparrow.live.session import LiveEvent, LiveSession
from sparrow.live.window import LiveConfig

P90_BOUND_S = 2.0
Render = Callable[[int, int], np.ndarray]    # (first, count) -> uint8 frames [count, H, W, 3] at fps


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_cameras(engine: Engine, n: int, seconds: float, seed: int, window_s: float, every_s: float, *,
                stream: Callable[[int], Render], fps: float, question: str, sampling: SamplingParams,
                max_questions: int = 4, max_queued: int = 8) -> list[dict]:
    """One run of n cameras (camera i: stream(seed + i)); a row per session."""
    latencies: list[list[float]] = [[] for _ in range(n)]
    errors = [0] * n
    max_lag = [0.0] * n

    def on_event(i: int):
        def seen(event: LiveEvent) -> None:
            if event.kind == "done" and event.camera is not None:
                latencies[i].append(time.time() - event.camera.wall_time_s)
            elif event.kind == "error" and event.question_id:
                errors[i] += 1
        return seen

    sessions = [LiveSession(engine, LiveConfig(fps=fps, window_s=window_s), on_event=on_event(i),
                            max_questions=max_questions, max_queued_questions=max_queued) for i in range(n)]
    renders = [stream(seed + i) for i in range(n)]
    total = int(seconds * fps)
    start = time.monotonic() + 0.5

    def camera(i: int) -> None:
        session = sessions[i]
        for k in range(total):
            wait = start + k / fps - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            session.push_frames(renders[i](k, 1), [k / fps])
            if k == 1:
                session.add_standing(question, every_s, sampling)
            if k % 2:
                max_lag[i] = max(max_lag[i], session.stats.lag_s)

    threads = [threading.Thread(target=camera, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = []
    for i, session in enumerate(sessions):
        session.end_of_stream()
        session.wait_ingested(60)
        deadline = time.monotonic() + 30
        while session.running_answers and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = session.stats
        rows.append(dict(n=n, session=i, dropped=stats.frames_dropped, sampled=stats.frames_sampled,
                         max_lag_s=max_lag[i], answers=len(latencies[i]), errors=errors[i],
                         p50=_pct(latencies[i], 50), p90=_pct(latencies[i], 90), refused=stats.questions_refused))
        session.close()
    return rows


def cameras_table(rows: list[dict]) -> str:
    lines = ["| cameras | session | frames dropped / sampled | max lag (s) | answers | errors | latency p50 (s) | p90 (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['session']} | {r['dropped']} / {r['sampled']} | {r['max_lag_s']:.1f} | "
                     f"{r['answers']} | {r['errors']} | {r['p50']:.2f} | {r['p90']:.2f} |")
    holds = [n for n in sorted({r["n"] for r in rows})
             if all(r["dropped"] == 0 and r["p90"] <= P90_BOUND_S for r in rows if r["n"] == n)]
    lines.append("")
    lines.append(f"Largest N at real time (no frame dropped, every session's answer p90 <= {P90_BOUND_S:g} s): "
                 f"{max(holds) if holds else 'none of those tried'}.")
    return "\n".join(lines)


__all__ = ["run_cameras", "cameras_table"]
