"""The static draft runner's C++ levels (kernels/draft_chain.py, csrc/draft_chain.cpp)
against torch: function by function against draft_compile's draft_level and greedy_chain (outputs
within float tolerance, the same tokens, the same buffers written), proposals through the proposer
equal to the reference's (greedy chains with a commit's emitted rows, seeded sampling, narrow and
wide trees), the engine's greedy output the target's, and the way out: a draft the kernel does
not take, SPARROW_DRAFT_NATIVE off or a failed build all leave the levels to torch. A request's
start (begin_context: its first entries into the draft's cache) by the kernel equals torch's.

The fixture builds the kernel (~25 s on a 2-core box with a cold torch extension cache; a cached
build loads in well under a second).
"""

import copy
import logging
import shutil

import pytest
import torch
from test_draft_compiled import SPEC, _fields, assert_same, contexts, run_steps

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.kernels import draft_chain
from sparrow.kernels import native as native_build
from sparrow.kernels.native import NativeExtension
from sparrow.models import draft_compile
from sparrow.models.draft_compile import DraftLevels
from sparrow.speculative.proposer import DraftRequest
from sparrow.speculative.sampling import new_generator
from sparrow.speculative.sparrow_proposer import SparrowProposer
from sparrow.tiny import tiny_draft
from sparrow.anchored_window import PAD_POS

STATIC = SpecConfig(**{**_fields(SPEC), "draft_step": "static"})
FP32 = {"atol": 2e-5, "rtol": 1e-4}


@pytest.fixture(scope="module")
def draft(qwen_target):
    return tiny_draft(qwen_target, seed=1)


@pytest.fixture(scope="module")
def kernel():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the draft's levels stay in torch")
    module = draft_chain.EXTENSION.load()
    assert module is not None, "the native draft levels did not build (see the log)"
    return module


@pytest.fixture
def calls(kernel, monkeypatch):
    """The kernel switched on; records each call of it by name."""
    monkeypatch.setattr(draft_chain, "IMPL", "kernel")
    seen = []
    for name in ("draft_level", "greedy_chain"):
        real = getattr(draft_chain, name)
        monkeypatch.setattr(draft_chain, name, lambda *a, _real=real, _name=name, **kw: (
            seen.append(_name), _real(*a, **kw))[1])
    return seen


def _batch(draft, rows: int, tree: bool, seed: int):
    """A runner's batch for 3 requests (bucket 4 when compiled-sized: here eager, 3) of different
    cache lengths, two levels' positions, a padding request's slots at PAD_POS."""
    runner = DraftLevels(draft, window=6, capacity=40, rows=rows, tree=tree, emitted_rows=3)
    states = [SparrowProposer(draft, STATIC).begin_context(c, 40) for c in contexts(draft)]
    positions = [[len(s.kv) + 3 + level for s in states] for level in range(2)]
    positions[1][1] = PAD_POS                                   # request 1 drafts one level only
    g = torch.Generator().manual_seed(seed)
    emitted = [([3, 7], torch.randn(2, draft.fuse.in_features, generator=g), len(states[0].kv)), None,
               ([5], torch.randn(1, draft.fuse.in_features, generator=g), len(states[2].kv))]
    return runner, runner.gather([s.kv for s in states], positions, emitted)


def _clone(batch):
    return ([k.clone() for k in batch.keys], [v.clone() for v in batch.values], batch.pos.clone())

def _both_chains(runner, batch, hidden):
    """greedy_chain by torch's function and by the kernel on copies of one batch's buffers:
    ((torch's out, start), (the kernel's out, start), [each one's (keys, values, pos)])."""
    outs, bufs = [], []
    for fn in (draft_compile.greedy_chain, draft_chain.greedy_chain):
        keys, values, pos = _clone(batch)
        outs.append(fn(runner.dims, batch.weights, hidden, batch.q_pos, batch.live, batch.allowed,
                       batch.level_slots, pos, batch.pinned, keys, values, batch.emitted))
        bufs.append((keys, values, pos))
    return outs[0], outs[1], bufs


def test_a_greedy_chain_equals_torchs_function(draft, kernel):
    """The emitted rows, then two levels, for three requests: the same tokens, scores within
    float tolerance, the same keys seen, the same keys, values and positions written."""
    runner, batch = _batch(draft, 1, False, 0)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(batch.bucket, 1, draft.config.hidden_size, generator=g)
    (want, want_start), (got, got_start), bufs = _both_chains(runner, batch, hidden)
    _same_chains(batch, want, got)
    torch.testing.assert_close(got_start, want_start, **FP32)
    assert torch.equal(bufs[0][2], bufs[1][2])
    _same_visible_keys(bufs[0], bufs[1])


