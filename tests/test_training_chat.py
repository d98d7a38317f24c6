"""train-draft on multi-turn data: a manifest row may hold a conversation ("messages"); the
draft is trained on the target's signals over the whole multi-turn prompt."""

import json

import pytest

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.chat import Message
from sparrow.errors import InvalidRequest
from sparrow.tiny import synthetic_frames
from sparrow.training import DraftTrainer, Sample, TrainConfig, load_samples
from sparrow.training.data import write_manifest

TURNS = [{"role": "user", "text": "What happens?"}, {"role": "assistant", "text": "A circle appears."},
         {"role": "user", "text": "Which way does it move?"}]
CONVERSATION = tuple(Message(t["role"], t["text"]) for t in TURNS)


def test_manifest_conversations_load_and_round_trip(tmp_path):
    manifest = tmp_path / "chat.jsonl"
    manifest.write_text(json.dumps({"video": "a.mp4", "messages": TURNS}) + "\n"
                        + json.dumps({"video": "b.mp4", "messages": TURNS + [{"role": "assistant",
                                                                               "content": "Left."}]}) + "\n")
    a, b = load_samples(manifest)
    assert (a.prompt, a.answer) == (CONVERSATION, None)
    assert (b.prompt, b.answer) == (CONVERSATION, "Left.")          # a closing assistant turn is the answer
    write_manifest(tmp_path / "again.jsonl", [a, b])
    assert load_samples(tmp_path / "again.jsonl") == [a, b]


@pytest.mark.parametrize("messages, says", [
    ([{"role": "assistant", "text": "hi"}, {"role": "user", "text": "q"}], "alternate"),
    ([{"role": "user", "text": ""}], "non-empty"),
    ("What happens?", "must be a list"),
])
def test_a_malformed_conversation_names_its_line(tmp_path, messages, says):
    manifest = tmp_path / "bad.jsonl"
    manifest.write_text("\n" + json.dumps({"video": "a.mp4", "messages": messages}) + "\n")
    with pytest.raises(InvalidRequest, match=f"bad.jsonl:2: .*{says}"):
        load_samples(manifest)


def test_training_reads_the_whole_conversation(qwen_target):
    video = synthetic_frames(4, 56, 56, seed=3)
    cfg = TrainConfig(steps=2, grad_accum=1, warmup=0, window=8, anchors=16, bridge_tokens=4, max_new_tokens=8,
                      log_every=100, eval_every=0, save_every=0)
    trainer = DraftTrainer.fresh(qwen_target, [Sample(video, CONVERSATION)], cfg, log=lambda _: None)
    sig = trainer.signals(0)
    assert sig is not None and not trainer.bad
    processed = trainer.plain.process_video(video, trainer.options)
    prompt_len = len(qwen_target.prompt_ids(CONVERSATION, processed.num_visual_tokens))
    # the draft's prompt entries are the conversation's text tokens after the first (t >= 1: each
    # reads the target's features at t - 1)
    assert sig.num_prompt == prompt_len - processed.num_visual_tokens - 1
    # and the response it learns is the target's own answer to the conversation
    want = Engine(qwen_target, spec=SpecConfig(method="none")).generate(
        processed, CONVERSATION, SamplingParams(max_new_tokens=8)).token_ids
    assert trainer._response(0, processed) == want
    trainer.fit()
    assert trainer.step == 2 and not trainer.bad
