"""Prefill's share of the scheduler thread while streams decode (sparrow/pacing.py): strict
alternation without a burst, consecutive slices within the stated bound with one, at most the
share sustained, and nothing charged while no stream decodes."""

from __future__ import annotations

import random

import pytest

from sparrow.pacing import PrefillPacer


def drive(pacer: PrefillPacer, slices: list[float], step_s: float) -> list[tuple[str, float, float]]:
    """A scheduler's turns on a virtual clock, streams decoding throughout: a slice runs when the
    pacer lets it (the next one of `slices`), else a decode step of step_s. Returns the timeline
    (kind, start, end)."""
    now, timeline, todo = 0.0, [], list(slices)
    while todo:
        if pacer.may_run(now, True):
            s = todo.pop(0)
            pacer.ran(now, now + s, True)
            timeline.append(("slice", now, now + s))
            now += s
        else:
            timeline.append(("step", now, now + step_s))
            now += step_s
    return timeline


def longest_prefill_run(timeline) -> float:
    run = best = 0.0
    for kind, start, end in timeline:
        run = run + end - start if kind == "slice" else 0.0
        best = max(best, run)
    return best


def test_without_a_burst_a_slice_waits_its_share_as_before():
    """burst 0: after a slice of s the next may run s x (1 - share) / share later, not sooner (the
    scheduler's rule before the balance), and never two slices back to back."""
    for share in (0.25, 0.5, 0.8):
        pacer = PrefillPacer(share, 0.0)
        assert pacer.may_run(10.0, True)
        pacer.ran(10.0, 10.1, True)
        wait = 0.1 * (1 - share) / share
        assert not pacer.may_run(10.1 + wait - 1e-6, True)
        assert pacer.may_run(10.1 + wait + 1e-6, True)
        timeline = drive(PrefillPacer(share, 0.0), [0.03] * 40, 0.01)
        assert longest_prefill_run(timeline) == pytest.approx(0.03)


def test_a_burst_runs_slices_back_to_back_within_the_stated_bound():
    """A pacer that has not been used lately lets slices run back to back, at most
    burst_s / (1 - share) + one slice (EngineConfig.prefill_burst_s), and then alternates."""
    rng = random.Random(7)
    for _ in range(200):
        share, burst = rng.choice((0.25, 0.5, 0.75)), rng.uniform(0.0, 0.2)
        slices = [rng.uniform(0.005, 0.1) for _ in range(rng.randint(1, 30))]
        timeline = drive(PrefillPacer(share, burst), slices, rng.uniform(0.002, 0.05))
        assert longest_prefill_run(timeline) <= burst / (1 - share) + max(slices) + 1e-9
    burst_of_eight = drive(PrefillPacer(0.5, 0.05), [0.012] * 8, 0.03)      # 8 question rests of 12 ms
    assert [kind for kind, *_ in burst_of_eight[:9]].count("step") <= 1


def test_sustained_prefill_gets_at_most_its_share():
    """A backlog of slices for 100 s of virtual time: prefill's share of it is the configured
    share (plus what the burst lets it run ahead), whatever the burst."""
    for share in (0.3, 0.5):
        for burst in (0.0, 0.05, 0.5):
            timeline = drive(PrefillPacer(share, burst), [0.02] * 2500, 0.015)
            end = timeline[-1][2]
            prefill = sum(e - s for kind, s, e in timeline if kind == "slice")
            assert prefill <= share * end + burst + 0.02 + 1e-9
            assert prefill >= 0.8 * share * end        # and gets most of it (a decode step overshoots the wait)


def test_slices_while_nothing_decodes_are_free():
    pacer = PrefillPacer(0.5, 0.05)
    for t in range(20):                      # a long prefill alone: 20 slices of 0.4 s
        assert pacer.may_run(0.4 * t, False)
        pacer.ran(0.4 * t, 0.4 * (t + 1), False)
    assert pacer.may_run(8.0, True)          # the first stream's first turn: the balance is whole
    assert pacer.balance == pytest.approx(0.05)


def test_bad_settings_are_refused():
    for share, burst in ((0.0, 0.1), (1.5, 0.1), (0.5, -0.01)):
        with pytest.raises(ValueError):
            PrefillPacer(share, burst)