def _same_chains(batch, want, got):
    """The same tokens, scores within float tolerance and most keys seen, at every pick a request
    makes: the first, then each level it drafts (one at PAD_POS, which it does not draft, sees
    only padding slots, whose keys nothing else reads: its pick is no one's)."""
    levels = batch.q_pos.shape[0] + 1
    picks = torch.cat([torch.ones(want.shape[0], 1, dtype=torch.bool), batch.live[:, :want.shape[0], 0].t()], 1)
    assert not picks.all()
    assert torch.equal(got[:, :levels][picks], want[:, :levels][picks])                        # tokens
    torch.testing.assert_close(got[:, levels:-1][picks], want[:, levels:-1][picks], atol=1e-4, rtol=1e-5)
    assert torch.equal(got[:, -1], want[:, -1])                                                # most keys seen


def _same_visible_keys(want, got):
    """Keys and values equal within float tolerance at every slot holding an entry (a position
    other than PAD_POS); a padding row's, at PAD_POS, no query sees (the kernel skips them)."""
    entry = (want[2] != PAD_POS)[:, None, :, None]
    assert entry.any()
    for a, b in zip(want[0] + want[1], got[0] + got[1]):
        torch.testing.assert_close(b * entry, a * entry, **FP32)


def test_a_ragged_chain_of_eight_requests_equals_torchs_function(draft, kernel):
    """A commit's emitted rows and three levels for eight requests at once, each unlike the
    others: caches of different lengths, none to all of the emitted rows real (a row's keys
    among its own request's only), requests stopping at different levels. The kernel packs
    the real rows together: the same tokens, scores, keys seen, positions, and keys and values
    wherever an entry is, as torch's function."""
    window, levels = 6, 3
    runner = DraftLevels(draft, window=window, capacity=64, rows=1, tree=False, emitted_rows=4)
    g = torch.Generator().manual_seed(5)
    base = contexts(draft)
    states = [SparrowProposer(draft, STATIC).begin_context(base[i % len(base)], 64) for i in range(8)]
    for i, s in enumerate(states[len(base):]):            # the same contexts again, cut shorter
        s.kv.truncate(max(1, len(s.kv) - 2 - i))
    counts = [0, 1, 4, 2, 3, 0, 4, 1]
    emitted = [None if c == 0 else (torch.randint(0, draft.config.vocab_size, (c,), generator=g).tolist(),
                                    torch.randn(c, draft.fuse.in_features, generator=g), len(s.kv))
               for c, s in zip(counts, states)]
    stop = [3, 1, 3, 2, 3, 3, 1, 2]                     # the levels each request drafts
    positions = [[len(s.kv) + c + level if level < stop[b] else PAD_POS for b, (s, c) in enumerate(zip(states, counts))]
                 for level in range(levels)]
    batch = runner.gather([s.kv for s in states], positions, emitted)
    assert batch.bucket == 8 and len(set(len(s.kv) for s in states)) > 3
    hidden = torch.randn(batch.bucket, 1, draft.config.hidden_size, generator=g)
    (want, want_start), (got, got_start), bufs = _both_chains(runner, batch, hidden)
    _same_chains(batch, want, got)
    assert len(set(want[:, -1].tolist())) > 2
    torch.testing.assert_close(got_start, want_start, **FP32)
    assert torch.equal(bufs[0][2], bufs[1][2])
    _same_visible_keys(bufs[0], bufs[1])


def test_a_seeded_chain_equals_torchs_function(draft, kernel):
    """Rows drawn by their seeded noise (temperature 1 and 0.7, a negative seed) beside a
    greedy one: the kernel picks the tokens torch's reference does (chain_pick: Gumbel-max over
    log softmax(logits / T) under sampling.gumbel_noise), scores within float tolerance; and the
    seeded rows really drew (not the greedy chain's tokens everywhere)."""
    runner, batch = _batch(draft, 1, False, 0)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(batch.bucket, 1, draft.config.hidden_size, generator=g)
    pad = batch.bucket - 3
    seeded = draft_compile.Seeded(torch.tensor([0.0, 1.0, 0.7] + [0.0] * pad, dtype=torch.float64),
                                  torch.tensor([0, 5, -3] + [0] * pad), torch.tensor([0, 11, 2] + [0] * pad))
    outs = []
    for fn, how in ((draft_compile.greedy_chain, seeded), (draft_chain.greedy_chain, seeded),
                    (draft_chain.greedy_chain, None)):
        keys, values, pos = _clone(batch)
        outs.append(fn(runner.dims, batch.weights, hidden, batch.q_pos, batch.live, batch.allowed,
                       batch.level_slots, pos, batch.pinned, keys, values, batch.emitted, how)[0])
    want, got, greedy = outs
    levels = batch.q_pos.shape[0] + 1
    _same_chains(batch, want, got)
    assert torch.equal(got[0], greedy[0])                                         # the greedy row
    assert not torch.equal(got[1:3, :levels], greedy[1:3, :levels])              # the seeded rows drew


