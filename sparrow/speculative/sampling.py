"""Logits to probabilities and sampling, with an explicit per-request generator.

The global RNG is never touched: every random draw takes the request's torch.Generator.
"""

from __future__ import annotations

import torch


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p.

    temperature must be > 0 here; greedy decoding takes the argmax and never calls this.
    """
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draft_probs(logits: torch.Tensor, sampling, mass: float = 1.0, max_candidates: int = 0) -> torch.Tensor:
    """A draft's q: the request's tempered / top-k / top-p distribution, then cut to the draft's
    own most likely tokens (cut_tail). The draft draws from this q and acceptance reads this
    same q, so the emitted tokens keep the target's distribution exactly (speculative sampling
    is exact for whatever distribution the draft really drew from); what the cut costs is at
    most the cut mass of acceptance, and what it buys is a q with few nonzeros (a remote
    draft's reply, services.draft.DraftProbs)."""
    return cut_tail(logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p),
                    mass, max_candidates)


def cut_tail(q: torch.Tensor, mass: float = 1.0, max_candidates: int = 0) -> torch.Tensor:
    """(..., V) probabilities kept on the smallest set of most likely tokens holding `mass`
    of them, at most `max_candidates` (0: no cap), renormalized. mass 1 and no cap: q itself."""
    vocab = q.shape[-1]
    capped = 0 < max_candidates < vocab
    if mass >= 1.0 and not capped:
        return q
    top, order = torch.topk(q, max_candidates if capped else vocab, dim=-1)           # descending
    keep_top = (top.cumsum(-1) - top) < mass                     # the first token always stays
    keep = torch.zeros_like(q, dtype=torch.bool).scatter(-1, order, keep_top)
    q = q.masked_fill(~keep, 0.0)
    return q / q.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from (V,) probabilities."""
    return int(torch.multinomial(probs, 1, generator=generator))


def draw_token(logits: torch.Tensor, sampling, generator: torch.Generator, mass: float = 1.0,
               max_candidates: int = 0) -> tuple[int, torch.Tensor | None]:
    """One draft token from (V,) logits under a request's SamplingParams: the argmax when
    greedy (no distribution), else a draw from draft_probs, returned with it (the q of the
    acceptance test)."""
    if sampling.greedy:
        return int(logits.argmax()), None
    q = draft_probs(logits, sampling, mass, max_candidates)
    return sample(q, generator), q


def new_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()          # fresh nondeterministic seed for this request only
    else:
        gen.manual_seed(seed)
    return gen
