"""The engine against the target's own greedy output: lossless, token for token."""

import numpy as np
import pytest
import torch
from helpers import OracleProposer, check_seeded_sampling

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.config import EngineConfig
from sparrow.errors import ContextOverflow, InvalidRequest, VideoError
from sparrow.models import SparrowDraft, TargetModel
from sparrow.tiny import synthetic_frames, tiny_draft

PROMPTS = ["What happens in the video?", "Which shape moves first, and where does it go?"]
SPEC = SpecConfig(adaptive_k=False, method="sparrow", num_draft_tokens=4, window=8, anchors=16)


def hf_greedy(target, engine, video, prompt, max_new_tokens):
    inputs = engine.prepare(video, prompt)
    out = target.hf.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("draft_seed", [0, 1])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("video_name", ["small_video", "large_video"])
def test_golden_random_draft(any_target, video_name, prompt, draft_seed, request):
    video = request.getfixturevalue(video_name)
    engine = Engine(any_target, tiny_draft(any_target, seed=draft_seed), SPEC)
    out = engine.generate(video, prompt, SamplingParams(max_new_tokens=24))
    assert out.token_ids == hf_greedy(any_target, engine, video, prompt, 24)
    assert out.metrics.steps > 0 and out.metrics.draft_tokens > 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_golden_oracle_all_accepted_and_corrupt_none_accepted(any_target, small_video, prompt):
    plain = Engine(any_target, spec=SpecConfig(method="none"))
    reference = hf_greedy(any_target, plain, small_video, prompt, 30)
    sampling = SamplingParams(max_new_tokens=30, ignore_eos=False)
    for corrupt in (False, True):
        proposer = OracleProposer(reference, corrupt=corrupt, vocab_size=any_target.vocab_size)
        engine = Engine(any_target, spec=SPEC, proposer=proposer)
        out = engine.generate(small_video, prompt, sampling, num_draft_tokens=4)   # k fixed: no adapting
        assert out.token_ids == reference
        m = out.metrics
        # Each step emitted 1 + its accepted drafts, none counted past the answer's end: the
        # first token is prefill's, the rest are the steps'.
        assert m.steps + m.accepted_tokens == len(out.token_ids) - 1 == m.steps + sum(m.accepted_per_position)
        if corrupt:
            assert m.accepted_tokens == 0 and m.mean_acceptance_length == 1.0
        elif len(reference) == 30:
            # Every full step accepts all k drafts and adds the bonus token: 1 + 4 + 5 + 5 + ...
            assert m.accepted_per_position[0] == m.steps
            assert m.mean_acceptance_length > 4.0


def test_drafts_accepted_past_the_answers_end_are_not_counted(qwen_target, small_video):
    """A draft that runs past the stop token with the target's own continuation is accepted
    there, but the answer ends at the stop: tau counts tokens emitted a step, so the metrics
    (and the Prometheus counters built from accepted_per_position) count no draft past it."""
    plain = Engine(qwen_target, spec=SpecConfig(method="none"))
    ahead = plain.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids
    # A stop token first seen where a step of k drafts (all accepted: k + 1 tokens a step, the
    # first token prefill's) has drafts after it, which the target's continuation accepts.
    for k in (4, 3, 2):
        found = [(t, i) for i, t in enumerate(ahead) if i >= 3 and (i - 1) % (k + 1) <= k - 2 and t not in ahead[:i]]
        if found:
            break
    stop, at = found[0]
    engine = Engine(qwen_target, spec=SPEC, proposer=OracleProposer(ahead))
    out = engine.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                                  stop_token_ids=[stop]), num_draft_tokens=k)
    assert out.token_ids == ahead[:at + 1] and out.finish_reason == "stop"
    m = out.metrics
    assert m.steps + m.accepted_tokens == len(out.token_ids) - 1 == m.steps + sum(m.accepted_per_position)
    assert m.mean_acceptance_length == pytest.approx(len(out.token_ids[1:]) / m.steps)


def test_plain_and_speculative_decoding_match_hf_with_prefill_in_chunks(qwen_target, large_video):
    """The prompt prefilled whole or a few positions at a time (chunks between decode steps):
    the same greedy tokens, plain and speculative."""
    prompt = PROMPTS[0]
    ref = hf_greedy(qwen_target, Engine(qwen_target, spec=SpecConfig(method="none")), large_video, prompt, 20)
    for chunk in (1 << 20, 37):
        config = EngineConfig(prefill_chunk_tokens=chunk)
        plain = Engine(qwen_target, spec=SpecConfig(method="none"), config=config)
        assert plain.generate(large_video, prompt, SamplingParams(max_new_tokens=20)).token_ids == ref
        spec = SpecConfig(adaptive_k=False, num_draft_tokens=3)
        sd = Engine(qwen_target, tiny_draft(qwen_target), spec, config=config)
        assert sd.generate(large_video, prompt, SamplingParams(max_new_tokens=20)).token_ids == ref


