"""Attention paths chosen by measurement (kernels/autotune.py, kernels/packed.py): the fastest
path serves once measured, a first use never waits on the measurement, choices are kept for the
next process, an environment variable forces one, and every path is exact."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_kernels import FP32

import sparrow.kernels.packed as packed
from sparrow.kernels import autotune
from sparrow.kernels.reference import verify_attention_ref


def _slow_and_fast(slow_ms: float):
    def bench():
        return lambda name: (lambda: time.sleep(slow_ms / 1e3)) if name == "slow" else (lambda: None)
    return bench


def test_the_fastest_path_serves_once_measured_and_a_first_use_never_waits(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "ENABLED", True)
    store = tmp_path / "choices.json"
    tuner = autotune.PathTuner("test", lambda: store)
    release = threading.Event()

    def held_bench():                 # the measurement cannot start until the test lets it
        assert release.wait(30)
        return _slow_and_fast(20)()
    assert tuner.choice(("k", 1), ("slow", "fast"), held_bench) is None     # queued, not waited on
    assert not tuner.wait(0.05)       # still measuring when the choice came back
    release.set()
    assert tuner.wait(30)
    assert tuner.choice(("k", 1), ("slow", "fast"), _slow_and_fast(20)) == "fast"
    times = tuner.times(("k", 1), ("slow", "fast"))
    assert times["slow"] > 15 > times["fast"]
    # another shape, the other way round: measured, not assumed
    assert tuner.choice(("k", 2), ("fast", "slow"), _slow_and_fast(20)) is None
    assert tuner.wait(30) and tuner.choice(("k", 2), ("fast", "slow"), _slow_and_fast(20)) == "fast"
    # the next process starts with the choices (and never times them again)
    again = autotune.PathTuner("test", lambda: store)
    never = lambda: pytest.fail("a kept choice was timed again")   # noqa: E731
    assert again.choice(("k", 1), ("slow", "fast"), never) == "fast"
    # a candidate set the kept choice was not made among is measured afresh
    assert again.choice(("k", 1), ("slow", "fast", "new"), _slow_and_fast(20)) is None
    again.stop()
    tuner.stop()


def test_a_forced_path_wins_where_it_can_serve(monkeypatch):
    monkeypatch.setattr(autotune, "FORCED", "slow")
    tuner = autotune.PathTuner("test", lambda: None)
    never = lambda: pytest.fail("a forced path is not timed")   # noqa: E731
    assert tuner.choice(("k",), ("slow", "fast"), never) == "slow"
    assert tuner.choice(("k",), ("fast", "other"), never) is None       # not a candidate: the default serves


@pytest.mark.parametrize("nq,prefix", [(1, 300), (5, 300), (13, 2100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_is_exact(nq, prefix, dtype):
    g = torch.Generator().manual_seed(nq)
    q = torch.randn(1, 8, nq, 32, generator=g).to(dtype)
    k = torch.randn(1, 2, prefix + nq, 32, generator=g).to(dtype)
    v = torch.randn(1, 2, prefix + nq, 32, generator=g).to(dtype)
    lens = torch.tensor([prefix])
    want = verify_attention_ref(q.float(), k.float(), v.float(), lens)
    bias = packed.own_bias(None, nq, 4, q.device) if nq > 1 else None
    tol = FP32 if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for path in packed.cpu_paths():
        got = packed.run_path(path, q, k, v, prefix, bias, 32 ** -0.5)
        torch.testing.assert_close(got.float(), want, **tol, msg=lambda m: f"{path}: {m}")


def test_packed_attention_serves_the_measured_path(monkeypatch):
    """Through packed_attention: the first call serves the rule's path, the worker measures every
    path of the shape, and later calls take the fastest one; the output is the reference's."""
    monkeypatch.setattr(autotune, "ENABLED", True)
    monkeypatch.setattr(packed, "TUNER", autotune.PathTuner("verify attention (test)", lambda: None))
    served: list[str] = []
    real = packed.run_path
    monkeypatch.setattr(packed, "run_path", lambda path, *a: served.append(path) or real(path, *a))
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 8, 5, 32, generator=g), torch.randn(1, 2, 905, 32, generator=g), \
        torch.randn(1, 2, 905, 32, generator=g)
    want = verify_attention_ref(q, k, v, torch.tensor([900]))
    torch.testing.assert_close(packed.packed_attention(q, k, v, 900), want, **FP32)
    assert served[0] == packed.default_path(q, 900)
    assert packed.TUNER.wait(60)
    key = packed.shape_key(q, k, 900)
    times = packed.TUNER.times(key, packed.cpu_paths())
    assert set(times) == set(packed.cpu_paths())
    served.clear()
    torch.testing.assert_close(packed.packed_attention(q, k, v, 900), want, **FP32)
    assert served == [min(times, key=times.get)]
    packed.TUNER.stop()


