"""The prefix part of the packed verify attention on a CPU, by a compiled kernel (csrc/cpu_prefix.cpp):
every query row of a kv head attends, unmasked, to all P cached keys, reading each key once for
all rows (online softmax over blocks of 64 keys kept in L1, vectorised for this CPU). Returns the
rows' normalised outputs and log-sum-exps, as torch's `_scaled_dot_product_flash_attention_for_cpu`
does, faster at many rows over a long cache (kernels/README.md).

It is built on first use with torch.utils.cpp_extension (ninja and a C++ compiler; -O3
-march=native), cached in torch's extension directory (TORCH_EXTENSIONS_DIR) under a name keyed
by this CPU's features, so a later process loads it in well under a second. A failed build is
logged once and `prefix_attention` returns None: the caller uses torch's op, and no request fails.

    SPARROW_CPU_PREFIX=torch    never build or use the kernel (torch's op; or set IMPL = "torch")
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# "kernel": the compiled kernel where it builds (torch's op otherwise); "torch": torch's op always.
IMPL = "torch" if os.environ.get("SPARROW_CPU_PREFIX", "").strip().lower() == "torch" else "kernel"
SOURCE = Path(__file__).with_name("csrc") / "cpu_prefix.cpp"
DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_module: list = [None]           # the loaded extension, once built
_failed: list = [False]          # a build failed in this process: never tried again
build_seconds: list = [None]     # how long the first load took (a build, or a cached load)
_background = threading.Event()  # start_loading's build is running


def _cpu_tag() -> str:
    """Names the build by this CPU's instruction set (-march=native): a cache directory shared by
    machines of other CPUs never loads a binary built for another one."""
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def load():
    """The compiled extension (building it the first time), or None where it cannot be built."""
    if _module[0] is not None or _failed[0]:
        return _module[0]
    with _lock:
        if _module[0] is None and not _failed[0]:
            t0 = time.perf_counter()
            try:
                from torch.utils.cpp_extension import load as load_ext
                _module[0] = load_ext(name=f"sparrow_cpu_prefix_{_cpu_tag()}", sources=[str(SOURCE)],
                                      extra_cflags=["-O3", "-march=native", "-ffp-contract=fast"], verbose=False)
                build_seconds[0] = time.perf_counter() - t0
                log.info("CPU prefix attention kernel loaded in %.1f s", build_seconds[0])
            except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a build error: all mean the fallback
                _failed[0] = True
                last = (str(exc).strip().splitlines() or [""])[-1]
                log.warning("CPU prefix attention kernel not built (%s: %s); using torch's CPU flash-attention op",
                            type(exc).__name__, last)
    return _module[0]


def start_loading() -> None:
    """Build (or load) the kernel on a thread of its own, now: a server calls this at startup, so
    its first long verify neither pays the build nor waits on it (until it is ready, verify uses
    torch's op). Not a daemon: interpreter exit waits for a build in progress rather than kill it
    holding the build directory's lock."""
    if IMPL != "kernel" or _module[0] is not None or _failed[0] or _background.is_set():
        return
    _background.set()

    def build() -> None:
        try:
            load()
        finally:
            _background.clear()
    threading.Thread(target=build, name="sparrow-cpu-prefix-build").start()


def ready() -> bool:
    """The kernel is built and switched on (no build is started here)."""
    return IMPL == "kernel" and _module[0] is not None


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these operands (CPU; fp32 or bf16 K/V; last dim contiguous)."""
    return (IMPL == "kernel" and q.device.type == "cpu" and k.dtype in DTYPES and v.dtype == k.dtype
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k.shape[2] >= 1)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Unmasked attention of every row of q (B, Hkv, R, D) over all of k, v (B, Hkv, P >= 1, D):
    outputs (B, Hkv, R, Dv) and natural log-sum-exps (B, Hkv, R), both fp32. None where the
    kernel does not apply (usable) or is not built: the caller computes it another way."""
    module = _module[0]
    if not usable(q, k, v) or module is None:
        if module is None and usable(q, k, v):
            start_loading()          # never built on a step (~30 s): torch's op until it is ready
        return None
    out, lse = module.prefix_attention(q, k, v, float(scale))
    return out, lse
