"""The EAGLE-style baseline draft contexts ("all": every prompt token, visual ones included;
"pruned": text + a pruned share of the visual tokens): the pruning rule, lossless decoding,
a draft span that grows with the video, and training == inference as for "text"."""

import pytest
import torch
from helpers import check_unroll_equals_proposer

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.errors import InvalidRequest
from sparrow.prefix_cache import PrefixCache
from sparrow.speculative.sparrow_proposer import SparrowProposer
from sparrow.speculative.draft_context import FULL_WINDOW, DraftContext, build_context
from sparrow.speculative.glimpse import select_glimpse
from sparrow.speculative.prune import prune_budget, prune_visual
from sparrow.speculative.sampling import new_generator
from sparrow.tiny import synthetic_frames, tiny_draft
from sparrow.training import TrainConfig
from sparrow.training.signals import target_signals
from sparrow.training.unroll import context_attention

PROMPT = "What happens in the video?"
CONTEXTS = ("all", "pruned")


def spec(context: str, **kw) -> SpecConfig:
    return SpecConfig(**{"adaptive_k": False, "num_draft_tokens": 4, "window": 4, "anchors": 5, "glimpse": 2,
                         "draft_context": context, "prune_keep": 0.3, **kw})


# ----- the pruning rule ---------------------------------------------------------------------------------
def test_prune_mass_stage_takes_top_attention_until_mass():
    att = torch.zeros(20)
    att[[3, 11, 17]] = torch.tensor([0.3, 0.25, 0.2])       # 75% of the mass in three tokens
    att[att == 0] = 0.25 / 17
    # mass 0.5: 3 (0.3) then 11 (0.55 >= 0.5) -> two top tokens, the rest of keep=2 is empty
    assert prune_visual(att, None, keep=2, mass=0.5).tolist() == [3, 11]
    # mass 0.7 needs three; keep caps stage 1
    assert prune_visual(att, None, keep=2, mass=0.7).tolist() == [3, 11]
    assert set(prune_visual(att, None, keep=3, mass=0.7).tolist()) == {3, 11, 17}
    # mass 1: the budget is filled by attention alone
    assert set(prune_visual(att, (1, 4, 5), keep=4, mass=1.0).tolist()) >= {3, 11, 17}


