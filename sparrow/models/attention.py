"""The backends that compute text-anchored window attention for the draft, by name.

Which keys a query may see is `sparrow.anchored_window.window_mask`; a backend takes that mask and
computes the attention. The optional ones (sparrow.kernels) are imported by name on first
use, so the kernels depend on nothing here and the core imports no kernel it is not asked for.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # q: (B, H, nq, D); k, v: (B, Hkv, nk, D); mask: (nq, nk) bool. GQA without copying K/V.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference: softmax(q k^T / sqrt(d) + mask) v."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ATTENTION_BACKENDS: dict[str, AttentionFn] = {"sdpa": _sdpa, "eager": _eager}


def register_backend(name: str, fn: AttentionFn) -> None:
    """Add a backend by name (the optional kernels are added here when first asked for); the draft
    looks them up by name."""
    ATTENTION_BACKENDS[name] = fn


# Optional kernels (sparrow.kernels), imported on first use: not selecting one costs nothing,
# and selecting one whose package is missing fails with that package's name.
# name -> (module, function, package that must be importable, how to get it)
OPTIONAL_BACKENDS: dict[str, tuple[str, str, str, str]] = {
    "flex": ("sparrow.kernels.flex", "masked_attention_flex", "torch.nn.attention.flex_attention", "torch>=2.5"),
    "triton": ("sparrow.kernels.triton_attention", "masked_attention_triton", "triton",
               "pip install -c constraints.txt 'sparrow[kernels]' (on CPU also TRITON_INTERPRET=1)"),
    "flash_attn": ("sparrow.kernels.flash", "masked_attention_flash", "flash_attn",
                   "pip install 'sparrow[cuda]' (CUDA only)"),
}


def _load_optional(name: str) -> AttentionFn:
    module, fn, package, hint = OPTIONAL_BACKENDS[name]
    try:
        backend = getattr(importlib.import_module(module), fn)
    except ImportError as e:
        raise ImportError(f"attention backend {name!r} needs {package!r}: {hint} ({e})") from e
    register_backend(name, backend)
    return backend


def available_backends() -> list[str]:
    """Registered backends plus the optional ones whose package is installed (nothing is imported)."""
    def installed(package: str) -> bool:
        try:
            return importlib.util.find_spec(package) is not None
        except ModuleNotFoundError:        # a missing parent package
            return False
    optional = [n for n, (_, _, package, _) in OPTIONAL_BACKENDS.items() if installed(package)]
    return sorted(set(ATTENTION_BACKENDS) | set(optional))


def get_backend(name: str) -> AttentionFn:
    if name in ATTENTION_BACKENDS:
        return ATTENTION_BACKENDS[name]
    if name in OPTIONAL_BACKENDS:
        return _load_optional(name)
    known = sorted(set(ATTENTION_BACKENDS) | set(OPTIONAL_BACKENDS))
    raise ValueError(f"unknown attention backend {name!r}; known: {known}")
