"""The static draft runner's levels by the C++ kernel (kernels/csrc/draft_chain.cpp), where it is
built: a small float32 draft on the CPU. `draft_level` and `greedy_chain` here take the arguments
of draft_compile's functions of the same names and return what they do, computed by plain loops
instead of ~80 tiny torch ops a level (whose dispatch, not arithmetic, is a draft step's cost on
a CPU). Equal to draft_compile's within float tolerance (tests/test_draft_native.py).

The core reaches it by name (sparrow.models.draft_compile.draft_kernel), as it does the verify
kernels. It is built in a process of its own when a static runner is made (kernels/native.py);
until it is ready, and for a draft it does not take (`usable`), torch computes the levels.

Which of the two serves a draft it takes is measured on the machine, not assumed (`serves`): a
kernel tuned on one CPU is a guess on another. Per (device, dtype, draft geometry, window, key
slots, which call, batch-rows bucket) both paths are timed once by the tuner's worker
(kernels/autotune.py) on a copy of the first such call's inputs, off the serving path; the
kernel serves until then, the faster one after, and the choice is kept in a file beside the
builds for the next process. Both paths are tested equal (tests/test_draft_native.py), so the
choice moves no target token.

    SPARROW_DRAFT_NATIVE=off    never build or use it (the levels stay in torch; or set IMPL = "torch")
    SPARROW_DRAFT_NATIVE=on     the kernel wherever it takes the draft, unmeasured (IMPL = "kernel")
    SPARROW_AUTOTUNE=0          no timing: the kernel wherever it takes the draft
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Callable

import torch

from sparrow.anchored_window import PAD_POS  # the rule's leaf module: kernels import no more of the core

from . import autotune
from .native import CSRC, NativeExtension


def impl_from_env(value: str | None) -> str:
    """SPARROW_DRAFT_NATIVE's value as an IMPL: "torch" (off), "kernel" (on) or "auto" (measured)."""
    value = (value or "").strip().lower()
    if value in ("off", "torch", "0", "false", "no"):
        return "torch"
    if value in ("on", "kernel", "1", "true", "yes"):
        return "kernel"
    return "auto"


# "auto": the measured faster of the C++ levels (where they build) and torch's; "kernel": the C++
# levels where they build, unmeasured; "torch": torch's always.
IMPL = impl_from_env(os.environ.get("SPARROW_DRAFT_NATIVE"))
EXTENSION = NativeExtension("sparrow_draft_chain", CSRC / "draft_chain.cpp", ["-fopenmp-simd"], "native draft levels")
# Beyond this many weights the arithmetic, not the dispatch, is the cost, and torch's matrix
# products (threaded, blocked) beat the kernel's single-threaded loops.
MAX_WEIGHTS = 1 << 22


def usable(w, dims) -> bool:
    """Whether the kernel takes a draft with these step weights (draft_compile.StepWeights, the
    shared embedding and lm_head included) and Dims: float32 on the CPU, the sdpa or eager
    attention (both exact softmax attention), at most MAX_WEIGHTS weights."""
    p = w[1]
    return (IMPL != "torch" and p.device.type == "cpu" and p.dtype == torch.float32
            and dims.backend in ("sdpa", "eager") and dims.head_dim % 2 == 0
            and sum(t.numel() for t in _flat(w)) <= MAX_WEIGHTS)


def start_loading() -> None:
    """Build (or load) the kernel in a process of its own, now (a server, at startup)."""
    if IMPL != "torch":
        EXTENSION.start_loading()


def ready() -> bool:
    """Built and switched on; else the build starts (in its own process) and the caller uses torch."""
    if IMPL == "torch":
        return False
    if EXTENSION.module is None:
        EXTENSION.start_loading()
    return EXTENSION.module is not None


# The paths a draft call can take, the default (what serves until measured) first.
PATHS = ("kernel", "torch")


def forced() -> str | None:
    """The path IMPL forces ("kernel", "torch"), or None: measured."""
    return IMPL if IMPL != "auto" else None


