"""Short prefills (questions after a cached video) finished together in one ragged forward
(prefill.finish_together): each request's logits, draft features and KV equal its own
prefill's, on both families; through the scheduler, requests admitted together prefill in
one forward, their outputs equal their solo runs, and one request's bad input fails only it."""

import threading

import pytest
import torch

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.config import EngineConfig
from sparrow.models.kv_cache import new_kv_cache
from sparrow.models.prefill import TOGETHER_ROWS, FeatureNeeds, PrefillJob, finish_together
from sparrow.prefix_cache import PrefixCache
from sparrow.tiny import synthetic_frames, tiny_draft
from sparrow.video import VideoOptions, prepare_video

QUESTIONS = ["What happens?", "Which shape moves first, and where does it go after that?",
             "Describe the colours of every object that appears in the video, one by one."]


def _jobs(target, video, needs, prefix):
    """One job a question after the prefix, and one over a whole prompt (video included) where
    it is short (the tiny LLaVA's 9-token video; Qwen's smallest video is 144 tokens)."""
    jobs = []
    for i, question in enumerate([QUESTIONS[0], *QUESTIONS]):
        inputs = target.build_inputs(video, question)
        kv = new_kv_cache("static", target.num_layers, inputs["input_ids"].shape[1] + 4)
        job = PrefillJob(target, inputs, kv, needs, prefix=prefix if i else None)
        if job.short:
            jobs.append(job)
    return jobs


def test_finished_together_equals_each_prefill_alone(any_target):
    target = any_target
    video = prepare_video(synthetic_frames(2, 28, 28, seed=3), target.processor, VideoOptions())
    needs = FeatureNeeds((1, target.num_layers), bridge_layer=1, visual_features=True)
    prefix = target.prefill_prefix(target.build_inputs(video, QUESTIONS[0]), needs.feature_layers,
                                   needs.bridge_layer, needs.visual_features)
    alone, together = _jobs(target, video, needs, prefix), _jobs(target, video, needs, prefix)
    assert len({job.remaining for job in together}) >= 3
    for job in alone:
        assert job.step()
    finish_together(together)
    for a, b in zip(alone, together):
        assert b.done and b.cursor == a.cursor == a.end
        oa, ob = a.output(), b.output()
        assert int(ob.logits.argmax()) == int(oa.logits.argmax())
        torch.testing.assert_close(ob.logits, oa.logits, atol=1e-4, rtol=1e-4)
        for name in ("text_features", "last_feature", "bridge_text", "bridge_visual", "visual_features"):
            torch.testing.assert_close(getattr(ob, name), getattr(oa, name), atol=1e-4, rtol=1e-4)
        for la, lb in zip(a.kv.layers, b.kv.layers):
            n = a.end
            torch.testing.assert_close(lb.keys[:, :, :n], la.keys[:, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(lb.values[:, :, :n], la.values[:, :, :n], atol=1e-4, rtol=1e-4)
        assert ob.state.length == oa.state.length == a.end


def test_a_long_rest_is_not_finished_together(qwen_target, small_video):
    video = prepare_video(small_video, qwen_target.processor, VideoOptions())
    inputs = qwen_target.build_inputs(video, QUESTIONS[0])
    job = PrefillJob(qwen_target, inputs, new_kv_cache("static", qwen_target.num_layers, 1024), FeatureNeeds())
    assert job.remaining > TOGETHER_ROWS and not job.short
    with pytest.raises(ValueError, match="not finished together"):
        finish_together([job])


def test_questions_admitted_together_prefill_in_one_forward_and_equal_their_solo_runs(qwen_target):
    """Five questions about one cached video, held until all are prepared, then admitted in
    one loop turn: their prefills run as one forward, and every output (greedy, seeded
    sampling, pinned k) equals the same request's solo run. A sixth whose embeddings fail
    gets its error; the others are untouched."""
    # A slice budget all five questions fit in however slow the machine is: the group's size is
    # the measured seconds per position against prefill_slice_s (a loaded 2-core box measured
    # a cost at which only four fit in the default 0.1 s).
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=1), SpecConfig(adaptive_k=False, num_draft_tokens=3),
                    prefix_cache=PrefixCache(max_bytes=1 << 30), config=EngineConfig(prefill_slice_s=60.0))
    video = synthetic_frames(8, 56, 56, seed=7)
    engine.generate(video, "Hello.", SamplingParams(max_new_tokens=1), video_key="v")      # the prefix, cached
    jobs = [(QUESTIONS[0], SamplingParams(max_new_tokens=12), None),
            (QUESTIONS[1], SamplingParams(max_new_tokens=16), None),
            (QUESTIONS[2], SamplingParams(max_new_tokens=10, temperature=1.0, seed=3), None),
            (QUESTIONS[0], SamplingParams(max_new_tokens=14, temperature=0.8, top_k=20, seed=9), 2),
            (QUESTIONS[1], SamplingParams(max_new_tokens=12), 0)]
    solo = [engine.generate(video, q, sp, video_key="v", num_draft_tokens=k).token_ids for q, sp, k in jobs]

    release, real_job = threading.Event(), engine.runner.prefill_job

    def prefill_job(request):                      # the sixth request's embeddings fail
        job = real_job(request)
        if request.prompt == "broken":
            def embed():
                raise RuntimeError("this prompt's embeddings failed")
            job.embed = embed
        return job

    engine.runner.prefill_job = prefill_job
    scheduler = engine.scheduler
    before = dict(scheduler.stats)
    holding = threading.Event()

    def hold_the_loop():                          # the scheduler thread waits here
        holding.set()
        release.wait(30)
    hold = scheduler.call_soon(hold_the_loop)
    assert holding.wait(30)                       # held before any request exists: none is admitted early
    gens = [engine.stream(video, q, sp, video_key="v", num_draft_tokens=k) for q, sp, k in jobs]
    broken = engine.stream(video, "broken", SamplingParams(max_new_tokens=4), video_key="v")
    gens_all = [*gens, broken]
    for _ in range(3000):
        if len(scheduler._ready) + len(scheduler._waiting) == len(gens_all):
            break
        threading.Event().wait(0.01)
    release.set()
    hold.result(timeout=30)
    outs = []
    for gen in gens:
        outs.append([t for delta in gen for t in delta.token_ids])
    with pytest.raises(RuntimeError, match="embeddings failed"):
        list(broken)
    assert outs == solo
    assert scheduler.stats["prefills_together"] - before["prefills_together"] == len(jobs)
    assert scheduler.stats["prefill_slices"] - before["prefill_slices"] == 1      # one forward for all five



