"""A draft tree while it grows in a propose (the Sparrow proposer's, sparrow_proposer.py): its
nodes, their draws and scores, which nodes get children, and each node's ancestors. A chain is
the tree of width and branch 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SpecConfig
from .proposer import DraftRequest, Proposal
from .sampling import draft_probs


@dataclass(slots=True)
class Node:
    index: int                     # node index in the tree (-1: the root)
    hidden: torch.Tensor | None    # draft output at this node (its children's distribution comes from it)
    score: float                   # cumulative draft log-probability
    logits: torch.Tensor | None = None    # (V,) its children's logits, when a static level computed them


class TreeGrowth:
    """One request's tree while it grows (propose)."""

    def __init__(self, request: DraftRequest, spec: SpecConfig):
        self.request, self.spec = request, spec
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.draw: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.parent_hidden: list[torch.Tensor] = []    # the parent's draft output, fed with the node
        self.scores: list[float] = []                  # cumulative draft log-probability of each node
        self.spec_index: dict[int, int] = {}           # node -> its entry after `committed` in the draft cache
        self.ancestors: dict[int, list[int]] = {-1: []}
        self.path_of: dict[int, tuple[int, ...]] = {-1: ()}       # node -> the tokens from the root to it
        self.path_score: dict[tuple[int, ...], float] = {}        # token path -> its first node's score
        self.slots: dict[int, int] = {}                # node -> its drafted slot in a static DraftBatch
        self.budget = min(spec.max_tree_nodes(request.k), request.budget or 1 << 30)

    def add_children(self, node: Node, logits: torch.Tensor, depth: int,
                     top: tuple[list[int], list[float]] | None = None) -> list[Node]:
        """top: at T=0, the node's tree_branch most probable tokens and their log-probabilities
        (the level's, read once: `SparrowProposer._greedy_top`)."""
        room = self.budget - len(self.tokens)
        n = min(self.spec.tree_branch, room)
        if n <= 0:
            return []
        sampling = self.request.sampling
        if sampling.greedy:
            picks, scores, row = top[0][:n], top[1][:n], None
        else:
            q = draft_probs(logits, sampling, self.spec.draft_mass, self.spec.draft_max_candidates)
            noise = self.request.noise
            picks = (noise.pick(q, depth - 1, n) if noise is not None else
                     torch.multinomial(q, n, replacement=True, generator=self.request.generator).tolist())
            scores = torch.log(q[picks].clamp(min=1e-30)).tolist()
            row = len(self.probs)
            self.probs.append(q)
        children = []
        for token, score in zip(picks, scores):
            index = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(node.index)
            self.draw.append(row if row is not None else index)
            self.parent_hidden.append(node.hidden)
            self.ancestors[index] = self.ancestors[node.index] + [index]
            self.path_of[index] = self.path_of[node.index] + (token,)
            self.path_score.setdefault(self.path_of[index], node.score + score)
            self.scores.append(node.score + score)
            children.append(Node(index, None, node.score + score))
        return children

    def to_expand(self, nodes: list[Node]) -> list[Node]:
        """The nodes of a new level that get children: the tree_width most probable.

        Sampled children are drawn with replacement, so two nodes can carry the same token path:
        equal in exact arithmetic, their scores differ in the last bits with the batch's shapes.
        Ranked by their path's first score, then by index, they keep a seeded request's tree, and
        so its draws, those of its solo run in any batch."""
        if len(self.tokens) >= self.budget:
            return []
        return sorted(nodes, key=lambda node: (-self.path_score[self.path_of[node.index]], node.index))[
            : self.spec.tree_width]

    def spec_mask(self, nodes: list[Node]) -> torch.Tensor:
        """(len(nodes), fed so far + len(nodes)): each fed node sees its fed ancestors and itself."""
        for node in nodes:
            self.spec_index[node.index] = len(self.spec_index)
        mask = torch.zeros(len(nodes), len(self.spec_index), dtype=torch.bool)
        for row, node in enumerate(nodes):
            for a in self.ancestors[node.index]:
                if a in self.spec_index:
                    mask[row, self.spec_index[a]] = True
        return mask

    def tree(self) -> Proposal:
        tokens = torch.tensor(self.tokens, dtype=torch.long)
        probs = torch.stack(self.probs) if self.probs else None
        scores = torch.tensor(self.scores, dtype=torch.float32)
        if all(p == i - 1 for i, p in enumerate(self.parents)):
            # A chain (width 1 or a single path): row i of probs is node i's distribution.
            return Proposal(tokens, probs, scores=scores)
        return Proposal(tokens, probs, torch.tensor(self.parents, dtype=torch.long),
                        torch.tensor(self.draw, dtype=torch.long), scores=scores)
