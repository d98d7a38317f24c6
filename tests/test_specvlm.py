"""SpecVLM-style proposer (a small VLM on a pruned video): lossless against plain decoding,
exact cache rollback, the 90% visual-token cut, seeded sampling, config errors."""

import math

import pytest
import torch

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.errors import InvalidRequest
from sparrow.models import TargetModel
from sparrow.prefix_cache import PrefixCache
from sparrow.speculative.glimpse import text_to_visual_attention
from sparrow.speculative.prune import prune_visual
from sparrow.speculative.specvlm import SpecVLMProposer
from sparrow.tiny import tiny_target
from sparrow.tokenizer import llava_ov_tokenizer
from sparrow.video import processor_for

PROMPT = "What happens in the video?"
SMALL = dict(hidden=32, layers=2, heads=2)     # half the tiny target's width and depth


@pytest.fixture(scope="module")
def small_vlms(tmp_path_factory):
    """Two small Qwen2.5-VL drafts; the first goes through save_pretrained/from_pretrained."""
    path = tmp_path_factory.mktemp("small_vlm")
    tiny_target("qwen2_5_vl", seed=5, **SMALL).save_pretrained(path)
    return [TargetModel.from_pretrained(path), tiny_target("qwen2_5_vl", seed=6, **SMALL)]


def specvlm_engine(target, small, keep_ratio=0.1, num_draft_tokens=4, prefix_cache=None) -> Engine:
    """An engine drafting with SpecVLM; the proposer keeps as many videos' visual tokens as
    the prefix cache keeps prefills."""
    proposer = SpecVLMProposer(target, small, keep_ratio=keep_ratio,
                               video_cache_entries=prefix_cache.max_entries if prefix_cache is not None else 0)
    return Engine(target, spec=SpecConfig(adaptive_k=False, method="specvlm", num_draft_tokens=num_draft_tokens), proposer=proposer,
                  prefix_cache=prefix_cache)


