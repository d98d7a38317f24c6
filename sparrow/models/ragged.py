"""A ragged batch for the target: several requests' new tokens in ONE forward, each reading
only its own KV cache.

Decoding many requests at once pays off because the weights are read once for all of them;
their KV caches have different lengths (a 0.5k video beside a 25k one) and their steps
different sizes (k + 1 tokens, k chosen per request). Padding them to one rectangle would
copy every cache into a padded batch each step, so instead the new tokens are packed along
the sequence axis, (1, N_total), and attention is computed per request over its own slot of
the KV arena (views, no copy), causal within the request's new tokens:

    request r:  rows [start_r, end_r) of the packed queries
                keys = its cache's filled part + its own new tokens (written in place)

`RaggedBatch` is handed to the HF model through public arguments only: as `cache`
(its `update` writes each request's keys into that request's cache) and as the attention
mask (`{"full_attention": batch}`, which transformers passes through untouched), which the
`sparrow_sdpa` attention function (gqa.py) recognises and answers with `attend`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from ..config import VERIFY_KERNELS

# Verify attention for one request's new tokens over its cache (a chain or a draft tree):
# "sdpa" (ragged_attention below: one SDPA call with a (G*n, L) mask) or a kernel of
# sparrow.kernels with the verify contract of kernels/reference.py (config.VERIFY_KERNELS),
# imported by name on first use.
VerifyFn = Callable[..., torch.Tensor]


def verify_kernel(name: str) -> VerifyFn | None:
    """The verify kernel called `name` (None: "sdpa", the ragged SDPA path)."""
    if name == "sdpa":
        return None
    if name not in VERIFY_KERNELS:
        raise ValueError(f"unknown verify attention {name!r}; choose from {['sdpa', *VERIFY_KERNELS]}")
    module, fn = VERIFY_KERNELS[name]
    return getattr(importlib.import_module(module), fn)


@functools.lru_cache(maxsize=None)
def _host_args(kernel: VerifyFn) -> tuple[str, ...]:
    """Which host-side facts the kernel takes (inspected once: a signature costs ~0.1 ms)."""
    params = inspect.signature(kernel).parameters
    return tuple(name for name in ("max_keys", "prefix_len") if name in params)


@functools.lru_cache(maxsize=None)
def _one_call(kernel: VerifyFn) -> Callable | None:
    """The kernel's module's form that takes every request of a layer in one call
    (`verify_attention_ragged(query, views, bounds, trees)`, None where it does not apply), if any."""
    return getattr(importlib.import_module(kernel.__module__), "verify_attention_ragged", None)


@dataclass(slots=True)
class RaggedSegment:
    cache: Cache          # the request's own cache (PreallocatedLayers over its arena slot)
    start: int            # rows of the packed batch
    end: int
    tree_mask: torch.Tensor | None = None   # (n, n) which new tokens each new token sees; None: causal


class RaggedBatch(Cache):
    def __init__(self, segments: list[RaggedSegment], kernel: VerifyFn | None = None):
        super().__init__(layers=[])
        self.segments = segments
        self.kernel = kernel           # a verify kernel (VERIFY_KERNELS), or None: ragged SDPA
        self._views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # Every layer sees the same prefix lengths: made on the device once per step, not per
        # layer; and a kernel that takes max_keys / prefix_len gets them from the host (no
        # device read back).
        self._prefix: list[torch.Tensor] | None = None
        self._host = _host_args(kernel) if kernel is not None else ()
        self._one_call = _one_call(kernel) if kernel is not None else None
        self._slots: torch.Tensor | bool | None = None      # _arena_positions, once a step
        self._record: tuple[int, object] | None = None       # ragged_attend's record, as numpy (its pointer)
        self._forms: dict = {}          # the one-call kernel's choices this step (one for every layer alike)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: (1, Hkv, N_total, D). Each request's rows go to its own cache: where
        every cache is a slot of one KV arena, in one copy into the arena per layer."""
        layers = [seg.cache.layers[layer_idx] for seg in self.segments]
        if self._slots is None:
            self._slots = _arena_positions(layers, self.segments, key_states)
        if self._slots is False:
            self._views[layer_idx] = [layer.update(key_states[:, :, seg.start:seg.end], value_states[:, :, seg.start:seg.end])
                                      for layer, seg in zip(layers, self.segments)]
        else:
            keys, values, _ = layers[0].arena
            n = self._slots.shape[0]
            keys.index_copy_(2, self._slots, key_states[:, :, :n])
            values.index_copy_(2, self._slots, value_states[:, :, :n])
            self._views[layer_idx] = [layer.advance(seg.end - seg.start) for layer, seg in zip(layers, self.segments)]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def lengths(self) -> list[int]:
        """Each request's cache length before this step (a request's layers are alike between
        steps): what `rewind` takes."""
        return [seg.cache.get_seq_length() for seg in self.segments]

    def rewind(self, lengths: list[int]) -> None:
        """Undo a step that stopped part way (a compiled step that raised after some layers
        wrote their keys): every layer of every request's cache back to `lengths`, and the
        batch ready to run the step again."""
        for seg, n in zip(self.segments, lengths):
            for layer in seg.cache.layers:
                extra = layer.get_seq_length() - n
                if extra > 0:
                    layer.crop(-extra)
        self._views.clear()
        self._forms.clear()
        self._slots = self._prefix = self._record = None

    @property
    def rows(self) -> int:
        """The packed rows the requests' tokens fill (a compiled step pads past them)."""
        return self.segments[-1].end if self.segments else 0

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """query (1, Hq, N_total, D) -> (1, N_total, Hq, Dv): each request's rows over its keys."""
        views = self._views.pop(layer_idx)
        kernel = self.kernel
        if kernel is not None and scaling is not None and abs(scaling * query.shape[-1] ** 0.5 - 1) > 1e-6:
            kernel = None              # the kernels' contract is softmax scale 1/sqrt(D)
        if kernel is not None and self._one_call is not None:
            out = self._one_call(query, views, [(seg.start, seg.end) for seg in self.segments],
                                 [seg.tree_mask for seg in self.segments], forms=self._forms)
            if out is not None:
                return out
        if kernel is None:
            out = [ragged_attention(query[:, :, seg.start:seg.end], k, v, scaling, seg.tree_mask)
                   for seg, (k, v) in zip(self.segments, views)]
        else:
            if self._prefix is None:
                self._prefix = [torch.tensor([k.shape[2] - (seg.end - seg.start)], device=query.device)
                                for seg, (k, _) in zip(self.segments, views)]
            def host(seg: RaggedSegment, k: torch.Tensor) -> dict[str, int]:   # k: prefix + the new rows
                known = {"max_keys": k.shape[2], "prefix_len": k.shape[2] - (seg.end - seg.start)}
                return {name: known[name] for name in self._host}
            out = [kernel(query[:, :, seg.start:seg.end], k, v, prefix,
                          seg.tree_mask.to(query.device) if seg.tree_mask is not None else None, **host(seg, k)
                          ).to(query.dtype)
                   for seg, (k, v), prefix in zip(self.segments, views, self._prefix)]
        return torch.cat(out, dim=2).transpose(1, 2).contiguous()

    def as_mask(self) -> dict[str, "RaggedBatch"]:
        """The `attention_mask` argument: transformers uses a dict as prepared masks, per layer type."""
        return {"full_attention": self, "sliding_attention": self}


