"""Serving turns and the path tuner's timed calls take turns (sparrow/tuning_gate.py): never
beside each other, the tuner's share of a busy engine bounded, every wait bounded."""

from __future__ import annotations

import threading
import time

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow import tuning_gate
from sparrow.kernels import autotune
from sparrow.tuning_gate import TuningGate
from sparrow.scheduler import Scheduler
from sparrow.tiny import tiny_draft

PROMPT = "What happens in the video?"


def overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list:
    return [(x, y) for x in a for y in b if x[0] < y[1] and y[0] < x[1]]


def test_turns_and_timed_calls_never_overlap_and_the_tuner_keeps_its_share():
    gate, turns, calls = TuningGate(share=0.25), [], []

    def serve():
        for _ in range(40):
            with gate.serving():
                t0 = time.perf_counter()
                time.sleep(0.004)
                turns.append((t0, time.perf_counter()))

    def tune():
        for _ in range(6):
            with gate.tuning():
                t0 = time.perf_counter()
                time.sleep(0.004)
                calls.append((t0, time.perf_counter()))
    threads = [threading.Thread(target=serve), threading.Thread(target=tune)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(turns) == 40 and len(calls) == 6
    assert not overlaps(turns, calls), "a timed call ran beside a serving turn"
    assert gate.stats["turns_waited"] >= 1                   # the tuner got its calls in between turns
    busy_calls = sum(b - a for a, b in calls)
    # after each call made while serving was busy, a pause of 3x its length (share 0.25)
    assert gate.stats["paused_s"] >= 0.9 * 3 * busy_calls * (gate.stats["calls"] - 1) / gate.stats["calls"]


def test_an_idle_engine_lets_the_tuner_run_unpaused():
    gate = TuningGate(share=0.25)
    for _ in range(5):
        with gate.tuning():
            time.sleep(0.002)
    assert gate.stats["paused_s"] == 0.0 and gate.stats["calls"] == 5


def waited_beside(gate: TuningGate, holder, waiter) -> float:
    """Seconds `waiter` (a gate's context) took to enter while another thread held `holder`
    (the other one) and never let go."""
    release = threading.Event()

    def hold():
        with holder(gate):
            release.wait(5)
    t = threading.Thread(target=hold)
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    with waiter(gate):
        waited = time.perf_counter() - t0
    release.set()
    t.join(5)
    return waited


def test_every_wait_is_bounded():
    """A timed call that hangs holds a turn back at most max_wait_s; a turn that never ends holds
    the tuner back at most max_wait_s."""
    gate = TuningGate(max_wait_s=0.2)
    assert 0.15 < waited_beside(gate, TuningGate.tuning, TuningGate.serving) < 1.0
    assert 0.15 < waited_beside(gate, TuningGate.serving, TuningGate.tuning) < 1.0


def test_a_call_made_inside_a_turn_does_not_wait_on_itself():
    gate = TuningGate(max_wait_s=1.0)
    with gate.serving():
        t0 = time.perf_counter()
        with gate.tuning():
            pass
        assert time.perf_counter() - t0 < 0.1


def test_an_engine_serving_while_a_tuner_measures_never_shares_the_device(qwen_target, small_video, monkeypatch):
    """The scheduler's turns (its decode steps here) and a tuner's timed calls, on the real engine:
    no overlap, and the answer is the plain engine's."""
    monkeypatch.setattr(autotune, "ENABLED", True)
    monkeypatch.setattr(tuning_gate, "GATE", TuningGate())
    monkeypatch.setattr("sparrow.scheduler.TUNING_GATE", tuning_gate.GATE)
    monkeypatch.setattr(autotune, "GATE", tuning_gate.GATE)
    steps, calls = [], []
    real = Scheduler._decode_step

    def timed_step(self):
        t0 = time.perf_counter()
        try:
            return real(self)
        finally:
            steps.append((t0, time.perf_counter()))
    monkeypatch.setattr(Scheduler, "_decode_step", timed_step)

    def bench():
        def run():
            t0 = time.perf_counter()
            x = time.perf_counter()
            while time.perf_counter() - x < 0.002:
                pass
            calls.append((t0, time.perf_counter()))
        return lambda name: run
    sampling = SamplingParams(max_new_tokens=160, ignore_eos=True)
    expected = Engine(qwen_target, spec=SpecConfig(method="none")).generate(small_video, PROMPT, sampling).token_ids
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=4), SpecConfig(num_draft_tokens=3, adaptive_k=False))
    tuner = autotune.PathTuner("gate-test", lambda: None, lambda: None)
    gen = engine.stream(small_video, PROMPT, sampling)
    tokens = []
    for delta in gen:
        if not tokens:
            assert tuner.choice(("k",), ("x", "y"), bench) is None      # queued while the stream runs
        tokens += delta.token_ids
    assert tuner.wait(60)
    assert tokens == expected
    assert calls and steps
    assert not overlaps(steps, calls), "a timed call ran beside a decode step"
    assert tuning_gate.GATE.stats["turns_waited"] + (tuning_gate.GATE.stats["paused_s"] > 0) >= 1, \
        "the measurement never met the stream: the test showed nothing"
