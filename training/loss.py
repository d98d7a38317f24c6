"""Distillation loss of an unrolled draft against the target's signals.

Step j of chain s predicts entry s + j + 1. Its teacher is the target at entry s + j: the
next-token distribution (soft cross-entropy, so the draft learns the whole distribution, as
speculative sampling needs) and, optionally, the final hidden state (SmoothL1, EAGLE-1).
Steps are weighted step_decay ** j: later steps matter less because they are reached less.

topk: 0 teaches the whole distribution (the soft cross-entropy is the KL divergence from the
target plus the target's entropy, a constant: the same gradient); k > 0 teaches the target's k
most likely tokens, renormalised (the head a draft tree branches on; k = 1 is the hard label,
the target's greedy token). Stats report the KL from the distribution taught.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .signals import TargetSignals
from .unroll import Unrolled


def teacher_probs(t_logits: torch.Tensor, topk: int = 0) -> torch.Tensor:
    """(c, V) the distribution taught: the target's, or its top-k renormalised."""
    probs = F.softmax(t_logits.float(), -1)
    if 0 < topk < probs.shape[-1]:
        top = torch.topk(probs, topk, dim=-1)
        probs = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def distill_loss(out: Unrolled, sig: TargetSignals, ce_weight: float, hidden_weight: float,
                 step_decay: float, topk: int = 0) -> tuple[torch.Tensor, dict]:
    """Returns the scalar loss and per-step stats (cross-entropy, KL, top-1 agreement with the target)."""
    n, p = sig.num_entries, sig.num_prompt
    total, weight_sum, stats = out.hidden[0].new_zeros(()), 0.0, {"ce": [], "kl": [], "top1": []}
    for j, (hidden, logits) in enumerate(zip(out.hidden, out.logits)):
        teacher = out.chains + j                                    # (C,) entry whose target logits teach
        valid = teacher + 1 < n                                     # the predicted entry exists
        if not bool(valid.any()):
            break
        idx = teacher[valid] - p                                    # rows of sig.logits / final_hidden
        t_logits = sig.logits[idx]                                  # (c, V)
        d_logits = logits[valid].float()
        teach = teacher_probs(t_logits, topk)
        ce = -(teach * F.log_softmax(d_logits, -1)).sum(-1).mean()
        loss = ce_weight * ce
        if hidden_weight > 0:
            loss = loss + hidden_weight * F.smooth_l1_loss(hidden[valid].float(), sig.final_hidden[idx].float())
        w = step_decay ** j
        total, weight_sum = total + w * loss, weight_sum + w
        stats["ce"].append(float(ce.detach()))
        stats["kl"].append(float(ce.detach() + (teach * teach.clamp_min(1e-30).log()).sum(-1).mean()))
        stats["top1"].append(float((d_logits.detach().argmax(-1) == t_logits.argmax(-1)).float().mean()))
    return total / max(weight_sum, 1e-12), stats


def chain_starts(sig: TargetSignals) -> torch.Tensor:
    """(C,) chain starts: every response entry with a successor, as inference drafts from the
    first generated token on (the prompt's last entry is never a chain start: the target's
    prefill produces the first token)."""
    return torch.arange(sig.num_prompt, sig.num_entries - 1, device=sig.token_ids.device)
