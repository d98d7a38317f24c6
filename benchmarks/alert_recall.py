"""Alert rules on live-world streams: recall and precision of "is a <colour> shape in view ?"
rules decided on the target's P(yes), per stream (`python -m benchmarks.live_sessions --alerts`).

Each held-out stream (seeds never trained on) plays into a LiveSession as fast as it ingests
and checks (a second of frames a push, the next once the checks it made due have run), with
one rule per colour checked every --alert-every seconds of stream. A check counts as positive when its rule is firing after it; the truth is whether a
shape of that colour is in view in the session's newest sampled frame (what "now" means in
the live world). Recall = firing checks among those whose truth is yes; precision = checks
whose truth is yes among the firing ones. Other thresholds (--alert-thresholds) are read off
the same checks' probabilities (a rule with fire_after = clear_after = 1 and no band fires
exactly when P(yes) >= its threshold).
"""

from __future__ import annotations

import statistics
import threading
import time

from sparrow.live.alerts import AlertRule
from sparrow.engine import Engine
from sparrow.live.session import LiveSession
from sparrow.live.window import LiveConfig
from sparrow.video import VideoOptions
from sparrow.world.live_stream import LiveStream
from sparrow.video.synthetic import PALETTE

FPS = 2.0
QUESTION = "is a {c} shape in view ?"


def alert_stream(engine: Engine, seed: int, seconds: float, window_s: float, every_s: float,
                 fire_at: float = 0.5, colours: tuple[str, ...] = tuple(PALETTE)) -> list[dict]:
    """One stream, one rule per colour: a row per check (colour, end_s, probability, firing, truth)."""
    stream = LiveStream(seed=seed)
    checks, lock = [], threading.Lock()

    def on_event(event):
        if event.kind == "check":
            with lock:
                checks.append(event.check)

    session = LiveSession(engine, LiveConfig(fps=FPS, window_s=window_s, max_lag_s=1e9,
                                             options=VideoOptions(min_pixels=28 * 28)), on_event=on_event)
    for colour in colours:
        session.alerts.add(AlertRule(colour, QUESTION.format(c=colour), every_s=every_s, fire_at=fire_at))
    per_push = int(stream.fps)
    t0 = time.perf_counter()
    for second in range(int(seconds)):
        first = second * per_push
        session.push_frames(stream.frames(first, first + per_push), stream.times(first, first + per_push))
        session.wait_ingested()
        while session.running_answers:        # every due check runs (none skipped for a busy engine)
            time.sleep(0.005)
    want = len(colours) * int(seconds // every_s)
    wall = time.perf_counter() - t0
    session.close()
    rows = []
    for check in checks:
        view = stream.view(stream.frame_at(check.end_s - 1.0 / FPS))       # the newest sampled frame
        rows.append(dict(seed=seed, colour=check.rule_id, end_s=check.end_s, probability=check.probability,
                         firing=check.active, truth=view is not None and view.color == check.rule_id,
                         checks_wanted=want, wall_s=wall))
    return rows


def recall_precision(rows: list[dict], key: str = "firing") -> tuple[float | None, float | None, int, int]:
    """(recall, precision, true cases, firing cases) of the checks' `key` decision against the truth."""
    truth = [r for r in rows if r["truth"]]
    firing = [r for r in rows if r[key]]
    hits = sum(1 for r in truth if r[key])
    return (hits / len(truth) if truth else None, hits / len(firing) if firing else None, len(truth), len(firing))


def _mmm(values: list[float | None]) -> str:
    """Median (min-max) of the values that exist; one value alone as itself."""
    v = sorted(x for x in values if x is not None)
    if len(v) == 1:
        return f"{v[0]:.3f}"
    return f"{statistics.median(v):.3f} ({v[0]:.3f}-{v[-1]:.3f})" if v else "-"


def alerts_table(rows: list[dict], args) -> str:
    seeds = sorted({r["seed"] for r in rows})
    decisions = [("firing", f"the rule as run (fire_at {args.fire_at:g})")]
    for t in args.alert_thresholds:
        for r in rows:
            r[f"p>={t:g}"] = r["probability"] >= t
        decisions.append((f"p>={t:g}", f"P(yes) >= {t:g}"))
    lines = []
    for key, label in decisions:
        per = [recall_precision([r for r in rows if r["seed"] == s], key) for s in seeds]
        red = [recall_precision([r for r in rows if r["seed"] == s and r["colour"] == "red"], key) for s in seeds]
        total = recall_precision(rows, key)
        lines.append(f"| {label} | {_mmm([p[0] for p in per])} | {_mmm([p[1] for p in per])} | "
                     f"{_mmm([total[0]])} | {_mmm([total[1]])} | {_mmm([p[0] for p in red])} | "
                     f"{_mmm([p[1] for p in red])} |")
    checks = len(rows)
    wanted = rows[0]["checks_wanted"] * len(seeds) if rows else 0
    truths = sum(r["truth"] for r in rows)
    per_stream = "; ".join(f"{s}: recall {p[0]:.2f} precision {p[1]:.2f} ({p[2]} yes, {p[3]} firing)"
                           for s, p in zip(seeds, [recall_precision([r for r in rows if r["seed"] == s]) for s in seeds])
                           if p[0] is not None and p[1] is not None)
    return (f"\nAlert rules on {len(seeds)} held-out live-world streams of {args.alert_seconds:.0f} s (seeds "
            f"{seeds[0]}+), window {args.accuracy_window:.0f} s, one rule per colour ({len(PALETTE)}: "
            f"\"{QUESTION}\") checked every {args.alert_every:g} s of stream; {checks} checks of {wanted} due "
            f"({truths} with the colour in view). Truth: the colour is in view in the session's newest sampled frame. "
            f"Per stream: median (min-max).\n\n"
            "| decision | recall per stream | precision per stream | recall, all | precision, all | "
            "red rule: recall per stream | red rule: precision per stream |\n|---|---|---|---|---|---|---|\n"
            + "\n".join(lines) + f"\n\nPer stream (P(yes) >= {args.fire_at:g}): {per_stream}.\n")
