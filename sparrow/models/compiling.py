"""torch.compile, kept per shape for the process: what the draft's static levels
(draft_compile.py) and the target's compiled steps (step_graph.py) both compile through.

Dynamo keeps graphs, and counts recompiles against its limit, per code object: so each shape
compiles its own copy of the function, shapes never evict one another, and callers of one
shape share its graph.
"""

from __future__ import annotations

import threading
import types
from typing import Callable

import torch

_COMPILED: dict[tuple, Callable] = {}

# Held while a graph compiles (its first call), by whoever compiles. A compiled target step
# runs under dynamo's process-wide "fail_on_recompile" stance, and only while it holds this
# lock (step_graph.py): so no compile elsewhere fails for its stance, and a step whose inputs
# fail its graph's guards runs eagerly instead of recompiling in line.
COMPILE_LOCK = threading.RLock()

# Inductor on a CPU: a small model's step is kernels of microseconds, so the generated
# wrapper's own cost is a large share of a call: its shape checks go (shapes are fixed per
# compiled copy), and the wrapper is C++ (cpp_wrapper) rather than Python (~25% of a k = 4
# draft propose at batch 1).
CPU_OPTIONS = {"cpp_wrapper": True, "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def compiled(fn: Callable, key: tuple, tag: str, device: torch.device, options: dict | None = None,
             cuda_graphs: bool = True) -> Callable:
    """fn compiled for one shape `key` (everything that fixes its shapes), its copy named
    fn.__name__ + tag. On a CPU inductor with `options` (CPU_OPTIONS when None); on CUDA, CUDA
    graphs ("reduce-overhead") where `cuda_graphs`, else inductor's kernels alone."""
    compiled_fn = _COMPILED.get(key)
    if compiled_fn is None:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
        copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        if device.type == "cuda":
            how = {"mode": "reduce-overhead"} if cuda_graphs else {}
        else:
            how = {"options": options or CPU_OPTIONS}
        compiled_fn = _COMPILED[key] = torch.compile(copy, fullgraph=True, dynamic=False, **how)
    return compiled_fn
