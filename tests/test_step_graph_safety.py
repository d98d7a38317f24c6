"""A compiled target step (step_graph.py) never serves a model that changed under it, never
fails a request, and its compiles never break other threads' forwards.

What must hold: after a graph is compiled, a config change (rms_norm_eps), a changed module
attribute (the norms' eps), and a hook added to a module each send the step to eager, which
then gives the eager result, with a warning; put back, the graph serves again. A graph that
raises part way has its step rerun eagerly on caches rewound to where they were, the request
gets its tokens, and that bucket stays eager. A long prefill that collects hidden states
answers exactly as without a compile while a bucket compiles on another thread and a second
request's vision tower runs on a third (the compile waits for them; transformers' output
capture is not thread-safe during a compile). `sparrow::ragged_attend` declares what it
writes, and the graph holds it without breaks and equals eager.
"""

import logging
import threading
import time

import pytest
import torch

import sparrow.models.compiling as compiling
import sparrow.models.ragged as ragged
import sparrow.models.step_graph as step_graph
from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.models.kv_cache import new_kv_cache
from sparrow.models.prefill import FeatureNeeds, PrefillJob
from sparrow.models.ragged import RaggedBatch
from sparrow.models.step_graph import StepGraph
from sparrow.tiny import tiny_target

PROMPT = "What happens in the video?"


@pytest.fixture
def compiled(qwen_target, small_video):
    """qwen_target with a compiled 1-token step, a step function that says whether the graph
    ran, step() -> (logits, ran), and the prefilled state it steps (and rolls back)."""
    target = qwen_target
    inputs = Engine(target, spec=SpecConfig(method="none")).prepare(small_video, PROMPT)
    state = target.prefill(inputs, inputs["input_ids"].shape[1] + 8).state
    graph = StepGraph(target, buckets=(1,), background=False)
    graph.warm((1,))
    runs = []
    real = graph.forward
    graph.forward = lambda *a: runs.append(real(*a)) or runs[-1]

    def step(compiled: bool = True):
        target.step_graph = graph if compiled else None
        logits = target.verify([state], [torch.tensor([3])])[0][0]
        target.rollback(state, 1)
        return logits, compiled and runs[-1] is not None
    try:
        yield target, graph, step, state
    finally:
        target.target_step = "eager"


def test_a_config_change_under_a_graph_runs_eagerly_with_a_warning(compiled, caplog):
    target, graph, step, _ = compiled
    config = target.text_config
    before = config.rms_norm_eps
    assert step()[1]                                            # the graph serves
    try:
        config.rms_norm_eps = 0.5
        with caplog.at_level(logging.WARNING, logger=step_graph.__name__):
            got, ran = step()
        want, _ = step(compiled=False)
        assert not ran and graph.guard_misses == {(1, ()): 1}
        assert "its config changed since the graph was compiled" in caplog.text
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        config.rms_norm_eps = before
    assert step()[1]                                            # as compiled again: the graph serves


def test_a_changed_norm_eps_gets_the_eager_result(compiled, caplog):
    """The norms copy rms_norm_eps at init: changing it where the model reads it changes the
    eager step, which the compiled step must then give."""
    target, graph, step, _ = compiled
    norms = [m for m in target.hf.model.language_model.modules() if hasattr(m, "variance_epsilon")]
    was, _ = step(compiled=False)
    try:
        for m in norms:
            m.variance_epsilon = 0.5
        with caplog.at_level(logging.WARNING, logger=step_graph.__name__):
            got, ran = step()
        want, _ = step(compiled=False)
        assert (want - was).abs().max() > 1e-2                  # the change matters
        assert not ran and "its module attributes changed" in caplog.text
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        for m in norms:
            m.variance_epsilon = target.text_config.rms_norm_eps
    got, ran = step()
    assert ran
    torch.testing.assert_close(got, was, atol=1e-4, rtol=1e-4)


def test_a_hook_added_after_compile_gets_the_eager_result(compiled, caplog):
    target, graph, step, _ = compiled
    was, ran = step()
    assert ran
    mlp = target.hf.model.language_model.layers[1].mlp
    handle = mlp.register_forward_hook(lambda module, args, out: out + 1.0)
    try:
        with caplog.at_level(logging.WARNING, logger=step_graph.__name__):
            got, ran = step()
        want, _ = step(compiled=False)
        assert (want - was).abs().max() > 1e-2 and not ran
        assert "its hooks changed" in caplog.text
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        handle.remove()
    got, ran = step()                                           # the hook gone: the graph serves again
    assert ran
    torch.testing.assert_close(got, was, atol=1e-4, rtol=1e-4)


def test_a_global_hook_or_train_mode_runs_eagerly(compiled):
    target, graph, step, _ = compiled
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        assert not step()[1]
    finally:
        handle.remove()
    assert step()[1]
    target.hf.model.language_model.layers[0].self_attn.train()  # one module's flag, not the model's
    try:
        assert not step()[1]
    finally:
        target.hf.eval()
    assert step()[1]


def _raise_once_inside_a_graph(monkeypatch, layer: int = 2) -> list:
    """RaggedBatch.attend raises once, at `layer`, when called by the compiled step's op (after
    the layers before it wrote their keys): a graph that fails part way."""
    real, raised = RaggedBatch.attend, []

    def flaky(self, layer_idx, query, scaling):
        if layer_idx == layer and not raised and getattr(ragged._CURRENT, "batch", None) is self:
            raised.append(layer_idx)
            raise RuntimeError("a kernel failed")
        return real(self, layer_idx, query, scaling)
    monkeypatch.setattr(RaggedBatch, "attend", flaky)
    return raised


