"""Split-KV ("flash-decoding") verify attention in plain torch, the algorithm the Triton
kernel runs, written so each step can be checked against plain SDPA.

A verify step has only nq ~ 5 query tokens, so parallelising over queries and heads alone
leaves most of a GPU idle while one request reads 25k cached keys. Instead the keys are cut
into S splits; each split produces, per query row, a partial softmax over its keys:

    out_s = sum_j p_j v_j / l_s,   lse_s = m_s + log(l_s)   (m_s: max score, l_s: sum of exp)

and a small reduction merges the splits exactly: out = sum_s exp(lse_s - lse) out_s with
lse = logsumexp_s(lse_s). A split that sees no key has lse_s = -inf and weight 0.
"""

from __future__ import annotations

import math

import torch

from .reference import chain_tree, verify_mask


def split_size(n_keys: int, num_splits: int, block: int = 1) -> int:
    """Keys per split: n_keys / num_splits rounded up to a whole number of kernel blocks."""
    per = math.ceil(n_keys / max(1, num_splits))
    return max(block, math.ceil(per / block) * block)


def split_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens: torch.Tensor,
                   tree: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split normalised outputs (B, H, nq, S, D) and log-sum-exps (B, H, nq, S), fp32.

    q (B, H, nq, D); k_cache, v_cache (B, Hkv, capacity, D); prefix_lens (B,); tree (nq, nq) | (B, nq, nq).
    """
    bsz, heads, nq, dim = q.shape
    hkv = k_cache.shape[1]
    group = heads // hkv
    n = int(prefix_lens.max()) + nq
    size = split_size(n, num_splits)
    # the `group` query heads of one kv head share its keys: stack them as rows r = g * nq + i
    qg = q.float().reshape(bsz, hkv, group * nq, dim) * dim ** -0.5            # (B, Hkv, G*nq, D)
    outs, lses = [], []
    for lo in range(0, n, size):
        hi = min(lo + size, n)
        ks, vs = k_cache[:, :, lo:hi].float(), v_cache[:, :, lo:hi].float()     # (B, Hkv, c, D)
        vis = verify_mask(prefix_lens, tree, torch.arange(lo, hi, device=q.device))          # (B, nq, c)
        vis = vis.unsqueeze(1).expand(bsz, group, nq, hi - lo).reshape(bsz, 1, group * nq, hi - lo)
        scores = (qg @ ks.transpose(-1, -2)).masked_fill(~vis, float("-inf"))  # (B, Hkv, G*nq, c)
        m = scores.amax(-1, keepdim=True)                                       # (B, Hkv, G*nq, 1)
        m = torch.where(torch.isinf(m), 0.0, m)     # an all-masked split: keep exp() finite (all zeros)
        p = torch.exp(scores - m)
        l = p.sum(-1, keepdim=True)                                              # (B, Hkv, G*nq, 1)
        outs.append((p @ vs) / l.clamp_min(1e-30))                               # (B, Hkv, G*nq, D)
        lses.append(torch.where(l > 0, m + torch.log(l), float("-inf")).squeeze(-1))
    out = torch.stack(outs, dim=-2).reshape(bsz, heads, nq, len(outs), dim)     # (B, H, nq, S, D)
    lse = torch.stack(lses, dim=-1).reshape(bsz, heads, nq, len(lses))         # (B, H, nq, S)
    return out, lse


def combine_splits(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge partials (..., S, D) with log-sum-exps (..., S) into (..., D), fp32."""
    m = lse.amax(-1, keepdim=True)                                              # (..., 1)
    m = torch.where(torch.isinf(m), 0.0, m)          # no split saw a key: all weights 0, output 0
    w = torch.exp(lse - m)                                                      # (..., S)
    return (w.unsqueeze(-1) * out).sum(-2) / w.sum(-1, keepdim=True).clamp_min(1e-30)


def verify_attention_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens: torch.Tensor,
                           tree: torch.Tensor | None = None, num_splits: int = 4) -> torch.Tensor:
    """Split-KV verify attention; same contract as reference.verify_attention_ref. (B, H, nq, D)."""
    tree = chain_tree(q.shape[2], q.device) if tree is None else tree
    out, lse = split_partials(q, k_cache, v_cache, prefix_lens, tree, num_splits)
    return combine_splits(out, lse).to(q.dtype)
