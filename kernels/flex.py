"""FlexAttention variants of the draft window and verify attention (contract: reference.py).

The visibility rules are written as `mask_mod`s over the same metadata the Triton kernel
reads; `create_block_mask` turns them into a block-sparse mask, so blocks no query sees are
skipped on a GPU. `compile=True` runs flex_attention through torch.compile: that is the fused
kernel (and the only fast path), but each new shape costs seconds to compile (about 18 s on
the 2-core CPU machine), so callers should bucket key lengths. Uncompiled (eager), flex
materialises the full score matrix: correct, slow, and what the CPU tests use.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from .reference import chain_tree


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod, batch: int | None,
         compile: bool) -> torch.Tensor:
    """q (B, H, nq, D); k, v (B, Hkv, nk, D); mask_mod(b, h, q_idx, kv_idx) -> bool. (B, H, nq, D)."""
    block_mask = create_block_mask(mask_mod, batch, None, q.shape[2], k.shape[2], device=q.device)
    gqa = q.shape[1] != k.shape[1]
    if compile:
        return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    with warnings.catch_warnings():      # the "called without torch.compile" warning: eager is chosen here
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def _batched(meta: torch.Tensor, bsz: int) -> torch.Tensor:
    """(n,) shared or (B, n) per row -> (B, n), so mask_mods index [b, i] either way."""
    return meta.expand(bsz, meta.shape[-1])


def window_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                          k_pos: torch.Tensor, k_pinned: torch.Tensor, window: int,
                          compile: bool = False) -> torch.Tensor:
    """Draft window attention; q_pos (nq,) | (B, nq); k_pos, k_pinned (nk,) | (B, nk)."""
    bsz = q.shape[0]
    qp, kp, pin = _batched(q_pos, bsz), _batched(k_pos, bsz), _batched(k_pinned, bsz)

    def sees(b, h, qi, ki):
        causal = kp[b, ki] <= qp[b, qi]
        return causal & (pin[b, ki] | (kp[b, ki] > qp[b, qi] - window))

    return _run(q, k, v, sees, bsz, compile)


def verify_attention_flex(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens: torch.Tensor,
                          tree: torch.Tensor | None = None, compile: bool = False) -> torch.Tensor:
    """Verify attention over prefix_lens[b] cached keys + nq draft tokens with their tree mask."""
    bsz, _, nq, _ = q.shape
    tree = (chain_tree(nq, q.device) if tree is None else tree).expand(bsz, nq, nq)    # (B, nq, nq)
    n = int(prefix_lens.max()) + nq

    def sees(b, h, qi, ki):
        rel = ki - prefix_lens[b]                                  # <0: the prefix, seen by all
        in_draft = (rel >= 0) & (rel < nq)
        return (rel < 0) | (in_draft & tree[b, qi, rel.clamp(0, nq - 1)])

    return _run(q, k_cache[:, :, :n], v_cache[:, :, :n], sees, bsz, compile)


def masked_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The registry signature: mask (nq, nk) bool. Compiled on CUDA, eager elsewhere (see above)."""
    return _run(q, k, v, lambda b, h, qi, ki: mask[qi, ki], None, compile=q.device.type == "cuda")
