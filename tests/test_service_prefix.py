"""The video-prefix prefill the servers use (Engine + PrefixCache): a second question on the
same video starts from the cached KV cache of the video, and nothing else changes."""

import pytest
import torch

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.prefix_cache import PrefixCache
from sparrow.tiny import synthetic_frames, tiny_draft

SPEC = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16, glimpse=3)
PROMPTS = ["What happens in the video?", "Which shape moves first, and where does it go?"]


def test_split_prefill_equals_full_prefill(any_target, large_video):
    engine = Engine(any_target, tiny_draft(any_target), SPEC)
    layers, bridge = engine.proposer.needs.feature_layers, engine.proposer.needs.bridge_layer
    inputs = engine.prepare(large_video, PROMPTS[1])
    full = any_target.prefill(inputs, 1000, layers, bridge)
    prefix = any_target.prefill_prefix(inputs, layers, bridge)
    split = any_target.prefill(inputs, 1000, layers, bridge, prefix=prefix)
    assert prefix.length > full.bridge_visual.shape[0]                  # the whole video is in the prefix
    for name in ("logits", "text_features", "last_feature", "bridge_text", "bridge_visual"):
        torch.testing.assert_close(getattr(split, name), getattr(full, name), atol=1e-4, rtol=1e-4)
    assert torch.equal(split.text_token_ids, full.text_token_ids)
    assert split.state.length == full.state.length == split.state.kv.get_seq_length()


def test_second_question_reuses_the_video_prefill(any_target, small_video):
    draft = tiny_draft(any_target)
    cache = PrefixCache(max_entries=2)
    cached, plain = Engine(any_target, draft, SPEC, prefix_cache=cache), Engine(any_target, draft, SPEC)
    calls = []

    def video(cancelled):                                 # decoded on a miss only
        calls.append(1)
        return small_video

    sampling = SamplingParams(max_new_tokens=16)
    for i, prompt in enumerate(PROMPTS + PROMPTS[:1]):
        out = cached.generate(video, prompt, sampling, video_key="clip-1")
        assert out.token_ids == plain.generate(small_video, prompt, sampling).token_ids
        assert (out.metrics.cached_prompt_tokens > out.metrics.visual_tokens) == (i > 0)
    assert len(calls) == 1 and len(cache) == 1
    plain_k0 = cached.generate(video, PROMPTS[1], sampling, video_key="clip-1", num_draft_tokens=0)
    assert plain_k0.token_ids == plain.generate(small_video, PROMPTS[1], sampling).token_ids
    assert plain_k0.metrics.draft_tokens == 0 and len(calls) == 1


def test_prefix_cache_is_bounded(qwen_target):
    engine = Engine(qwen_target, spec=SpecConfig(method="none"), prefix_cache=PrefixCache(max_entries=2))
    for seed in range(3):
        engine.generate(synthetic_frames(4, 56, 56, seed=seed), PROMPTS[0], SamplingParams(max_new_tokens=2),
                        video_key=f"v{seed}")
    assert len(engine.prefix_cache) == 2 and engine.prefix_cache.get("v0") is None
    one = engine.prefix_cache.get("v2").prefix.nbytes
    small = PrefixCache(max_bytes=one)
    assert small.put("a", engine.prefix_cache.get("v2")) and small.put("b", engine.prefix_cache.get("v1"))
    assert len(small) == 1 and small.nbytes <= one
    with pytest.raises(ValueError):
        PrefixCache(max_entries=0)
