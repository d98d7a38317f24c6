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

    def can_fit(self, capacity: int) -> bool:
        return any(n >= capacity for _, n in self._free)

    def allocate(self, capacity: int) -> "KVSlot | None":
        """A slot of `capacity` tokens, or None while no free range is that large."""
        for i, (start, n) in enumerate(self._free):
            if n >= capacity:
                self._free[i:i + 1] = [(start + capacity, n - capacity)] if n > capacity else []
                return KVSlot(self, start, capacity)
        return None

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


class KVSlot:
    """One request's range of a KVArena; `cache` is its transformers Cache."""

    def __init__(self, arena: KVArena, start: int, capacity: int):
        self.arena, self.start, self.capacity = arena, start, capacity
        end = start + capacity
        self.cache = Cache(layers=[PreallocatedLayer(capacity, k[:, :, start:end], v[:, :, start:end])
                                   for k, v in zip(arena.keys, arena.values)])
        for layer, k, v in zip(self.cache.layers, arena.keys, arena.values):
            layer.arena = (k, v, start)
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.arena.release(self)
