"""The target's KV cache: a preallocated buffer plus a length, as in gpt-fast.

transformers' DynamicCache grows by concatenation, which copies the whole cache on every
step: at 25k cached tokens that copy costs as much as the attention itself. Here each layer
owns one buffer sized for the whole request (prompt + max new tokens + draft tokens + 1),
`update` writes the new keys/values in place and returns views of the filled part, and
rollback after a rejected draft is moving the length back (`crop`).

It is a `transformers.Cache` made of `CacheLayerMixin` layers, handed to the HF model only
through the public `cache` argument.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys/values: buffers [B, H, capacity, D] and a fill length. The buffers
    are allocated on first use, or given (views of a KVArena's slot)."""

    def __init__(self, capacity: int, k_buf: torch.Tensor | None = None, v_buf: torch.Tensor | None = None):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        # (arena keys, arena values, first position) when the buffers are a KVArena slot's views:
        # a ragged step writes every request's new rows of a layer in one copy (ragged.py)
        self.arena: tuple[torch.Tensor, torch.Tensor, int] | None = None
        if k_buf is not None:
            self.k_buf, self.v_buf = k_buf, v_buf
            self.dtype, self.device = k_buf.dtype, k_buf.device
            self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.k_buf = key_states.new_empty((b, h, self.capacity, d))
        self.v_buf = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.room(n)
        self.k_buf[:, :, self.length:end].copy_(key_states)
        self.v_buf[:, :, self.length:end].copy_(value_states)
        return self.advance(n)

    def room(self, n: int) -> int:
        """Where n more rows would end; an error past the capacity (nothing written)."""
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded (need {end})")
        return end

    def advance(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The n rows after the fill length are written (by `update`, or in place by a ragged
        step's one copy): they join the cache; its keys and values, as views."""
        self.length += n
        self.keys = self.k_buf[:, :, :self.length]      # views, no copy
        self.values = self.v_buf[:, :, :self.length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self.keys = self.k_buf[:, :, :self.length]
            self.values = self.v_buf[:, :, :self.length]

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None


def new_kv_cache(kind: str, num_layers: int, capacity: int) -> Cache:
    """A fresh cache for one request. kind: "static" (preallocated) or "dynamic" (HF default)."""
    if kind == "static":
        return Cache(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])
    return DynamicCache()


class KVArena:
    """The target's KV memory for every running request: ONE key and one value buffer per
    layer, (1, Hkv, tokens, D), allocated once. A request holds a slot, a contiguous range of
    `capacity` token positions (prompt + max new tokens + draft tokens + 1), and its cache is
    a `Cache` of PreallocatedLayers over views of that range: writes go in place, rollback is
    a length move, and nothing is copied as a request grows. Slots are placed first-fit and
    freed ranges merge with their neighbours; admission asks `can_fit` (memory, not a count).

    A freed slot whose first rows are a cached video prefix (`KVSlot.holds`) keeps them while
    nobody needs its range: the next request that starts from that prefix is given the same
    range back (`allocate(..., prefix=)`) and skips the prefix's copy (at 25k tokens tens of ms,
    and the first touch of its pages). Such resident ranges are free memory: a placement avoids
    them while other free space fits, then takes the oldest; a placement over a resident's rows
    forgets it. A resident is known by its VideoPrefix object (held weakly: the prefix cache's
    eviction ends it), whose rows the slot's request copied in or prefilled (VideoPrefix's
    tensors are clones of them), so the rows given back are bitwise the copy's.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, tokens: int,
                 dtype: torch.dtype, device: torch.device | str, prefault: bool = False):
        if tokens < 1:
            raise ValueError(f"a KV arena needs >= 1 token, got {tokens}")
        shape = (1, num_kv_heads, tokens, head_dim)
        # torch.empty: pages never written are never touched, so an idle arena costs address space
        # only, and a slot's first request pays the first touch of its pages (on a CPU ~0.5 ms a MB:
        # ~35 ms of a 25k-token request's start, its cached prefix copied in). prefault: every page
        # written now (torch.zeros), so none does (EngineConfig.kv_prefault).
        new = torch.zeros if prefault else torch.empty
        self.keys = [new(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [new(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.tokens = tokens
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.keys[0].element_size()
        self._free: list[tuple[int, int]] = [(0, tokens)]       # (start, length), sorted by start
        # start -> (weakref to the VideoPrefix held there, its rows, the freed slot's capacity); oldest first
        self._resident: dict[int, tuple[weakref.ref, int, int]] = {}
        self.prefix_hits = 0                                    # allocations given their prefix in place

    @classmethod
    def for_model(cls, text_config, budget_bytes: int, dtype: torch.dtype, device, prefault: bool = False) -> "KVArena":
        """An arena of `budget_bytes` for a transformers text config."""
        heads = text_config.num_attention_heads
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        per_token = 2 * text_config.num_hidden_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        return cls(text_config.num_hidden_layers, kv_heads, head_dim, max(1, budget_bytes // per_token), dtype, device,
                   prefault)

    @property
    def free_tokens(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def resident_prefixes(self) -> int:
        return sum(1 for ref, _, _ in self._resident.values() if ref() is not None)

    def can_fit(self, capacity: int) -> bool:
        return any(n >= capacity for _, n in self._free)

    def allocate(self, capacity: int, prefix=None) -> "KVSlot | None":
        """A slot of `capacity` tokens, or None while no free range is that large. With `prefix`
        (a VideoPrefix) the slot that held it is given back when its range is free; the slot's
        `preloaded` then says so (PrefillJob takes the rows in place)."""
        if prefix is not None:
            for start, (ref, _, _) in self._resident.items():
                if ref() is prefix and self._is_free(start, capacity):
                    self._claim(start, capacity)
                    self.prefix_hits += 1
                    slot = KVSlot(self, start, capacity)
                    slot.holds = slot.preloaded = prefix
                    return slot
        start = self._place(capacity)
        if start is None:
            return None
        self._claim(start, capacity)
        return KVSlot(self, start, capacity)

    def release(self, slot: "KVSlot") -> None:
        self._free.append((slot.start, slot.capacity))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self._free = merged
        if slot.holds is not None and slot.holds.length <= slot.capacity:
            self._resident.pop(slot.start, None)              # re-inserted: the newest
            self._resident[slot.start] = (weakref.ref(slot.holds), slot.holds.length, slot.capacity)

    def _is_free(self, start: int, capacity: int) -> bool:
        return any(a <= start and start + capacity <= a + n for a, n in self._free)

    def _place(self, capacity: int) -> int | None:
        """Where a slot of `capacity` goes: first fit in free space no resident prefix keeps, at
        a free range's start or end where it can (a slot placed beside a resident range then does
        not split the free range: a later long request still finds it whole); while none fits,
        the oldest resident is forgotten."""
        for dead in [s for s, (ref, _, _) in self._resident.items() if ref() is None]:
            del self._resident[dead]                          # its prefix was evicted from the cache
        if not self.can_fit(capacity):
            return None
        while True:
            kept = sorted((s, s + extent) for s, (_, _, extent) in self._resident.items())
            inside = None
            for start, n in self._free:
                for a, b in _gaps(start, start + n, kept):
                    if b - a < capacity:
                        continue
                    if a == start:
                        return a
                    if b == start + n:
                        return b - capacity
                    inside = a if inside is None else inside
            if inside is not None:
                return inside
            del self._resident[next(iter(self._resident))]   # can_fit: once none is left, it fits

    def _claim(self, start: int, capacity: int) -> None:
        """[start, start + capacity) leaves the free list; residents whose rows it covers are forgotten."""
        end = start + capacity
        i = next(i for i, (a, n) in enumerate(self._free) if a <= start and end <= a + n)
        a, n = self._free[i]
        self._free[i:i + 1] = [(s, e - s) for s, e in ((a, start), (end, a + n)) if e > s]
        for s in [s for s, (_, rows, _) in self._resident.items() if s < end and start < s + rows]:
            del self._resident[s]


def _gaps(start: int, end: int, kept: list[tuple[int, int]]):
    """The parts of [start, end) outside the sorted ranges `kept`."""
    at = start
    for a, b in kept:
        if b <= at or a >= end:
            continue
        if a > at:
            yield at, a
        at = max(at, b)
    if at < end:
        yield at, end


class KVSlot:
    """One request's range of a KVArena; `cache` is its transformers Cache. `holds`: the
    VideoPrefix whose rows are the slot's first rows (set by whoever puts them there);
    `preloaded`: that prefix when the arena gave the slot back with its rows in place."""

    def __init__(self, arena: KVArena, start: int, capacity: int):
        self.arena, self.start, self.capacity = arena, start, capacity
        end = start + capacity
        self.cache = Cache(layers=[PreallocatedLayer(capacity, k[:, :, start:end], v[:, :, start:end])
                                   for k, v in zip(arena.keys, arena.values)])
        for layer, k, v in zip(self.cache.layers, arena.keys, arena.values):
            layer.arena = (k, v, start)
        self.holds = self.preloaded = None
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.arena.release(self)
