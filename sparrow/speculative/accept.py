"""Acceptance: the one place where draft tokens become output tokens. Pure functions,
tensors in, a small result out; no model, cache or I/O. A draft is a tree (tree.py); a
chain is the tree with one child per node, and goes through the same functions.

Words (per verify step):
  draft tokens   the k tokens the draft proposed
  accepted       the longest prefix of draft tokens the target agrees with
  recovered      on the first rejection, the token the target emits instead
  bonus          when all k are accepted, the target's own next token after them

Greedy (temperature 0): a draft token is accepted iff it equals the target's argmax; the
output is exactly the target's greedy output.
Sampling: Leviathan et al. / Chen et al. speculative sampling. Draft token x_i ~ q_i is
accepted with probability min(1, p_i(x_i) / q_i(x_i)); on rejection the recovered token is
drawn from norm(max(0, p_i - q_i)). The emitted tokens are distributed exactly as the
target's p. A deterministic draft (no q) counts as q = one-hot(x_i).

Randomness: a step draws its uniforms up front, one per node (node i's try reads u[i]; a node is
tried at most once) and one for the last draw (u[N], by inverse CDF: `draw_with`), so the
per-request functions here and the batched ones (accept_batch.py) read the same numbers from a
request's generator and agree token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree


@dataclass(frozen=True, slots=True)
class AcceptResult:
    num_accepted: int      # accepted draft tokens, 0..depth
    next_token: int        # recovered token (a rejection) or bonus token (a leaf was reached)
    path: tuple[int, ...] = ()   # the accepted nodes, root to leaf (a chain: 0 .. num_accepted-1)

    def tokens(self, draft_tokens: torch.Tensor) -> list[int]:
        """The tokens this step emits: the accepted path + recovered/bonus."""
        path = self.path or tuple(range(self.num_accepted))
        return [int(draft_tokens[i]) for i in path] + [self.next_token]


def accept_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> AcceptResult:
    """target_logits: (N+1, V); row 0 scores the token after the root, row i+1 the token after
    node i. From the root, follow the child whose token is the target's argmax; the first node
    without such a child ends the path and the argmax there is the next token. The emitted
    tokens are exactly the target's greedy continuation, whatever the tree."""
    best = target_logits.argmax(dim=-1).tolist()                       # (N+1,) one host read
    return greedy_walk(tree.tokens.tolist(), tree.children(), best)


def greedy_walk(tokens: list[int], children: list[list[int]], best: list[int]) -> AcceptResult:
    """accept_tree_greedy over values already on the host: the nodes' tokens, their children
    (DraftTree.children()) and the target's argmax of each row (N+1)."""
    node, path = -1, []
    while True:
        want = best[node + 1]
        match = next((c for c in children[node + 1] if tokens[c] == want), None)
        if match is None:
            return AcceptResult(len(path), want, tuple(path))
        path.append(match)
        node = match


def accept_tree_speculative(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> AcceptResult:
    """target_probs: (N+1, V) after the request's temperature/top-k/top-p, rows as above.

    Recursive rejection sampling over siblings: at a node, its children x_1, x_2, ... (drawn
    i.i.d. from the draft's q there, or a deterministic draft's distinct tokens, q_j =
    one-hot(x_j)) are tried in order; x_j is accepted with probability min(1, p(x_j) / q(x_j)),
    and on its rejection p becomes norm(max(0, p - q)) for the next sibling. An accepted child
    continues from its own row; when every child is rejected (or a leaf is reached) the next
    token is drawn from p as it stands. Each try is a Leviathan/Chen step against the residual
    of the last, so the emitted tokens have exactly the target's distribution; a chain is the
    case of one child per node."""
    uniforms = step_uniforms(tree.size, generator, target_probs.device)          # (N+1,)
    tokens, children = tree.tokens.tolist(), tree.children()
    node, path = -1, []
    while True:
        p = target_probs[node + 1]
        kids = children[node + 1]
        accepted = None
        for c in kids:
            x = tokens[c]
            q = tree.probs[tree.draw_row(c)].to(p.device) if tree.probs is not None else None
            qx = float(q[x]) if q is not None else 1.0
            if float(uniforms[c]) * qx <= float(p[x]):  # u < p/q  <=>  accept
                accepted = c
                break
            p = _residual(p, q, x)
        if accepted is None:
            return AcceptResult(len(path), int(draw_with(p, uniforms[-1])), tuple(path))
        path.append(accepted)
        node = accepted


def step_uniforms(nodes: int, generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """(nodes + 1,) uniforms of one sampled step: one per node's try, then the last draw's."""
    return torch.rand(nodes + 1, generator=generator, device=device)


def draw_with(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(..., V) probabilities, (...) uniforms in [0, 1) -> (...) tokens by inverse CDF: the first
    token whose cumulative mass reaches (1 - u) x the row's mass (never a token of zero mass)."""
    cdf = p.cumsum(-1)
    reach = (1 - u).unsqueeze(-1) * cdf[..., -1:]
    return (cdf < reach).sum(-1).clamp(max=p.shape[-1] - 1)


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """norm(max(0, p - q)); q None is one-hot(x). If p == q up to rounding leaves no mass, p
    itself is the right distribution (then x is accepted almost surely anyway)."""
    if q is not None:
        residual = (p - q).clamp(min=0)
    else:
        residual = p.clone()
        residual[x] = 0.0
    total = residual.sum()
    return residual / total if total > 1e-12 else p


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> AcceptResult:
    """A chain: draft_tokens (k,); target_logits (k+1, V), row i scores the token after input i."""
    return accept_tree_greedy(DraftTree.chain(draft_tokens), target_logits)


def accept_speculative(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, generator: torch.Generator) -> AcceptResult:
    """A chain: draft_tokens (k,); draft_probs (k, V) or None (deterministic draft);
    target_probs (k+1, V) after the request's temperature/top-k/top-p."""
    return accept_tree_speculative(DraftTree.chain(draft_tokens, draft_probs), target_probs, generator)