@pytest.mark.parametrize("rows,tree", [(1, False), (3, True)])
def test_a_level_equals_torchs_function(draft, kernel, rows, tree):
    """One level of a chain, and of a tree of three rows under an ancestor rule (each row sees
    its own slot and some of the others'): hidden and logits within float tolerance, the same
    top tokens and keys seen."""
    runner, batch = _batch(draft, rows, tree, 2)
    g = torch.Generator().manual_seed(3)
    b, h = batch.bucket, draft.config.hidden_size
    if tree:
        rule = torch.rand(b, rows, rows, generator=g) < 0.5
        rule |= torch.eye(rows, dtype=torch.bool)
        batch.allow(rule)
    tokens = torch.randint(0, draft.config.vocab_size, (b, rows), generator=g)
    hidden = torch.randn(b, rows, h, generator=g)
    live = torch.rand(b, rows, generator=g) < 0.8
    outs = []
    for fn in (draft_compile.draft_level, draft_chain.draft_level):
        keys, values, pos = _clone(batch)
        outs.append(fn(runner.dims, batch.weights, tokens, hidden, batch.q_pos[0], live, batch.allowed,
                       batch.level_slots[0], pos, batch.pinned, keys, values))
    (x0, l0, p0, i0, s0), (x1, l1, p1, i1, s1) = outs
    torch.testing.assert_close(x1, x0, **FP32)
    torch.testing.assert_close(l1, l0, **FP32)
    torch.testing.assert_close(p1, p0, **FP32)
    assert torch.equal(i1, i0) and torch.equal(s1, s0)


def test_a_batch_gathered_by_the_kernel_equals_torchs(draft, kernel, monkeypatch):
    """DraftLevels.gather's copies (three requests' caches of different lengths, bucket 4 with a
    padding request): the same positions and pinned flags everywhere, the same keys and values
    in every slot a request fills and zeros after them."""
    states = [SparrowProposer(draft, STATIC).begin_context(c, 40) for c in contexts(draft)]
    kvs, positions = [s.kv for s in states], [[len(s.kv) + 3 for s in states]]
    got = {}
    for impl in ("kernel", "torch"):
        monkeypatch.setattr(draft_chain, "IMPL", impl)
        runner = DraftLevels(draft, window=6, capacity=40, emitted_rows=3)
        runner.bucket = lambda n: 4                            # as compiled runners pad: one padding request
        assert runner.native == (impl == "kernel")
        batch = runner.gather(kvs, positions)
        got[impl] = (batch.pos, batch.pinned, [k[:, :, :batch.start] for k in batch.keys + batch.values])
    (pos, pinned, keys), (pos0, pinned0, keys0) = got["kernel"], got["torch"]
    assert torch.equal(pos, pos0) and torch.equal(pinned, pinned0)
    for a, b in zip(keys, keys0):
        assert torch.equal(a[:3], b[:3])


def test_a_cache_compacted_by_the_kernel_equals_torchs(draft, kernel):
    """DraftKV.evict's compaction: the same entries kept, in order, with their keys and values;
    nothing moves while the room a step needs still fits."""
    kv = SparrowProposer(draft, STATIC).begin_context(contexts(draft)[2], 40).kv
    n = len(kv)
    for next_pos, room in ((int(kv.pos.max()) + 1, 0), (int(kv.pos.max()) + 10, kv.capacity - n + 1)):
        a, b = copy.deepcopy(kv), copy.deepcopy(kv)
        a.evict(next_pos, 6, room)
        draft_chain.evict(b, next_pos, 6, room)
        assert len(a) == len(b) and torch.equal(a.pos, b.pos) and torch.equal(a.pinned, b.pinned)
        assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))
    assert len(b) < n                                   # the second one dropped entries


def test_a_requests_start_through_the_kernel_equals_torchs(draft, kernel, monkeypatch):
    """begin_context (glimpse states, anchors and the last window through the layers into a new
    cache) by the kernel: the same entries, positions and pinned flags, keys and values and the
    last output within float tolerance, the same most keys seen; prompts shorter and longer
    than anchors + window."""
    proposer = SparrowProposer(draft, STATIC)
    begun = {}
    for impl in ("kernel", "torch"):
        monkeypatch.setattr(draft_chain, "IMPL", impl)
        begun[impl] = [proposer.begin_context(c, 40) for c in contexts(draft)]
    for got, want in zip(begun["kernel"], begun["torch"]):
        assert len(got.kv) == len(want.kv) and got.kv.max_visible == want.kv.max_visible
        assert torch.equal(got.kv.pos, want.kv.pos) and torch.equal(got.kv.pinned, want.kv.pinned)
        for a, b in zip(got.kv.keys + got.kv.values, want.kv.keys + want.kv.values):
            torch.testing.assert_close(a, b, **FP32)
        torch.testing.assert_close(got.last_hidden, want.last_hidden, **FP32)


