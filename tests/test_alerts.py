"""Alert rules (sparrow/live/alerts.py, sparrow/live/rules.py): the state machine on stub
probabilities, the rule lifecycle on a running session, P(yes) equal to the target's own
forward, the webhook sink against a loopback HTTP server, and an alert on the committed live
target that fires where the condition holds."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from sparrow.live.alerts import AlertRule, AlertState, Incident, yes_no_ids, yes_probability
from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.errors import InvalidRequest
from sparrow.live.session import LiveSession
from sparrow.live.window import LiveConfig
from sparrow.tiny import synthetic_frames, tiny_target
from sparrow.video import VideoOptions
from sparrow.video.options import Frames

OPTIONS = VideoOptions(min_pixels=28 * 28, max_pixels=84 * 112)


def run(state: AlertState, probs: list[float], every_s: float = 1.0) -> list[tuple[int, str]]:
    """(check index, incident kind) for a sequence of stub probabilities, one check a second."""
    out = []
    for i, p in enumerate(probs):
        check = state.observe(p, max(0.0, i * every_s - 4), (i + 1) * every_s)
        assert check.active == state.active
        if check.incident is not None:
            out.append((i, check.incident.kind))
    return out


# ----- the state machine ----------------------------------------------------------------------------
def test_threshold_fires_and_clears_on_the_probability():
    rule = AlertRule("r", "is a red shape in view ?", fire_at=0.3)
    # 0.4 is a greedy "no" (P(no) = 0.6) and still fires at a threshold of 0.3.
    assert run(AlertState(rule), [0.1, 0.29, 0.4, 0.9, 0.31, 0.2, 0.05, 0.5]) == [(2, "fired"), (5, "cleared"),
                                                                                    (7, "fired")]
    state = AlertState(rule)
    check = state.observe(0.75, 2.0, 6.0, source_pts_s=106.0, wall_time_s=1.7e9)
    assert check.incident == Incident("r", "fired", 0.75, 2.0, 6.0, "is a red shape in view ?", 106.0, 1.7e9)


def test_hysteresis_band_and_consecutive_checks():
    band = AlertRule("r", "q ?", fire_at=0.7, clear_at=0.3)
    # Between 0.3 and 0.7 a clear rule stays clear and a firing one stays firing: no flapping.
    assert run(AlertState(band), [0.6, 0.8, 0.5, 0.4, 0.65, 0.31, 0.29, 0.6, 0.69, 0.71]) == [
        (1, "fired"), (6, "cleared"), (9, "fired")]
    consecutive = AlertRule("r", "q ?", fire_at=0.5, fire_after=3, clear_after=2)
    # One high check between lows never fires; three in a row do; one low between highs never clears.
    assert run(AlertState(consecutive), [0.9, 0.1, 0.9, 0.9, 0.1, 0.9, 0.9, 0.9, 0.1, 0.9, 0.1, 0.1, 0.9]) == [
        (7, "fired"), (11, "cleared")]


def test_cooldown_holds_back_a_new_firing():
    rule = AlertRule("r", "q ?", fire_at=0.5, cooldown_s=10.0)
    # Fired at end_s 1; cleared at 3; high again from 4 on: it may fire again at end_s >= 11.
    probs = [0.9, 0.9, 0.1] + [0.9] * 10
    assert run(AlertState(rule), probs) == [(0, "fired"), (2, "cleared"), (10, "fired")]
    state = AlertState(rule)
    run(state, [0.9])
    # A replaced rule keeps its firing state and cooldown: its next incident is the clear.
    state.replace(AlertRule("r", "is a blue shape in view ?", fire_at=0.8, cooldown_s=10.0))
    assert state.active
    check = state.observe(0.6, 1.0, 2.0)
    assert check.incident.kind == "cleared" and check.incident.question == "is a blue shape in view ?"


def test_bad_rules_and_probabilities_are_refused():
    for kwargs in (dict(every_s=0), dict(fire_at=0.0), dict(fire_at=1.5), dict(clear_at=0.9), dict(fire_after=0),
                   dict(clear_after=1.5), dict(cooldown_s=-1), dict(every_s=float("nan"))):
        with pytest.raises(InvalidRequest):
            AlertRule("r", "q ?", **{"fire_at": 0.5, **kwargs})
    for rule_id, question in (("", "q ?"), ("x" * 129, "q ?"), ("r", "  ")):
        with pytest.raises(InvalidRequest):
            AlertRule(rule_id, question)
    with pytest.raises(InvalidRequest):
        AlertState(AlertRule("r", "q ?")).observe(1.2, 0.0, 1.0)


def test_yes_probability_among_the_yes_and_no_tokens():
    assert yes_probability((0.2, 0.1, 0.1), 1) == pytest.approx(0.2 / 0.4)
    assert yes_probability((0.2, 0.1, 0.1), 2) == pytest.approx(0.3 / 0.4)
    assert yes_probability((0.0, 0.0), 1) == 0.0


# ----- on a running session ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    eng = Engine(tiny_target("qwen2_5_vl", seed=3), spec=SpecConfig(method="none"))
    yield eng
    eng.close()


def _collect(events: list, lock: threading.Lock):
    def on_event(event):
        with lock:
            events.append(event)
    return on_event


def _wait_checks(events, lock, rule_id: str, n: int, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with lock:
            checks = [e.check for e in events if e.kind == "check" and e.question_id == rule_id]
        if len(checks) >= n:
            return checks
        time.sleep(0.02)
    raise AssertionError(f"{len(checks)} checks of {rule_id}, wanted {n}")


def test_rule_lifecycle_mid_session(engine):
    events, lock = [], threading.Lock()
    session = LiveSession(engine, LiveConfig(window_s=60, max_lag_s=100, options=OPTIONS),
                          on_event=_collect(events, lock))
    frames, times = synthetic_frames(24, 84, 112, seed=1), np.arange(24) / 2.0
    session.push_frames(frames[:4], times[:4])           # 2 s of stream
    session.wait_ingested(60)
    alerts = session.alerts
    # Created mid-session: checked every 2 s of stream from the window's end (2 s) on.
    assert alerts.add(AlertRule("red", "is a red shape in view ?", every_s=2.0, fire_at=0.01)) == "red"
    alerts.add(AlertRule("blue", "is a blue shape in view ?", every_s=4.0, fire_at=0.99))
    with pytest.raises(InvalidRequest, match="exists already"):
        alerts.add(AlertRule("red", "again ?"))
    assert [r.rule_id for r in alerts.list()] == ["red", "blue"]
    session.push_frames(frames[4:12], times[4:12])       # to 6 s: red due at 4, 6; blue at 6
    session.wait_ingested(60)
    red = _wait_checks(events, lock, "red", 2)
    blue = _wait_checks(events, lock, "blue", 1)
    assert [c.end_s for c in red] == [4.0, 6.0] and [c.end_s for c in blue] == [6.0]
    # fire_at 0.01 fires at the first check; 0.99 on a random tiny model does not.
    assert red[0].incident is not None and red[0].incident.kind == "fired" and red[1].incident is None
    assert alerts.active("red") and not alerts.active("blue")
    # Replaced: the new question and threshold apply from the next check; still firing until it clears.
    alerts.replace(AlertRule("red", "is a green shape in view ?", every_s=2.0, fire_at=0.995, clear_at=0.99))
    with pytest.raises(InvalidRequest, match="no alert rule"):
        alerts.replace(AlertRule("nope", "q ?"))
    assert alerts.list()[0].question == "is a green shape in view ?"
    assert alerts.remove("blue") and not alerts.remove("blue")
    session.push_frames(frames[12:16], times[12:16])     # to 8 s: only red is due
    session.wait_ingested(60)
    red = _wait_checks(events, lock, "red", 3)
    assert red[2].end_s == 8.0 and red[2].incident.kind == "cleared"
    assert red[2].incident.question == "is a green shape in view ?"
    assert len(_wait_checks(events, lock, "blue", 1)) == 1
    assert [r.rule_id for r in alerts.list()] == ["red"]
    session.close()
    with pytest.raises(InvalidRequest, match="closed"):
        alerts.add(AlertRule("late", "q ?"))
    assert alerts.list() == []


def test_check_probability_is_the_target_forward(engine):
    """A check's P(yes) is the target's next-token distribution after the question about the
    window: the same as HF's forward over the same frames prefilled in one shot."""
    target = engine.target
    events, lock = [], threading.Lock()
    session = LiveSession(engine, LiveConfig(window_s=60, max_lag_s=100, options=OPTIONS),
                          on_event=_collect(events, lock))
    question = "is a red shape in view ?"
    session.alerts.add(AlertRule("r", question, every_s=3.0))
    frames = synthetic_frames(6, 84, 112, seed=5)
    session.push_frames(frames, np.arange(6) / 2.0)
    session.wait_ingested(60)
    check = _wait_checks(events, lock, "r", 1)[0]
    session.close()
    assert (check.start_s, check.end_s) == (0.0, 3.0)
    inputs = engine.prepare(Frames(frames, np.arange(6) / 2.0, 2.0, OPTIONS), question, OPTIONS)
    with torch.no_grad():
        logits = target.hf(**inputs).logits[0, -1].float()
    yes, no = yes_no_ids(target.tokenizer)
    probs = torch.softmax(logits, -1)[list(yes + no)].tolist()
    assert check.probability == pytest.approx(yes_probability(tuple(probs), len(yes)), abs=1e-4)