def test_inputs_are_copied_only_when_a_measurement_is_queued(tmp_path, monkeypatch):
    """snapshot runs on the caller's thread once, when the shape is queued; never for a known,
    pending or forced shape; its value is what the bench times on."""
    monkeypatch.setattr(autotune, "ENABLED", True)
    tuner = autotune.PathTuner("test", lambda: None)
    copies: list[int] = []
    got: list[object] = []

    def bench(inputs):
        got.append(inputs)
        return _slow_and_fast(20)()
    for _ in range(3):
        tuner.choice(("k",), ("slow", "fast"), bench, lambda: copies.append(1) or "copied")
    assert tuner.wait(30) and copies == [1] and got == ["copied"]
    assert tuner.choice(("k",), ("slow", "fast"), bench, lambda: pytest.fail("copied again")) == "fast"
    forced = autotune.PathTuner("test", lambda: None, lambda: "slow")
    assert forced.choice(("k",), ("slow", "fast"), bench, lambda: pytest.fail("copied for a forced path")) == "slow"
    tuner.stop()


def test_two_tuners_on_one_file_keep_each_others_choices(tmp_path, monkeypatch):
    """A second tuner (or process) saving its choices leaves the first one's in the file."""
    monkeypatch.setattr(autotune, "ENABLED", True)
    store = tmp_path / "choices.json"
    a, b = autotune.PathTuner("a", lambda: store), autotune.PathTuner("b", lambda: store)
    a.forget()
    b.forget()                        # neither read the file: each saves only what it measured
    a.measure(("a",), ("slow", "fast"), _slow_and_fast(20))
    b.measure(("b",), ("fast", "slow"), _slow_and_fast(20))
    again = autotune.PathTuner("c", lambda: store)
    never = lambda: pytest.fail("a kept choice was timed again")   # noqa: E731
    assert again.choice(("a",), ("slow", "fast"), never) == "fast"
    assert again.choice(("b",), ("fast", "slow"), never) == "fast"


def test_a_tuner_with_its_own_override_ignores_the_attention_one(monkeypatch):
    monkeypatch.setattr(autotune, "FORCED", "slow")
    monkeypatch.setattr(autotune, "ENABLED", False)
    own = autotune.PathTuner("test", lambda: None, lambda: None)
    assert own.choice(("k",), ("slow", "fast"), lambda: pytest.fail("timed")) is None


def test_a_cpu_time_clock_does_not_charge_waiting(monkeypatch):
    """With time.thread_time a path that waits (a sleep, a GIL held by another thread) is charged
    only its own work: a 30 ms sleep beats 5 ms of computing; by the wall clock it loses."""
    def spin():
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.005:
            pass

    def bench():
        return lambda name: (lambda: time.sleep(0.03)) if name == "waits" else spin
    by_cpu = autotune.PathTuner("test", lambda: None, lambda: None, time.thread_time)
    by_wall = autotune.PathTuner("test", lambda: None, lambda: None)
    assert by_cpu.measure(("k",), ("waits", "works"), bench) == "waits"
    assert by_wall.measure(("k",), ("waits", "works"), bench) == "works"


