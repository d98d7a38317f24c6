"""EAGLE-3 drafts in the published layout (config.json with draft_vocab_size, fc over 3H, a
midlayer over [embedding ; hidden], its own norm and lm_head over a reduced vocabulary with
d2t / t2d): written here by the test, loaded by Eagle3Draft.from_pretrained, and lossless
through the engine's one acceptance path."""

import json

import pytest
import torch
from safetensors.torch import save_file

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.errors import InvalidRequest
from sparrow.speculative.draft_context import DraftContext
from sparrow.speculative.eagle3 import Eagle3Draft, Eagle3Proposer

PROMPT = "What happens in the video?"
SPEC = SpecConfig(adaptive_k=False, num_draft_tokens=3, draft_context="all")


def write_eagle3(path, target, seed=0, own_embed=False, draft_vocab=None, drop=()):
    """A random EAGLE-3 draft for `target`, as SpecForge writes one; returns (tensors, draft ids)."""
    tc = target.text_config
    h, v = tc.hidden_size, target.vocab_size
    heads, kv_heads = tc.num_attention_heads, tc.num_key_value_heads
    d = h // heads
    vd = draft_vocab or v // 2
    g = torch.Generator().manual_seed(seed)
    keep = torch.sort(torch.randperm(v, generator=g)[:vd]).values               # target ids in the draft vocab
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.2                          # noqa: E731
    t = {"fc.weight": rnd(h, 3 * h), "norm.weight": 1 + rnd(h), "lm_head.weight": rnd(vd, h),
         "midlayer.input_layernorm.weight": 1 + rnd(h), "midlayer.hidden_norm.weight": 1 + rnd(h),
         "midlayer.post_attention_layernorm.weight": 1 + rnd(h),
         "midlayer.self_attn.q_proj.weight": rnd(heads * d, 2 * h),
         "midlayer.self_attn.k_proj.weight": rnd(kv_heads * d, 2 * h),
         "midlayer.self_attn.v_proj.weight": rnd(kv_heads * d, 2 * h),
         "midlayer.self_attn.o_proj.weight": rnd(h, heads * d),
         "midlayer.mlp.gate_proj.weight": rnd(2 * h, h), "midlayer.mlp.up_proj.weight": rnd(2 * h, h),
         "midlayer.mlp.down_proj.weight": rnd(h, 2 * h),
         "d2t": keep - torch.arange(vd), "t2d": torch.zeros(v, dtype=torch.bool).index_fill_(0, keep, True)}
    if own_embed:
        t["embed_tokens.weight"] = rnd(v, h)
    for name in drop:
        t.pop(name)
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": 2 * h, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "vocab_size": v, "draft_vocab_size": vd, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 32768, "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    (path / "config.json").write_text(json.dumps(config))
    return t, keep


def hf_greedy(target, engine, video, n):
    inputs = engine.prepare(video, PROMPT)
    return target.hf.generate(**inputs, do_sample=False, max_new_tokens=n)[0, inputs["input_ids"].shape[1]:].tolist()


def test_layout_loads_every_tensor(tmp_path, qwen_target):
    tensors, _ = write_eagle3(tmp_path, qwen_target)
    draft = Eagle3Draft.from_pretrained(tmp_path, qwen_target)
    state = draft.state_dict()
    assert set(state) == set(tensors)                    # the target's embedding is shared, not owned
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name
    assert draft.config.feature_layers == (1, 2, 3) and draft.d2t.dtype == torch.long


@pytest.mark.parametrize("drop", [("midlayer.hidden_norm.weight",), ("d2t",)])
def test_other_layouts_are_refused(tmp_path, qwen_target, drop):
    write_eagle3(tmp_path, qwen_target, drop=drop)
    with pytest.raises(InvalidRequest, match="EAGLE-3 layout"):
        Eagle3Draft.from_pretrained(tmp_path, qwen_target)


def test_cached_steps_equal_one_pass(tmp_path, qwen_target):
    """begin over n entries then commits of 2 and 3 == one forward over all of them, in a cache
    that grows (doubling) as in one sized for them; rollback is a length move."""
    write_eagle3(tmp_path, qwen_target, seed=3)
    draft = Eagle3Draft.from_pretrained(tmp_path, qwen_target)
    g = torch.Generator().manual_seed(0)
    ids, hidden = torch.randint(0, 500, (12,), generator=g), torch.randn(12, 64, generator=g)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        whole = draft.forward_entries(ids, hidden, draft.empty_kv(cpu, 12))
        kv = draft.empty_kv(cpu)
        parts = torch.cat([draft.forward_entries(ids[a:b], hidden[a:b], kv) for a, b in ((0, 7), (7, 9), (9, 12))])
        kv.truncate(9)
        again = draft.forward_entries(ids[9:], hidden[9:], kv)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, parts[9:])
    c = draft.config
    assert (len(kv), kv.capacity, kv.max_visible) == (12, 14, 12)           # capacity 1 -> 7 -> 14
    assert kv.nbytes == 2 * c.num_kv_heads * 14 * c.head_dim * kv.keys[0].element_size()