def _placed_as_whole(target, video, prefix, question: str) -> int:
    """A question after `prefix`: its prefill's positions and rope delta equal the family's over
    the whole prompt; returns the delta."""
    inputs = target.build_inputs(video, question)
    kv = new_kv_cache("static", target.num_layers, inputs["input_ids"].shape[1] + 4)
    job = PrefillJob(target, inputs, kv, FeatureNeeds(), prefix=prefix)
    want, delta = target.family.prefill_positions(target.hf, inputs)
    assert torch.equal(job.position_ids, want) and job.rope_delta == delta
    return delta


def test_a_question_after_a_cached_prefix_is_placed_as_the_whole_prompt_would_be(any_target):
    """VideoPrefix carries its own positions: a later question's (position_ids, rope delta) are
    the prefix's and its text's, equal to what the family computes over the whole prompt."""
    target = any_target
    video = prepare_video(synthetic_frames(6, 56, 84, seed=5), target.processor, VideoOptions())
    prefix = target.prefill_prefix(target.build_inputs(video, QUESTIONS[0]), (), None, False)
    assert prefix.position_ids is not None and prefix.position_ids.shape[-1] == prefix.length
    for question in [*QUESTIONS, "?" * 300]:
        _placed_as_whole(target, video, prefix, question)


def test_a_real_time_videos_prefix_places_later_questions_as_the_whole_prompt_would_be():
    """On a real-time Qwen2.5-VL target (the committed live one) a 30 s video's temporal positions
    run past its text's, so the rope delta after a prompt depends on the question's length; the
    positions a cached prefix gives later questions still equal the family's over the whole prompt."""
    import random
    from pathlib import Path

    from sparrow.models import TargetModel
    from sparrow.world.live_target import Clip, encoded_clip, heldout_clip, live_questions
    live = Path(__file__).resolve().parents[1] / "models" / "live" / "target"
    target = TargetModel.from_pretrained(live)
    stream, end = heldout_clip(3 * 10**9, 30)
    frames, index = encoded_clip(stream, end - round(30 * stream.fps), 30)
    video = target.processor.process(frames)
    questions = [q for _, q, _ in live_questions(Clip.of(stream, index), random.Random(1),
                                                 ("colour_now", "what_now", "present_now"))]
    prefix = target.prefill_prefix(target.build_inputs(video, questions[0]), (), None, False)
    assert prefix.position_ids is not None
    deltas = set()
    for question in [*questions, "what is in view ? " * 40]:
        deltas.add(_placed_as_whole(target, video, prefix, question))
    assert len(deltas) > 1          # the case: the delta moved with the question's length
