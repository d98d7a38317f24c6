"""Logits to probabilities and sampling, with an explicit per-request generator.

The global RNG is never touched: every random draw takes the request's torch.Generator, or,
for a seeded request, its PositionNoise.

Seeded sampling is Gumbel-max with noise keyed by (seed, output position, token): the token at
position t is argmax_v(log p_t(v) + G(seed, t, v)), with G standard Gumbel. That is an exact
draw from p_t, and a function of the target's distributions and the seed alone: speculative
decoding with any k, tree or draft, in any batch, emits exactly the tokens plain decoding does
with the same seed (acceptance is then the greedy rule over the perturbed scores). A draft
that perturbs its own q with the same noise proposes the target's token whenever q and p agree
on the argmax of the perturbed scores.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer over int64 tensors (multiplication wraps modulo 2^64)."""
    x = x + _signed(_GOLDEN)
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    return x ^ _shr(x, 31)


def gumbel_noise(seed: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """(n, vocab) float32 standard Gumbel noise, one row per output position in `positions`
    (n,) int64, a pure function of (seed, position, token id), computed on positions' device."""
    key = _mix(torch.full_like(positions, _signed(seed & _MASK64)) ^ _mix(positions))             # (n,)
    ids = torch.arange(vocab, device=positions.device, dtype=torch.int64)
    bits = _mix(key[:, None] * _signed(_MIX1) + ids[None, :])                                       # (n, V)
    u = (_shr(bits, 11).double() + 0.5) * 2.0 ** -53                                                # (0, 1)
    return (-torch.log(-torch.log(u))).float()


class PositionNoise:
    """A seeded request's randomness: Gumbel noise keyed by output position. `position` is the
    output position of the next token to be decided (the first token is position 0); rows
    are asked for by their offset from it (a draft node at depth d sits at offset d - 1, and
    the target's row after it scores offset d)."""

    def __init__(self, seed: int):
        self.seed, self.position = seed, 0

    @property
    def seed_bits(self) -> int:
        """The seed's 64 bits as an int64 (what gumbel_noise keys by; a kernel's uint64 reads the same bits)."""
        return _signed(self.seed & _MASK64)

    def scores(self, probs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """(n, V) probabilities of the tokens at offsets (n,) -> log p + Gumbel: the token is their argmax."""
        positions = offsets.to(probs.device, torch.int64) + self.position
        return torch.log(probs) + gumbel_noise(self.seed, positions, probs.shape[-1])

    def pick(self, q: torch.Tensor, offset: int, n: int = 1) -> list[int]:
        """The n tokens with the highest perturbed scores under a draft's (V,) q at offset:
        the first is the draft's Gumbel-max draw, the rest its best distinct alternatives."""
        row = self.scores(q[None], torch.tensor([offset]))[0]
        return torch.topk(row, min(n, int((q > 0).sum()))).indices.tolist()


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
               max_candidates: int = 0, noise: PositionNoise | None = None,
               offset: int = 0) -> tuple[int, torch.Tensor | None]:
    """One draft token from (V,) logits under a request's SamplingParams: the argmax when
    greedy (no distribution), else a draw from draft_probs, returned with it (the q of the
    acceptance test): with the request's position noise at `offset` when it is seeded, else
    from its generator."""
    if sampling.greedy:
        return int(logits.argmax()), None
    q = draft_probs(logits, sampling, mass, max_candidates)
    return (noise.pick(q, offset)[0] if noise is not None else sample(q, generator)), q


def new_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()          # fresh nondeterministic seed for this request only
    else:
        gen.manual_seed(seed)
    return gen
