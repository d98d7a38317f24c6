"""The Sparrow draft's static-shape levels (sparrow.models.draft_compile; SpecConfig.draft_step
"static" and "compiled") against the reference (SparrowDraft.forward_packed per request): the same
proposals token for token (chains and trees, T=0 and seeded sampling, a batch of requests of
different lengths and depths), the same keys seen, one host read per chain propose, and the
engine's greedy output still the target's.

The compiled path is checked at one batch bucket (4), one row a request, the SPEC's key slots:
the chain at T=0 (greedy_chain) and the level the rest run (draft_level). torch.compile costs
~10-30 s a shape on a 2-core CPU, paid once each here (the tests share them); trees of width 2
run the same function eagerly.
"""

import logging

import pytest
import torch
from torch._dynamo.utils import counters

import sparrow.models.draft_compile as draft_compile
from sparrow.kernels import draft_chain
from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.models.draft_compile import COMPILE_SECONDS, DraftLevels
from sparrow.speculative.proposer import DraftRequest, StepResult
from sparrow.speculative.sampling import PositionNoise, new_generator
from sparrow.speculative.sparrow_proposer import SparrowProposer
from sparrow.speculative.draft_context import DraftContext
from sparrow.tiny import tiny_draft
from sparrow.anchored_window import window_mask

SPEC = SpecConfig(num_draft_tokens=4, window=6, anchors=5, glimpse=2, adaptive_k=False, draft_step="compiled")
PROMPTS = (4, 9, 23)            # prompt entries of the batch's requests: below, at and past anchors + window


@pytest.fixture(scope="module")
def draft(qwen_target):
    return tiny_draft(qwen_target, seed=1)


@pytest.fixture(autouse=True)
def torch_levels(monkeypatch):
    """The static levels in torch here (test_draft_native.py checks the C++ ones the same way)."""
    monkeypatch.setattr(draft_chain, "IMPL", "torch")


def contexts(draft, glimpse: int = 2) -> list[DraftContext]:
    """Random draft contexts of different lengths (what build_context makes from a prefill)."""
    g = torch.Generator().manual_seed(0)
    return [DraftContext.synthetic(draft, n, glimpse, g) for n in PROMPTS]


def proposers(draft, spec: SpecConfig, compiled: bool = True) -> dict[str, SparrowProposer]:
    """The reference, the static levels run eagerly, and (when asked) compiled."""
    steps = ("reference", "static") + (("compiled",) if compiled else ())
    paths = {step: SparrowProposer(draft, SpecConfig(**{**_fields(spec), "draft_step": step})) for step in steps}
    assert paths["reference"].levels is None and not paths["static"].levels.compiled
    assert not compiled or paths["compiled"].levels.compiled
    return paths


def _fields(spec: SpecConfig) -> dict:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def run_steps(draft, spec: SpecConfig, ks: list[int], sampling: SamplingParams, steps: int = 4,
              compiled: bool = True, noise: bool = True) -> dict[str, list]:
    """Each path begins the same contexts, then `steps` times proposes for the whole batch and
    commits the same emitted tokens (the reference's first draft token, if any, + a random bonus),
    so the caches grow, slide and evict alike, then proposes once more. A seeded request draws
    by its position noise, as in the engine (noise=False: by its generator). Returns each path's
    proposals, step by step."""
    paths = proposers(draft, spec, compiled)
    states = {name: [p.begin_context(c, 40) for c in contexts(draft, spec.glimpse)] for name, p in paths.items()}
    g = torch.Generator().manual_seed(5)
    out = {name: [] for name in paths}
    for step in range(steps + 1):
        for name, p in paths.items():
            batch = [DraftRequest(s, k, sampling, new_generator(100 + i),
                                  noise=PositionNoise(sampling.seed + step) if noise and sampling.replayable else None)
                     for i, (s, k) in enumerate(zip(states[name], ks))]
            out[name].append(p.propose(batch))
        if step == steps:           # (a static greedy chain runs the last commit: after it, all have)
            break
        emitted = []
        for prop in out["reference"][-1]:
            tokens = prop.tokens[:1].tolist() + [int(torch.randint(0, draft.config.vocab_size, (1,), generator=g))]
            emitted.append((tokens, torch.randn(len(tokens), draft.fuse.in_features, generator=g)))
        for name, p in paths.items():
            p.commit(states[name], [StepResult(None, t, f) for t, f in emitted])
    for name in paths:
        assert [s.max_keys() for s in states[name]] == [s.max_keys() for s in states["reference"]], name
    return out


