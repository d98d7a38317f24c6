"""Many live sessions on one engine, served fairly (sparrow/live/session.py, live_questions.py, the
scheduler's round-robin tasks).

What must hold: a session's questions are bounded (in flight, then queued, then refused with
ResourceExhausted / RESOURCE_EXHAUSTED, the session going on) and the admitted ones are
answered as if asked alone; one session's backlog and burst of questions never delay another's
frames (the bystander's pairs are prefilled at their turn, and what it sees is the same with
and without the burst); a session's window is a slot of the engine's KV arena, so a session
that cannot get one is refused and its memory is the arena's again once it closes.

Determinism without timing: a "gate" task holds the scheduler thread while the test queues
work, so the order of what runs after it is fixed by the scheduler's rules alone.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from sparrow.config import EngineConfig, SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.errors import ResourceExhausted
from sparrow.live.session import LiveMemoryExhausted, LiveSession
from sparrow.live.window import LiveConfig
from sparrow.tiny import synthetic_frames
import test_live

OPTIONS, QUESTION = test_live.OPTIONS, test_live.QUESTION
target, engine = test_live.target, test_live.engine        # the live tests' fixtures: one tiny target, one engine
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def config(**kw) -> LiveConfig:
    return LiveConfig(**{"window_s": 60.0, "max_lag_s": 100.0, "options": OPTIONS, **kw})


def push(session: LiveSession, first: int, n: int, seed: int) -> None:
    """Frames first .. first + n - 1 of a 2 fps camera (n/2 pairs)."""
    frames = synthetic_frames(first + n, 84, 112, seed=seed)[first:]
    session.push_frames(frames, np.arange(first, first + n) / 2.0)


class Gate:
    """Holds the scheduler thread (a task) until opened."""

    def __init__(self, engine):
        self.entered, self.release = threading.Event(), threading.Event()
        self.done = engine.scheduler.call_soon(self._hold, key="gate")
        assert self.entered.wait(30)

    def _hold(self) -> None:
        self.entered.set()
        self.release.wait(60)

    def open(self) -> None:
        self.release.set()
        self.done.result(30)


def record_ingest(session: LiveSession, name: str, order: list) -> None:
    """Note each pair the session prefills, in the order the scheduler runs them."""
    window = session._window
    append = window.append

    def noted(pair):
        order.append((name, pair.index, pair.start_s, pair.end_s))
        append(pair)

    window.append = noted


def tokens(answer) -> list[int]:
    for _ in answer.generation:
        pass
    return answer.generation.output.token_ids


def test_questions_past_the_bound_are_refused_the_others_answered(engine):
    session = LiveSession(engine, config(), max_questions=2, max_queued_questions=3)
    push(session, 0, 4, seed=1)
    session.wait_ingested(60)
    alone = tokens(session.ask(QUESTION, GREEDY))                   # the answer when asked alone
    gate = Gate(engine)                                             # nothing is answered while we ask
    admitted, refused = [], []
    for i in range(9):
        try:
            admitted.append(session.ask(f"{QUESTION}", GREEDY, question_id=f"b{i}"))
        except ResourceExhausted as exc:
            refused.append((f"b{i}", str(exc)))
    stats = session.stats
    assert [a.question_id for a in admitted] == ["b0", "b1", "b2", "b3", "b4"]      # 2 in flight + 3 queued
    assert [qid for qid, _ in refused] == ["b5", "b6", "b7", "b8"]
    assert "refused" in refused[0][1] and "(2 and 3)" in refused[0][1]
    assert (stats.questions_queued, stats.questions_refused) == (3, 4)
    assert session.running_answers == 5
    gate.open()
    assert [tokens(a) for a in admitted] == [alone] * 5             # queued ones start as others end
    assert session.stats.questions_queued == 0 and session.running_answers == 0
    # The session went on: a new question after the burst is answered.
    assert tokens(session.ask(QUESTION, GREEDY)) == alone
    session.close()


def test_close_ends_queued_questions_without_starting_them(engine):
    session = LiveSession(engine, config(), max_questions=1, max_queued_questions=1)
    push(session, 0, 2, seed=1)
    session.wait_ingested(60)
    gate = Gate(engine)
    running, queued = session.ask(QUESTION, GREEDY), session.ask(QUESTION, GREEDY)
    assert queued.generation.request is None                         # not handed to the engine
    session.close()
    gate.open()
    with pytest.raises(Exception, match="closed before this question started"):
        tokens(queued)
    assert queued.generation.request is None
    for _ in running.generation:
        pass
    assert running.generation.output.finish_reason == "abort"


def _bystander_run(engine, burst: bool) -> tuple[list, list, tuple]:
    """Session A (maybe a burst: 12 pairs of backlog + 9 questions) and bystander B (2 pairs),
    queued while the scheduler is held. Returns the ingest order after the gate, B's pairs,
    and B's stats that say what it saw."""
    order: list = []
    a = LiveSession(engine, config(), max_questions=1, max_queued_questions=2)
    b = LiveSession(engine, config(max_lag_s=2.0))     # at most 2 pairs waiting, then B drops
    push(a, 0, 2, seed=1)
    push(b, 0, 2, seed=2)                              # each session's first pair sizes its window
    a.wait_ingested(60)
    b.wait_ingested(60)
    record_ingest(a, "a", order)
    record_ingest(b, "b", order)
    gate = Gate(engine)
    if burst:
        push(a, 2, 24, seed=1)
        for _ in range(9):
            try:
                a.ask(QUESTION, GREEDY)
            except ResourceExhausted:
                pass
    push(b, 2, 4, seed=2)
    gate.open()
    a.wait_ingested(120)
    b.wait_ingested(60)
    mine = [entry for entry in order if entry[0] == "b"]
    stats = b.stats
    seen = (stats.pairs_prefilled, stats.frames_dropped, stats.window_start_s, stats.window_end_s)
    a.close()
    b.close()
    return order, mine, seen