def clock() -> float:
    """What a draft call costs: with one torch thread, the worker thread's CPU time (torch's ~80
    ops a level each give up the GIL, so wall time would charge them a busy serving thread's hold
    on it: 4x torch's idle time measured with a Python loop on the main thread; the kernel's loops
    run on the calling thread); with more, wall time (torch's ops may run on its other threads)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def new_tuner(store: Callable[[], Path | None]) -> autotune.PathTuner:
    """A tuner of the draft's paths keeping its choices at store() (TUNER's: beside the builds)."""
    return autotune.tuner("draft levels", store, forced, clock)


TUNER = new_tuner(lambda: autotune.store_path(EXTENSION.build_name, kind="draft_levels"))


def serves(fn: Callable, args: tuple) -> bool:
    """Whether the kernel serves this call of draft_compile's `fn` (draft_level or greedy_chain,
    torch's path) with these arguments, the kernel being built and taking the draft: forced by
    IMPL, else the path measured faster for the call's key; the kernel until it is measured (the
    first call of a key queues the measurement, on copies of its inputs)."""
    chosen = TUNER.choice(shape_key(fn, args), PATHS, functools.partial(_bench, fn), lambda: _copied(args))
    return chosen != "torch"


def shape_key(fn: Callable, args: tuple) -> tuple:
    """What the two paths' speeds depend on: device, dtype, the draft's geometry (heads, kv heads,
    head dim, hidden size, layers, vocabulary), its window, the key slots, the call (a level, a
    chain, a chain with a commit's emitted rows first), and the batch's rows (requests x rows a
    level) by bucket."""
    global _geometry
    level = fn.__name__ == "draft_level"
    dims, w, pos = args[0], args[1], args[8] if level else args[7]
    rows = pos.shape[0] * (args[2].shape[1] if level else 1)          # a level: (B, R) tokens; a chain: one row
    call = fn.__name__ if level or args[11] is None else "greedy_chain+emitted"      # a commit's rows first
    geometry = _geometry
    if geometry[0] is not w or geometry[1] is not dims:               # (a call a level: made once a draft)
        geometry = _geometry = (w, dims, (w[1].device.type, str(w[1].dtype), dims.heads, dims.kv_heads,
                                          dims.head_dim, w[1].shape[0], len(w[4]), w[0].shape[0], dims.window))
    return (*geometry[2], pos.shape[1], call, autotune.rows_bucket(rows))


_geometry: tuple = (None, None, ())       # (weights, dims, their part of the key), replaced whole


def _copied(args: tuple) -> tuple:
    """The call's arguments with every tensor copied (the paths write the key buffers in place;
    a queued measurement holds none of the live ones). The weights are shared, read only."""
    def copy(a):
        if isinstance(a, torch.Tensor):
            return a.clone()
        if isinstance(a, list):
            return [copy(t) for t in a]
        if isinstance(a, tuple) and hasattr(a, "_fields"):                  # Emitted, Seeded
            return type(a)(*(copy(t) for t in a))
        return a
    return (args[0], args[1], *(copy(a) for a in args[2:]))


def _bench(fn: Callable, args: tuple) -> Callable[[str], Callable[[], object]]:
    """The measurement of one call (autotune.Bench's inner function): torch's `fn` and the
    kernel's function of the same name, each on inputs of its own (copies of `args`)."""
    own = {name: _copied(args) for name in PATHS}
    paths = {"kernel": globals()[fn.__name__], "torch": fn}

    def runner(name: str) -> Callable[[], object]:
        def run():
            with torch.inference_mode():                 # as the proposer runs them
                return paths[name](*own[name])
        return run
    return runner


_last_flat: tuple = (None, None)     # (weights, their flat list), replaced whole: a tuner's worker reads it too


def _flat(w) -> list[torch.Tensor]:
    """draft_compile.StepWeights in the kernel's order: embed, fc, final norm, lm_head, fuse,
    inverse frequencies, then the seven tensors of each layer."""
    global _last_flat
    last = _last_flat
    if last[0] is w:
        return last[1]
    flat = [t.contiguous() for t in (w[0], w[1], w[2], w[3], w[5], w[6], *(t for layer in w[4] for t in layer))]
    _last_flat = (w, flat)
    return flat


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
