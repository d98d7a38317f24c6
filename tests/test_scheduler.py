"""The batched engine: many requests in one scheduler, each one's output independent of its
neighbours; admission by KV memory; every registered method lossless through the scheduler."""

import threading
import time

import pytest

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.errors import InvalidRequest, ResourceExhausted, VideoError
from sparrow.config import EngineConfig
from sparrow.scheduler import STARVED_SLICES
from sparrow.speculative.proposer import Proposer
from sparrow.speculative.registry import PROPOSERS, build_proposer
from sparrow.tiny import synthetic_frames, tiny_draft, tiny_target

SPEC = SpecConfig(adaptive_k=False, method="sparrow", num_draft_tokens=4, window=8, anchors=16)
PROMPTS = ["What happens in the video?", "Which shape moves first, and where does it go?"]


def hf_greedy(target, engine, video, prompt, n):
    inputs = engine.prepare(video, prompt)
    out = target.hf.generate(**inputs, do_sample=False, max_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _jobs(videos):
    """Mixed requests: video lengths, k (pinned 0/2/4 and the engine's), greedy and seeded
    sampling, a stop string."""
    return [
        dict(video=videos[0], prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=24)),
        dict(video=videos[1], prompt=PROMPTS[1], sampling=SamplingParams(max_new_tokens=20), k=2),
        dict(video=videos[2], prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=16), k=0),
        dict(video=videos[1], prompt=PROMPTS[0],
             sampling=SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=11)),
        dict(video=videos[2], prompt=PROMPTS[1],
             sampling=SamplingParams(max_new_tokens=20, temperature=0.7, top_k=40, seed=5), k=3),
        dict(video=videos[0], prompt=PROMPTS[1], sampling=SamplingParams(max_new_tokens=30, stop=("e",))),
    ]


def _solo(engine, job):
    return engine.generate(job["video"], job["prompt"], job["sampling"], num_draft_tokens=job.get("k"))


def test_concurrent_mixed_requests_equal_their_solo_runs(qwen_target):
    videos = [synthetic_frames(4, 56, 56, seed=1), synthetic_frames(8, 84, 112, seed=2),
              synthetic_frames(16, 56, 84, seed=3)]
    arena_bytes = 3 * 1024 * 1024        # room for a few requests at once: the aborted slot must be reused
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=1), SPEC,
                    config=EngineConfig(kv_cache_bytes=arena_bytes, prefill_chunk_tokens=64))
    jobs = _jobs(videos)
    solo = [_solo(engine, job) for job in jobs]
    for job, out in zip(jobs, solo):
        if job["sampling"].greedy and not job["sampling"].stop:
            assert out.token_ids == hf_greedy(qwen_target, engine, job["video"], job["prompt"],
                                              job["sampling"].max_new_tokens)

    results, errors = {}, {}

    def run(name, job):
        gen = engine.stream(job["video"], job["prompt"], job["sampling"], num_draft_tokens=job.get("k"))
        try:
            tokens = []
            for delta in gen:
                tokens.extend(delta.token_ids)
                if name == "aborted" and len(tokens) >= 3:
                    gen.abort()
            results[name] = (tokens, gen.output)
        except Exception as exc:  # noqa: BLE001
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    threads.append(threading.Thread(target=run, args=("aborted", dict(
        video=videos[1], prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=200, ignore_eos=True)))))
    threads.append(threading.Thread(target=run, args=("bad", dict(
        video=b"this is not a video container", prompt=PROMPTS[0], sampling=SamplingParams()))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)

    assert set(errors) == {"bad"} and isinstance(errors["bad"], VideoError)
    for i, out in enumerate(solo):
        tokens, output = results[i]
        assert tokens == out.token_ids == output.token_ids, f"request {i} differs from its solo run"
        assert output.text == out.text and output.finish_reason == out.finish_reason
    assert results[5][1].finish_reason == "stop" and "e" not in results[5][1].text
    aborted_tokens, aborted = results["aborted"]
    assert aborted.finish_reason == "abort" and 3 <= len(aborted_tokens) < 200
    assert engine.scheduler.stats["max_batch"] > 1                      # they really ran together
    arena = engine.runner.arena
    assert arena.free_tokens == arena.tokens                           # every slot came back
    # The arena holds only a few requests: the ones that waited got the aborted and finished slots.
    assert engine.scheduler.stats["waited_for_memory"] > 0


def test_requests_wait_for_memory_and_are_refused_past_the_arena_or_the_timeout(qwen_target, small_video):
    draft = tiny_draft(qwen_target, seed=1)
    per_token = 2 * 4 * 2 * 16 * 4                                     # layers x kv heads x head dim x fp32, K and V
    tight = EngineConfig(kv_cache_bytes=1000 * per_token, queue_timeout_s=0.3)   # prompt is ~330 tokens
    engine = Engine(qwen_target, draft, SPEC, config=tight)
    with pytest.raises(ResourceExhausted, match="KV memory"):
        engine.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=2000))
    # One request fills most of the arena; a second one waits, then is refused after the timeout.
    # The first holds its memory until it ends (~600 one-token steps: far longer than the timeout).
    long = engine.stream(small_video, PROMPTS[0], SamplingParams(max_new_tokens=600, ignore_eos=True),
                         num_draft_tokens=0)
    next(long)
    with pytest.raises(ResourceExhausted, match="waited"):
        engine.generate(small_video, PROMPTS[1], SamplingParams(max_new_tokens=200))
    long.close()
    # Memory is back: the same request now runs.
    assert len(engine.generate(small_video, PROMPTS[1], SamplingParams(max_new_tokens=8)).token_ids) >= 1