def test_a_commit_runs_at_the_next_propose(tmp_path, qwen_target):
    """A commit runs no draft pass (the deferred commit, speculative/proposer.py): two steps'
    entries wait, and the next propose runs them in one pass before it drafts."""
    write_eagle3(tmp_path, qwen_target, seed=3)
    proposer = Eagle3Proposer(Eagle3Draft.from_pretrained(tmp_path, qwen_target))
    draft, g = proposer.draft, torch.Generator().manual_seed(0)
    width = draft.fc.in_features
    ctx = DraftContext(torch.randint(0, 500, (8,), generator=g), torch.randn(8, width, generator=g), 8,
                       torch.zeros(0, draft.fc.out_features))
    state = proposer.begin_context(ctx, 8)
    passes, real = [], draft.forward_entries
    draft.forward_entries = lambda ids, *a: (passes.append(ids.shape[0]), real(ids, *a))[1]
    feats = torch.randn(5, width, generator=g)
    proposer.commit_one(state, [1, 2], feats[:2])
    proposer.commit_one(state, [3, 4, 5], feats[2:])
    assert passes == [] and state.committed == 8
    proposer.propose_one(state, 1, SamplingParams(), torch.Generator())
    assert passes == [5] and state.committed == 13 and not state.pending


@pytest.mark.parametrize("own_embed", [False, True])
def test_eagle3_is_lossless_and_drafts_from_its_vocabulary(tmp_path, any_target, small_video, own_embed):
    _, keep = write_eagle3(tmp_path, any_target, seed=1, own_embed=own_embed)
    proposer = Eagle3Proposer(Eagle3Draft.from_pretrained(tmp_path, any_target))
    engine = Engine(any_target, spec=SPEC, proposer=proposer)
    out = engine.generate(small_video, PROMPT, SamplingParams(max_new_tokens=20))
    assert out.token_ids == hf_greedy(any_target, engine, small_video, 20)
    m, c = out.metrics, proposer.draft.config
    assert m.draft_tokens > 0
    # Its KV buffers, sized at begin for every prompt entry + 20 new tokens + 3 drafts + 1 (never grown).
    per_entry = 2 * c.num_kv_heads * c.head_dim * proposer.draft.fc.weight.element_size()
    assert m.draft_kv_bytes == per_entry * (m.prompt_tokens + 20 + 3 + 1)
    assert m.prompt_tokens < m.draft_max_keys < m.prompt_tokens + 20 + 3
    drafted = []
    real = proposer.propose
    proposer.propose = lambda batch: drafted.extend(out := real(batch)) or out
    sampled = engine.generate(small_video, PROMPT, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5))
    again = engine.generate(small_video, PROMPT, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5))
    assert sampled.token_ids == again.token_ids
    allowed = set(keep.tolist())
    for p in drafted:
        assert set(p.tokens.tolist()) <= allowed
        outside = torch.ones(any_target.vocab_size, dtype=torch.bool).index_fill_(0, keep, False)
        assert float(p.probs[:, outside].sum()) == 0.0 and torch.allclose(p.probs.sum(-1), torch.ones(len(p.tokens)))


def test_pass_through_draft_proposes_the_last_emitted_token(tmp_path, qwen_target, small_video):
    """A checkpoint whose layer passes the last target layer's (final-normed) state through, with
    a plain norm (a positive rescale: same argmax) and the target's lm_head in reverse row order,
    undone by d2t. Its first draft after each entry (x_t, h_{t-1}) is then the target's argmax
    at t-1, which is x_t itself: so every step's first draft token must be the token emitted
    last. That holds only if d2t, the order of the fused features and the commit path are right."""
    tensors, _ = write_eagle3(tmp_path, qwen_target, draft_vocab=qwen_target.vocab_size)
    h, v = qwen_target.hidden_size, qwen_target.vocab_size
    fc = torch.zeros(h, 3 * h)
    fc[:, 2 * h:] = torch.eye(h)                                 # the third feature layer only
    outputs = ("o_proj.weight", "down_proj.weight")               # attention and MLP add nothing: a pass-through
    tensors.update({k: torch.zeros_like(t) for k, t in tensors.items() if k.endswith(outputs)})
    tensors.update({"fc.weight": fc, "norm.weight": torch.ones(h),
                    "lm_head.weight": qwen_target.lm_head().weight.detach().flip(0).clone(),
                    "d2t": v - 1 - 2 * torch.arange(v)})        # draft id d is target id v - 1 - d
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, qwen_target.num_layers]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    proposer = Eagle3Proposer(Eagle3Draft.from_pretrained(tmp_path, qwen_target))
    firsts, commits = [], []
    propose, commit = proposer.propose, proposer.commit

    def recording_propose(batch):
        out = propose(batch)
        firsts.extend(int(p.tokens[0]) for p in out)
        return out

    def recording_commit(states, results):
        commits.extend(list(r.tokens) for r in results)
        commit(states, results)

    proposer.propose, proposer.commit = recording_propose, recording_commit
    engine = Engine(qwen_target, spec=SPEC, proposer=proposer)
    out = engine.generate(small_video, PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert out.token_ids == hf_greedy(qwen_target, engine, small_video, 16)
    emitted_last = [out.token_ids[0]] + [c[-1] for c in commits]
    assert len(firsts) >= 3 and firsts == emitted_last[: len(firsts)]