def test_sampling_seeded_reproducible_and_runs(any_target, small_video):
    a = check_seeded_sampling(Engine(any_target, tiny_draft(any_target), SPEC), small_video, PROMPTS[0])
    assert a.finish_reason in ("stop", "length")


@pytest.mark.parametrize("spec", [
    SPEC,                                                                       # a chain, k fixed
    SpecConfig(adaptive_k=False, num_draft_tokens=2, window=8, anchors=16),     # another k
    SpecConfig(adaptive_k=False, num_draft_tokens=3, tree_width=2, tree_branch=2, tree_budget=8, window=8, anchors=16),
    SpecConfig(adaptive_k=False, method="eagle-style", num_draft_tokens=3),
], ids=["chain", "chain-k2", "tree", "eagle-style"])
def test_seeded_sampling_equals_plain_decoding_with_the_same_seed(qwen_target, small_video, large_video, spec):
    """A seeded sampled request emits plain decoding's tokens for that seed, token for token,
    whatever the draft, k or tree, alone or beside another request (Gumbel-max keyed by
    position: speculative/sampling.py)."""
    plain = Engine(qwen_target, spec=SpecConfig(method="none"))
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=2), spec)
    for seed, temperature, top_p in ((3, 1.0, 1.0), (11, 0.7, 0.9)):
        s = SamplingParams(max_new_tokens=24, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=True)
        want = plain.generate(small_video, PROMPTS[0], s).token_ids
        out = engine.generate(small_video, PROMPTS[0], s)
        assert out.token_ids == want and out.metrics.draft_tokens > 0
        a = engine.stream(small_video, PROMPTS[0], s)
        b = engine.stream(large_video, PROMPTS[1], SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed + 1))
        for _ in b:
            pass
        assert [t for d in a for t in d.token_ids] == want


def test_sampling_does_not_touch_global_rng(qwen_target, small_video):
    engine = Engine(qwen_target, tiny_draft(qwen_target), SPEC)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    engine.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=0.8, seed=1))
    assert torch.equal(torch.rand(3), expected)


def test_interleaved_streams_equal_solo_runs(qwen_target, small_video, large_video):
    engine = Engine(qwen_target, tiny_draft(qwen_target), SPEC)
    sampling = SamplingParams(max_new_tokens=24)
    solo_a = engine.generate(small_video, PROMPTS[0], sampling).token_ids
    solo_b = engine.generate(large_video, PROMPTS[1], sampling).token_ids
    a, b = engine.stream(small_video, PROMPTS[0], sampling), engine.stream(large_video, PROMPTS[1], sampling)
    got = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name in list(live):
            try:
                got[name].extend(next(live[name]).token_ids)
            except StopIteration:
                del live[name]
    assert got["a"] == solo_a and got["b"] == solo_b
    assert a.output.token_ids == solo_a


def test_draft_attention_span_is_bounded_by_anchors_window_glimpse(qwen_target):
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=6, anchors=5, glimpse=3)
    engine = Engine(qwen_target, tiny_draft(qwen_target), spec)
    spans = {}
    for frames in (4, 64):
        out = engine.generate(synthetic_frames(frames, 56, 56), PROMPTS[1], SamplingParams(max_new_tokens=20))
        spans[frames] = (out.metrics.visual_tokens, out.metrics.draft_max_keys, out.metrics.draft_kv_bytes)
    assert spans[64][0] >= 8 * spans[4][0]                       # many more visual tokens...
    bound = spec.anchors + spec.window + spec.glimpse
    assert spans[4][1] <= bound and spans[64][1] <= bound        # ...same bounded span
    assert spans[64][1] == spans[4][1]
    assert spans[64][2] == spans[4][2] > 0                       # ...and the same draft KV memory
    assert out.metrics.to_dict()["draft_kv_bytes"] == spans[64][2]


