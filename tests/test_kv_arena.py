"""A ragged step over KV arena slots writes every request's new keys of a layer in one copy
(ragged._arena_positions): the same keys, values and logits as each cache writing its own
rows, and nothing past a slot (a neighbour's keys are never touched).
"""

import pytest
import torch
from helpers import RAGGED_PROMPTS

from sparrow import Engine, SpecConfig
from sparrow.models.kv_cache import KVArena
from sparrow.models.prefill import FeatureNeeds, PrefillJob

def _prefilled(target, video, arena: KVArena | None, room: int):
    engine = Engine(target, spec=SpecConfig(method="none"))
    states = []
    for prompt in RAGGED_PROMPTS:
        inputs = engine.prepare(video, prompt)
        capacity = inputs["input_ids"].shape[1] + room
        if arena is not None:
            states.append(PrefillJob(target, inputs, arena.allocate(capacity).cache, FeatureNeeds()).run().output().state)
        else:
            states.append(target.prefill(inputs, capacity).state)
    return states


def _arena(target) -> KVArena:
    return KVArena.for_model(target.text_config, 4 << 20, target.hf.dtype, target.device)


def test_one_copy_into_the_arena_is_each_cache_writing_its_own(qwen_target, small_video):
    target = qwen_target
    arena = _arena(target)
    in_arena, own = _prefilled(target, small_video, arena, 8), _prefilled(target, small_video, None, 8)
    tokens = [torch.tensor(t) for t in ([3], [3, 4, 5, 6, 7], [5, 6])]
    got = target.verify(in_arena, tokens)[0]
    want = target.verify(own, tokens)[0]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for a, b in zip(in_arena, own):
        assert a.length == b.length
        for la, lb in zip(a.kv.layers, b.kv.layers):
            assert la.arena is not None and lb.arena is None
            torch.testing.assert_close(la.keys, lb.keys, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(la.values, lb.values, atol=1e-6, rtol=1e-6)


def test_rows_past_a_slot_are_refused_before_anything_is_written(qwen_target, small_video):
    target = qwen_target
    arena = _arena(target)
    states = _prefilled(target, small_video, arena, 2)
    before = [k.clone() for k in arena.keys]
    lengths = [s.length for s in states]
    with pytest.raises(RuntimeError, match="KV cache capacity"):
        target.verify(states, [torch.tensor([3]), torch.tensor([3, 4, 5]), torch.tensor([3])])   # 3 > room 2
    for k, b in zip(arena.keys, before):
        assert torch.equal(k.view(torch.int32), b.view(torch.int32))   # bits (unused memory may hold NaN); the first row too
    assert [s.kv.get_seq_length() for s in states] == lengths


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_prefaulted_arena_is_resident_when_made_and_a_lazy_one_is_not():
    """kv_prefault writes every page when the arena is made (no request pays their first touch);
    without it the arena costs address space only until slots are used."""
    size = 64 << 20
    before = _resident_bytes()
    lazy = KVArena(2, 2, 32, size // (2 * 2 * 2 * 32 * 4), torch.float32, "cpu")
    lazy_grew = _resident_bytes() - before
    before = _resident_bytes()
    eager = KVArena(2, 2, 32, size // (2 * 2 * 2 * 32 * 4), torch.float32, "cpu", prefault=True)
    eager_grew = _resident_bytes() - before
    assert lazy_grew < size // 8 and eager_grew > size * 7 // 8, (lazy_grew, eager_grew)
    assert all(not k.any() for k in eager.keys) and eager.tokens == lazy.tokens


def test_an_engine_with_kv_prefault_makes_its_arena_at_once_and_answers_the_same(qwen_target, small_video):
    from sparrow import SamplingParams
    from sparrow.config import EngineConfig
    lazy = Engine(qwen_target, spec=SpecConfig(method="none"), config=EngineConfig(kv_cache_bytes=8 << 20))
    eager = Engine(qwen_target, spec=SpecConfig(method="none"),
                   config=EngineConfig(kv_cache_bytes=8 << 20, kv_prefault=True))
    try:
        assert lazy.runner._arena is None and eager.runner._arena is not None
        params = SamplingParams(max_new_tokens=6)
        assert (eager.generate(small_video, "what happens?", params).token_ids
                == lazy.generate(small_video, "what happens?", params).token_ids)
    finally:
        lazy.shutdown()
        eager.shutdown()
