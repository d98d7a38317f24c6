"""Conversations about one video: a follow-up question carries the earlier turns, starts from
the cached prefill of the video, and answers exactly as HF generate does on the same prompt."""

import pytest
from test_engine import hf_greedy

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.chat import Message, as_messages, with_history
from sparrow.errors import InvalidRequest
from sparrow.prefix_cache import PrefixCache
from sparrow.tiny import tiny_draft

SPEC = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16)
FIRST, FOLLOW_UP = "What happens in the video?", "And which way does it move?"
ANSWER = "A red circle appears."


def test_follow_up_reuses_the_video_prefill_and_equals_hf_generate(any_target, small_video):
    engine = Engine(any_target, tiny_draft(any_target), SPEC, prefix_cache=PrefixCache(max_entries=2))
    decoded = []

    def video(cancelled):                          # called on a prefix-cache miss only
        decoded.append(1)
        return small_video

    sampling = SamplingParams(max_new_tokens=16)
    first = engine.generate(video, FIRST, sampling, video_key="clip")
    conversation = with_history([Message("user", FIRST), Message("assistant", ANSWER)], FOLLOW_UP)
    follow = engine.generate(video, conversation, sampling, video_key="clip")

    assert first.metrics.cached_prompt_tokens == 0
    assert follow.metrics.cached_prompt_tokens > follow.metrics.visual_tokens > 0     # the video's prefill reused
    assert len(decoded) == 1
    assert follow.metrics.prompt_tokens > first.metrics.prompt_tokens                  # the earlier turns are in it
    assert follow.token_ids == hf_greedy(any_target, engine, small_video, conversation, 16)


def test_the_video_sits_in_the_first_user_turn(qwen_target):
    one = qwen_target.prompt_ids(FIRST, 4)
    two = qwen_target.prompt_ids([Message("user", FIRST), Message("assistant", ANSWER), Message("user", FOLLOW_UP)], 4)
    last_video = max(i for i, t in enumerate(one) if t == qwen_target.video_token_id)
    assert two[:last_video + 1] == one[:last_video + 1] and two.count(qwen_target.video_token_id) == 4
    after = qwen_target.tokenizer.decode(two[last_video + 1:])
    assert after.index(FIRST) < after.index(ANSWER) < after.index(FOLLOW_UP)


@pytest.mark.parametrize("turns, error", [
    ([], "at least"),
    ([Message("assistant", ANSWER), Message("user", FOLLOW_UP)], "alternate"),
    ([Message("user", FIRST), Message("user", FOLLOW_UP)], "alternate"),
    ([Message("user", FIRST), Message("assistant", ANSWER)], "end with the user"),
    (["What happens?"], "sequence of sparrow.chat.Message"),
])
def test_malformed_conversations_are_refused(turns, error):
    with pytest.raises(InvalidRequest, match=error):
        as_messages(turns)


def test_a_message_needs_a_known_role_and_text():
    with pytest.raises(InvalidRequest, match="role"):
        Message("system", "be brief")
    with pytest.raises(InvalidRequest, match="non-empty"):
        Message.from_dict({"role": "assistant", "text": "  "})
    assert Message.from_dict({"role": "user", "content": "hi"}) == Message("user", "hi")


def test_the_engine_refuses_a_malformed_conversation(qwen_target, small_video):
    engine = Engine(qwen_target, spec=SpecConfig(method="none"))
    with pytest.raises(InvalidRequest, match="end with the user"):
        engine.generate(small_video, [Message("user", FIRST), Message("assistant", ANSWER)])
