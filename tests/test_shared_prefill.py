"""A question about a video whose first prefill is still running waits for that prefill and
reads the prefix cache, instead of decoding and prefilling the same video again; the first
request's abort or error never breaks the one that waited."""

import threading
import time

import pytest

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.config import EngineConfig
from sparrow.output import TokenDelta
from sparrow.prefix_cache import PrefillsInFlight, PrefixCache
from sparrow.tiny import synthetic_frames, tiny_draft

SPEC = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16, glimpse=3)
PROMPTS = ["What happens in the video?", "Which shape moves first, and where does it go?"]
GREEDY = SamplingParams(max_new_tokens=16)
SEEDED = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)


def _counted(video, calls, delay=0.0):
    def load(cancelled):
        calls.append(1)
        time.sleep(delay)                   # a decode that takes a while: the repeat arrives meanwhile
        return video
    return load


def _final(out: list, deadline: float):
    """A request's last event (its output or error), waited for until `deadline`."""
    while not (out and not isinstance(out[-1], TokenDelta)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out and not isinstance(out[-1], TokenDelta), "no final event"
    return out[-1]


def _together(engine, jobs):
    """Submit every (video, prompt, sampling) at once; their outputs, in order."""
    outputs = [[] for _ in jobs]
    requests = [engine.submit(video, prompt, sampling, video_key="clip", sink=out.append)
                for (video, prompt, sampling), out in zip(jobs, outputs)]
    deadline = time.monotonic() + 120
    return requests, [_final(out, deadline) for out in outputs]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_repeat_submitted_with_the_first_waits_for_its_prefill(qwen_target, large_video, sampling):
    draft = tiny_draft(qwen_target, seed=1)
    solo = [Engine(qwen_target, draft, SPEC).generate(large_video, p, sampling).token_ids for p in PROMPTS]
    engine = Engine(qwen_target, draft, SPEC, prefix_cache=PrefixCache())
    calls = []
    video = _counted(large_video, calls, delay=0.3)
    _, outs = _together(engine, [(video, p, sampling) for p in PROMPTS])
    assert [o.token_ids for o in outs] == solo
    assert len(calls) == 1 and engine.scheduler.stats["waited_for_prefill"] == 1     # one decode, one prefill
    cached = [o.metrics.cached_prompt_tokens for o in outs]
    assert cached[0] == 0 and cached[1] > outs[1].metrics.visual_tokens


def test_the_first_aborted_mid_prefill_the_second_prefills_itself(qwen_target):
    video = synthetic_frames(64, 112, 112, seed=4)                  # 512 visual tokens: many 32-token slices
    draft = tiny_draft(qwen_target, seed=1)
    config = EngineConfig(prefill_chunk_tokens=32)
    solo = Engine(qwen_target, draft, SPEC, config=config).generate(video, PROMPTS[1], GREEDY).token_ids
    engine = Engine(qwen_target, draft, SPEC, prefix_cache=PrefixCache(), config=config)
    calls, outputs = [], [[], []]
    first = engine.submit(_counted(video, calls), PROMPTS[0], GREEDY, video_key="clip", sink=outputs[0].append)
    second = engine.submit(_counted(video, calls), PROMPTS[1], GREEDY, video_key="clip", sink=outputs[1].append)
    deadline = time.monotonic() + 60
    while engine.scheduler.stats["prefill_slices"] < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert len(calls) == 1 and not first.done                         # the first is mid-prefill; the second waits
    first.abort()
    aborted, answered = _final(outputs[0], deadline), _final(outputs[1], deadline)
    assert aborted.finish_reason == "abort" and aborted.token_ids == []
    assert answered.token_ids == solo and len(calls) == 2             # it decoded and prefilled the video itself
    assert engine.scheduler.stats["waited_for_prefill"] == 1
    arena = engine.runner.arena
    assert arena.free_tokens == arena.tokens
    # the second's prefill went to the cache: a third question reads it
    third = engine.generate(_counted(video, calls), PROMPTS[0], GREEDY, video_key="clip")
    assert third.metrics.cached_prompt_tokens > third.metrics.visual_tokens and len(calls) == 2


def test_the_first_failing_or_its_prefix_refused_the_others_still_answer(qwen_target, small_video):
    draft = tiny_draft(qwen_target, seed=1)
    solo = [Engine(qwen_target, draft, SPEC).generate(small_video, p, GREEDY).token_ids for p in PROMPTS]

    def broken(cancelled):
        time.sleep(0.3)
        raise ValueError("no such video")

    engine = Engine(qwen_target, draft, SPEC, prefix_cache=PrefixCache())
    calls = []
    _, outs = _together(engine, [(broken, PROMPTS[0], GREEDY), (_counted(small_video, calls), PROMPTS[1], GREEDY),
                                 (_counted(small_video, calls), PROMPTS[0], GREEDY)])
    assert isinstance(outs[0], ValueError)
    assert [o.token_ids for o in outs[1:]] == solo[::-1] and len(calls) == 1   # the second led, the third waited
    assert engine.scheduler.stats["waited_for_prefill"] == 2
    # A cache too small for the prefix: the waiters are let go together and prefill for themselves.
    engine = Engine(qwen_target, draft, SPEC, prefix_cache=PrefixCache(max_bytes=1))
    calls = []
    video = _counted(small_video, calls, delay=0.3)
    _, outs = _together(engine, [(video, PROMPTS[0], GREEDY), (video, PROMPTS[1], GREEDY), (video, PROMPTS[0], GREEDY)])
    assert [o.token_ids for o in outs] == [solo[0], solo[1], solo[0]] and len(calls) == 3
    assert engine.scheduler.stats["waited_for_prefill"] == 2


def test_a_waiter_that_aborts_ends_at_once(qwen_target, small_video):
    engine = Engine(qwen_target, spec=SpecConfig(method="none"), prefix_cache=PrefixCache())
    release, outputs = threading.Event(), [[], []]

    def blocking(cancelled):
        release.wait(30)
        return small_video

    first = engine.submit(blocking, PROMPTS[0], GREEDY, video_key="clip", sink=outputs[0].append)
    second = engine.submit(blocking, PROMPTS[1], GREEDY, video_key="clip", sink=outputs[1].append)
    deadline = time.monotonic() + 10
    while engine.scheduler.stats["waited_for_prefill"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    second.abort()
    assert _final(outputs[1], deadline).finish_reason == "abort" and not first.done
    release.set()
    assert _final(outputs[0], deadline + 20).finish_reason == "length"


def test_in_flight_registry_hands_a_key_on():
    inflight, a, b, c = PrefillsInFlight(), object(), object(), object()
    assert not inflight.join("v", a, cached=False)                    # a leads
    assert inflight.join("v", b, cached=False) and inflight.join("v", c, cached=False)
    assert inflight.settle(a, finished=False, cached=False) == [b]    # a ended: b leads ...
    assert not inflight.join("v", b, cached=False) and len(inflight) == 1   # ... c waits for b
    assert inflight.settle(b, finished=True, cached=True) == [c] and len(inflight) == 0
    assert inflight.settle(b, finished=True, cached=True) == []       # once only
    assert not inflight.join("v", c, cached=True) and inflight.leads(c) is None
    # finished but not cached: the waiters never wait again for this key
    assert not inflight.join("w", a, cached=False) and inflight.join("w", b, cached=False)
    assert inflight.settle(a, finished=True, cached=False) == [b]
    assert not inflight.join("w", b, cached=False) and inflight.leads(b) is None
    assert inflight.drop(lambda r: True) == []