def test_prune_uniform_stage_strides_over_the_rest_in_token_order():
    n = 48                                                   # grid (3, 4, 4): t, h, w
    att = torch.full((n,), 1.0)
    att[0] = 100.0                                           # one token holds > half the mass
    keep = prune_visual(att, (3, 4, 4), keep=7, mass=0.5)
    assert keep.tolist()[0] == 0 and keep.shape == (7,)
    uniform = keep[1:]
    # six picks over the 47 remaining tokens: evenly strided, each frame (16 tokens) gets two
    gaps = uniform.diff()
    assert int(gaps.max() - gaps.min()) <= 1
    assert torch.bincount(uniform // 16, minlength=3).tolist() == [2, 2, 2]
    # mass 0 skips stage 1: purely uniform, centred strides
    assert prune_visual(att, None, keep=4, mass=0.0).tolist() == [6, 18, 30, 42]


def test_prune_edges_and_determinism():
    att = torch.rand(30, generator=torch.Generator().manual_seed(0))
    assert prune_visual(att, None, keep=30).tolist() == list(range(30))
    assert prune_visual(att, None, keep=99).tolist() == list(range(30))
    assert prune_visual(att, None, keep=0).shape == (0,) and prune_visual(att, None, keep=0).dtype == torch.long
    assert prune_visual(att[:0], None, keep=5).shape == (0,)
    a, b = prune_visual(att, None, keep=9), prune_visual(att.clone(), None, keep=9)
    assert torch.equal(a, b) and torch.equal(a, a.sort().values) and a.unique().shape == (9,)
    ties = torch.ones(10)                                    # ties: the earlier token wins, every time
    assert prune_visual(ties, None, keep=3).tolist() == prune_visual(ties, None, keep=3).tolist()
    with pytest.raises(ValueError):
        prune_visual(att, (2, 4, 4), keep=3)                 # 32 != 30 tokens
    assert [prune_budget(n, 0.1) for n in (0, 1, 10, 11, 250)] == [0, 1, 1, 2, 25]


def test_glimpse_is_the_pruning_rule_with_its_own_bounds():
    """select_glimpse calls prune_visual; what it keeps (pinned here to the outputs of the
    glimpse's earlier, separate implementation): stage 1 takes at most half the budget,
    stage 2's picks include both ends of the remaining tokens."""
    att = 0.01 + 0.001 * torch.arange(12.0)                 # distinct: no ties to break
    att[3], att[9] = 0.5, 0.3
    # mass 0.5: token 3 alone holds it; five uniform picks over the 11 others, both ends in
    assert select_glimpse(att, 6).tolist() == [0, 2, 3, 6, 9, 11]
    assert prune_visual(att, None, keep=6).tolist() == [1, 3, 4, 6, 8, 10]   # pruning: centred strides
    # mass 1 would take every token by attention: the glimpse stops at half the budget
    assert select_glimpse(att, 6, mass=1.0).tolist() == [0, 3, 5, 9, 10, 11]
    assert select_glimpse(att, 1).tolist() == [3]
    assert select_glimpse(att, 12).tolist() == list(range(12)) and select_glimpse(att, 0).shape == (0,)
    assert prune_budget(10, 0.0) == 0 and prune_budget(10, 1.0) == 10


def test_invalid_context_settings_are_rejected():
    for bad in (dict(draft_context="visual"), dict(draft_context=""), dict(prune_keep=1.5), dict(prune_keep=-0.1)):
        with pytest.raises(InvalidRequest):
            SpecConfig(**bad)
    with pytest.raises(InvalidRequest):
        TrainConfig(context="everything")
    with pytest.raises(InvalidRequest):
        TrainConfig(prune_keep=2.0)
    assert TrainConfig(context="pruned", prune_keep=0.2).spec().draft_context == "pruned"


# ----- inference ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("context", CONTEXTS)
def test_greedy_output_equals_plain_decoding(qwen_target, llava_target, small_video, large_video, context):
    for target, video in ((qwen_target, large_video), (llava_target, small_video)):
        plain = Engine(target, spec=SpecConfig(method="none"))
        ref = plain.generate(video, PROMPT, SamplingParams(max_new_tokens=20)).token_ids
        s = spec(context)
        engine = Engine(target, tiny_draft(target, seed=1), s)
        out = engine.generate(video, PROMPT, SamplingParams(max_new_tokens=20))
        assert out.token_ids == ref
        assert out.metrics.steps > 0 and out.metrics.draft_tokens > 0


def test_draft_keys_grow_with_the_video_in_all_but_not_in_text(qwen_target):
    keys, memory = {}, {}
    for context in ("text", "all", "pruned"):
        s = spec(context, prune_keep=0.25)
        engine = Engine(qwen_target, tiny_draft(qwen_target), s)
        for frames in (4, 32):
            m = engine.generate(synthetic_frames(frames, 56, 56), PROMPT,
                                SamplingParams(max_new_tokens=12, ignore_eos=True)).metrics
            keys[context, frames] = (m.visual_tokens, m.draft_max_keys)
            memory[context, frames] = m.draft_kv_bytes
    (v4, text4), (v32, text32) = keys["text", 4], keys["text", 32]
    assert v32 >= 8 * v4 and text4 == text32 <= 5 + 4 + 2
    # the draft's KV buffers: the same for any video with "text", growing with it otherwise
    assert 0 < memory["text", 4] == memory["text", 32] < memory["pruned", 32] < memory["all", 32]
    assert memory["all", 4] < memory["all", 32] and memory["pruned", 4] < memory["pruned", 32]
    grow_all = keys["all", 32][1] - keys["all", 4][1]
    grow_pruned = keys["pruned", 32][1] - keys["pruned", 4][1]
    # every visual token is a key (up to where the last draft step of each run happened to end)
    k = 4
    assert abs(grow_all - (v32 - v4)) < k
    assert abs(grow_pruned - (prune_budget(v32, 0.25) - prune_budget(v4, 0.25))) < k
    assert keys["all", 4][1] > keys["pruned", 4][1] > text4


def test_all_context_keeps_every_entry_and_round_trips(qwen_target, small_video):
    s = spec("all")
    draft = tiny_draft(qwen_target)
    proposer = SparrowProposer(draft, s)
    engine = Engine(qwen_target, draft, s)
    inputs = engine.prepare(small_video, PROMPT)
    pre = qwen_target.prefill(inputs, 512, proposer.needs.feature_layers, proposer.needs.bridge_layer, visual_features=True)
    ctx = build_context(pre, 7, s.glimpse, "all")
    ids = inputs["input_ids"][0]
    assert torch.equal(ctx.token_ids, torch.cat([ids[1:], torch.tensor([7])]))       # every t >= 1, in order
    assert ctx.num_prompt == ids.shape[0] - 1 and ctx.num_visual == int((ids == qwen_target.video_token_id).sum())
    again = DraftContext.from_tensors(ctx.to_tensors())
    assert (again.num_prompt, again.num_visual) == (ctx.num_prompt, ctx.num_visual)
    state = proposer.begin_context(again)
    assert len(state.kv) == s.glimpse + ctx.token_ids.shape[0]                      # nothing skipped
    proposer.propose_one(state, 3, SamplingParams(), new_generator(0))
    proposer.commit_one(state, [5, 6], torch.zeros(2, ctx.features.shape[1]))
    proposer.propose_one(state, 1, SamplingParams(), new_generator(0))              # runs the commit
    assert len(state.kv) == s.glimpse + ctx.token_ids.shape[0] + 2                  # nothing evicted
    assert state.kv.max_visible == len(state.kv) and proposer.window == FULL_WINDOW
    text = build_context(qwen_target.prefill(inputs, 512, proposer.needs.feature_layers, proposer.needs.bridge_layer),
                         7, s.glimpse)                                             # "text" is untouched
    assert text.num_visual == 0 and text.token_ids.shape[0] == ctx.token_ids.shape[0] - ctx.num_visual


@pytest.mark.parametrize("context", ["all", "text"])
def test_begin_in_slices_equals_one_pass(qwen_target, small_video, monkeypatch, context):
    """A full-context draft builds its cache over the prompt in bounded slices (each attending to
    the ones before through the cache): the same cache and last hidden state as one dense pass."""
    import sparrow.speculative.sparrow_proposer as propose

    s = spec(context)
    draft = tiny_draft(qwen_target)
    proposer = SparrowProposer(draft, s)
    inputs = Engine(qwen_target, draft, s).prepare(small_video, PROMPT)
    pre = qwen_target.prefill(inputs, 512, proposer.needs.feature_layers, proposer.needs.bridge_layer,
                              visual_features=context != "text")
    ctx = build_context(pre, 7, s.glimpse, context)
    one = proposer.begin_context(ctx)
    calls = []
    real = draft.forward_packed
    monkeypatch.setattr(draft, "forward_packed", lambda z, *a: calls.append(z.shape[0]) or real(z, *a))
    monkeypatch.setattr(propose, "BEGIN_SLICE_ENTRIES", 64 * 64)
    sliced = proposer.begin_context(ctx)
    n = len(one.kv)
    if context == "all":
        assert len(calls) > 2 and max(calls) == 64                     # 64 rows a slice: 4,096 // (n > 64) -> 64
    assert len(sliced.kv) == n and sliced.committed == one.committed
    for a, b in ((one.kv._k, sliced.kv._k), (one.kv._v, sliced.kv._v)):
        for x, y in zip(a, b):
            torch.testing.assert_close(x[..., :n, :], y[..., :n, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one.last_hidden, sliced.last_hidden, rtol=1e-5, atol=1e-5)


def test_cached_video_prefix_serves_the_pruned_context(qwen_target, small_video):
    s = spec("pruned")
    draft = tiny_draft(qwen_target)
    cached = Engine(qwen_target, draft, s, prefix_cache=PrefixCache())
    plain = Engine(qwen_target, spec=SpecConfig(method="none"))
    sampling = SamplingParams(max_new_tokens=12)
    for prompt in (PROMPT, "Which shape moves first?"):
        out = cached.generate(small_video, prompt, sampling, video_key="clip")
        assert out.token_ids == plain.generate(small_video, prompt, sampling).token_ids
    assert out.metrics.cached_prompt_tokens > out.metrics.visual_tokens
    a = Engine(qwen_target, draft, s).generate(small_video, prompt, sampling).metrics
    assert (a.accepted_tokens, a.draft_max_keys) == (out.metrics.accepted_tokens, out.metrics.draft_max_keys)
    # the split prefill hands the draft the same visual entries as the full one
    layers, bridge = cached.proposer.needs.feature_layers, cached.proposer.needs.bridge_layer
    inputs = cached.prepare(small_video, prompt)
    full = qwen_target.prefill(inputs, 512, layers, bridge, visual_features=True)
    split = qwen_target.prefill(inputs, 512, layers, bridge, visual_features=True,
                                prefix=qwen_target.prefill_prefix(inputs, layers, bridge, visual_features=True))
    for name in ("text_positions", "visual_positions"):
        assert torch.equal(getattr(split, name), getattr(full, name))
    torch.testing.assert_close(split.visual_features, full.visual_features, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):      # a prefix cached without them cannot serve this context
        qwen_target.prefill(inputs, 512, layers, bridge, visual_features=True,
                            prefix=qwen_target.prefill_prefix(inputs, layers, bridge))


# ----- training == inference ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def response(qwen_target, small_video):
    engine = Engine(qwen_target, spec=SpecConfig(method="none"))
    processed = engine.process_video(small_video)
    return processed, engine.generate(processed, PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids


@pytest.mark.parametrize("context", CONTEXTS)
def test_signals_are_what_prefill_gives_the_draft(qwen_target, response, context):
    processed, tokens = response
    s = spec(context)
    draft = tiny_draft(qwen_target, seed=1)
    dc = draft.config
    sig = target_signals(qwen_target, processed, PROMPT, tokens, dc.feature_layers, dc.bridge_layer,
                         context, s.prune_keep)
    pre = qwen_target.prefill(qwen_target.build_inputs(processed, PROMPT), 512, dc.feature_layers, dc.bridge_layer,
                              visual_features=True)
    ctx = build_context(pre, int(sig.token_ids[sig.num_prompt]), s.glimpse, context, s.prune_keep)
    p = sig.num_prompt
    assert torch.equal(ctx.token_ids, sig.token_ids[: p + 1]) and ctx.num_prompt == p
    assert ctx.num_visual == sig.num_visual > 0
    torch.testing.assert_close(ctx.features, sig.features[: p + 1], atol=1e-4, rtol=1e-4)
    if context == "pruned":
        assert sig.num_visual == prune_budget(processed.num_visual_tokens, s.prune_keep)


@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("context", CONTEXTS)
def test_training_masks_and_outputs_equal_inference(qwen_target, response, context, offset):
    """As tests/test_training.py for "text": chain start s = P + offset; the proposer's
    distributions and the keys each step sees equal the training unroll's."""
    processed, tokens = response
    s_cfg = spec(context)
    draft = tiny_draft(qwen_target, seed=1)
    dc = draft.config
    sig = target_signals(qwen_target, processed, PROMPT, tokens, dc.feature_layers, dc.bridge_layer,
                         context, s_cfg.prune_keep)
    s, p = sig.num_prompt + offset, sig.num_prompt
    pinned, window = context_attention(context, sig.num_entries, p, s_cfg.anchors, s_cfg.window)
    inference_rows = check_unroll_equals_proposer(draft, s_cfg, sig, s, pinned, window, s_cfg.glimpse)
    # every query sees the whole glimpse + every entry up to itself: nothing is windowed out
    assert inference_rows[0].shape[0] == s_cfg.glimpse + s + 1
    assert inference_rows[-1].shape[0] == s_cfg.glimpse + s + s_cfg.num_draft_tokens


@pytest.mark.parametrize("context", CONTEXTS)
def test_train_draft_runs_and_evaluates_in_the_same_context(qwen_target, context, monkeypatch):
    import sparrow.training.trainer as trainer_module
    from sparrow.training import DraftTrainer, Sample

    cfg = TrainConfig(steps=2, grad_accum=1, warmup=1, unroll=2, window=4, anchors=5, bridge_tokens=2,
                      context=context, prune_keep=0.3, max_new_tokens=6, log_every=100, eval_every=2,
                      eval_samples=1, save_every=0)
    seen = []
    real = trainer_module.held_out_tau

    def recording(target, draft, samples, spec, *args):
        seen.append(spec)
        return real(target, draft, samples, spec, *args)

    monkeypatch.setattr(trainer_module, "held_out_tau", recording)
    samples = [Sample(synthetic_frames(4, 56, 56, seed=i), PROMPT) for i in range(2)]
    trainer = DraftTrainer.fresh(qwen_target, samples[:1], cfg, heldout=samples[1:], log=lambda _: None)
    sig = trainer.signals(0)
    assert sig.num_visual > 0 and sig.num_prompt > sig.num_visual
    summary = trainer.fit()
    assert summary["steps"] == 2 and summary["heldout"]["samples"] == 1
    assert [(s.draft_context, s.prune_keep) for s in seen] == [(context, 0.3)]


def test_a_prefix_cached_for_a_draft_that_reads_less_is_prefilled_again(qwen_target, small_video):
    """Engines sharing one prefix cache (the benchmarks', a server's methods): a video prefilled
    for plain decoding holds no draft features, one prefilled for a text-only draft no
    bridge-layer states; a request whose draft reads them prefills the video again (a miss, not
    an error) and answers as it does alone, and the richer entry then serves the others."""
    cache, draft = PrefixCache(), tiny_draft(qwen_target)
    plain = Engine(qwen_target, spec=SpecConfig(method="none"), prefix_cache=cache)
    text = Engine(qwen_target, draft, spec("text", glimpse=0), prefix_cache=cache)
    glimpse = Engine(qwen_target, draft, spec("text", glimpse=2), prefix_cache=cache)
    sampling = SamplingParams(max_new_tokens=12)
    alone = Engine(qwen_target, draft, spec("text", glimpse=2)).generate(small_video, PROMPT, sampling)
    assert plain.generate(small_video, PROMPT, sampling, video_key="clip").token_ids == alone.token_ids
    assert text.generate(small_video, PROMPT, sampling, video_key="clip").metrics.cached_prompt_tokens == 0  # no features
    assert text.generate(small_video, PROMPT, sampling, video_key="clip").metrics.cached_prompt_tokens > 0
    out = glimpse.generate(small_video, PROMPT, sampling, video_key="clip")
    assert out.token_ids == alone.token_ids and out.metrics.cached_prompt_tokens == 0
    assert (out.metrics.accepted_tokens, out.metrics.draft_max_keys) == (alone.metrics.accepted_tokens,
                                                                          alone.metrics.draft_max_keys)
    again = text.generate(small_video, "Which shape moves first?", sampling, video_key="clip")
    assert again.metrics.cached_prompt_tokens > 0


def test_the_glimpse_scores_a_cached_videos_prompt_rows_once(qwen_target, large_video, monkeypatch):
    """glimpse.prompt_attention: the text rows before the video's end (the system prompt's) are
    scored against the video once per cached video, by the question whose prefill made the cached
    prefix (it keeps the mass there); later questions score only their own rows. The first,
    uncached question and a cached one split the rows at the same place, so their attention is
    bitwise the same, and it equals one mean over all rows up to rounding."""
    from sparrow.speculative import draft_context, glimpse

    seen, scored = [], []
    real_attention, real_mass = glimpse.prompt_attention, glimpse.visual_mass

    def attention(prefill):
        att = real_attention(prefill)
        seen.append((att, glimpse.text_to_visual_attention(prefill.bridge_text, prefill.bridge_visual),
                     prefill.video_text_rows, prefill.prefix))
        return att

    def mass(text, visual):
        scored.append(text.shape[0])
        return real_mass(text, visual)

    monkeypatch.setattr(draft_context, "prompt_attention", attention)
    monkeypatch.setattr(glimpse, "visual_mass", mass)
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=1), spec("text"), prefix_cache=PrefixCache())
    outs = [engine.generate(large_video, PROMPT, SamplingParams(max_new_tokens=6), video_key="v") for _ in range(3)]
    assert [o.metrics.cached_prompt_tokens > 0 for o in outs] == [False, True, True]
    (first, ref, m, made), (second, _, m2, prefix), (third, _, _, same) = seen
    assert made is prefix is same and m == m2 == prefix.bridge_text.shape[0] > 0
    assert torch.equal(first, second) and torch.equal(second, third)
    torch.testing.assert_close(first, ref, rtol=1e-5, atol=1e-7)
    assert torch.equal(select_glimpse(first, 2), select_glimpse(ref, 2))
    assert torch.equal(prefix.glimpse_mass, real_mass(prefix.bridge_text, prefix.bridge_visual))
    # rows scored, each question's last call the reference mean over all n rows: the first question
    # both parts (the prefix's rows kept on the prefix it made); the later ones their own only
    n = prefix.bridge_text.shape[0] + (q := scored[1])
    assert q > 0 and scored == [m, q, n, q, n, q, n]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
