"""The background compiler (sparrow.models.background_compile): a shape compiles only once hot,
on a copy of the caller's arguments, under the caller's grad / inference mode, never making
the caller wait; a failing compile leaves the shape eager. (The draft's "auto" steps through
it, compiled == eager token for token: tests/test_draft_compiled.py.)"""

import threading

import torch

from sparrow.models.background_compile import BackgroundCompiler


def test_a_shape_compiles_once_it_is_hot_on_copies_of_the_callers_arguments():
    seen, gate = [], threading.Event()

    def compile_call(buf, pair):
        gate.wait(10)
        seen.append((buf, pair, torch.is_inference_mode_enabled(), threading.current_thread().name))
        buf.add_(1)

    bg = BackgroundCompiler(hot=3)
    buf, pair = torch.zeros(4), (torch.ones(2), 5)
    with torch.inference_mode():
        for _ in range(2):
            bg.offer("s", compile_call, (buf, pair))
        assert not seen and bg.wait(0)                       # not hot yet: nothing queued
        bg.offer("s", compile_call, (buf, pair))             # the third call: queued, the caller goes on
    assert not bg.wait(0.05) and not bg.ready("s")           # compiling (held at the gate) while the caller runs
    gate.set()
    assert bg.wait(10) and bg.ready("s")
    (got, got_pair, inference, thread), = seen
    assert thread == "sparrow-compile" and inference
    assert got is not buf and got_pair[0] is not pair[0] and got_pair[1] == 5
    assert torch.equal(buf, torch.zeros(4)) and torch.equal(got, torch.ones(4))    # the caller's buffer untouched
    bg.offer("s", compile_call, (buf, pair))
    assert bg.wait(1) and len(seen) == 1                     # compiled once


def test_a_failed_compile_leaves_the_shape_eager_and_the_worker_serving():
    compiled = []

    def broken(x):
        raise RuntimeError("no compiler")

    bg = BackgroundCompiler(hot=1, on_compiled=lambda key, s: compiled.append(key))
    bg.offer("bad", broken, (torch.zeros(1),))
    assert bg.wait(10) and not bg.ready("bad") and "no compiler" in str(bg.failed("bad"))
    bg.offer("good", lambda x: None, (torch.zeros(1),))
    assert bg.wait(10) and bg.ready("good") and compiled == ["good"] and bg.failed("good") is None
