"""The batch step's acceptance in one tensor program (speculative/accept_batch.py) against the
per-request reference (accept.py through `accept_one`): equal on random ragged batches of chains
and trees, greedy, sampled and seeded requests mixed (property-based); every request's KV moved
to its accepted path in one gather/scatter equals keep_path request by request; and through the
engine, greedy output equals HF's and a batched request's tokens equal its solo run's."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.config import EngineConfig
from sparrow.models.kv_cache import KVArena
from sparrow.models.prefill import TargetState
from sparrow.speculative.accept_batch import accept_all, accept_one
from sparrow.speculative.sampling import PositionNoise, new_generator
from sparrow.speculative.tree import DraftTree
from sparrow.tiny import synthetic_frames, tiny_draft

VOCAB = 6
PROMPT = "What happens in the video?"


@st.composite
def request(draw):
    """One request of a step: its kind, its draft (none, a chain or a tree; with or without the
    draft's q), and the target's logits over [root, nodes], often leaning to the drafted tokens."""
    kind = draw(st.sampled_from(["greedy", "sampled", "seeded"]))
    size = draw(st.integers(0, 7))
    chain = draw(st.booleans())
    parents = [i - 1 if chain else draw(st.integers(-1, i - 1)) for i in range(size)]
    with_q = kind != "greedy" and size > 0 and draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if with_q:                                 # one q row per parent, siblings drawn i.i.d. from it
        rows: dict[int, int] = {}
        draw_rows = [rows.setdefault(p, len(rows)) for p in parents]
        q = torch.softmax(torch.randn(len(rows), VOCAB, generator=gen) * 2, -1)
        tokens = [int(torch.multinomial(q[r], 1, generator=gen)) for r in draw_rows]
        tree = DraftTree(torch.tensor(tokens), q, None if chain else torch.tensor(parents),
                         None if chain else torch.tensor(draw_rows))
    elif size:
        tokens = [draw(st.integers(0, VOCAB - 1)) for _ in range(size)]
        tree = DraftTree(torch.tensor(tokens), None, None if chain else torch.tensor(parents))
    else:
        tree, tokens = None, []
    logits = torch.randn(size + 1, VOCAB, generator=gen) * 2
    if draw(st.booleans()):                    # the target agrees with the first child of each node
        for i, p in enumerate(parents):
            if p == -1 or parents.index(p) == i:
                logits[p + 1, tokens[i]] += 6.0
    seed = draw(st.integers(0, 2**40)) if kind == "seeded" else None
    sampling = SamplingParams(max_new_tokens=8) if kind == "greedy" else SamplingParams(
        max_new_tokens=8, temperature=draw(st.sampled_from([0.6, 1.0, 1.5])), top_k=draw(st.sampled_from([0, 3])),
        top_p=draw(st.sampled_from([1.0, 0.8])), seed=seed)
    return tree, logits, sampling, draw(st.integers(0, 2**31))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request(), min_size=1, max_size=6), st.integers(0, 50))
def test_batched_acceptance_equals_the_per_request_reference(batch, position):
    ref_gens = [new_generator(g) for *_, g in batch]
    got_gens = [new_generator(g) for *_, g in batch]
    ref_noise, got_noise = ([PositionNoise(s.seed) if s.seed is not None else None for _, _, s, _ in batch]
                            for _ in range(2))
    for n in (*ref_noise, *got_noise):
        if n is not None:
            n.position = position
    reference = [accept_one(t, lg, s, g, n) for (t, lg, s, _), g, n in zip(batch, ref_gens, ref_noise)]
    got = accept_all([t for t, *_ in batch], [lg for _, lg, *_ in batch], [s for _, _, s, _ in batch], got_gens,
                     got_noise)
    assert got == reference
    assert [n.position for n in got_noise if n] == [n.position for n in ref_noise if n]
    # the generators were advanced alike: the next step's draws agree too
    assert all(torch.equal(torch.rand(2, generator=a), torch.rand(2, generator=b)) for a, b in zip(ref_gens, got_gens))


def test_a_batch_that_accepts_deep_paths_is_exercised():
    """The property above is only worth its examples if acceptance goes deep: a tree whose
    target follows every node's first child accepts its whole first path, in both programs."""
    parents = [-1, -1, 0, 0, 2, 4]
    tree = DraftTree(torch.tensor([1, 2, 3, 4, 5, 0]), None, torch.tensor(parents))
    logits = torch.zeros(7, VOCAB)
    for row, token in ((0, 1), (1, 3), (3, 5), (5, 0), (6, 2)):
        logits[row, token] = 5.0
    greedy = SamplingParams(max_new_tokens=8)
    [got] = accept_all([tree], [logits], [greedy], [new_generator(0)], [None])
    assert got == accept_one(tree, logits, greedy, new_generator(0), None)
    assert got.path == (0, 2, 4, 5) and got.next_token == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_kv_moves_equal_keep_path_per_request(qwen_target, seed):
    """Random accepted paths (chains' prefixes and trees' paths) over requests in one arena:
    keep_paths' one gather/scatter per layer leaves every slot as keep_path does."""
    gen = torch.Generator().manual_seed(seed)
    c = qwen_target.text_config
    arenas = [KVArena(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, 400,
                      torch.float32, "cpu") for _ in range(2)]
    fill = [torch.randn(a.keys[0].shape, generator=gen) for a in arenas[:1] for _ in range(2 * len(a.keys))]
    plans = []
    for _ in range(5):
        prefix, verified = int(torch.randint(3, 20, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        nodes = sorted(torch.randperm(verified - 1, generator=gen)[:int(torch.randint(0, verified, (1,), generator=gen))]
                       .tolist())
        plans.append((prefix + verified, verified, nodes))
    states = []
    for arena in arenas:
        for buf, data in zip([*arena.keys, *arena.values], fill):
            buf.copy_(data)
        row = []
        for length, _, _ in plans:
            slot = arena.allocate(length + 4)
            for layer in slot.cache.layers:
                layer.length = length
            row.append(TargetState(slot.cache, length, 0))
        states.append(row)
    qwen_target.keep_paths(states[0], [v for _, v, _ in plans], [p for *_, p in plans])
    for state, (_, verified, path) in zip(states[1], plans):
        qwen_target.keep_path(state, verified, path)
    assert any(p != list(range(len(p))) for *_, p in plans)                 # some paths really move
    for a, b in zip(states[0], states[1]):
        assert a.length == b.length and [x.length for x in a.kv.layers] == [x.length for x in b.kv.layers]
        for la, lb in zip(a.kv.layers, b.kv.layers):
            assert torch.equal(la.k_buf[:, :, :la.length], lb.k_buf[:, :, :lb.length])
            assert torch.equal(la.v_buf[:, :, :la.length], lb.v_buf[:, :, :lb.length])


def _together(engine, jobs):
    """Every job streamed at once (they share decode steps); tokens per job."""
    gens = [engine.stream(v, PROMPT, s) for v, s in jobs]
    outs: list[list[int] | None] = [None] * len(gens)

    def run(i):
        outs[i] = [t for d in gens[i] for t in d.token_ids]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(gens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return outs


@pytest.mark.parametrize("tree", [0, 2], ids=["chain", "tree"])
def test_batched_greedy_equals_hf_and_batched_equals_solo(qwen_target, tree):
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=3, window=8, anchors=16, tree_width=tree or 1,
                      tree_branch=tree or 1)
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=4), spec, config=EngineConfig(prefill_chunk_tokens=64))
    videos = [synthetic_frames(4, 56, 56, seed=1), synthetic_frames(8, 84, 112, seed=2), synthetic_frames(4, 56, 84, seed=3)]
    # answers long enough (EOS ignored) that the five overlap for many steps, however loaded the machine
    jobs = [(videos[0], SamplingParams(max_new_tokens=40, ignore_eos=True)),
            (videos[1], SamplingParams(max_new_tokens=32, ignore_eos=True)),
            (videos[2], SamplingParams(max_new_tokens=36, temperature=1.0, seed=11, ignore_eos=True)),
            (videos[0], SamplingParams(max_new_tokens=30, temperature=1.0, top_k=5, seed=12, ignore_eos=True)),
            (videos[1], SamplingParams(max_new_tokens=30, temperature=0.8, ignore_eos=True))]   # unseeded: sampling program
    solo = [engine.generate(v, PROMPT, s).token_ids for v, s in jobs]
    for (video, s), out in zip(jobs[:2], solo):
        inputs = engine.prepare(video, PROMPT)
        hf = qwen_target.hf.generate(**inputs, do_sample=False, max_new_tokens=s.max_new_tokens)
        hf = hf[0, inputs["input_ids"].shape[1]:].tolist()          # HF stops at EOS; the engine went on
        assert len(hf) >= 8 and out[:len(hf)] == hf
    steps = engine.scheduler.stats["steps"]
    together = _together(engine, jobs)
    for i in range(4):
        assert together[i] == solo[i], f"request {i} batched differs from its solo run"
    assert len(together[4]) == 30
    assert engine.scheduler.stats["max_batch"] > 1 and engine.scheduler.stats["steps"] > steps
