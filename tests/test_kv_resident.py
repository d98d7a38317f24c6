"""A freed KV slot keeps its cached video prefix's rows while nobody needs its range, and the next
question about that video is given the slot back and skips the prefix's copy (KVArena.allocate's
prefix). What must hold: the rows given back are bitwise the prefix's; other placements avoid a
resident range while other space fits and forget it when they cover its rows; a prefix the cache
dropped is no longer matched; and an answer started in place equals the copy's and plain decoding's.
"""

import gc

import torch

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.config import EngineConfig
from sparrow.models.kv_cache import KVArena
from sparrow.models.prefill import VideoPrefix
from sparrow.prefix_cache import PrefixCache

HEADS, DIM = 2, 4


def _arena(tokens: int) -> KVArena:
    return KVArena(2, HEADS, DIM, tokens, torch.float32, "cpu")


def _prefix(rows: int, seed: int) -> VideoPrefix:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, HEADS, rows, DIM, generator=g) for _ in range(2)]
    values = [torch.randn(1, HEADS, rows, DIM, generator=g) for _ in range(2)]
    return VideoPrefix(torch.arange(rows), keys, values, None, None, None)


def _hold(arena: KVArena, capacity: int, prefix: VideoPrefix):
    """A slot that copies `prefix` in (as a cached question's prefill does) and writes rows after it."""
    slot = arena.allocate(capacity)
    prefix.load_into(slot.cache)
    for i, layer in enumerate(slot.cache.layers):
        layer.update(torch.full((1, HEADS, 3, DIM), 7.0), torch.full((1, HEADS, 3, DIM), 7.0), i)
    slot.holds = prefix
    return slot


def test_a_freed_slot_is_given_back_with_its_prefix_rows_bitwise():
    arena, prefix = _arena(100), _prefix(20, 0)
    first = _hold(arena, 30, prefix)
    first.release()
    other = arena.allocate(30)                       # another video: at the free space's far end
    assert other.start == 70 and other.preloaded is None
    again = arena.allocate(28, prefix)               # a shorter answer's slot: the same range
    assert (again.start, again.preloaded) == (first.start, prefix) and arena.prefix_hits == 1
    assert prefix.take_in_place(again.cache) == 20
    for layer, k, v in zip(again.cache.layers, prefix.keys, prefix.values):
        assert layer.length == 20 and torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert arena.free_tokens == 100 - 30 - 28


def test_a_resident_range_never_keeps_a_long_request_out():
    arena, prefix = _arena(100), _prefix(20, 4)
    _hold(arena, 30, prefix).release()
    arena.allocate(30)                               # placed at the end: the free space stays one range
    assert arena.can_fit(70) and arena.resident_prefixes == 1
    long = arena.allocate(70)                        # only by taking the resident range: it is forgotten
    assert long.start == 0 and arena.resident_prefixes == 0 and arena.free_tokens == 0


def test_a_placement_over_the_rows_forgets_them_and_the_oldest_goes_first():
    arena, a, b = _arena(60), _prefix(10, 1), _prefix(10, 2)
    sa, sb = _hold(arena, 30, a), _hold(arena, 30, b)
    sa.release()
    sb.release()
    assert arena.resident_prefixes == 2
    big = arena.allocate(30)                        # no free space outside the residents: the oldest (a) goes
    assert big.start == sa.start and arena.resident_prefixes == 1
    assert arena.allocate(30, a).preloaded is None    # a's rows are gone: placed over b's, which are forgotten
    big.release()
    assert arena.allocate(30, b).preloaded is None and arena.resident_prefixes == 0


def test_a_prefix_the_cache_dropped_is_not_matched():
    arena, prefix = _arena(100), _prefix(20, 3)
    _hold(arena, 30, prefix).release()
    assert arena.resident_prefixes == 1
    del prefix
    gc.collect()
    lookalike = _prefix(20, 3)                       # equal tensors, another object: no claim on the rows
    assert arena.resident_prefixes == 0 and arena.allocate(30, lookalike).preloaded is None


def test_a_question_on_a_cached_video_starts_in_place_and_answers_as_the_copy_does(qwen_target, small_video):
    cache, sampling = PrefixCache(), SamplingParams(max_new_tokens=10)
    config = EngineConfig(kv_cache_bytes=8 << 20)
    engine = Engine(qwen_target, spec=SpecConfig(method="none"), prefix_cache=cache, config=config)
    copying = Engine(qwen_target, spec=SpecConfig(method="none"), prefix_cache=cache, config=config)  # no residents
    plain = Engine(qwen_target, spec=SpecConfig(method="none"), config=config)
    try:
        engine.generate(small_video, "What happens in the video?", sampling, video_key="clip")
        assert engine.scheduler.stats["prefix_in_place"] == 0
        for prompt in ("Which shape moves first?", "What colour is the square?"):
            got = engine.generate(small_video, prompt, sampling, video_key="clip")
            assert got.metrics.cached_prompt_tokens > 0
            assert got.token_ids == copying.generate(small_video, prompt, sampling, video_key="clip").token_ids
            assert got.token_ids == plain.generate(small_video, prompt, sampling).token_ids
        assert engine.scheduler.stats["prefix_in_place"] == 2 and copying.scheduler.stats["prefix_in_place"] == 1
    finally:
        for e in (engine, copying, plain):
            e.shutdown()
