"""Lossless in bfloat16: the golden tests of test_engine.py on bf16 models, loaded the way a
server loads them (from_pretrained with dtype=bfloat16). bf16 on CPU is the cheap proxy for
the GPU dtype: a verify forward over k+1 tokens and HF's one-token decode steps must still
pick the same tokens, and sampling must still follow the target's distribution.

SPARROW_TEST_DEVICE=cuda (or auto) runs them on a GPU: `make gpu-check` does."""

import os

import pytest
import torch
from helpers import OracleProposer, check_seeded_sampling

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.models import TargetModel
from sparrow.models.placement import parse_device
from sparrow.spec.sampling import logits_to_probs
from sparrow.tiny import tiny_draft

PROMPTS = ["What happens in the video?", "Which shape moves first, and where does it go?"]
SPEC = SpecConfig(method="sparrow", num_draft_tokens=4, window=8, anchors=16)
DEVICE = parse_device(os.environ.get("SPARROW_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module", params=["qwen2_5_vl", "llava_onevision"])
def bf16_target(request, tmp_path_factory, qwen_target, llava_target):
    fp32 = qwen_target if request.param == "qwen2_5_vl" else llava_target
    path = tmp_path_factory.mktemp(request.param)
    fp32.save_pretrained(path)
    target = TargetModel.from_pretrained(path, dtype=torch.bfloat16, device=DEVICE)
    assert target.hf.dtype == torch.bfloat16 and target.device.type == DEVICE.type
    return target


def hf_greedy(target, engine, video, prompt, max_new_tokens):
    inputs = engine.prepare(video, prompt)
    out = target.hf.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("video_name", ["small_video", "large_video"])
def test_bf16_golden_random_draft(bf16_target, video_name, prompt, request):
    video = request.getfixturevalue(video_name)
    draft = tiny_draft(bf16_target, seed=1)
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    engine = Engine(bf16_target, draft, SPEC)
    out = engine.generate(video, prompt, SamplingParams(max_new_tokens=24))
    assert out.token_ids == hf_greedy(bf16_target, engine, video, prompt, 24)
    assert out.metrics.steps > 0 and out.metrics.draft_tokens > 0


def test_bf16_golden_oracle_all_accepted_and_corrupt_none_accepted(bf16_target, small_video):
    plain = Engine(bf16_target, spec=SpecConfig(method="none"))
    reference = hf_greedy(bf16_target, plain, small_video, PROMPTS[0], 30)
    assert plain.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=30)).token_ids == reference
    for corrupt in (False, True):
        proposer = OracleProposer(reference, corrupt=corrupt, vocab_size=bf16_target.vocab_size)
        out = Engine(bf16_target, spec=SPEC, proposer=proposer).generate(small_video, PROMPTS[0],
                                                                         SamplingParams(max_new_tokens=30))
        assert out.token_ids == reference
        if corrupt:
            assert out.metrics.accepted_tokens == 0
        elif len(reference) == 30:
            assert out.metrics.accepted_per_position[0] == out.metrics.steps


def test_bf16_sampling_seeded_reproducible(bf16_target, small_video):
    check_seeded_sampling(Engine(bf16_target, tiny_draft(bf16_target), SPEC), small_video, PROMPTS[0])


def test_bf16_speculative_sampling_follows_the_target(qwen_target, tmp_path, small_video):
    """Second token of T=1, top_k=2 answers (the first verify step, a random draft, k=1): it
    never leaves the target's top-2 at that position, and its frequencies given the first
    token match the target's bf16 distribution there."""
    qwen_target.save_pretrained(tmp_path)
    target = TargetModel.from_pretrained(tmp_path, dtype=torch.bfloat16, device=DEVICE)
    spec = SpecConfig(num_draft_tokens=1, window=8, anchors=16)
    engine = Engine(target, tiny_draft(target, seed=2), spec)
    video = engine.process_video(small_video)          # processed once, reused by every request
    firsts, seconds = [], []
    for seed in range(240):
        out = engine.generate(video, PROMPTS[0], SamplingParams(max_new_tokens=2, temperature=1.0, top_k=2,
                                                                 seed=seed, ignore_eos=True))
        firsts.append(out.token_ids[0])
        seconds.append(out.token_ids[1])
    first = max(set(firsts), key=firsts.count)
    inputs = engine.prepare(video, PROMPTS[0])
    ids = torch.cat([inputs["input_ids"], torch.tensor([[first]], device=target.device)], dim=1)
    text_type = torch.zeros(1, 1, dtype=torch.int32, device=target.device)         # the appended token is text
    with torch.no_grad():
        logits = target.hf(**{**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids),
                              "mm_token_type_ids": torch.cat([inputs["mm_token_type_ids"], text_type], 1)}).logits
    p = logits_to_probs(logits[0, -1], 1.0, top_k=2)
    support = set(torch.nonzero(p).view(-1).tolist())
    after = [s for f, s in zip(firsts, seconds) if f == first]
    assert len(after) >= 60 and set(after) <= support
    top = int(p.argmax())
    observed = after.count(top) / len(after)
    sigma = (float(p[top]) * (1 - float(p[top])) / len(after)) ** 0.5
    assert abs(observed - float(p[top])) <= 4 * sigma + 1e-3, (observed, float(p[top]), len(after))
