"""The target's compiled decode/verify step (TargetModel.target_step "compiled", step_graph.py)
against the eager step, its reference.

What must hold: on both families, a ragged batch of a decode, a chain and a tree on caches of
different lengths gets the eager step's logits and features through the compiled graph (the
batch padded to a token bucket); greedy decoding through compiled steps is HF's greedy output,
plain and speculative, chains (all accepted, none accepted) and trees, and a seeded sample is
the eager engine's; a step no bucket holds, a graph not compiled yet, or one whose compile
failed runs eagerly; a step waits for a compile running on another thread (never beside it);
the background compile serves the steps after it; the setting refuses what it does not know.
(A model changed under a graph, a graph that raises, compiles beside forwards:
tests/test_step_graph_safety.py.)
"""

import logging
import threading
import time

import pytest
import torch
from helpers import OracleProposer, ragged_step_inputs

import sparrow.models.step_graph as step_graph
from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.models.compiling import GATE
from sparrow.models.step_graph import StepGraph
from sparrow.tiny import tiny_draft, tiny_target

PROMPT = "What happens in the video?"
BUCKETS = (1, 8, 16)          # a decode step, a k <= 7 chain or a small tree, the ragged batch below
LAYERS = (1, 2, 3)            # the tiny draft's feature layers


def _graph(target, background: bool = False) -> StepGraph:
    """A compiled step for `target` with the tests' buckets (graphs are kept for the process,
    so the tests after the first reuse them)."""
    graph = StepGraph(target, buckets=BUCKETS, background=background)
    target.step_graph = graph
    return graph


@pytest.fixture
def eager_after(any_target):
    yield any_target
    any_target.target_step = "eager"


def _ragged_step(target, video) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One forward over a decode, a chain and a tree, each on its own cache of its own length."""
    states, tokens, trees = ragged_step_inputs(target, video)
    return target.verify(states, tokens, LAYERS, trees=trees)


def test_a_ragged_batch_through_the_graph_is_the_eager_step(eager_after, small_video):
    target = eager_after
    want = _ragged_step(target, small_video)
    graph = _graph(target)
    graph.warm((11,), LAYERS)
    runs = []
    real = graph.forward
    graph.forward = lambda *a: runs.append(real(*a)) or runs[-1]
    got = _ragged_step(target, small_video)
    assert runs and runs[-1] is not None                 # the compiled graph ran, padded 11 -> 16
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_a_graph_with_more_feature_layers_serves_a_step_asking_for_fewer(qwen_target, small_video):
    """Features of a subset of the graph's layers, in the order asked, are the eager step's."""
    target = qwen_target
    states, tokens, trees = ragged_step_inputs(target, small_video)
    want = target.verify(states, tokens, (3, 1), trees=trees)[1]
    try:
        graph = _graph(target)
        graph.warm((11,), LAYERS)
        states, tokens, trees = ragged_step_inputs(target, small_video)
        got = target.verify(states, tokens, (3, 1), trees=trees)[1]
        assert set(graph.compile_seconds) == {(16, LAYERS)} and not graph.guard_misses    # the wider graph ran
    finally:
        target.target_step = "eager"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_a_fresh_model_compiles_with_features_before_any_eager_step():
    """A model's first forward that asks for hidden states installs transformers' hooks (under a
    lock dynamo cannot trace): a graph with feature layers built before any eager step."""
    target = tiny_target("qwen2_5_vl", seed=5)
    graph = _graph(target)
    graph.warm((1,), LAYERS)
    assert (1, LAYERS) in graph.compile_seconds, graph.failed


def test_greedy_through_compiled_steps_is_hf_greedy(eager_after, small_video):
    """Plain decoding (1-token steps), an oracle chain all accepted and none accepted (5-token
    steps), and draft trees (their features: the graph with the draft's layers)."""
    target = eager_after
    sampling = SamplingParams(max_new_tokens=16)
    inputs = Engine(target, spec=SpecConfig(method="none")).prepare(small_video, PROMPT)
    reference = target.hf.generate(**inputs, do_sample=False, max_new_tokens=16)[0, inputs["input_ids"].shape[1]:]
    reference = reference.tolist()
    graph = _graph(target)
    graph.warm((1, 8), LAYERS)      # steps without features run in these graphs too
    assert Engine(target, spec=SpecConfig(method="none")).generate(small_video, PROMPT, sampling).token_ids == reference
    chain = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16)
    for corrupt in (False, True):
        oracle = OracleProposer(reference, corrupt=corrupt, vocab_size=target.vocab_size)
        out = Engine(target, spec=chain, proposer=oracle).generate(small_video, PROMPT, sampling)
        assert out.token_ids == reference and (out.metrics.accepted_tokens == 0) == corrupt
    tree = SpecConfig(adaptive_k=False, num_draft_tokens=3, tree_width=2, tree_branch=2, tree_budget=6)
    out = Engine(target, tiny_draft(target, seed=1), tree).generate(small_video, PROMPT, sampling)
    assert out.token_ids == reference and out.metrics.draft_tokens > 0
    assert set(graph.compile_seconds) == {(1, LAYERS), (8, LAYERS)} and not graph.failed
    assert not graph.guard_misses           # the engine's steps fit the graphs warm() built: none ran eagerly