def test_save_load_round_trip(tmp_path, any_target, small_video):
    any_target.save_pretrained(tmp_path / "target")
    loaded = TargetModel.from_pretrained(tmp_path / "target")
    draft = tiny_draft(any_target, seed=3)
    draft.save_pretrained(tmp_path / "draft")
    draft2 = SparrowDraft.from_pretrained(tmp_path / "draft", target=loaded)
    sampling = SamplingParams(max_new_tokens=16)
    a = Engine(any_target, draft, SPEC).generate(small_video, PROMPTS[0], sampling)
    b = Engine(loaded, draft2, SPEC).generate(small_video, PROMPTS[0], sampling)
    assert a.token_ids == b.token_ids
    assert a.metrics.accepted_tokens == b.metrics.accepted_tokens
    inputs = Engine(any_target, spec=SpecConfig(method="none")).prepare(small_video, PROMPTS[0])
    with torch.no_grad():
        torch.testing.assert_close(any_target.hf(**inputs).logits, loaded.hf(**inputs).logits)
    assert set(draft.state_dict()) == set(draft2.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in draft.state_dict())


def test_qwen_uses_three_axis_positions(qwen_target, large_video):
    """prepare() carries mm_token_type_ids and second_per_grid_ts, so the positions are M-RoPE:
    changing the video's time spacing changes the output; our explicit positions equal HF's."""
    engine = Engine(qwen_target, spec=SpecConfig(method="none"))
    inputs = engine.prepare(large_video, PROMPTS[0])
    assert {"mm_token_type_ids", "second_per_grid_ts", "video_grid_thw"} <= set(inputs)
    pos, _ = qwen_target.family.prefill_positions(qwen_target.hf, inputs)
    assert pos.shape[0] == 3 and not torch.equal(pos[0], pos[1])      # really 3-axis
    with torch.no_grad():
        base = qwen_target.hf(**inputs).logits
        explicit = qwen_target.hf(**inputs, position_ids=pos).logits
        slower = qwen_target.hf(**{**inputs, "second_per_grid_ts": inputs["second_per_grid_ts"] * 4}).logits
    torch.testing.assert_close(base, explicit)
    assert not torch.allclose(base, slower, atol=1e-4)
    assert qwen_target.hf.model.rope_deltas is not None  # HF's own call above stored state...
    qwen_target.hf.model.rope_deltas = None
    Engine(qwen_target, tiny_draft(qwen_target), SPEC).generate(large_video, PROMPTS[0],
                                                                      SamplingParams(max_new_tokens=4))
    assert qwen_target.hf.model.rope_deltas is None            # ...the engine leaves none behind


def test_bad_inputs_get_typed_errors(qwen_target, small_video):
    engine = Engine(qwen_target, tiny_draft(qwen_target), SPEC)
    with pytest.raises(InvalidRequest):
        engine.generate(small_video, "   ")
    with pytest.raises(VideoError):
        engine.generate(np.zeros((0, 56, 56, 3), np.uint8), PROMPTS[0])
    with pytest.raises(VideoError):
        engine.generate(b"definitely not a video container", PROMPTS[0])
    with pytest.raises(ContextOverflow):
        engine.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=40000))
    with pytest.raises(InvalidRequest):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequest):
        SpecConfig(adaptive_k=False, method="medusa")
    # and the engine still serves afterwards
    assert engine.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=4)).token_ids


def test_stream_deltas_concatenate_to_output(qwen_target, small_video):
    engine = Engine(qwen_target, tiny_draft(qwen_target), SPEC)
    gen = engine.stream(small_video, PROMPTS[0], SamplingParams(max_new_tokens=20))
    deltas = list(gen)
    assert [t for d in deltas for t in d.token_ids] == gen.output.token_ids
    assert "".join(d.text for d in deltas) == gen.output.text
    assert gen.output.text == qwen_target.tokenizer.decode(gen.output.token_ids, skip_special_tokens=True)


def test_abort_stops_generation(qwen_target, small_video):
    engine = Engine(qwen_target, tiny_draft(qwen_target), SPEC)
    gen = engine.stream(small_video, PROMPTS[0], SamplingParams(max_new_tokens=2000, ignore_eos=True))
    next(gen)
    gen.abort()
    rest = list(gen)
    assert rest == [] and gen.output.finish_reason == "abort"
    assert len(gen.output.token_ids) < 2000


def test_stop_string_ends_the_answer_and_is_not_part_of_it(qwen_target, small_video):
    engine = Engine(qwen_target, tiny_draft(qwen_target), SPEC)
    full = engine.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True))
    text = full.text
    assert len(text) >= 8, text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    at = text.find(stop)
    gen = engine.stream(small_video, PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop, "\x00never")))
    streamed = "".join(d.text for d in gen)
    out = gen.output
    assert out.finish_reason == "stop"
    assert out.text == text[:at] == streamed
    assert stop not in out.text