def test_proposals_through_the_kernel_equal_the_reference(draft, calls):
    """What test_draft_compiled checks for torch's static levels, through the kernel: greedy
    chains (their commits in the chain's call), seeded chains (one call a step too), narrow and
    wide trees (seeded sampling in the wide one)."""
    assert_same(run_steps(draft, STATIC, [4, 2, 3], SamplingParams(), compiled=False))
    calls.clear()
    assert_same(run_steps(draft, STATIC, [4, 3, 1], SamplingParams(temperature=1.0, seed=3), compiled=False),
                seeded=True)
    assert "greedy_chain" in calls and "draft_level" not in calls        # seeded chains: one call a step
    calls.clear()
    assert_same(run_steps(draft, STATIC, [4, 3, 1], SamplingParams(temperature=1.0, seed=3), compiled=False,
                          noise=False))
    assert "draft_level" in calls and "greedy_chain" not in calls        # drawn by a generator: by level
    narrow = SpecConfig(**{**_fields(STATIC), "tree_branch": 2})
    assert_same(run_steps(draft, narrow, [4, 3, 2], SamplingParams(), compiled=False))
    wide = SpecConfig(**{**_fields(STATIC), "tree_width": 2, "tree_branch": 2, "tree_budget": 7})
    assert_same(run_steps(draft, wide, [3, 4, 2], SamplingParams(temperature=0.8, seed=1), steps=3, compiled=False))
    assert "draft_level" in calls and "greedy_chain" not in calls        # trees: by level


def test_engine_greedy_through_the_kernel_is_the_targets(qwen_target, draft, small_video, calls):
    engine = Engine(qwen_target, draft, STATIC)
    prompt = "What happens in the video?"
    inputs = engine.prepare(small_video, prompt)
    want = qwen_target.hf.generate(**inputs, do_sample=False, max_new_tokens=12)[0, inputs["input_ids"].shape[1]:]
    out = engine.generate(small_video, prompt, SamplingParams(max_new_tokens=12))
    assert out.token_ids == want.tolist() and out.metrics.draft_tokens > 0
    assert "greedy_chain" in calls


def _propose(draft, spec: SpecConfig) -> list:
    proposer = SparrowProposer(draft, spec)
    states = [proposer.begin_context(c, 40) for c in contexts(draft)]
    return proposer.propose([DraftRequest(s, 4, SamplingParams(), new_generator(0)) for s in states])


def test_what_the_kernel_does_not_take_stays_in_torch(draft, qwen_target, calls, monkeypatch):
    """A bfloat16 draft, a compiled runner, a draft past MAX_WEIGHTS and the switch off: torch's
    levels, never the kernel."""
    bf16 = tiny_draft(qwen_target, seed=1).to(torch.bfloat16)
    assert not SparrowProposer(bf16, STATIC).levels.native
    assert not SparrowProposer(draft, SPEC).levels.native            # compiled
    weights = sum(t.numel() for t in draft_chain._flat(SparrowProposer(draft, STATIC).levels.weights()))
    monkeypatch.setattr(draft_chain, "MAX_WEIGHTS", weights - 1)     # the shared lm_head and embedding count
    assert not SparrowProposer(draft, STATIC).levels.native
    monkeypatch.setattr(draft_chain, "MAX_WEIGHTS", weights)
    assert SparrowProposer(draft, STATIC).levels.native
    monkeypatch.setattr(draft_chain, "IMPL", "torch")
    assert not SparrowProposer(draft, STATIC).levels.native
    _propose(draft, STATIC)
    assert calls == []


def test_a_failed_build_leaves_the_levels_to_torch(draft, monkeypatch, tmp_path, caplog):
    """A source that does not compile: the first runner starts the build in its own process, its
    proposals never wait on it and equal the reference's; the failure is logged once."""
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    ext = NativeExtension("broken_draft_for_test", bad, [], "native draft levels (a broken source)")
    monkeypatch.setattr(draft_chain, "EXTENSION", ext)
    monkeypatch.setattr(draft_chain, "IMPL", "kernel")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with caplog.at_level(logging.WARNING, logger=native_build.__name__):
        want = _propose(draft, SpecConfig(**{**_fields(STATIC), "draft_step": "reference"}))
        got = _propose(draft, STATIC)
        ext.wait(120)
        again = _propose(draft, STATIC)
    for a, b, c in zip(got, again, want):
        assert torch.equal(a.tokens, c.tokens) and torch.equal(b.tokens, c.tokens)
    assert ext.failed and ext.module is None
    # (another extension's build, started by an earlier test in this process, may log its own line)
    assert len([r for r in caplog.records if "not built" in r.getMessage() and ext.what in r.getMessage()]) == 1