def assert_same(out: dict[str, list], exact_probs: bool = False, seeded: bool = False) -> None:
    """Every path's proposals equal the reference's. seeded: a path may carry no draft probabilities
    (a seeded chain's one call: acceptance of a seeded request reads its noise, not q)."""
    ref = out["reference"]
    for name, steps in out.items():
        for step, (got, want) in enumerate(zip(steps, ref)):
            for i, (a, b) in enumerate(zip(got, want)):
                where = f"{name}, step {step}, request {i}"
                assert torch.equal(a.tokens, b.tokens), where
                assert (a.parents is None) == (b.parents is None), where
                if b.parents is not None:
                    assert torch.equal(a.parents, b.parents) and torch.equal(a.draw, b.draw), where
                torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=1e-5, msg=where)
                if b.probs is not None and not (seeded and a.probs is None):
                    torch.testing.assert_close(a.probs, b.probs, atol=1e-6, rtol=1e-5, msg=where)


# ----- the window rule, batched --------------------------------------------------------------------------
def test_window_mask_broadcasts_over_a_batch_of_requests():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randint(0, 30, (3, 2), generator=g), torch.randint(-1, 30, (3, 11), generator=g)
    pinned = torch.rand(3, 11, generator=g) < 0.3
    batched = window_mask(q, k, pinned, 5)
    assert batched.shape == (3, 2, 11)
    for b in range(3):
        assert torch.equal(batched[b], window_mask(q[b], k[b], pinned[b], 5))


# ----- proposals: compiled == static eager == reference ----------------------------------------------------
def compiled_shapes(name: str) -> list[tuple]:
    """The shapes of `name` (greedy_chain, draft_level) compiled so far, at batch bucket 4, one row."""
    return [shape for shape in COMPILE_SECONDS if shape[:3] == (name, 4, 1)]


def test_greedy_chains_compiled_equal_reference(draft, caplog):
    """Three requests of different lengths and depths (bucket 4: one padding row), four steps;
    the chain compiles once (and says so in the log), whatever the depths and steps."""
    before, graphs = set(COMPILE_SECONDS), counters["stats"]["unique_graphs"]
    with caplog.at_level(logging.INFO, logger="sparrow.models.draft_compile"):
        out = run_steps(draft, SPEC, [4, 2, 3], SamplingParams())
        out_short = run_steps(draft, SPEC, [2, 3, 1], SamplingParams(), steps=2)     # shallower: the same graph
    assert_same(out)
    assert_same(out_short)
    assert all(len(p.tokens) == k for step in out["compiled"] for p, k in zip(step, [4, 2, 3]))
    shapes = compiled_shapes("greedy_chain")
    assert len(shapes) == 1, "the compiled chain never ran"
    if shapes[0] not in before:             # compiled here (not by an earlier test of this process)
        assert counters["stats"]["unique_graphs"] == graphs + 1
        assert [r for r in caplog.records if "greedy_chain compiled for batch bucket 4" in r.getMessage()]


def test_sampled_chains_and_narrow_trees_compiled_equal_reference(draft):
    """T=1 with seeded generators (the same draws from numerically the same q), and trees of
    width 1 x branch 2 at T=0 and T=1: level by level, through one compiled draft_level. With
    position noise (a seeded request in the engine) the static levels run the chain in one call
    (chain_pick: no q), and the compiled levels still level by level (their graphs have no noise)."""
    run_steps(draft, SPEC, [4, 1, 1], SamplingParams(temperature=1.0, seed=0), steps=1, noise=False)  # compiled
    graphs = counters["stats"]["unique_graphs"]
    assert_same(run_steps(draft, SPEC, [4, 3, 1], SamplingParams(temperature=1.0, seed=3), noise=False))
    assert_same(run_steps(draft, SPEC, [4, 3, 1], SamplingParams(temperature=1.0, seed=3)), seeded=True)
    narrow = SpecConfig(**{**_fields(SPEC), "tree_branch": 2})
    assert_same(run_steps(draft, narrow, [4, 3, 2], SamplingParams()))
    assert_same(run_steps(draft, narrow, [3, 4, 2], SamplingParams(temperature=0.7, seed=2), steps=3))
    assert counters["stats"]["unique_graphs"] == graphs and len(compiled_shapes("draft_level")) == 1