def _arena_positions(layers: list, segments: list[RaggedSegment], new: torch.Tensor) -> torch.Tensor | bool:
    """The arena positions a step's packed rows go to (every layer alike: a request's layers
    have one fill length), when every cache is a slot of one arena and the rows follow one
    another from 0, in the arena's dtype (`new`: the first layer's new keys); False otherwise
    (each cache writes its own rows). Checks every request's room first: nothing is written
    past a slot."""
    homes = [getattr(layer, "arena", None) for layer in layers]
    if not layers or any(h is None or h[0] is not homes[0][0] for h in homes) or segments[0].start != 0 or any(
            a.end != b.start for a, b in zip(segments, segments[1:])) or homes[0][0].dtype != new.dtype:
        return False
    positions = []
    for layer, seg, (_, _, first) in zip(layers, segments, homes):
        layer.room(seg.end - seg.start)
        at = first + layer.length
        positions.append(torch.arange(at, at + seg.end - seg.start))
    return torch.cat(positions).to(new.device)


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None,
                     tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One request: q (1, Hq, n, D) the last n of its L keys k/v (1, Hkv, L, D). They see every
    earlier key, and among themselves what tree_mask (n, n) allows (a draft tree's ancestors),
    or causal order. Query heads that share a key/value head are stacked (as grouped_sdpa
    does), so the cache is read once per key/value head, not copied per query head.
    -> (1, Hq, n, Dv)."""
    _, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    groups = hq // hkv
    mask = None
    if tree_mask is not None:
        past = torch.ones(n, length - n, dtype=torch.bool, device=q.device)
        mask = torch.cat([past, tree_mask.to(q.device)], dim=1).repeat(groups, 1)     # (G*n, L)
    elif n > 1:
        row = torch.arange(n, device=q.device).view(n, 1)
        col = torch.arange(length, device=q.device).view(1, length)
        mask = (col <= row + (length - n)).repeat(groups, 1)          # (G*n, L)
    qg = q.reshape(1, hkv, groups * n, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling)   # (1, Hkv, G*n, Dv)
    return out.reshape(1, hq, n, v.shape[-1])


# ----- a ragged batch inside a compiled step (step_graph.py) --------------------------------
# A compiled step cannot trace a RaggedBatch: its segments are host facts that change every
# step. So the compiled forward is handed `RaggedStep`, a cache whose update leaves the keys
# alone and a mask that gqa.grouped_sdpa answers with the opaque op `sparrow::ragged_attend`;
# the op writes the layer's new keys into each request's cache and attends, through the
# step's RaggedBatch, made current around the compiled call (`current_batch`). The graph
# sees only tensors of the step's padded token count, so one graph serves any batch whose
# tokens fit its bucket.
_CURRENT = threading.local()


@contextlib.contextmanager
def current_batch(batch: RaggedBatch):
    """The RaggedBatch `ragged_attend` works through while a compiled step runs (per thread)."""
    before = getattr(_CURRENT, "batch", None)
    _CURRENT.batch = batch
    try:
        yield batch
    finally:
        _CURRENT.batch = before


# What ragged_attend writes, as the graph sees it. The op writes each layer's new keys and
# values into the caches of the current batch, which are not values of the graph (they change
# with every step's requests), so they cannot be its arguments; `written` can: the op records in
# written[layer] the rows it wrote to the caches for that layer. Declared as mutated, it makes
# the op what it is to the compiler: a writer, kept, run once and in order (never dropped,
# merged or moved as a pure op may be). A process-wide record (the last step's, any thread):
# tests read it; nothing decides on it. An inference tensor (steps run in inference mode): a
# mutable op's argument that is a normal tensor has its version counter bumped in Python on
# every call (torch.library's ADInplaceOrView kernel, ~25 us a layer: a tenth of a decode step).
MAX_LAYERS = 1024
with torch.inference_mode():
    KV_WRITES = torch.zeros(MAX_LAYERS, dtype=torch.long)


@torch.library.custom_op("sparrow::ragged_attend", mutates_args=("written",))
def _ragged_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, written: torch.Tensor,
                   layer_idx: int, scaling: float | None) -> torch.Tensor:
    """query (1, Hq, N, D), key/value (1, Hkv, N, D) of a padded step: the current batch's rows
    [0, rows) written to their caches and attended as `RaggedBatch.attend`, the rows written
    recorded in written[layer_idx]; the padding rows' output is zero. -> (1, N, Hq, Dv)."""
    batch: RaggedBatch | None = getattr(_CURRENT, "batch", None)
    if batch is None:
        raise RuntimeError("sparrow::ragged_attend runs only inside current_batch(...)")
    n = batch.rows
    if batch._record is None or batch._record[0] != written.data_ptr():
        batch._record = (written.data_ptr(), written.numpy())    # a numpy view: a store of ~0.1 us
    batch._record[1][layer_idx] = n
    if n == 0:                          # a graph's first run, on an empty batch (step_graph.py)
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1])
    batch.update(key[:, :, :n], value[:, :, :n], layer_idx)
    out = batch.attend(layer_idx, query[:, :, :n], scaling)
    if n < query.shape[2]:
        out = torch.cat([out, out.new_zeros(1, query.shape[2] - n, *out.shape[2:])], dim=1)
    return out


@_ragged_attend.register_fake
def _(query, key, value, written, layer_idx, scaling):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])


def ragged_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                  scaling: float | None) -> torch.Tensor:
    """`sparrow::ragged_attend` with the record it writes (KV_WRITES): what a compiled step's
    attention calls (gqa.grouped_sdpa)."""
    return _ragged_attend(query, key, value, KV_WRITES, layer_idx, scaling)


class RaggedStep(Cache):
    """What a compiled step's forward gets as its cache and its mask (above): the keys are
    written, and attended, by `ragged_attend`."""

    def __init__(self):
        super().__init__(layers=[])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def as_mask(self) -> dict[str, "RaggedStep"]:
        return {"full_attention": self, "sliding_attention": self}
