"""Acceptance for a whole decode step's batch at once: the rules of accept.py over every
request's draft tree, with one host read per step. Greedy (and seeded) requests: one argmax
over every row of the batch, read once, each tree walked over the values. Speculative sampling
(Leviathan/Chen over siblings): one tensor program over the trees padded to the batch's
largest. accept.py's per-request functions stay the reference (`accept_one` here dispatches to
them); tests/test_batch_accept.py checks that the two agree token for token on random ragged
batches of chains and trees.

The sampling program's batch of B requests, request b with N_b draft nodes (0: it did not draft), N = max N_b:

    tokens  (B, N)        node tokens, 0 past N_b
    kids    (B, N+1, W)   kids[b, u+1]: the children of node u (u = -1: the root) in order, -1 pads
    logits  (B, N+1, V)   row 0 scores the token after the root, row i+1 the token after node i
    q       (sum M_b, V)  the draft distributions of every request, one after another (not padded)

The loops run over depth and sibling slots (host constants of the batch's shape), never over
requests, and read nothing back to the host; a batch of chains needs no loop at all (every
node's test at once, one residual). `accept_all` reads the outcome once.
Every draft kind (chain, tree, any proposer) comes here as a DraftTree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams
from .accept import AcceptResult, accept_tree_greedy, accept_tree_speculative, draw_with, greedy_walk, step_uniforms
from .sampling import PositionNoise, logits_to_probs
from .tree import DraftTree

_EMPTY = torch.empty(0, dtype=torch.long)


@dataclass(slots=True)
class PaddedTrees:
    """A batch's draft trees as padded tensors (shapes in the module's docstring)."""

    sizes: list[int]                 # N_b, host
    depth: int                       # the deepest node of the batch (0: nobody drafted)
    tokens: torch.Tensor             # (B, N) long
    valid: torch.Tensor              # (B, N) bool
    kids: torch.Tensor               # (B, N+1, W) long
    draw: torch.Tensor               # (B, N) long: the row of q each node was drawn from
    q: torch.Tensor | None           # (sum M_b, V) every request's draft distributions, one after another
    has_q: torch.Tensor              # (B,) bool: request b's draft has distributions
    chains: bool                     # every tree is a chain (node i the child of node i-1)

    @classmethod
    def of(cls, trees: list[DraftTree], device: torch.device | str, vocab: int) -> "PaddedTrees":
        """The structure is host metadata (a tree's parents); tokens and q are gathered as they are."""
        sizes = [t.size for t in trees]
        n = max(sizes, default=0)
        draw, kids, depth, offset = [], [], 0, 0
        for t in trees:
            par = t.parent_list()
            d = [0] * t.size
            for i, p in enumerate(par):
                d[i] = 1 if p < 0 else d[p] + 1
            depth = max([depth, *d])
            draw.append([offset + t.draw_row(i) if t.probs is not None else 0 for i in range(t.size)] + [0] * (n - t.size))
            offset += t.probs.shape[0] if t.probs is not None else 0
            kids.append([list(c) for c in t.children()] + [[] for _ in range(n - t.size)])
        width = max((len(c) for row in kids for c in row), default=0)
        kids = [[c + [-1] * (width - len(c)) for c in row] for row in kids]
        tokens = torch.zeros(len(trees), n, dtype=torch.long, device=device)
        for b, t in enumerate(trees):
            tokens[b, :t.size] = t.tokens.to(device)
        given = [t.probs.to(device) for t in trees if t.probs is not None]
        q = torch.cat(given) if given else None                 # no padding: V is large, rows are few
        as_long = dict(dtype=torch.long, device=device)
        return cls(sizes, depth, tokens,
                   torch.arange(n, device=device)[None, :] < torch.tensor(sizes, **as_long)[:, None],
                   torch.tensor(kids, **as_long).view(len(trees), n + 1, width),
                   torch.tensor(draw, **as_long).view(len(trees), n), q,
                   torch.tensor([t.probs is not None for t in trees], dtype=torch.bool, device=device),
                   all(t.is_chain for t in trees))


def speculative_batch(trees: PaddedTrees, p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p (B, N+1, V) the target's probabilities after each request's truncation; u (B, N+1) the
    step's uniforms (accept.step_uniforms: u[b, i] node i's try, u[b, N_b] the last draw).
    accept_tree_speculative's walk for every request at once. Returns accepted (B, N), next (B,)."""
    if trees.chains:
        return _speculative_chains(trees, p, u)
    b_idx = torch.arange(p.shape[0], device=p.device)
    cur = torch.full((p.shape[0],), -1, dtype=torch.long, device=p.device)       # the node the walk is at
    dist = p[:, 0]                                                                 # (B, V)
    walking = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
    accepted = torch.zeros_like(trees.valid)
    for _ in range(trees.depth):
        took = torch.zeros_like(walking)
        chosen = cur
        for j in range(trees.kids.shape[2]):
            c = trees.kids[b_idx, cur + 1, j]                                          # (B,)
            trying = walking & ~took & (c >= 0)
            c = c.clamp(min=0)
            x = trees.tokens[b_idx, c]
            px = dist.gather(1, x[:, None])[:, 0]
            if trees.q is not None:
                q = trees.q[trees.draw[b_idx, c]]                                       # (B, V)
                qx = torch.where(trees.has_q, q.gather(1, x[:, None])[:, 0], torch.ones_like(px))
                minus = torch.where(trees.has_q[:, None], q, torch.zeros_like(q))
            else:
                qx, minus = torch.ones_like(px), torch.zeros_like(dist)
            # u x q(x) <= p(x) in float64, where the product of two float32s is exact (as accept.py's floats)
            ok = trying & (u[b_idx, c].double() * qx.double() <= px.double())
            # on rejection: norm(max(0, p - q)); q one-hot(x) for a deterministic draft (accept._residual)
            residual = (dist - minus).clamp(min=0).scatter(1, x[:, None], 0.0) if trees.q is None else \
                torch.where(trees.has_q[:, None], (dist - minus).clamp(min=0), dist.scatter(1, x[:, None], 0.0))
            total = residual.sum(-1, keepdim=True)
            residual = torch.where(total > 1e-12, residual / total, dist)
            dist = torch.where((trying & ~ok)[:, None], residual, dist)
            chosen = torch.where(ok, c, chosen)
            took |= ok
        walking &= took
        accepted[b_idx, chosen.clamp(min=0)] |= walking
        cur = torch.where(walking, chosen, cur)
        dist = torch.where(walking[:, None], p[b_idx, cur + 1], dist)
    last = u.gather(1, torch.tensor(trees.sizes, device=p.device)[:, None])[:, 0]
    return accepted, draw_with(dist, last)


def _speculative_chains(trees: PaddedTrees, p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """speculative_batch when every tree is a chain: node i is tried iff nodes 0..i-1 were
    accepted, so every node's test runs at once, and only the first rejection's residual (or
    the bonus row) is ever drawn from: no loop, one (B, V) residual."""
    n = trees.tokens.shape[1]
    b_idx = torch.arange(p.shape[0], device=p.device)
    px = p[:, :n].gather(2, trees.tokens[:, :, None])[:, :, 0]                      # (B, N)
    qx = torch.ones_like(px)
    if trees.q is not None:
        qx = torch.where(trees.has_q[:, None], trees.q[trees.draw, trees.tokens], qx)
    ok = (u[:, :n].double() * qx.double() <= px.double()) & trees.valid
    accepted = ok.long().cumprod(1).bool()                                            # the accepted prefix
    count = accepted.sum(1)                                                           # (B,)
    dist = p[b_idx, count]                                                            # (B, V): row after the prefix
    rejected = count < torch.tensor(trees.sizes, device=p.device)
    at = count.clamp(max=max(n - 1, 0))
    if n:
        x = trees.tokens[b_idx, at]
        if trees.q is not None:
            q = trees.q[trees.draw[b_idx, at]]
            residual = torch.where(trees.has_q[:, None], (dist - q).clamp(min=0), dist.scatter(1, x[:, None], 0.0))
        else:
            residual = dist.scatter(1, x[:, None], 0.0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 1e-12, residual / total, dist)
        dist = torch.where(rejected[:, None], residual, dist)
    last = u.gather(1, torch.tensor(trees.sizes, device=p.device)[:, None])[:, 0]
    return accepted, draw_with(dist, last)


def accept_one(tree: DraftTree | None, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator,
               noise: PositionNoise | None) -> AcceptResult:
    """The per-request reference: accept.py's functions for one request (an empty tree when it
    did not draft). A seeded request (noise) is greedy over its Gumbel-perturbed scores, row 0
    at the next position and the row after a node at depth d, d positions on: its tokens are
    those of plain decoding with the same seed, whatever was drafted."""
    tree = tree if tree is not None else DraftTree.chain(_EMPTY)
    if sampling.greedy:
        return accept_tree_greedy(tree, logits)
    p = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    if noise is None:
        return accept_tree_speculative(tree, p, generator)
    result = accept_tree_greedy(tree, noise.scores(p, _offsets(tree)))
    noise.position += result.num_accepted + 1
    return result


def accept_all(trees: list[DraftTree | None], logits: list[torch.Tensor], samplings: list[SamplingParams],
               generators: list[torch.Generator], noises: list[PositionNoise | None]) -> list[AcceptResult]:
    """Every request of a step at once, equal to `accept_one` for each. Greedy and seeded
    requests: one argmax over all their rows (a seeded request's rows are its Gumbel-perturbed
    scores) and one host read of it with every drafted token, then each tree's walk over those
    values (measured on a CPU: a tensor walk's ~40 small ops cost more than the walk in Python
    over one read). Unseeded sampled requests: speculative_batch, one tensor program and one
    host read, when two or more share the step (one alone: accept_one, cheaper)."""
    full = [t if t is not None else DraftTree.chain(_EMPTY) for t in trees]
    results: list[AcceptResult | None] = [None] * len(full)
    greedy = [i for i, s in enumerate(samplings) if s.greedy or noises[i] is not None]
    sampled = [i for i, s in enumerate(samplings) if not s.greedy and noises[i] is None]
    if greedy:
        rows = []
        for i in greedy:                    # (n_i, V) rows whose argmax is the token: logits, or log p + Gumbel
            s = samplings[i]
            rows.append(logits[i] if s.greedy else noises[i].scores(
                logits_to_probs(logits[i], s.temperature, s.top_k, s.top_p), _offsets(full[i])))
        best = torch.cat(rows).argmax(-1)
        read = torch.cat([best, *(full[i].tokens.to(best.device) for i in greedy)]).tolist()   # the one host read
        at, tok = 0, best.shape[0]
        for i in greedy:
            n = full[i].size
            results[i] = greedy_walk(read[tok:tok + n], full[i].children(), read[at:at + n + 1])
            at, tok = at + n + 1, tok + n
            if noises[i] is not None:
                noises[i].position += results[i].num_accepted + 1
    if len(sampled) == 1:
        i = sampled[0]
        results[i] = accept_one(full[i], logits[i], samplings[i], generators[i], None)
    elif sampled:
        device, vocab = logits[0].device, logits[0].shape[-1]
        rows = max(full[i].size for i in sampled) + 1
        p = _probs([logits[i] for i in sampled], [samplings[i] for i in sampled], rows)   # (S, N+1, V)
        u = _padded([step_uniforms(full[i].size, generators[i], device) for i in sampled], rows, device)
        padded = PaddedTrees.of([full[i] for i in sampled], device, vocab)
        _collect(results, sampled, full, *speculative_batch(padded, p, u))
    return results


def _offsets(tree: DraftTree) -> torch.Tensor:
    """(N+1,) each row's output position after the next one: the root's 0, a node's its depth."""
    return torch.cat([torch.zeros(1, dtype=torch.long), tree.depths()])


def _padded(rows: list[torch.Tensor], n: int, device) -> torch.Tensor:
    """Ragged (n_i,) or (n_i, V) tensors stacked into (B, n) / (B, n, V), zeros past n_i."""
    out = rows[0].new_zeros((len(rows), n, *rows[0].shape[1:]), device=device)
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


def _probs(logits: list[torch.Tensor], samplings: list[SamplingParams], rows: int) -> torch.Tensor:
    """(B, rows, V) each request's probabilities after its own temperature / top-k / top-p, one
    logits_to_probs call per distinct setting (rows past a request's own are uniform filler)."""
    p = _padded(logits, rows, logits[0].device)
    out = torch.empty_like(p, dtype=torch.float32)
    groups: dict[tuple, list[int]] = {}
    for b, s in enumerate(samplings):
        groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(b)
    for (temperature, top_k, top_p), members in groups.items():
        idx = torch.tensor(members, device=p.device)
        out[idx] = logits_to_probs(p[idx], temperature, top_k, top_p)
    return out


def _collect(results: list, members: list[int], trees: list[DraftTree], accepted: torch.Tensor,
             nxt: torch.Tensor) -> None:
    """The batch's outcome read once: each member's accepted path and next token."""
    read = torch.cat([nxt[:, None], accepted.long()], 1).tolist()         # (B, 1 + N): the one host read
    for b, i in enumerate(members):
        path = tuple(j for j, f in enumerate(read[b][1:trees[i].size + 1]) if f)
        results[i] = AcceptResult(len(path), read[b][0], path)