def test_a_long_prefill_is_sliced_between_running_streams_steps(qwen_target):
    """While a long video prefills in slices, a running stream keeps getting tokens."""
    engine = Engine(qwen_target, spec=SpecConfig(method="none"), config=EngineConfig(prefill_chunk_tokens=32))
    assert engine.scheduler.idle()
    short_times = []
    short = engine.submit(synthetic_frames(4, 56, 56, seed=1), PROMPTS[0],
                          SamplingParams(max_new_tokens=2000, ignore_eos=True),
                          sink=lambda item: short_times.append(time.monotonic()))
    while len(short_times) < 3:
        time.sleep(0.01)
    assert not engine.scheduler.idle()
    long_video = synthetic_frames(64, 112, 112, seed=4)                 # 512 visual tokens: 17+ slices
    submitted = time.monotonic()
    long = engine.stream(long_video, PROMPTS[0], SamplingParams(max_new_tokens=4))
    first = next(long)
    first_at = time.monotonic()
    rest = [t for d in long for t in d.token_ids]
    short.abort()
    deadline = time.monotonic() + 10
    while not engine.scheduler.idle() and time.monotonic() < deadline:   # the aborted stream leaves at its next step
        time.sleep(0.01)
    assert engine.scheduler.idle()
    assert engine.scheduler.stats["prefill_slices"] >= 17
    during = [t for t in short_times if submitted < t < first_at]
    assert len(during) >= 10                                            # the stream did not freeze
    assert list(first.token_ids) + rest == hf_greedy(qwen_target, engine, long_video, PROMPTS[0], 4)


@pytest.mark.parametrize("method", ["sparrow", "eagle-style", "specvlm", "none"])
def test_every_registered_method_is_a_proposer_and_lossless_through_the_scheduler(qwen_target, large_video, method):
    assert method in PROPOSERS
    spec = SpecConfig(adaptive_k=False, method=method, num_draft_tokens=3, window=8, anchors=16, prune_keep=0.5)
    draft = (tiny_target("qwen2_5_vl", seed=6, hidden=32, layers=2, heads=2) if method == "specvlm"
             else tiny_draft(qwen_target, seed=2) if method != "none" else None)
    proposer = build_proposer(spec, qwen_target, draft)
    assert (proposer is None) == (method == "none")
    if proposer is not None:
        assert isinstance(proposer, Proposer)
    engine = Engine(qwen_target, draft, spec)
    expected = hf_greedy(qwen_target, engine, large_video, PROMPTS[1], 20)
    # Two at once through the scheduler, and each as the target's own greedy output.
    gens = [engine.stream(large_video, PROMPTS[1], SamplingParams(max_new_tokens=20)) for _ in range(2)]
    outs = [[t for d in g for t in d.token_ids] for g in gens]
    assert outs == [expected, expected]
    if method != "none":
        assert gens[0].output.metrics.draft_tokens > 0


def test_unknown_method_and_missing_draft_are_clear_errors(qwen_target):
    build_proposer(SpecConfig(method="none"), qwen_target, None)          # loads the built-in methods
    assert {"sparrow", "eagle-style", "eagle3", "specvlm", "none"} <= set(PROPOSERS)
    with pytest.raises(InvalidRequest, match="method"):
        SpecConfig(adaptive_k=False, method="medusa")
    with pytest.raises(InvalidRequest, match="Eagle3Draft"):
        Engine(qwen_target, tiny_draft(qwen_target), SpecConfig(adaptive_k=False, method="eagle3"))
    with pytest.raises(InvalidRequest, match="needs a draft"):
        Engine(qwen_target, spec=SpecConfig(adaptive_k=False, method="sparrow"))
    with pytest.raises(InvalidRequest, match="Sparrow draft"):
        Engine(qwen_target, tiny_target("qwen2_5_vl", seed=6, hidden=32, layers=2, heads=2), SpecConfig(adaptive_k=False))


