"""The draft's levels chosen by measurement (kernels/draft_chain.py `serves`, through
kernels/autotune.py's PathTuner): the kernel serves a call first seen while the tuner's worker
times both paths on copies of its inputs; then the faster one serves (one path made slower on
purpose, each way round); the choice is kept in the tuner's file and a new tuner reads it; the
override (SPARROW_DRAFT_NATIVE: IMPL "torch" / "kernel") wins over a measured choice and is
never timed; and the engine's greedy output is the target's whichever path serves.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_draft_compiled import _fields, assert_same, run_steps
from test_draft_native import STATIC, _propose, draft, kernel  # noqa: F401 - fixtures

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.kernels import autotune, draft_chain

SLOW_MS = 20.0


def _spin(ms: float) -> None:
    """ms of this thread's CPU time (what the draft's tuner counts; a sleep costs none)."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < ms / 1e3:
        pass


@pytest.fixture
def tuned(kernel, monkeypatch, tmp_path):  # noqa: F811 - the fixture imported above
    """Measured paths (IMPL "auto", timing on) by a fresh tuner keeping its choices in tmp_path.
    Returns (tuner, store, served, slow): served records each kernel call by name; slow[0] names
    the path whose timed runs (the tuner's measurement only) spin SLOW_MS more."""
    monkeypatch.setattr(autotune, "ENABLED", True)
    monkeypatch.setattr(draft_chain, "IMPL", "auto")
    store = tmp_path / "draft_levels.json"
    tuner = draft_chain.new_tuner(lambda: store)
    monkeypatch.setattr(draft_chain, "TUNER", tuner)
    slow: list[str | None] = [None]
    real_bench = draft_chain._bench

    def bench(fn, args):
        runner = real_bench(fn, args)

        def timed(name):
            run = runner(name)
            return (lambda: (_spin(SLOW_MS), run())[1]) if name == slow[0] else run
        return timed
    monkeypatch.setattr(draft_chain, "_bench", bench)
    served: list[str] = []
    for name in ("draft_level", "greedy_chain"):
        real = getattr(draft_chain, name)
        monkeypatch.setattr(draft_chain, name, lambda *a, _real=real, _name=name, **kw: (
            served.append(_name), _real(*a, **kw))[1])
    # One torch thread: the tuner then times by the worker's CPU time, which _spin adds to exactly.
    # With more, it times wall time, and torch's threaded levels beside another busy process
    # (a loaded box, an xdist worker next door) can take longer than the slowed path.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield tuner, store, served, slow
    finally:
        torch.set_num_threads(threads)
        tuner.stop()


@pytest.mark.parametrize("slower,faster", [("kernel", "torch"), ("torch", "kernel")])
def test_the_path_measured_faster_serves_and_is_kept(draft, tuned, slower, faster):  # noqa: F811
    tuner, store, served, slow = tuned
    slow[0] = slower
    want = _propose(draft, SpecConfig(**{**_fields(STATIC), "draft_step": "reference"}))
    first = _propose(draft, STATIC)                     # served by the kernel while the worker times both
    assert "greedy_chain" in served
    assert tuner.wait(120)
    measured = tuner.measured()
    assert measured, "nothing was measured"
    for full, (choice, ms) in measured.items():
        assert full[-1] == draft_chain.PATHS and choice == faster
        assert ms[slower] > ms[faster] and ms[slower] >= SLOW_MS * 0.99
    served.clear()
    again = _propose(draft, STATIC)
    assert ("greedy_chain" in served) == (faster == "kernel")
    for a, b, c in zip(first, again, want):
        assert torch.equal(a.tokens, c.tokens) and torch.equal(b.tokens, c.tokens)
    # the next process starts with the choice: a new tuner on the same file, never timing it again
    fresh = draft_chain.new_tuner(lambda: store)
    for full, (choice, _) in measured.items():
        assert fresh.choice(full[:-1], full[-1], lambda: pytest.fail("a kept choice was timed again")) == choice


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_the_override_wins_over_a_measured_choice(draft, tuned, monkeypatch, impl):  # noqa: F811
    """A choice measured the other way, then IMPL forces a path: that path serves, untimed."""
    tuner, store, served, slow = tuned
    slow[0] = impl                                       # measured: the other path is faster
    _propose(draft, STATIC)
    assert tuner.wait(120) and {c for c, _ in tuner.measured().values()} == {"torch" if impl == "kernel" else "kernel"}
    monkeypatch.setattr(draft_chain, "IMPL", impl)
    monkeypatch.setattr(draft_chain, "_bench", lambda *a: pytest.fail("a forced path was timed"))
    served.clear()
    _propose(draft, STATIC)
    assert ("greedy_chain" in served) == (impl == "kernel")