def test_a_burst_in_one_session_does_not_change_anothers_ingest(engine):
    quiet_order, quiet_b, quiet_seen = _bystander_run(engine, burst=False)
    order, busy_b, busy_seen = _bystander_run(engine, burst=True)
    # The bystander's frames: the same pairs at the same stream times, none dropped.
    assert busy_b == quiet_b == [("b", 1, 1.0, 2.0), ("b", 2, 2.0, 3.0)]
    assert busy_seen == quiet_seen and busy_seen[1] == 0
    # ... prefilled at their turn: A's 12 waiting pairs take turns with B's 2, not ahead of them.
    positions = [i for i, entry in enumerate(order) if entry[0] == "b"]
    assert positions == [1, 3], order
    assert [entry[1] for entry in order if entry[0] == "a"] == list(range(1, 13))   # A's in order
    assert len(order) == 14 and quiet_order == quiet_b


def test_scheduler_tasks_take_turns_by_key(engine):
    ran: list = []
    gate = Gate(engine)
    futures = [engine.scheduler.call_soon(lambda k=k, i=i: ran.append((k, i)), key=k)
               for k, n in (("x", 4), ("y", 2), ("z", 1)) for i in range(n)]
    gate.open()
    for f in futures:
        f.result(30)
    assert ran == [("x", 0), ("y", 0), ("z", 0), ("x", 1), ("y", 1), ("x", 2), ("x", 3)]


