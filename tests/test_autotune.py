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