def test_a_graph_that_raises_reruns_its_step_eagerly_on_rewound_caches(compiled, monkeypatch, caplog):
    target, graph, step, state = compiled
    want, _ = step(compiled=False)
    raised = _raise_once_inside_a_graph(monkeypatch)
    target.step_graph = graph
    with caplog.at_level(logging.WARNING, logger=step_graph.__name__):
        got = target.verify([state], [torch.tensor([3])])[0][0]
    lengths = {layer.length for layer in state.kv.layers}    # layers 0-2 wrote in the graph: undone, then once more
    target.rollback(state, 1)
    assert raised == [2] and lengths == {state.length + 1}
    assert (1, ()) in graph.failed and "reran eagerly" in caplog.text
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not step()[1]                                        # that bucket stays eager


def test_a_graph_that_raises_fails_no_request(qwen_target, small_video, monkeypatch):
    target = qwen_target
    sampling = SamplingParams(max_new_tokens=8)
    engine = Engine(target, spec=SpecConfig(method="none"))
    want = engine.generate(small_video, PROMPT, sampling).token_ids
    graph = StepGraph(target, buckets=(1,), background=False)
    graph.warm((1,))
    target.step_graph = graph
    try:
        raised = _raise_once_inside_a_graph(monkeypatch)
        out = engine.generate(small_video, PROMPT, sampling)
    finally:
        target.target_step = "eager"
    assert raised and out.finish_reason in ("stop", "length") and out.token_ids == want
    assert (1, ()) in graph.failed


def test_the_attention_op_declares_its_writes_and_the_graph_has_no_breaks(qwen_target):
    op = torch.ops.sparrow.ragged_attend.default
    written = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["written"]
    target = qwen_target
    ids = torch.zeros(1, 4, dtype=torch.long)
    positions = target.family.step_positions(0, 4, 0)
    with torch.inference_mode(), ragged.current_batch(RaggedBatch([])):
        explained = torch._dynamo.explain(step_graph._step_forward)(target.hf, ids, positions, ())
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    calls = [n for n in explained.graphs[0].graph.nodes if "ragged_attend" in str(n.target)]
    assert len(calls) == target.num_layers


def test_every_layer_records_its_writes_through_the_graph(compiled):
    target, graph, step, _ = compiled
    with torch.inference_mode():
        ragged.KV_WRITES.zero_()
    assert step()[1]
    assert ragged.KV_WRITES[:target.num_layers].tolist() == [1] * target.num_layers


@pytest.fixture(scope="module")
def fresh_target():
    return tiny_target("qwen2_5_vl", seed=11)             # a model no graph was compiled for


@pytest.mark.parametrize("how", ["background", "warm"])
def test_a_long_prefill_answers_the_same_while_a_bucket_compiles_beside_it(fresh_target, small_video, how):
    """Three threads as in serving: a long prompt's prefill (collecting the draft's features),
    another request's vision tower, and a bucket's compile: asked as a step asks (compiled in
    the background: it waits until the prefills are done, none waits for it), or warmed on a
    thread of its own (it goes first; the prefills wait for it). The prefills answer as with
    no compile going on."""
    target = fresh_target
    bucket = {"background": 1, "warm": 2}[how]
    needs = FeatureNeeds((1, 2, 3), bridge_layer=2)
    text = target.text_inputs([(i * 7) % 150 + 10 for i in range(600)])
    video_inputs = Engine(target, spec=SpecConfig(method="none")).prepare(small_video, PROMPT)

    def prefill():
        job = PrefillJob(target, text, new_kv_cache("static", target.num_layers, 608), needs, chunk_tokens=100)
        return job.run().output()
    want = prefill()
    graph = StepGraph(target, buckets=(bucket,), background=True)
    target.step_graph = graph
    stop, outs, errors = threading.Event(), [], []

    def prefills():
        while not stop.is_set():
            try:
                outs.append(prefill())
            except Exception as e:      # noqa: BLE001 - what the test counts
                errors.append(e)

    def vision():
        while not stop.is_set():
            target.prompt_embeds(video_inputs)
    threads = [threading.Thread(target=prefills), threading.Thread(target=vision)]
    waited = None
    if how == "background":
        waited_before = _gate_waited()
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        if how == "background":
            graph._ask((bucket, ()))                    # a step's ask: compiled on the worker thread
            time.sleep(4.0)
            waited = _gate_waited() - waited_before
        else:
            warm = threading.Thread(target=graph.warm, args=((bucket,),))
            warm.start()
            warm.join(300)
            time.sleep(0.5)                             # prefills after it too
        stop.set()
        for t in threads:
            t.join(60)
        deadline = time.monotonic() + 300
        while (bucket, ()) not in graph.compile_seconds and not graph.failed and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        target.target_step = "eager"
    assert not errors, errors[:3]
    assert outs and (bucket, ()) in graph.compile_seconds, graph.failed
    for out in outs:
        for name in ("text_features", "bridge_text", "bridge_visual", "last_feature", "logits"):
            assert torch.equal(getattr(out, name), getattr(want, name)), name
    if waited is not None:
        assert waited == 0.0                            # the background compile held no prefill up


def _gate_waited() -> float:
    """Seconds model forwards spent waiting for compiles (compiling.GATE; 0 without one)."""
    gate = getattr(compiling, "GATE", None)
    return gate.waited_s if gate is not None else 0.0