def test_live_window_is_a_slot_of_the_engines_kv_arena(target):
    probe = Engine(target, spec=SpecConfig(method="none"))
    session = LiveSession(probe, config(window_s=10.0))
    push(session, 0, 2, seed=1)
    capacity = session._slot.capacity
    arena = probe.runner.arena
    assert arena.free_tokens == arena.tokens - capacity                # the window is the arena's
    session.close()
    probe.scheduler.call_soon(lambda: None).result(30)                 # the release runs on the scheduler
    assert arena.free_tokens == arena.tokens
    probe.close()
    # An engine whose arena holds one window, not two.
    tight = Engine(target, spec=SpecConfig(method="none"),
                   config=EngineConfig(kv_cache_bytes=arena.bytes_per_token * (capacity + capacity // 2)))
    first = LiveSession(tight, config(window_s=10.0))
    push(first, 0, 2, seed=1)
    second = LiveSession(tight, config(window_s=10.0))
    with pytest.raises(LiveMemoryExhausted, match="KV memory"):
        push(second, 0, 2, seed=2)
    with pytest.raises(LiveMemoryExhausted):                          # refused for good
        push(second, 2, 2, seed=2)
    second.close()
    first.close()
    third = LiveSession(tight, config(window_s=10.0))                 # the first's memory is free again
    push(third, 0, 2, seed=3)
    third.wait_ingested(60)
    assert third.stats.pairs_prefilled == 1
    third.close()
    tight.close()


def test_service_refuses_a_burst_past_the_bound_with_resource_exhausted(tiny_model_dirs):
    from test_service_live import OPEN, Reader, make_server, prefilled

    from sparrow.services.client import SparrowClient
    from sparrow.services.protos import pb

    def refusals(responses) -> list[str]:
        return [r.event.question_id for r in responses if r.HasField("event")
                and r.event.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]

    with make_server(*tiny_model_dirs, max_live_questions=1, max_live_queued_questions=1) as server, \
            SparrowClient(server.address) as client, client.live(stats_every_s=0.1, **OPEN) as live:
        live.opened()
        reader = Reader(live)
        live.send_frames(synthetic_frames(4, 84, 112, seed=1), [0.0, 0.5, 1.0, 1.5])
        reader.until(prefilled(2))
        gate = Gate(server.service.engine)                  # the burst arrives while nothing is answered
        ids = [live.ask(QUESTION, question_id=f"q{i}", max_new_tokens=4, temperature=0.0) for i in range(8)]
        reader.until(lambda r: len(refusals(reader.seen)) == 6)
        gate.open()
        live.close()                                         # half-close: the answers finish, then OK
        reader.rest()
    responses = reader.seen
    done = [r.done for r in responses if r.HasField("done")]
    assert sorted(d.question_id for d in done) == ids[:2]               # 1 in flight + 1 queued: answered
    assert all(d.completion.finish_reason != pb.FINISH_REASON_ERROR and d.completion.usage.completion_tokens for d in done)
    assert refusals(responses) == ids[2:]
    event = next(r.event for r in responses if r.HasField("event") and r.event.question_id == "q2")
    assert event.kind == pb.LIVE_EVENT_KIND_ERROR and "refused" in event.message
    assert responses[-1].HasField("stats") and responses[-1].stats.final           # the session went on, ended OK
    assert responses[-1].stats.questions_refused == len(ids) - 2 and responses[-1].stats.questions_queued == 0


def test_per_session_lag_and_drops_in_metrics(engine):
    from sparrow.services import prom

    recorder = prom.Recorder(prom.PrometheusSink(), "tiny")

    def value(name: str, **labels) -> float | None:
        return recorder.sink.registry.get_sample_value(f"sparrow:{name}", {"model_name": "tiny", **labels})

    first, second = recorder.live_session(), recorder.live_session()
    session = LiveSession(engine, config(), max_questions=1)
    push(session, 0, 2, seed=1)
    session.wait_ingested(60)
    stats = session.stats
    first.update(stats)
    second.update(type(stats)(**{**{f: getattr(stats, f) for f in stats.__slots__},
                                 "lag_s": 3.5, "frames_dropped": 4, "questions_refused": 2}))
    assert value("live_session_lag_seconds", slot="0") == stats.lag_s
    assert (value("live_session_lag_seconds", slot="1"), value("live_session_frames_dropped", slot="1")) == (3.5, 4)
    assert value("live_questions_refused_total") == 2
    first.end("ok")
    assert value("live_session_lag_seconds", slot="0") == 0.0          # a free slot reads 0 ...
    third = recorder.live_session()                                    # ... and the next session takes it
    assert third.slot == 0
    third.end("ok")
    second.end("ok")
    session.close()
