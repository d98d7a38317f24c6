"""The static draft levels's levels by the C++ kernel (kernels/csrc/draft_chain.cpp), where it is
built: a small float32 draft on the CPU. `draft_level` and `greedy_chain` here take the arguments
of draft_compile's functions of the same names and return what they do, computed by plain loops
instead of ~80 tiny torch ops a level (whose dispatch, not arithmetic, is a draft step's cost on
a CPU). Equal to draft_compile's within float tolerance (tests/test_draft_native.py).

The core reaches it by name (sparrow.models.draft_compile.draft_kernel), as it does the verify
kernels. It is built in a process of its own when a static levels is made (kernels/native.py);
until it is ready, and for a draft it does not take (`usable`), torch computes the levels
in torch.

    SPARROW_DRAFT_NATIVE=off    never build or use it (the levels stay in torch; or set IMPL = "torch")
"""

from __future__ import annotations

import os

import torch

from sparrow.anchored_window import PAD_POS  # the rule's leaf module: kernels import no more of the core

from .native import CSRC, NativeExtension

# "kernel": the C++ levels where they build (torch's otherwise); "torch": torch's always.
IMPL = "torch" if os.environ.get("SPARROW_DRAFT_NATIVE", "").strip().lower() in ("off", "torch", "0") else "kernel"
EXTENSION = NativeExtension("sparrow_draft_chain", CSRC / "draft_chain.cpp", ["-fopenmp-simd"], "native draft levels")
# Beyond this many weights the arithmetic, not the dispatch, is the cost, and torch's matrix
# products (threaded, blocked) beat the kernel's single-threaded loops.
MAX_WEIGHTS = 1 << 22


def usable(w, dims) -> bool:
    """Whether the kernel takes a draft with these step weights (draft_compile.StepWeights, the
    shared embedding and lm_head included) and Dims: float32 on the CPU, the sdpa or eager
    attention (both exact softmax attention), at most MAX_WEIGHTS weights."""
    p = w[1]
    return (IMPL == "kernel" and p.device.type == "cpu" and p.dtype == torch.float32
            and dims.backend in ("sdpa", "eager") and dims.head_dim % 2 == 0
            and sum(t.numel() for t in _flat(w)) <= MAX_WEIGHTS)


def start_loading() -> None:
    """Build (or load) the kernel in a process of its own, now (a server, at startup)."""
    if IMPL == "kernel":
        EXTENSION.start_loading()


def ready() -> bool:
    """Built and switched on; else the build starts (in its own process) and the caller uses torch."""
    if IMPL != "kernel":
        return False
    if EXTENSION.module is None:
        EXTENSION.start_loading()
    return EXTENSION.module is not None


_last_flat: list = [None, None]     # (weights, their flat list): the levels' weights, rebuilt only when they change


def _flat(w) -> list[torch.Tensor]:
    """draft_compile.StepWeights in the kernel's order: embed, fc, final norm, lm_head, fuse,
    inverse frequencies, then the seven tensors of each layer."""
    if _last_flat[0] is not w:
        _last_flat[:] = [w, [t.contiguous() for t in (w[0], w[1], w[2], w[3], w[5], w[6],
                                                       *(t for layer in w[4] for t in layer))]]
    return _last_flat[1]


def draft_level(dims, w, tokens, hidden, q_pos, live, allowed, slots, pos, pinned, keys, values):
    """draft_compile.draft_level by the kernel."""
    b, r = tokens.shape
    if q_pos.dim() == 1:
        q_pos = q_pos[:, None].expand(b, r)
    out = EXTENSION.module.draft_level(dims.heads, dims.kv_heads, dims.head_dim, dims.eps, dims.window, _flat(w),
                                       tokens.contiguous(), hidden.contiguous(), q_pos.contiguous(),
                                       live.contiguous(), allowed, slots.contiguous(), pos, pinned, keys, values)
    return tuple(out)


def greedy_chain(dims, w, hidden, q_pos, live, allowed, slots, pos, pinned, keys, values, emitted=None,
                 seeded=None):
    """draft_compile.greedy_chain by the kernel (seeded rows drawn by their noise, as chain_pick)."""
    e = [] if emitted is None else [t.contiguous() for t in emitted]
    s = [] if seeded is None else [t.contiguous() for t in seeded]
    out, start = EXTENSION.module.greedy_chain(dims.heads, dims.kv_heads, dims.head_dim, dims.eps, dims.window,
                                               PAD_POS, _flat(w), hidden.contiguous(), q_pos.contiguous(),
                                               live.contiguous(), allowed, slots.contiguous(), pos, pinned, keys,
                                               values, e, s)
    return out, start


def entries(dims, w, z, pos, pinned, kv, window: int) -> torch.Tensor:
    """SparrowDraft.forward_entries (inference) by the kernel: one request's new entries z (n, H)
    at positions pos (n,) with pinned flags (n,) through the layers, appended to kv. Returns (n, H)."""
    n = z.shape[0]
    kv.reserve(n)
    kv_pos, kv_pinned, keys, values = kv.buffers
    out, seen = EXTENSION.module.entries(dims.heads, dims.kv_heads, dims.head_dim, dims.eps, window, _flat(w),
                                         z.contiguous(), pos.contiguous(), pinned.contiguous(), kv_pos, kv_pinned,
                                         keys, values, len(kv))
    kv.max_visible = max(kv.max_visible, seen)
    kv.advance(n)
    return out


def gather(pos, pinned, keys, values, kvs) -> None:
    """DraftLevels.gather's copies by the kernel: each DraftKV's filled entries at slots [0, n_b)
    of the batch's buffers, every other slot at PAD_POS (keys zero); padding requests at PAD_POS."""
    EXTENSION.module.gather(pos, pinned, keys, values, [kv.pos for kv in kvs], [kv.pinned for kv in kvs],
                            [kv.keys for kv in kvs], [kv.values for kv in kvs], PAD_POS)


def scatter(pos, keys, values, start: int, counts: list[int], kvs) -> None:
    """Each DraftKV's counts[b] new entries from the batch's slots [start, start + counts[b])
    appended after its filled ones (unpinned; room reserved and the length moved by the caller)."""
    buffers = [kv.buffers for kv in kvs]
    EXTENSION.module.scatter(pos, keys, values, start, counts, [len(kv) for kv in kvs], [b[0] for b in buffers],
                             [b[1] for b in buffers], [b[2] for b in buffers], [b[3] for b in buffers])


def evict(kv, next_pos: int, window: int, room: int) -> None:
    """DraftKV.evict by the kernel: the same rule (forget what no query at >= next_pos can see,
    only when `room` more entries would not fit), the compaction one loop in place."""
    if len(kv) + room <= kv.capacity:
        return
    pos, pinned, keys, values = kv.buffers
    kv.truncate(EXTENSION.module.compact(pos, pinned, keys, values, len(kv), next_pos, window))