class Recording(SpecVLMProposer):
    """Keeps every request's state and checks the cache invariant after each commit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.states, self.committed = [], 0

    def begin(self, start):
        state = super().begin(start)
        self.states.append(state)
        self.prompt_len = start.inputs["input_ids"].shape[1]
        self.room = start.room
        self.committed = 1                                   # the first token, from prefill
        assert state.kv_bytes() > 0                          # the cache is allocated for the whole request
        return state

    def commit_one(self, state, tokens, features=None):
        super().commit_one(state, tokens)
        self.committed += len(tokens)
        # The cache holds kept prompt + every emitted token except the pending ones: nothing
        # rejected is left behind, nothing accepted is fed twice.
        fed = self.committed - len(state.pending)
        assert state.cached == state.prompt_entries + fed
        assert state.next_index == self.prompt_len + fed
        assert 1 <= len(state.pending) <= 2

    def end(self, state):
        self.final_bytes = state.kv_bytes()                  # what the request held at its end
        self.final_capacity = state.capacity
        super().end(state)
        assert state.kv_bytes() == 0                         # freed


def plain_tokens(target, video, sampling, prompt=PROMPT):
    return Engine(target, spec=SpecConfig(method="none")).generate(video, prompt, sampling).token_ids


@pytest.mark.parametrize("small_index", [0, 1])
@pytest.mark.parametrize("video_name", ["small_video", "large_video"])
def test_greedy_equals_plain_decoding(qwen_target, small_vlms, video_name, small_index, request):
    video = request.getfixturevalue(video_name)
    sampling = SamplingParams(max_new_tokens=24)
    proposer = Recording(qwen_target, small_vlms[small_index], keep_ratio=0.1)
    out = Engine(qwen_target, spec=SpecConfig(adaptive_k=False, num_draft_tokens=4), proposer=proposer).generate(video, PROMPT, sampling)
    assert out.token_ids == plain_tokens(qwen_target, video, sampling)
    assert out.metrics.steps > 0 and out.metrics.draft_tokens > 0
    # The draft's KV memory: the small VLM's preallocated buffers, sized at begin for the kept
    # prompt + every new token + one step's drafts + 1, and never grown.
    small = small_vlms[small_index]
    state, c = proposer.states[-1], small.text_config
    size = torch.empty(0, dtype=small.hf.dtype).element_size()
    per_entry = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * size
    assert proposer.room == sampling.max_new_tokens + 4 + 1
    assert proposer.final_capacity == state.prompt_entries + proposer.room
    assert out.metrics.draft_kv_bytes == proposer.final_bytes == proposer.final_capacity * per_entry
    assert state.prompt_entries < out.metrics.draft_max_keys <= state.prompt_entries + sampling.max_new_tokens
    assert state.cache is None                               # released at the end of the request


def test_llava_onevision_greedy_equals_plain_decoding(llava_target, large_video):
    small = tiny_target("llava_onevision", seed=5, **SMALL)
    sampling = SamplingParams(max_new_tokens=24)
    engine = specvlm_engine(llava_target, small, keep_ratio=0.1)
    out = engine.generate(large_video, PROMPT, sampling)
    assert out.token_ids == plain_tokens(llava_target, large_video, sampling) and out.metrics.draft_tokens > 0


def test_target_as_draft_accepts_every_token(any_target, large_video):
    """The target itself on the full video: its drafts are its own greedy tokens, so every
    one is accepted; any slip in the rollback/commit bookkeeping would show as a rejection."""
    k, sampling = 4, SamplingParams(max_new_tokens=31, ignore_eos=True)
    proposer = Recording(any_target, any_target, keep_ratio=1.0)
    assert proposer.needs.bridge_layer is None                     # no pruning: no hidden states asked for
    out = Engine(any_target, spec=SpecConfig(adaptive_k=False, num_draft_tokens=k), proposer=proposer).generate(
        large_video, PROMPT, sampling)
    m = out.metrics
    assert out.token_ids == plain_tokens(any_target, large_video, sampling)
    assert m.accepted_tokens == m.draft_tokens
    assert m.mean_acceptance_length == k + 1 and m.steps == 6    # 1 + 6 * 5 = 31 tokens
    assert proposer.states[0].num_kept == proposer.states[0].num_visual


def test_full_video_draft_prefill_matches_hf_forward(qwen_target, small_vlms, small_video):
    """keep_ratio 1: the draft's cache + explicit M-RoPE positions reproduce the HF model's own
    forward over the whole prompt (which builds its 3-axis positions itself)."""
    small = small_vlms[0]
    engine = Engine(qwen_target, spec=SpecConfig(method="none"))
    inputs = engine.prepare(small_video, PROMPT)
    proposer = SpecVLMProposer(qwen_target, small, keep_ratio=1.0)
    pre = qwen_target.prefill(inputs, capacity=inputs["input_ids"].shape[1] + 8)
    first = int(pre.logits.argmax())
    state = proposer.begin_request(pre, inputs, None, first)
    with torch.inference_mode():
        got = proposer._feed(state, [first])
    ids = torch.cat([inputs["input_ids"], torch.tensor([[first]])], dim=1)
    full = dict(inputs, input_ids=ids, attention_mask=torch.ones_like(ids),
                mm_token_type_ids=torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.int32)], 1))
    with torch.inference_mode():
        ref = small.hf(**full).logits[0, -1].float()
    small.hf.model.rope_deltas = None                        # HF's own forward leaves this behind
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_keep_ratio_cuts_visual_tokens_by_90_percent(qwen_target, small_vlms, large_video):
    proposer = Recording(qwen_target, small_vlms[0], keep_ratio=0.1, mass=0.5)
    engine = Engine(qwen_target, spec=SpecConfig(adaptive_k=False, num_draft_tokens=3), proposer=proposer)
    seen = []                                                # the small LM's prefill inputs
    hook = small_vlms[0].hf.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs) if kwargs.get("inputs_embeds") is not None else None,
        with_kwargs=True)
    try:
        out = engine.generate(large_video, PROMPT, SamplingParams(max_new_tokens=8))
    finally:
        hook.remove()
    state, nv = proposer.states[0], out.metrics.visual_tokens
    assert state.num_visual == nv and state.num_kept == math.ceil(0.1 * nv) < nv
    assert state.prompt_entries == out.metrics.prompt_tokens - nv + state.num_kept
    # The kept tokens are the two-stage selection under the target's bridge-layer attention.
    inputs = engine.prepare(large_video, PROMPT)
    pre = qwen_target.prefill(inputs, capacity=inputs["input_ids"].shape[1] + 1, bridge_layer=proposer.needs.bridge_layer)
    attention = text_to_visual_attention(pre.bridge_text, pre.bridge_visual)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    expected = prune_visual(attention, (t, h // 2, w // 2), state.num_kept, 0.5)
    assert torch.equal(state.kept_visual, expected)
    assert int(attention.argmax()) in state.kept_visual.tolist()
    # Kept tokens sit at their ORIGINAL 3-axis M-RoPE positions, not re-numbered ones.
    full_pos, _ = small_vlms[0].family.prefill_positions(small_vlms[0].hf, inputs)
    keep = inputs["input_ids"][0] != qwen_target.video_token_id
    keep[torch.nonzero(~keep).view(-1)[expected]] = True
    assert len(seen) == 1 and seen[0]["inputs_embeds"].shape[1] == state.prompt_entries
    assert torch.equal(seen[0]["position_ids"], full_pos[..., keep])
    # A tenth of the visual tokens: a much smaller draft cache than the unpruned one.
    full = Recording(qwen_target, small_vlms[0], keep_ratio=1.0)
    Engine(qwen_target, spec=SpecConfig(adaptive_k=False, num_draft_tokens=3), proposer=full).generate(
        large_video, PROMPT, SamplingParams(max_new_tokens=8))
    assert proposer.final_bytes < full.final_bytes


def test_sampling_is_seeded_and_reproducible(qwen_target, small_vlms, small_video):
    engine = specvlm_engine(qwen_target, small_vlms[1], keep_ratio=0.1, num_draft_tokens=3)
    s = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11)
    a, b = engine.generate(small_video, PROMPT, s), engine.generate(small_video, PROMPT, s)
    assert a.token_ids == b.token_ids and a.metrics.draft_tokens > 0
    outs = [engine.generate(small_video, PROMPT, SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed))
            for seed in range(3)]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    held = [o.metrics.draft_kv_bytes for o in [a, b, *outs]]
    assert all(b > 0 for b in held) and len(set(held)) == 1      # one video, one prompt: the same buffers
    # The target as its own draft at T=1: q == p, so (almost) every draft token is accepted.
    own = specvlm_engine(qwen_target, qwen_target, keep_ratio=1.0, num_draft_tokens=3)
    torch.manual_seed(0)
    rng_before = torch.get_rng_state()
    m = own.generate(small_video, PROMPT, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3,
                                                         ignore_eos=True)).metrics
    assert torch.equal(torch.get_rng_state(), rng_before)          # never the global RNG
    assert m.accepted_tokens >= 0.9 * m.draft_tokens


def test_bad_config_raises(qwen_target, llava_target, small_vlms):
    small = small_vlms[0]
    for kwargs in (dict(keep_ratio=1.5), dict(keep_ratio=-0.1), dict(mass=2.0), dict(bridge_layer=99)):
        with pytest.raises(InvalidRequest):
            SpecVLMProposer(qwen_target, small, **kwargs)
    with pytest.raises(InvalidRequest, match="family"):
        SpecVLMProposer(qwen_target, llava_target)
    with pytest.raises(InvalidRequest, match="tokenizer"):
        SpecVLMProposer(qwen_target, TargetModel(small.hf, llava_ov_tokenizer()))
    with pytest.raises(InvalidRequest, match="processor"):
        SpecVLMProposer(qwen_target, TargetModel(small.hf, small.tokenizer, processor_for(small.hf.config,
                                                                                          merge_size=1)))
    with pytest.raises(InvalidRequest):
        SpecConfig(adaptive_k=False, method="specvlm", num_draft_tokens=0)
    with pytest.raises(InvalidRequest, match="needs a draft"):
        Engine(qwen_target, spec=SpecConfig(adaptive_k=False, method="specvlm"))


def test_prefix_cache_hits_reuse_the_small_vlms_visual_tokens(qwen_target, small_vlms, small_video):
    """A hit carries no pixels: the proposer reuses the small VLM's visual tokens it kept for
    the key, and a hit on a key it does not hold is a clear error that loses nothing."""
    cache = PrefixCache(max_entries=2)
    sampling = SamplingParams(max_new_tokens=12)
    plain = plain_tokens(qwen_target, small_video, sampling)
    # The target as its own small VLM, seeing every visual token: it proposes exactly what the
    # target decodes only if the visual tokens it gets on a hit are the video's own.
    mirror = specvlm_engine(qwen_target, qwen_target, keep_ratio=1.0, prefix_cache=PrefixCache(max_entries=2))
    first = mirror.generate(small_video, PROMPT, sampling, video_key="clip")
    again = mirror.generate(None, PROMPT, sampling, video_key="clip")      # the video is not sent again
    assert first.token_ids == plain and again.token_ids == plain
    assert again.metrics.cached_prompt_tokens > 0 and first.metrics.cached_prompt_tokens == 0
    assert again.metrics.accepted_tokens == again.metrics.draft_tokens > 0
    assert again.metrics.tau == first.metrics.tau > 3.0

    engine = specvlm_engine(qwen_target, small_vlms[0], prefix_cache=cache)
    assert engine.generate(small_video, PROMPT, sampling, video_key="clip").token_ids == plain
    # Another question on the cached video: the small VLM sees the same pruned video.
    other = "Describe the colours."
    assert (engine.generate(None, other, sampling, video_key="clip").token_ids
            == plain_tokens(qwen_target, small_video, sampling, other))
    # The proposer keeps as many videos as the prefix cache; a prefix made by another engine
    # (sharing the cache) is not in this proposer's keeping.
    assert engine.proposer.video_cache_entries == 2
    elsewhere = specvlm_engine(qwen_target, small_vlms[0], prefix_cache=cache)
    with pytest.raises(InvalidRequest, match="'clip' is not among them"):
        elsewhere.generate(None, PROMPT, sampling, video_key="clip")
    assert engine.generate(None, PROMPT, sampling, video_key="clip").token_ids == plain   # still serving
    with pytest.raises(InvalidRequest, match="video_cache_entries"):
        SpecVLMProposer(qwen_target, small_vlms[0], video_cache_entries=-1)


def test_a_cache_sized_too_small_grows_and_gives_the_same_logits(qwen_target, small_vlms, small_video):
    """begin sizes the draft cache for the request; fed past that (a direct caller), it doubles,
    keeps what it held, and the draft's logits are those of a cache that had room."""
    engine = Engine(qwen_target, spec=SpecConfig(method="none"))
    inputs = engine.prepare(small_video, PROMPT)
    proposer = SpecVLMProposer(qwen_target, small_vlms[0], keep_ratio=0.5)
    pre = qwen_target.prefill(inputs, capacity=inputs["input_ids"].shape[1] + 8,
                              bridge_layer=proposer.needs.bridge_layer)
    first = int(pre.logits.argmax())
    tight = proposer.begin_request(pre, inputs, None, first, room=1)
    roomy = proposer.begin_request(pre, inputs, None, first, room=16)
    bytes_before, capacity = tight.kv_bytes(), tight.capacity
    assert capacity == tight.prompt_entries + 1 and roomy.capacity == roomy.prompt_entries + 16
    with torch.inference_mode():
        for ids in ([first], [5, 6], [7]):
            torch.testing.assert_close(proposer._feed(tight, ids), proposer._feed(roomy, ids))
        tight.cache.crop(-2)                                 # rollback is a length move, in the grown cache too
        roomy.cache.crop(-2)
        tight.next_index, roomy.next_index = tight.next_index - 2, roomy.next_index - 2
        torch.testing.assert_close(proposer._feed(tight, [9]), proposer._feed(roomy, [9]))
    assert tight.capacity == 2 * capacity and tight.kv_bytes() == 2 * bytes_before
    assert tight.cached == roomy.cached == tight.prompt_entries + 3
    assert tight.max_keys() == roomy.max_keys() == tight.prompt_entries + 4