def test_two_tuners_never_measure_at_once(monkeypatch):
    """Every tuner's measurements go through one worker, one at a time: a measurement is never
    timed under another's load."""
    monkeypatch.setattr(autotune, "ENABLED", True)
    spans: list[tuple[str, float, float]] = []

    def bench(tag):
        def run():
            t0 = time.perf_counter()
            time.sleep(0.002)
            spans.append((tag, t0, time.perf_counter()))
        return lambda: (lambda name: run)
    a = autotune.PathTuner("a", lambda: None, lambda: None)
    b = autotune.PathTuner("b", lambda: None, lambda: None)
    assert a.choice(("k",), ("x", "y"), bench("a")) is None
    assert b.choice(("k",), ("x", "y"), bench("b")) is None
    assert a.wait(60) and b.wait(60)
    first = {tag: min(t0 for t, t0, _ in spans if t == tag) for tag in "ab"}
    last = {tag: max(t1 for t, _, t1 in spans if t == tag) for tag in "ab"}
    assert last["a"] <= first["b"] or last["b"] <= first["a"], "two measurements ran at once"


def test_a_timing_reads_its_keys_cold(monkeypatch):
    """packed._bench's runners take the next of several caches each call, as many as fill
    cold_bytes() (twice the last-level cache): a timing sees keys coming from memory, as a serving
    step over many requests and layers does, not the cache the last call left warm. The copies
    hold the same values, so every call computes the same output."""
    monkeypatch.setattr(packed, "cold_bytes", lambda: 1 << 20)
    seen, outs = [], []
    real = packed.run_path

    def spy(name, q, k, v, prefix_len, bias, scale):
        seen.append((k.data_ptr(), v.data_ptr()))
        return real(name, q, k, v, prefix_len, bias, scale)

    monkeypatch.setattr(packed, "run_path", spy)
    nq, prefix = 5, 1000                     # a set: 2 x (2 kv heads x 1005 keys x 32) fp32 = 514 KB
    run = packed._bench((1, 4, nq, 32), (1, 2, prefix + nq, 32), torch.float32, prefix)("dense")
    for _ in range(6):
        outs.append(run())
    per_set = 2 * 2 * (prefix + nq) * 32 * 4
    sets = -(-(1 << 20) // per_set)
    assert sets == 3 and len(set(seen)) == sets and seen[:sets] == seen[sets:]
    assert len({k for k, _ in seen} | {v for _, v in seen}) == 2 * sets        # no two share memory
    assert all(torch.equal(o, outs[0]) for o in outs)
    monkeypatch.setattr(packed, "cold_bytes", lambda: 1 << 40)
    seen.clear()
    run = packed._bench((1, 4, 1, 32), (1, 2, 2, 32), torch.float32, 1)("dense")
    for _ in range(packed.COLD_SETS + 1):
        run()
    assert len(set(seen)) == packed.COLD_SETS                               # capped


EXIT_PROBE = """
import time, torch
from sparrow.kernels import autotune
t = autotune.tuner("exit-probe", lambda: None)
a = torch.randn(1200, 1200)
ran = []
def bench():
    return lambda name: (lambda: ran.append(name) or a @ a @ a @ a)
t.choice(("k",), ("x", "y", "z"), bench)
while not ran:
    time.sleep(0.01)
print("exiting", flush=True)
"""


def test_a_process_ending_during_a_measurement_exits_cleanly():
    """A tuner measuring (seconds at a long shape) when its process ends stops before its next
    timed call and the exit waits for the one under way: torch's teardown under a running op
    aborted the process (SIGABRT, 'terminate called without an active exception')."""
    import os
    import subprocess
    import sys

    t0 = time.monotonic()
    env = {**os.environ, "SPARROW_AUTOTUNE": "1"}          # the suite's default is off (conftest)
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "exiting" and "terminate" not in done.stderr
    assert time.monotonic() - t0 < 60