# ----- the webhook sink ---------------------------------------------------------------------------------
def test_webhook_receives_each_incident_exactly_once():
    """Bodies POSTed off the caller's thread; a 503 is retried, so every incident arrives, once."""
    from webhook_recorder import Recorder

    from sparrow.services.live.webhook import WebhookConfig, WebhookSink

    with Recorder(fail_first=2) as recorder:
        sink = WebhookSink(recorder.url, WebhookConfig(backoff_s=0.01))
        ids = [sink.post({"rule_id": "r", "kind": "fired" if i % 2 == 0 else "cleared", "n": i}) for i in range(6)]
        sink.close()
        assert len(set(ids)) == 6
        assert [b["incident_id"] for b in recorder.accepted] == ids            # each once, in order
        assert recorder.keys == ids and [b["n"] for b in recorder.accepted] == list(range(6))
        assert len(recorder.refused) == 2 and sink.counts == {"sent": 6, "dropped": 0, "failed": 0, "retries": 2}
        with pytest.raises(RuntimeError, match="closed"):
            sink.post({"rule_id": "r"})


def test_webhook_queue_is_bounded_and_an_unreachable_receiver_gives_up():
    import socket

    from sparrow.services.live.webhook import WebhookConfig, WebhookSink

    with socket.socket() as s:              # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = WebhookSink(f"http://127.0.0.1:{port}/hook", WebhookConfig(max_queue=2, attempts=2, backoff_s=0.01,
                                                                       timeout_s=0.5, flush_s=10))
    for i in range(20):
        sink.post({"n": i})
    sink.close()
    c = sink.counts
    assert c["sent"] == 0 and c["failed"] >= 1 and c["failed"] + c["dropped"] == 20 and c["dropped"] >= 17


