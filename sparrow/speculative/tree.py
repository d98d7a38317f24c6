"""Draft trees: what a proposer proposes for one request in one step.

    root      the request's last emitted token (its KV is written by the verify step)
    node i    tokens[i], child of parents[i] (-1: the root), at depth[i] >= 1; nodes are in
              breadth-first order, so a parent always comes before its children

A chain of k draft tokens is the tree whose node i is the child of node i-1: every proposer
proposes trees, chains included, and the scheduler, the target's verify and acceptance have
one code path for both.

For sampling, the children of a node must have been drawn i.i.d. from one draft distribution
q (or be a deterministic draft's distinct tokens): `probs` holds those distributions, one row
per node that has children, and `draw[i]` is the row node i was drawn from. Acceptance
(accept.py) reads q there; nothing else about how the tree was grown matters to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class DraftTree:
    tokens: torch.Tensor                    # (N,) long
    probs: torch.Tensor | None = None       # (M, V) draft distributions, None for a deterministic draft
    parents: torch.Tensor | None = None     # (N,) long, -1 = the root; None: a chain
    draw: torch.Tensor | None = None        # (N,) long rows of probs; None: row i for node i (a chain)
    scores: torch.Tensor | None = None      # (N,) cumulative draft log-probability of each node's path
    _children: list[list[int]] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def parent_list(self) -> list[int]:
        if self.parents is None:
            return list(range(-1, self.size - 1))
        return self.parents.tolist()

    def children(self) -> list[list[int]]:
        """children()[u + 1]: the nodes whose parent is u (u = -1: the root), in order."""
        if self._children is None:
            kids: list[list[int]] = [[] for _ in range(self.size + 1)]
            for i, p in enumerate(self.parent_list()):
                kids[p + 1].append(i)
            self._children = kids
        return self._children

    def depths(self) -> torch.Tensor:
        """(N,) depth of every node (the root's children: 1)."""
        if self.parents is None:
            return torch.arange(1, self.size + 1)
        depth = [0] * self.size
        for i, p in enumerate(self.parent_list()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return torch.tensor(depth, dtype=torch.long)

    def draw_row(self, node: int) -> int:
        return node if self.draw is None else int(self.draw[node])

    def attention_mask(self) -> torch.Tensor | None:
        """(N+1, N+1) bool over [root, nodes]: row i sees column j iff j is i's ancestor or i
        itself (the root is everyone's ancestor). None for a chain: plain causal order."""
        if self.parents is None:
            return None
        n = self.size
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parent_list()):
            row = i + 1
            if p >= 0:
                mask[row] = mask[p + 1]
            mask[row, row] = True
        return mask

    def best(self, n: int) -> "DraftTree":
        """The n nodes with the highest scores (ties: the earlier node), re-indexed in their
        order. A node's score is at most its parent's and parents come first, so the set holds
        every kept node's ancestors: it is a tree. A chain keeps its first n. Only for trees
        whose nodes were chosen deterministically (T=0): dropping sampled siblings by their
        values would bias the sampling acceptance."""
        if n >= self.size:
            return self
        if self.parents is None:
            return DraftTree(self.tokens[:n], self.probs[:n] if self.probs is not None else None,
                             scores=self.scores[:n] if self.scores is not None else None)
        if self.scores is None:
            raise ValueError("a tree without scores cannot be cut to its best nodes")
        order = sorted(range(self.size), key=lambda i: (-float(self.scores[i]), i))[:n]
        return self.subtree(order, "the best nodes do not hold their ancestors (scores must not rise along a path)")

    def subtree(self, nodes: list[int], why: str = "the nodes kept do not hold their ancestors") -> "DraftTree":
        """These nodes (each with its ancestors among them), re-indexed in their order; a single
        path comes back as a chain. The same determinism caveat as `best`."""
        keep = sorted(nodes)
        if self.parents is None:
            if keep != list(range(len(keep))):
                raise ValueError(why)
            return DraftTree(self.tokens[:len(keep)], self.probs[:len(keep)] if self.probs is not None else None,
                             scores=self.scores[:len(keep)] if self.scores is not None else None)
        new = {old: i for i, old in enumerate(keep)}
        parents = [int(self.parents[i]) for i in keep]
        if any(p >= 0 and p not in new for p in parents):
            raise ValueError(why)
        idx = torch.tensor(keep, dtype=torch.long)
        parents_t = torch.tensor([new[p] if p >= 0 else -1 for p in parents], dtype=torch.long)
        tokens, scores = self.tokens[idx], self.scores[idx] if self.scores is not None else None
        if all(int(p) == i - 1 for i, p in enumerate(parents_t.tolist())) and self.probs is None:
            return DraftTree(tokens, None, scores=scores)                 # a single path: a chain
        draw = self.draw[idx] if self.draw is not None else idx
        return DraftTree(tokens, self.probs, parents_t, draw, scores=scores)

    @classmethod
    def chain(cls, tokens: torch.Tensor, probs: torch.Tensor | None = None) -> "DraftTree":
        return cls(tokens, probs)
