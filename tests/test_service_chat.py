"""Conversations over gRPC: a request carries earlier turns; the follow-up starts from the video's
cached prefill and answers as the engine does on the same conversation."""

from __future__ import annotations

import grpc
import pytest
from test_service import PROMPTS, make_service

from sparrow import SamplingParams
from sparrow.chat import Message, with_history
from sparrow.services.client import SparrowClient
from sparrow.services.server import BackgroundServer

ANSWER = "A red circle appears."


@pytest.fixture(scope="module")
def server(tiny_model_dirs, clips):
    with BackgroundServer(make_service(tiny_model_dirs, clips, max_history_turns=4)) as running:
        yield running


@pytest.fixture
def client(server):
    with SparrowClient(server.address) as c:
        yield c


def test_follow_up_reuses_the_video_prefill(client, clips, reference_engine):
    video_id = client.upload(clips.data["d"])
    first = client.generate(PROMPTS[0], video_id=video_id, max_new_tokens=10)
    history = [("user", PROMPTS[0]), ("assistant", ANSWER)]
    follow = client.generate(PROMPTS[1], video_id=video_id, max_new_tokens=10, history=history)
    usage = follow.completion.usage
    assert first.completion.usage.cached_prompt_tokens == 0
    assert usage.visual_tokens < usage.cached_prompt_tokens < usage.prompt_tokens
    assert usage.prompt_tokens > first.completion.usage.prompt_tokens + 5        # the earlier turns are in the prompt
    conversation = with_history([Message(r, t) for r, t in history], PROMPTS[1])
    want = reference_engine.generate(clips.data["d"], conversation, SamplingParams(max_new_tokens=10))
    assert follow.token_ids == want.token_ids


@pytest.mark.parametrize("history, code", [
    ([("assistant", ANSWER)], grpc.StatusCode.INVALID_ARGUMENT),                        # must start with the user
    ([("user", PROMPTS[0])], grpc.StatusCode.INVALID_ARGUMENT),                         # two user turns in a row
    ([("user", "q"), ("robot", "a")], grpc.StatusCode.INVALID_ARGUMENT),
    ([("user", "q"), ("assistant", "a")] * 3, grpc.StatusCode.RESOURCE_EXHAUSTED),      # over max_history_turns
])
def test_malformed_or_oversized_history_gets_its_code(client, clips, history, code):
    with pytest.raises(grpc.RpcError) as info:
        client.generate(PROMPTS[1], data=clips.data["b"], max_new_tokens=2, history=history)
    assert info.value.code() == code


def test_cli_generate_sends_earlier_turns(server, clips, reference_engine, capsys):
    from sparrow.cli.main import main

    assert main(["generate", "--server", server.address, str(clips.path("b")), PROMPTS[1], "--max-new-tokens", "8",
                 "--turn", "user", PROMPTS[0], "--turn", "assistant", ANSWER]) == 0
    out, err = capsys.readouterr()
    conversation = with_history([Message("user", PROMPTS[0]), Message("assistant", ANSWER)], PROMPTS[1])
    assert out.rstrip("\n") == reference_engine.generate(clips.data["b"], conversation,
                                                         SamplingParams(max_new_tokens=8)).text