def test_adaptive_k_stays_lossless_and_drops_to_plain_decoding_for_a_useless_draft(qwen_target, small_video):
    """A random draft is almost never accepted: the policy learns that and stops drafting,
    while greedy output stays the target's."""
    spec = SpecConfig(num_draft_tokens=4, window=8, anchors=16)          # adaptive k: the default
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=3), spec)
    expected = hf_greedy(qwen_target, engine, small_video, PROMPTS[0], 60)
    sampling = SamplingParams(max_new_tokens=60, ignore_eos=True)
    outs = [engine.generate(small_video, PROMPTS[0], sampling) for _ in range(3)]
    assert all(o.token_ids[: len(expected)] == expected for o in outs)
    late = outs[-1].metrics
    assert late.draft_tokens < late.steps * 4 / 2       # far fewer drafts than a fixed k = 4 would make
    assert engine.scheduler.policy.costs.verify_samples   # it measured the verify costs it chose from


# ----- ended requests cost nothing; short prefills are not queued behind long ones ------------------
def test_an_ended_request_is_never_prepared_and_its_decode_stops(qwen_target, small_video, tmp_path):
    """With the only preparer busy, a request aborted while queued, or whose deadline passed
    while queued, is never prepared (its deferred video never decoded); a deadline that passes
    during decoding stops it; a video read whose request ended stops at the next packet."""
    from sparrow.errors import RequestAborted
    from sparrow.video import VideoOptions, load_frames
    from sparrow.video.synthetic import write_synthetic_video

    engine = Engine(qwen_target, spec=SpecConfig(method="none"), config=EngineConfig(prepare_threads=1))
    release, decoded, outputs = threading.Event(), [], []

    def blocking(cancelled):
        release.wait(10)
        return small_video

    def counted(cancelled):
        decoded.append(1)
        return small_video

    first = engine.submit(blocking, PROMPTS[0], SamplingParams(max_new_tokens=2), sink=outputs.append)
    second = engine.submit(counted, PROMPTS[0], SamplingParams(max_new_tokens=2), sink=outputs.append)
    second.abort()
    # a deadline ends a request by itself, with no one to abort it: past by the time a preparer is free
    third = engine.submit(counted, PROMPTS[0], SamplingParams(max_new_tokens=2), sink=outputs.append,
                          deadline=time.monotonic() + 0.05)
    time.sleep(0.1)
    release.set()
    deadline = time.monotonic() + 30
    while sum(1 for o in outputs if hasattr(o, "finish_reason")) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    finals = [o for o in outputs if hasattr(o, "finish_reason")]
    assert sorted(o.finish_reason for o in finals) == ["abort", "abort", "length"] and not decoded
    stats = engine.scheduler.stats
    assert (stats["ended_before_prepare"], stats["prepared_dead"]) == (2, 0)
    assert first.done and second.done and third.done
    # and one whose deadline passes while it decodes stops there
    outputs.clear()
    late = engine.submit(small_video, PROMPTS[0], SamplingParams(max_new_tokens=4000, ignore_eos=True),
                         sink=outputs.append, deadline=time.monotonic() + 1.0)
    # `done` is the scheduler's own mark, set as the request leaves and before its final event
    # reaches the sink: wait for the event itself
    deadline = time.monotonic() + 30
    while not (outputs and hasattr(outputs[-1], "finish_reason")) and time.monotonic() < deadline:
        time.sleep(0.01)
    final = outputs[-1]
    assert final.finish_reason == "abort" and 0 < len(final.token_ids) < 4000
    out = engine.generate(small_video, PROMPTS[0], SamplingParams(max_new_tokens=4000, ignore_eos=True), timeout_s=0.5)
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 4000

    path = write_synthetic_video(tmp_path / "v.mp4", num_frames=48, width=64, height=64, fps=8.0, seed=3).path
    ended = threading.Event()
    ended.set()
    with pytest.raises(RequestAborted):
        load_frames(path, VideoOptions(num_frames=48), cancelled=ended)
    assert len(load_frames(path, VideoOptions(num_frames=8), cancelled=threading.Event()).frames) == 8