def test_a_seeded_sample_through_compiled_steps_is_the_eager_engines(qwen_target, small_video):
    target = qwen_target
    draft = tiny_draft(target, seed=1)
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=4)
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)
    want = Engine(target, draft, spec).generate(small_video, PROMPT, sampling).token_ids
    try:
        _graph(target).warm((1, 5), LAYERS)
        got = Engine(target, draft, spec).generate(small_video, PROMPT, sampling).token_ids
    finally:
        target.target_step = "eager"
    assert got == want


def test_steps_run_eagerly_until_the_background_compile_is_ready(qwen_target, small_video, caplog):
    target = qwen_target
    engine = Engine(target, spec=SpecConfig(method="none"))
    inputs = engine.prepare(small_video, PROMPT)
    state = target.prefill(inputs, inputs["input_ids"].shape[1] + 8).state
    graph = StepGraph(target, buckets=(2,), background=True)
    target.step_graph = graph
    try:
        with caplog.at_level(logging.INFO, logger=step_graph.__name__):
            calls = []
            real = graph.forward
            graph.forward = lambda *a: calls.append(real(*a)) or calls[-1]
            first = target.verify([state], [torch.tensor([3, 4])])[0][0]
            assert calls == [None]                          # eager: the compile has only started
            deadline = time.monotonic() + 120
            while (2, ()) not in graph.compile_seconds and time.monotonic() < deadline:
                time.sleep(0.2)
            assert (2, ()) in graph.compile_seconds, graph.failed
            target.rollback(state, 2)
            again = target.verify([state], [torch.tensor([3, 4])])[0][0]
            assert calls[-1] is not None                    # the graph ran
            torch.testing.assert_close(again, first, atol=1e-4, rtol=1e-4)
            assert target.verify([state], [torch.tensor([3, 4, 5])])[0][0].shape[0] == 3   # no bucket: eager
            assert calls[-1] is None and graph.bucket(3) is None
        assert "target step compiled for 2 tokens" in caplog.text
    finally:
        target.target_step = "eager"


def test_a_step_waits_for_a_compile_and_runs_eagerly_when_its_guards_fail(qwen_target, small_video, caplog):
    """No step runs beside a compile on another thread (it holds GATE's compile side): it
    waits for it, then runs its graph. No step compiles in line: when the model changed under a
    graph (train mode), the step runs eagerly; back as it was, the graph runs again."""
    target = qwen_target
    engine = Engine(target, spec=SpecConfig(method="none"))
    inputs = engine.prepare(small_video, PROMPT)
    state = target.prefill(inputs, inputs["input_ids"].shape[1] + 8).state
    graph = _graph(target)
    graph.warm((1,))
    calls = []
    real = graph.forward
    graph.forward = lambda *a: calls.append(real(*a)) or calls[-1]

    def step():
        target.verify([state], [torch.tensor([3])])
        target.rollback(state, 1)
    try:
        step()
        assert calls[-1] is not None
        held, done, stepped = threading.Event(), threading.Event(), threading.Event()

        def compiling():
            with GATE.compile():
                held.set()
                done.wait(30)
        other = threading.Thread(target=compiling)
        other.start()
        held.wait(30)
        calls.clear()
        stepper = threading.Thread(target=lambda: (step(), stepped.set()))
        stepper.start()
        assert not stepped.wait(1.0) and not calls          # waiting at the gate: neither eager nor compiled
        done.set()
        other.join()
        stepper.join(30)
        assert stepped.is_set() and calls[-1] is not None
        target.hf.train()
        with caplog.at_level(logging.WARNING, logger=step_graph.__name__):
            step()
        assert calls[-1] is None and graph.guard_misses == {(1, ()): 1}
        assert "runs eagerly (no recompile in line)" in caplog.text
        target.hf.eval()
        step()
        assert calls[-1] is not None
    finally:
        target.hf.eval()
        target.target_step = "eager"


def test_a_bucket_whose_compile_fails_stays_eager(qwen_target, small_video, monkeypatch, caplog):
    target = qwen_target

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(step_graph, "compiled", broken)
    engine = Engine(target, spec=SpecConfig(method="none"))
    sampling = SamplingParams(max_new_tokens=6)
    want = engine.generate(small_video, PROMPT, sampling).token_ids
    graph = _graph(target)
    try:
        with caplog.at_level(logging.WARNING, logger=step_graph.__name__):
            assert engine.generate(small_video, PROMPT, sampling).token_ids == want
    finally:
        target.target_step = "eager"
    assert graph.failed and not graph.compile_seconds
    assert "could not be compiled, it stays eager: RuntimeError: no compiler here" in caplog.text


def test_the_setting(qwen_target):
    assert qwen_target.target_step == "eager" and qwen_target.step_graph is None
    with pytest.raises(ValueError, match="unknown target step"):
        qwen_target.target_step = "fast"
    qwen_target.target_step = "compiled"
    try:
        assert isinstance(qwen_target.step_graph, StepGraph) and qwen_target.target_step == "compiled"
        graph = qwen_target.step_graph
        qwen_target.target_step = "compiled"
        assert qwen_target.step_graph is graph          # kept: its graphs stay
    finally:
        qwen_target.target_step = "eager"
    assert qwen_target.step_graph is None
