"""Engine requests read from asyncio (services/async_requests.py): a scheduler phase's events
(a decode step's, a prefill's) reach the loop in one wake-up, and a reader that fell behind
gets its waiting deltas joined, every token in order."""

import asyncio

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.output import GenerationOutput, TokenDelta
from sparrow.services.async_requests import AsyncRequests
from sparrow.tiny import tiny_draft

PROMPT = "What happens in the video?"


def test_a_late_reader_gets_every_token_joined_and_the_loop_is_woken_once_a_phase(qwen_target, small_video):
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=0), spec=SpecConfig(num_draft_tokens=2, adaptive_k=False))
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = engine.generate(small_video, PROMPT, sampling).token_ids
    runner = AsyncRequests(engine, max_concurrent=4)

    async def main():
        loop = asyncio.get_running_loop()
        posts, wakes, sizes, held, plain_call = [], [], [], [], loop.call_soon_threadsafe

        def counted(callback, *args):
            wakes.append(callback)
            return plain_call(callback, *args)
        loop.call_soon_threadsafe = counted
        post, hand_over = runner._post, runner._hand_over
        runner._post = lambda loop, request, item: (posts.append(item), post(loop, request, item))[1]
        runner._hand_over = lambda loop: (sizes.append(len(runner._outbox.get(loop, ()))), hand_over(loop))[1]
        decode = engine.scheduler._decode_step

        def step():                               # what a decode step finds not yet handed over
            with runner._lock:
                held.append(bool(runner._outbox.get(loop)) and loop not in runner._woken)
            decode()
        engine.scheduler._decode_step = step
        started = [runner.start(small_video, PROMPT, sampling, None) for _ in range(3)]
        while runner.active:                      # nobody reads until every request is over
            await asyncio.sleep(0.01)
        events = [[item async for item in running.events()] for running in started]
        return posts, wakes, sizes, held, events

    posts, wakes, sizes, held, events = asyncio.run(main())
    for got in events:
        deltas = [e for e in got if isinstance(e, TokenDelta)]
        assert len(deltas) == 1 and isinstance(got[-1], GenerationOutput)          # joined while it waited
        assert list(deltas[0].token_ids) == alone == got[-1].token_ids
        assert deltas[0].text == got[-1].text
    assert sum(isinstance(p, TokenDelta) for p in posts) > 3 * 2                  # several steps each
    # a step's events for the three requests share a wake-up: one a phase, not one an event; and a
    # phase's events (a first token from a prefill) are on their way before the decode step after it
    assert len(wakes) == len(sizes) < len(posts) == sum(sizes) and max(sizes) >= 3
    assert held and not any(held)
    runner.shutdown()