def test_a_short_prefill_is_not_queued_behind_a_long_one(qwen_target):
    """A 1k-position prefill runs in 32-position slices; a short request that arrives while it
    runs gets its slices next (fewest positions left first): between the short's admission and
    its first token the long one only gets a starved prefill's turns (one per STARVED_SLICES x
    prefill_slice_s it waited), and it still finishes with the target's own tokens."""
    engine = Engine(qwen_target, spec=SpecConfig(method="none"), config=EngineConfig(prefill_chunk_tokens=32))
    scheduler, marks = engine.scheduler, {}
    real_job = engine.runner.prefill_job

    def job(request):
        marks.setdefault(request.id, (scheduler.stats["prefill_slices"], time.perf_counter()))   # admitted
        return real_job(request)

    engine.runner.prefill_job = job
    long_video = synthetic_frames(128, 112, 112, seed=4)                # 1024 visual tokens: 32+ slices
    long = engine.stream(long_video, PROMPTS[0], SamplingParams(max_new_tokens=3))
    while scheduler.stats["prefill_slices"] < 2:
        time.sleep(0.005)
    first_token = {}

    def short_sink(item):
        first_token.setdefault("slices", scheduler.stats["prefill_slices"])
        first_token.setdefault("at", time.perf_counter())
        first_token.setdefault("long_left", long.request.job.end - long.request.job.cursor
                               if long.request.job is not None else 0)

    short = engine.submit(synthetic_frames(4, 56, 56, seed=1), PROMPTS[1], SamplingParams(max_new_tokens=1),
                          sink=short_sink)
    rest = [t for d in long for t in d.token_ids]
    deadline = time.monotonic() + 30
    while not short.done and time.monotonic() < deadline:
        time.sleep(0.01)
    short_slices = -(-short.metrics.prompt_tokens // 32)
    admitted_slices, admitted_at = marks[short.id]
    starved_after = STARVED_SLICES * engine.config.prefill_slice_s
    long_turns = 1 + int((first_token["at"] - admitted_at) / starved_after)     # the one running, then starved turns
    assert first_token["slices"] - admitted_slices <= short_slices + long_turns
    assert first_token["long_left"] > 500                                # most of the long prefill still to run
    assert rest == hf_greedy(qwen_target, engine, long_video, PROMPTS[0], 3)


class _StubPrefill:
    """A prefill job whose slices cost stub seconds on a virtual clock: a position costs more
    the deeper it is (attention over what came before), as measured on this box's tiny world
    target (~60 us a position at the start of a prompt, ~1.4 ms at 25k)."""

    def __init__(self, positions: int, clock: list, chunk: int = 2048):
        self.end, self.cursor, self.clock, self.chunk = positions, 0, clock, chunk

    short = False                   # never finished with others (finish_together)

    @property
    def remaining(self):
        return self.end - self.cursor

    def step(self, limit=None):
        n = min(limit or self.chunk, self.chunk, self.end - self.cursor)
        self.clock[0] += n * (60e-6 + 55e-9 * (self.cursor + n / 2))
        self.cursor += n
        return self.cursor >= self.end


def _stub_request(positions: int, clock: list):
    from types import SimpleNamespace
    return SimpleNamespace(aborted=threading.Event(), job=_StubPrefill(positions, clock), prefill_s_per_token=0.0,
                           prefill_last_slice=0, prefill_turn_at=clock[0], metrics=SimpleNamespace(prefill_seconds=0.0))


def test_short_prefills_wait_about_a_slice_while_a_long_one_runs_under_a_stub_cost(qwen_target, monkeypatch):
    """Streams decoding (an 8 ms step a loop turn), a 25k-position prefill, and a short
    question (524 positions) every 0.5 s on a virtual clock with a stub cost: each short's
    first token comes within 3 x prefill_slice_s of its arrival (the slice running then, the
    streams' turn, then its own: one slice, run ahead of the long one's), and the long prefill
    keeps its share and finishes."""
    import sparrow.scheduler as scheduler_module
    from types import SimpleNamespace
    clock = [0.0]
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic))
    engine = Engine(qwen_target, spec=SpecConfig(method="none"))
    s, slice_s = engine.scheduler, engine.config.prefill_slice_s
    first_token = {}
    monkeypatch.setattr(s, "_emit", lambda request, tokens: first_token.setdefault(id(request), clock[0]))
    monkeypatch.setattr(s.runner, "start_decoding", lambda request: 0)
    s._running.append(object())                                 # streams are decoding
    long = _stub_request(25_000, clock)
    s._prefilling.append(long)
    shorts, arrivals = [], [1.0 + 0.5 * i for i in range(12)]
    while id(long) not in first_token and clock[0] < 120:
        while arrivals and clock[0] >= arrivals[0]:
            shorts.append(_stub_request(524, clock))
            shorts[-1].arrived = arrivals.pop(0)        # (it came while the last slice ran)
            s._prefilling.append(shorts[-1])
        s._prefill_slice()
        clock[0] += 0.008                                       # the streams' decode step
    waits = [first_token[id(r)] - r.arrived if id(r) in first_token else None for r in shorts]
    assert len(shorts) == 12 and None not in waits
    assert max(waits) <= 3 * slice_s, waits
    assert id(long) in first_token                              # never starved: it finished too