def test_wide_trees_equal_reference(draft):
    """Width 2 x branch 2 (two rows a level, ancestors by the tree rule), run eagerly (the
    compiled function is the same code); greedy and sampled."""
    wide = SpecConfig(**{**_fields(SPEC), "tree_width": 2, "tree_branch": 2, "tree_budget": 7})
    assert_same(run_steps(draft, wide, [4, 3, 2], SamplingParams(), compiled=False))
    assert_same(run_steps(draft, wide, [3, 4, 2], SamplingParams(temperature=0.8, seed=1), steps=3, compiled=False))


def test_a_greedy_chain_propose_reads_the_host_once(draft, monkeypatch):
    paths = proposers(draft, SPEC, compiled=False)
    states = [paths["static"].begin_context(c, 40) for c in contexts(draft)]
    reads = []
    for name in ("tolist", "item", "cpu", "__int__", "__float__", "__bool__", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name, **kw: (
            reads.append(_name), _real(self, *a, **kw))[1])
    paths["static"].propose([DraftRequest(s, 4, SamplingParams(), new_generator(0)) for s in states])
    monkeypatch.undo()
    assert reads == ["tolist"]


def test_a_commit_runs_in_the_next_greedy_chains_call(draft, monkeypatch):
    """A commit runs no draft pass of its own (the deferred commit, proposer.py): with a static
    runner the next greedy chain runs the emitted entries first, in its one call (and one host
    read). Entries that wait past `emitted_rows`, or a propose that is not a greedy chain, run
    them alone first (the reference pass, one for all the steps waiting), so nothing is lost;
    run_steps checks the proposals equal the reference's throughout. The reference path waits
    too."""
    from sparrow.models.draft import SparrowDraft

    paths = proposers(draft, SPEC, compiled=False)
    static = paths["static"]
    states = [static.begin_context(c, 40) for c in contexts(draft)]
    passes = []
    real = SparrowDraft.forward_packed
    monkeypatch.setattr(SparrowDraft, "forward_packed", lambda self, *a, **kw: (passes.append(1), real(self, *a, **kw))[1])
    greedy = [DraftRequest(s, 4, SamplingParams(), new_generator(0)) for s in states]
    feats = torch.randn(3, draft.fuse.in_features)
    before = [(s.next_pos, len(s.kv)) for s in states]
    static.propose(greedy)
    static.commit(states, [StepResult(None, [1, 2, 3], feats)] * 3)
    assert passes == [] and [s.next_pos for s in states] == [n for n, _ in before]     # waiting
    static.propose(greedy)
    assert passes == [] and all(not s.pending for s in states)
    assert [(s.next_pos, len(s.kv)) for s in states] == [(n + 3, k + 3) for n, k in before]
    static.commit(states, [StepResult(None, [1, 2, 3], feats)] * 3)
    static.commit(states, [StepResult(None, [4, 5, 6], feats)] * 3)      # 6 waiting > emitted_rows (5)
    static.commit(states, [StepResult(None, [7], feats)] * 3)
    assert passes == [] and [len(s.pending) for s in states] == [7] * 3
    static.propose([DraftRequest(s, 4, SamplingParams(temperature=1.0, seed=0), new_generator(0)) for s in states])
    assert passes == [1] and [s.next_pos for s in states] == [n + 10 for n, _ in before]
    reference = paths["reference"]
    states = [reference.begin_context(c, 40) for c in contexts(draft)]
    before = [s.next_pos for s in states]
    passes.clear()
    reference.commit(states, [StepResult(None, [1, 2, 3], feats)] * 3)
    assert passes == [] and [s.next_pos for s in states] == before
    reference.propose([DraftRequest(s, 1, SamplingParams(), new_generator(0)) for s in states])
    assert passes == [1] and [s.next_pos for s in states] == [n + 3 for n in before]


