"""The packed verify attention on a CPU, by a compiled kernel (csrc/cpu_prefix.cpp).

`prefix_attention`: every query row of a kv head attends, unmasked, to all P cached keys, reading
each key once for all rows (online softmax over blocks of keys kept in L1, vectorised for this
CPU). Returns the rows' normalised outputs and log-sum-exps, as torch's
`_scaled_dot_product_flash_attention_for_cpu` does, faster at many rows over a long cache
(kernels/README.md).

`ragged_attention`: a ragged batch's whole step for one layer in ONE call: every request's rows
over its own prefix (as above) and its own new keys (causal or its tree's mask), merged by
log-sum-exp. A batch of short caches otherwise pays a handful of torch calls a request a layer
(~70 us each at 0.5k keys, most of it per-call overhead, not arithmetic).

It is built on first use (kernels/native.py: cached per build key, built in a process of its own, a failed
build logged once): until it is ready, and where it cannot be built, `prefix_attention` returns
None and the caller uses torch's op, so no request fails or waits on a build.

    SPARROW_CPU_PREFIX=torch    never build or use the kernel (torch's op; or set IMPL = "torch")
"""

from __future__ import annotations

import os

import torch

from .native import CSRC, NativeExtension

# "kernel": the compiled kernel where it builds (torch's op otherwise); "torch": torch's op always.
IMPL = "torch" if os.environ.get("SPARROW_CPU_PREFIX", "").strip().lower() == "torch" else "kernel"
DTYPES = (torch.float32, torch.bfloat16)
EXTENSION = NativeExtension("sparrow_cpu_prefix", CSRC / "cpu_prefix.cpp", ["-ffp-contract=fast"],
                            "CPU prefix attention kernel")


def load():
    """The compiled extension (building it the first time), or None where it cannot be built."""
    return EXTENSION.load()


def start_loading() -> None:
    """Build (or load) the kernel in a process of its own, now: a server calls this at startup, so
    its first long verify neither pays the build nor waits on it (until it is ready, verify uses
    torch's op)."""
    if IMPL == "kernel":
        EXTENSION.start_loading()


def ready() -> bool:
    """The kernel is built and switched on (no build is started here)."""
    return IMPL == "kernel" and EXTENSION.module is not None


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these operands (CPU; fp32 or bf16 K/V; last dim contiguous)."""
    return (IMPL == "kernel" and q.device.type == "cpu" and k.dtype in DTYPES and v.dtype == k.dtype
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k.shape[2] >= 1)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Unmasked attention of every row of q (B, Hkv, R, D) over all of k, v (B, Hkv, P >= 1, D):
    outputs (B, Hkv, R, Dv) and natural log-sum-exps (B, Hkv, R), both fp32. None where the
    kernel does not apply (usable) or is not built: the caller computes it another way."""
    module = EXTENSION.module
    if not usable(q, k, v) or module is None:
        if module is None and usable(q, k, v):
            start_loading()          # never built on a step (~60 s): torch's op until it is ready
        return None
    out, lse = module.prefix_attention(q, k, v, float(scale))
    return out, lse


_CAUSAL = torch.empty(0, dtype=torch.bool)          # a segment without a tree: causal among its new keys


def ragged_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], starts: list[int],
                     ends: list[int], trees: list[torch.Tensor | None], scale: float) -> torch.Tensor | None:
    """A ragged batch's verify attention in one call: segment s is rows starts[s]..ends[s] of the
    packed queries q (1, Hq, N, D), over its keys / values (1, Hkv, P_s + n_s, D) (its cache's
    prefix, then its n_s new rows), seeing the whole prefix and, among its new keys, what
    trees[s] (n_s, n_s) allows (None: causal). -> (N, Hq, Dv) fp32; None where the kernel does
    not apply (usable) or is not built."""
    module = EXTENSION.module
    if module is None or not all(usable(q, k, v) for k, v in zip(keys, values)):
        if module is None and usable(q, keys[0], values[0]):
            start_loading()
        return None
    owns = [_CAUSAL if t is None else t.to(dtype=torch.bool).contiguous() for t in trees]
    return module.ragged_attention(q, keys, values, starts, ends, owns, float(scale))