# ----- the committed live target ----------------------------------------------------------------------------
def test_an_alert_fires_on_a_live_world_stream_where_the_condition_holds():
    """The committed live target (models/live/target) on a held-out live-world stream: the rule
    "is a red shape in view ?", checked every second of stream, fires at each of the two red
    visits in the first 30 s of this stream, while red is in view, and clears after each: both
    red circles turn orange before they leave (the palette's closest pair), and the rule clears
    then (BENCHMARKS.md has recall and precision on five streams)."""
    from benchmarks.alert_recall import alert_stream, recall_precision
    from sparrow.models.target import TargetModel

    engine = Engine(TargetModel.from_pretrained("models/live/target"), spec=SpecConfig(method="none"))
    rows = alert_stream(engine, seed=424247, seconds=30, window_s=12, every_s=1.0, colours=("red",))
    engine.close()
    assert len(rows) == 30
    recall, precision, true_cases, firing = recall_precision(rows)
    assert true_cases >= 6, rows
    firing = [r["firing"] for r in rows]
    fired = [r for r, before in zip(rows, [False, *firing]) if r["firing"] and not before]
    cleared = [r for r, before in zip(rows, [False, *firing]) if before and not r["firing"]]
    assert len(fired) == 2 and all(r["truth"] for r in fired), rows       # each visit, while red is in view
    assert len(cleared) == 2 and not rows[-1]["firing"], rows
    assert recall >= 0.9 and precision >= 0.9, (recall, precision, rows)
