"""Plain-torch references for the two attention shapes Sparrow runs. Every kernel in this
package is tested against these; they favour being obviously right over being fast.

    draft window   a few draft queries over anchors + window + glimpse, the rule of
                   `sparrow.anchored_window.window_mask`; the visible keys are gathered first,
                   so no mask over the whole key set is built
    verify         nq draft tokens (a chain, or a tree with its own (nq, nq) mask) on top of a
                   cached prefix of length L; every draft token sees the whole prefix

Conventions shared by every implementation in sparrow.kernels:
    q (B, H, nq, D); k, v (B, Hkv, nk, D), H a multiple of Hkv (GQA: query head h reads kv
    head h // (H // Hkv)); softmax scale 1/sqrt(D); a query that sees no key outputs zeros.
    Window metadata is given once, (n,), or per batch row, (B, n); a padding key carries
    PAD_POS, a position no query reaches, so ragged key sets batch without a length tensor.
    Verify metadata: prefix_lens (B,) long; the draft tokens' keys sit in the cache right
    after the prefix (rows prefix_lens[b] .. prefix_lens[b] + nq - 1), as the preallocated
    target cache writes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparrow.anchored_window import PAD_POS, window_mask  # the rule's leaf module: kernels import no more of the core


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) where mask) v in fp32, zeros for a query with no visible key.

    q (B, H, nq, D); k, v (B, Hkv, nk, D); mask bool, broadcastable to (B, H, nq, nk).
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)       # (B, H, nk, D)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5   # (B, H, nq, nk)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    # softmax over an all -inf row is NaN; the package-wide convention is a zero output
    probs = torch.where(mask.any(-1, keepdim=True), probs, 0.0)
    return (probs @ v.float()).to(q.dtype)                                     # (B, H, nq, D)


def _row(meta: torch.Tensor, b: int) -> torch.Tensor:
    """Metadata given once (n,) or per batch row (B, n) -> row b, (n,)."""
    return meta if meta.dim() == 1 else meta[b]


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, k_pinned: torch.Tensor, window: int) -> torch.Tensor:
    """Indices (n_vis,) of the keys some query in q_pos (nq,) may see: pinned keys up to the
    last query and unpinned keys in (first query - window, last query]. For consecutive query
    positions that is at most pinned + window + nq - 1 keys, however long the key set is."""
    lo, hi = q_pos.min(), q_pos.max()
    keep = (k_pos <= hi) & (k_pinned | (k_pos > lo - window))                  # (nk,)
    return keep.nonzero().view(-1)


def window_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         k_pos: torch.Tensor, k_pinned: torch.Tensor, window: int) -> torch.Tensor:
    """Draft window attention by gathering. q (B, H, nq, D); k, v (B, Hkv, nk, D);
    q_pos (nq,) | (B, nq); k_pos, k_pinned (nk,) | (B, nk). Returns (B, H, nq, D)."""
    out = []
    for b in range(q.shape[0]):                      # rows may see different key sets (ragged)
        qp, kp, pin = _row(q_pos, b), _row(k_pos, b), _row(k_pinned, b)
        idx = visible_keys(qp, kp, pin, window)                                # (n_vis,)
        mask = window_mask(qp, kp[idx], pin[idx], window)                      # (nq, n_vis): small
        out.append(attend(q[b:b + 1], k[b:b + 1, :, idx], v[b:b + 1, :, idx], mask))
    return torch.cat(out)


def chain_tree(nq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The (nq, nq) mask of a chain of draft tokens: each sees itself and the ones before it."""
    return torch.ones(nq, nq, dtype=torch.bool, device=device).tril()


def verify_mask(prefix_lens: torch.Tensor, tree: torch.Tensor, key_idx: torch.Tensor) -> torch.Tensor:
    """Which keys each draft token sees: (B, nq, n) bool for the cache rows key_idx (n,).

    prefix_lens (B,); tree (nq, nq) or (B, nq, nq), tree[i, j]: draft token i sees draft token j.
    Row key_idx[c] of batch b is prefix when < prefix_lens[b], else draft token key_idx - L.
    """
    nq = tree.shape[-1]
    bsz = prefix_lens.shape[0]
    rel = key_idx.view(1, -1) - prefix_lens.view(-1, 1)                       # (B, n): <0 in the prefix
    in_draft = (rel >= 0) & (rel < nq)                                         # (B, n)
    tree_b = tree.expand(bsz, nq, nq)
    cols = rel.clamp(0, nq - 1).unsqueeze(1).expand(bsz, nq, rel.shape[1])    # (B, nq, n)
    sees_draft = tree_b.gather(2, cols) & in_draft.unsqueeze(1)               # (B, nq, n)
    return (rel < 0).unsqueeze(1) | sees_draft


def verify_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         prefix_lens: torch.Tensor, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Verify attention as plain SDPA with a dense mask over prefix + draft tokens.

    q (B, H, nq, D); k_cache, v_cache (B, Hkv, capacity, D); prefix_lens (B,);
    tree (nq, nq) | (B, nq, nq) | None (a chain). Returns (B, H, nq, D).
    """
    nq = q.shape[2]
    tree = chain_tree(nq, q.device) if tree is None else tree
    n = int(prefix_lens.max()) + nq
    mask = verify_mask(prefix_lens, tree, torch.arange(n, device=q.device))   # (B, nq, n)
    return F.scaled_dot_product_attention(q, k_cache[:, :, :n], v_cache[:, :, :n], attn_mask=mask.unsqueeze(1),
                                          enable_gqa=q.shape[1] != k_cache.shape[1])
