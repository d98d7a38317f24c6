"""Lossless in bfloat16: the golden tests of test_engine.py on bf16 models, loaded the way a
server loads them (from_pretrained with dtype=bfloat16). bf16 on CPU is the cheap proxy for
the GPU dtype: a verify forward over k+1 tokens and HF's one-token decode steps must still
pick the same tokens, and sampling must still follow the target's distribution.

SPARROW_TEST_DEVICE=cuda (or auto) runs them on a GPU: `make gpu-check` does. There the
comparison with HF's one-token decoding is exact up to the first position where the two differ,
and that position must be a bf16 tie: cuBLAS picks different kernels (and summation orders) for
a 5-token verify and a 1-token decode step, so the target's own bf16 logits differ in their last
bits between the two shapes, and HF's greedy with another batch shape would differ the same way.
What the engine guarantees exactly is that each emitted token is the argmax of the target's
logits in the verify pass; where HF's and ours part, the two tokens' HF logits must lie within
a few bf16 steps of each other (a wrong token is not a near tie). CPUs differ the same way: on
some (an AMD EPYC with AVX-512 BF16, 2026-11-25) the oneDNN bf16 matmul for a 5-row verify and a
1-row decode step round differently, and the LLaVA-OneVision golden runs part from HF's at such a
tie; elsewhere the match is exact."""

import os

import pytest
import torch
from helpers import OracleProposer, check_seeded_sampling

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.models import TargetModel
from sparrow.models.placement import parse_device
from sparrow.speculative.sampling import logits_to_probs
from sparrow.tiny import tiny_draft

PROMPTS = ["What happens in the video?", "Which shape moves first, and where does it go?"]
SPEC = SpecConfig(adaptive_k=False, method="sparrow", num_draft_tokens=4, window=8, anchors=16)
DEVICE = parse_device(os.environ.get("SPARROW_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module", params=["qwen2_5_vl", "llava_onevision"])
def bf16_target(request, tmp_path_factory, qwen_target, llava_target):
    fp32 = qwen_target if request.param == "qwen2_5_vl" else llava_target
    path = tmp_path_factory.mktemp(request.param)
    fp32.save_pretrained(path)
    target = TargetModel.from_pretrained(path, dtype=torch.bfloat16, device=DEVICE)
    assert target.hf.dtype == torch.bfloat16 and target.device.type == DEVICE.type
    return target


def hf_greedy(target, engine, video, prompt, max_new_tokens, scores: list | None = None):
    inputs = engine.prepare(video, prompt)
    out = target.hf.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, output_scores=True,
                             return_dict_in_generate=True)
    if scores is not None:
        scores.extend(out.scores)                      # the logits HF picked each token from
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist()


# A near tie in bf16: within this many units of the last place of the largest logit.
TIE_ULPS = 4


def assert_target_greedy(target, engine, video, prompt, got: list[int], max_new_tokens: int) -> None:
    """got == HF's greedy tokens, up to a first difference that is a bf16 tie (module doc)."""
    scores: list[torch.Tensor] = []
    want = hf_greedy(target, engine, video, prompt, max_new_tokens, scores)
    if got == want:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert i < len(got) and i < len(want), (got, want)          # one stopped early: not a tie
    assert is_bf16_tie(scores[i][0], want[i], got[i]), (i, got[i], want[i], scores[i][0][[want[i], got[i]]])


def is_bf16_tie(logits: torch.Tensor, best: int, other: int) -> bool:
    """logits[other] is within TIE_ULPS bf16 steps (at the largest logit's scale) below logits[best]."""
    logits = logits.float()
    ulp = 2.0 ** (torch.floor(torch.log2(logits.abs().max())) - 7)      # bf16: 8 significant bits
    gap = float(logits[best] - logits[other])
    return 0 <= gap <= TIE_ULPS * float(ulp)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("video_name", ["small_video", "large_video"])
def test_bf16_golden_random_draft(bf16_target, video_name, prompt, request):
    video = request.getfixturevalue(video_name)
    draft = tiny_draft(bf16_target, seed=1)
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    engine = Engine(bf16_target, draft, SPEC)
    out = engine.generate(video, prompt, SamplingParams(max_new_tokens=24))
    assert_target_greedy(bf16_target, engine, video, prompt, out.token_ids, 24)
    assert out.metrics.steps > 0 and out.metrics.draft_tokens > 0


def test_bf16_golden_oracle_all_accepted_and_corrupt_none_accepted(bf16_target, small_video):
    plain = Engine(bf16_target, spec=SpecConfig(method="none"))
    # The engine's own greedy (its attention path may be the C++ kernel, whose bf16 rounding is not
    # SDPA's: HF's up to a bf16 tie) is what speculation must reproduce exactly.
    reference = plain.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=30)).token_ids
    assert_target_greedy(bf16_target, plain, small_video, PROMPTS[0], reference, 30)
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
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=1, window=8, anchors=16)
    engine = Engine(target, tiny_draft(target, seed=2), spec)
    video = engine.process_video(small_video)          # processed once, reused by every request
    # All at once: batched, a seeded request's tokens are its solo run's (tests/test_world.py).
    gens = [engine.stream(video, PROMPTS[0], SamplingParams(max_new_tokens=2, temperature=1.0, top_k=2,
                                                            seed=seed, ignore_eos=True)) for seed in range(240)]
    firsts, seconds = [], []
    for g in gens:
        for _ in g:
            pass
        firsts.append(g.output.token_ids[0])
        seconds.append(g.output.token_ids[1])
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


def test_tie_rule_refuses_a_wrong_token(bf16_target, small_video):
    """The CUDA comparison's tie rule: a token a bf16 step or two below the greedy one is a tie;
    the target's least likely token, or one above the greedy (not its argmax), is not."""
    engine = Engine(bf16_target, spec=SpecConfig(method="none"))
    scores: list[torch.Tensor] = []
    hf_greedy(bf16_target, engine, small_video, PROMPTS[0], 3, scores)
    logits = scores[0][0].float().clone()
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert is_bf16_tie(logits, best, best) and not is_bf16_tie(logits, best, worst)
    ulp = 2.0 ** (torch.floor(torch.log2(logits.abs().max())) - 7)
    near = (best + 1) % logits.numel()
    logits[near] = logits[best] - 2 * ulp
    assert is_bf16_tie(logits, best, near) and not is_bf16_tie(logits, near, best)
    logits[near] = logits[best] - 8 * ulp
    assert not is_bf16_tie(logits, best, near)