def test_the_environment_variable_names_the_override():
    assert [draft_chain.impl_from_env(v) for v in ("off", "torch", "0", " OFF ")] == ["torch"] * 4
    assert [draft_chain.impl_from_env(v) for v in ("on", "kernel", "1")] == ["kernel"] * 3
    assert [draft_chain.impl_from_env(v) for v in (None, "", "auto")] == ["auto"] * 3


def test_the_attention_override_does_not_force_the_draft(monkeypatch):
    """SPARROW_ATTENTION_PATH=kernel names an attention path; the draft's tuner has its own."""
    monkeypatch.setattr(autotune, "FORCED", "kernel")
    monkeypatch.setattr(draft_chain, "IMPL", "auto")
    tuner = draft_chain.new_tuner(lambda: None)
    monkeypatch.setattr(autotune, "ENABLED", False)
    assert tuner.choice(("k",), draft_chain.PATHS, lambda: pytest.fail("timed")) is None
    monkeypatch.setattr(draft_chain, "IMPL", "torch")
    assert tuner.choice(("k",), draft_chain.PATHS, lambda: pytest.fail("timed")) == "torch"


def test_trees_and_seeded_chains_are_measured_and_exact(draft, tuned):  # noqa: F811
    """Levels of a wide tree (draft_level) and seeded chains: measured by their own keys, the
    proposals the reference's before and after the choice (torch, the kernel made slow)."""
    tuner, store, served, slow = tuned
    slow[0] = "kernel"
    wide = SpecConfig(**{**_fields(STATIC), "tree_width": 2, "tree_branch": 2, "tree_budget": 7})
    for _ in range(2):
        assert_same(run_steps(draft, wide, [3, 4, 2], SamplingParams(temperature=0.8, seed=1), steps=3,
                              compiled=False))
        assert_same(run_steps(draft, STATIC, [4, 3, 1], SamplingParams(temperature=1.0, seed=3), compiled=False),
                    seeded=True)
        assert tuner.wait(120)
    calls = {full[-3] for full in tuner.measured()}    # (..., call, rows bucket, candidates)
    assert {"draft_level", "greedy_chain"} <= calls
    assert {c for c, _ in tuner.measured().values()} == {"torch"}


@pytest.mark.parametrize("how", ["measured kernel", "measured torch", "forced kernel", "forced torch"])
def test_engine_greedy_is_the_targets_whichever_path_serves(qwen_target, draft, small_video, tuned,  # noqa: F811
                                                            monkeypatch, how):
    tuner, store, served, slow = tuned
    kind, path = how.split()
    if kind == "forced":
        monkeypatch.setattr(draft_chain, "IMPL", path)
    else:
        slow[0] = "torch" if path == "kernel" else "kernel"
    engine = Engine(qwen_target, draft, STATIC)
    prompt = "What happens in the video?"
    inputs = engine.prepare(small_video, prompt)
    want = qwen_target.hf.generate(**inputs, do_sample=False, max_new_tokens=12)[0, inputs["input_ids"].shape[1]:]
    first = engine.generate(small_video, prompt, SamplingParams(max_new_tokens=12))
    assert tuner.wait(120)
    if kind == "measured":
        assert tuner.measured() and {c for c, _ in tuner.measured().values()} == {path}
    served.clear()
    out = engine.generate(small_video, prompt, SamplingParams(max_new_tokens=12))
    assert first.token_ids == want.tolist() and out.token_ids == want.tolist()
    assert out.metrics.draft_tokens > 0
    assert ("greedy_chain" in served) == (path == "kernel")