def test_warm_up_compiles_before_the_first_request(draft, monkeypatch):
    """A server with compiled draft steps runs (so compiles) the greedy chain of its batch
    buckets before it serves: a batch of 3 runs in bucket 4, and after warm_up its first propose
    compiles nothing. Eager runners: nothing to do."""
    assert proposers(draft, SPEC, compiled=False)["static"].warm_up((1, 3)) == 0.0
    compiled = SparrowProposer(draft, SPEC)
    calls = []
    real_run = DraftLevels._run
    monkeypatch.setattr(DraftLevels, "_run", lambda self, fn, batch, args: (
        calls.append((fn.__name__, batch.bucket, self.compiled)), real_run(self, fn, batch, args))[1])
    assert compiled.warm_up((3,)) > 0
    assert calls == [("greedy_chain", 4, True)]
    before = set(COMPILE_SECONDS)
    states = [compiled.begin_context(c, 40) for c in contexts(draft)]
    compiled.propose([DraftRequest(s, 4, SamplingParams(), new_generator(0)) for s in states])
    assert set(COMPILE_SECONDS) == before


def test_weights_changed_in_place_are_read_again(draft):
    """A runner keeps the draft's weights concatenated; training them must not leave it stale."""
    paths = proposers(draft, SPEC, compiled=False)
    ctx = contexts(draft)
    greedy = SamplingParams()
    before = [paths["static"].propose_one(paths["static"].begin_context(c, 40), 4, greedy, new_generator(0)) for c in ctx]
    saved = {k: v.clone() for k, v in draft.state_dict().items()}
    try:
        with torch.no_grad():
            for layer in draft.layers:
                layer.k_proj.weight.mul_(-3.0)
                layer.gate_proj.weight.add_(0.5)
        for c in ctx:
            want = paths["reference"].propose_one(paths["reference"].begin_context(c, 40), 4, greedy, new_generator(0))
            got = paths["static"].propose_one(paths["static"].begin_context(c, 40), 4, greedy, new_generator(0))
            assert torch.equal(got.tokens, want.tokens)
    finally:
        draft.load_state_dict(saved)
    assert before   # (the same draft is used by the other tests: restored)


def test_what_the_static_shapes_cannot_hold_runs_the_reference(draft):
    """A cache longer than the runner's slots, and a full-attention context, take the reference path."""
    paths = proposers(draft, SPEC, compiled=False)
    paths["static"].levels = DraftLevels(draft, SPEC.window, capacity=10)
    states = {name: [p.begin_context(c, 40) for c in contexts(draft)] for name, p in paths.items()}
    assert max(len(s.kv) for s in states["static"]) + 3 > 10
    got, want = ([p.propose([DraftRequest(s, 4, SamplingParams(), new_generator(0)) for s in states[name]])
                  for name, p in paths.items()])
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(got, want))
    assert SparrowProposer(draft, SpecConfig(**{**_fields(SPEC), "draft_context": "all"})).levels is None


# ----- the engine --------------------------------------------------------------------------------------------
def test_engine_greedy_with_the_compiled_draft_is_the_targets(qwen_target, draft, small_video, monkeypatch):
    """One request through the engine (run in batch bucket 4, the compiled shape above) == HF greedy."""
    monkeypatch.setattr(draft_compile, "BATCH_BUCKETS", (4, 64))
    levels = []
    real_run = DraftLevels._run
    monkeypatch.setattr(DraftLevels, "_run", lambda self, *a, **kw: (levels.append(self.compiled), real_run(self, *a, **kw))[1])
    engine = Engine(qwen_target, draft, SPEC)
    prompt = "What happens in the video?"
    inputs = engine.prepare(small_video, prompt)
    want = qwen_target.hf.generate(**inputs, do_sample=False, max_new_tokens=12)[0, inputs["input_ids"].shape[1]:]
    out = engine.generate(small_video, prompt, SamplingParams(max_new_tokens=12))
    assert out.token_ids == want.tolist()
    assert levels and all(levels) and out.metrics.draft_tokens > 0
