"""The target's KV cache: a preallocated buffer plus a length, as in gpt-fast.

transformers' DynamicCache grows by concatenation, which copies the whole cache on every
step: at 25k cached tokens that copy costs as much as the attention itself. Here each layer
owns one buffer sized for the whole request (prompt + max new tokens + draft tokens + 1),
`update` writes the new keys/values in place and returns views of the filled part, and
rollback after a rejected draft is moving the length back (`crop`).

It is a `transformers.Cache` made of `CacheLayerMixin` layers, handed to the HF model only
through the public `past_key_values` argument.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys/values: buffers [B, H, capacity, D] and a fill length."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

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
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded (need {end})")
        self.k_buf[:, :, self.length:end].copy_(key_states)
        self.v_buf[:, :, self.length:end].copy_(value_states)
        self.length = end
        self.keys = self.k_buf[:, :, :end]      # views, no copy
        self.values = self.v_buf[:, :, :end]
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
