"""Test-only helpers, kept out of the package: a stub proposer that forces "always accept" /
"never accept", the check that the training unroll sees what decoding sees, and the check
that seeded sampling is reproducible.
Tests import them as `from helpers import ...` (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import sparrow.models.draft as draft_module
from sparrow import Engine
from sparrow.config import SamplingParams, SpecConfig
from sparrow.models.draft import SparrowDraft
from sparrow.models.prefill import FeatureNeeds
from sparrow.speculative.sparrow_proposer import SparrowProposer
from sparrow.speculative.draft_context import DraftContext
from sparrow.speculative.proposer import DraftState, Proposal
from sparrow.speculative.sampling import new_generator
from sparrow.speculative.tree import DraftTree
from sparrow.training.unroll import unroll


@dataclass(slots=True)
class _OracleState(DraftState):
    pos: int

    def kv_bytes(self) -> int:
        return 0                            # no draft model, no KV

    def max_keys(self) -> int:
        return 0


class OracleProposer:
    """Proposes a known continuation (e.g. the target's own greedy output): every draft token
    is accepted while the continuation is right. `corrupt` flips every draft token to a wrong
    one instead (nothing is accepted). A test stub, never used for serving."""

    needs = FeatureNeeds()

    def __init__(self, continuation: list[int], corrupt: bool = False, vocab_size: int | None = None):
        self.continuation = list(continuation)
        self.corrupt = corrupt
        self.vocab_size = vocab_size

    def begin(self, start) -> _OracleState:
        return _OracleState(pos=1)          # the first token comes from prefill

    def propose(self, batch) -> list[Proposal]:
        out = []
        for r in batch:
            seq = self.continuation[r.state.pos: r.state.pos + r.k]
            seq += [self.continuation[-1]] * (r.k - len(seq))
            if self.corrupt:
                seq = [(t + 1) % self.vocab_size for t in seq]
            out.append(Proposal(torch.tensor(seq, dtype=torch.long), None))
        return out

    def commit(self, states, results) -> None:
        for state, result in zip(states, results):
            state.pos += len(result.tokens)

    def end(self, state) -> None:
        pass


class OracleTreeProposer(OracleProposer):
    """Deterministic draft trees around a known greedy continuation: every node has `width`
    children, wrong tokens first; the right token (where `mode` puts it) is the LAST sibling,
    so acceptance must search the siblings. mode: "always" (the right token at every level),
    "never" (no right token anywhere), "sometimes" (right at the first level only, wrong below).
    Only the right token's subtree is expanded further; wrong siblings are leaves."""

    def __init__(self, continuation: list[int], vocab_size: int, width: int, mode: str):
        super().__init__(continuation, vocab_size=vocab_size)
        self.width, self.mode = width, mode

    def propose(self, batch) -> list[Proposal]:
        out = []
        for r in batch:
            tokens, parents, parent = [], [], -1
            for depth in range(r.k):
                pos = r.state.pos + depth
                right = self.continuation[min(pos, len(self.continuation) - 1)]
                right_here = self.mode == "always" or (self.mode == "sometimes" and depth == 0)
                wrong = [(right + 1 + j) % self.vocab_size for j in range(self.width)]
                kids = wrong[: self.width - 1] + [right if right_here else wrong[-1]]
                first = len(tokens)
                tokens += kids
                parents += [parent] * len(kids)
                parent = first + len(kids) - 1          # grow below the last sibling
            out.append(Proposal(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(parents, dtype=torch.long)))
        return out


def check_unroll_equals_proposer(draft: SparrowDraft, spec: SpecConfig, sig, start: int, pinned: torch.Tensor,
                                 window: int, glimpse: int) -> list[torch.Tensor]:
    """Propose spec.num_draft_tokens tokens from chain start `start` over the training signals
    `sig` (as decoding does), recording every window mask the draft builds; run the training
    unroll over the same tokens; assert that each step's distribution and the keys it sees are
    the same. Returns the key positions each inference step saw."""
    s, k = start, spec.num_draft_tokens
    recorded, real = [], draft_module.window_mask

    def recording(q_pos, k_pos, k_pinned, w):
        mask = real(q_pos, k_pos, k_pinned, w)
        recorded.append((k_pos, mask))
        return mask

    proposer = SparrowProposer(draft, dataclasses.replace(spec, draft_step="reference"))   # the masks it builds
    draft_module.window_mask = recording
    try:
        state = proposer.begin_context(DraftContext(sig.token_ids[: s + 1], sig.features[: s + 1], sig.num_prompt,
                                            sig.prefix(glimpse), sig.num_visual))
        proposal = proposer.propose_one(state, k, SamplingParams(temperature=1.0), new_generator(0))
    finally:
        draft_module.window_mask = real
    ids = sig.token_ids.clone()
    ids[s + 1: s + k] = proposal.tokens[: k - 1]        # the tokens the proposer fed forward
    with torch.no_grad():
        out = unroll(draft, ids, sig.features, pinned, sig.prefix(glimpse), torch.tensor([s]), k, window,
                     keep_masks=True)
    for j in range(k):
        torch.testing.assert_close(torch.softmax(out.logits[j][0].float(), -1), proposal.probs[j])
    # begin's last row (entry s), then one forward per fed-back draft token
    inference_rows = [recorded[-k][0][recorded[-k][1][-1]]] + [kp[m[0]] for kp, m in recorded[-(k - 1):]]
    for j, row in enumerate(inference_rows):
        training_row = out.key_pos[j][out.masks[j][0]]
        assert sorted(row.tolist()) == sorted(training_row.tolist()), f"step {j}"
    return inference_rows


def check_seeded_sampling(engine: Engine, video, prompt: str):
    """Sampling with a seed: the same seed gives the same tokens, different seeds different
    ones (a seed that were ignored would pass the first check alone). Returns the first output."""
    s = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=123)
    a = engine.generate(video, prompt, s)
    b = engine.generate(video, prompt, s)
    assert a.token_ids == b.token_ids and len(a.token_ids) >= 1
    others = {tuple(engine.generate(video, prompt, SamplingParams(max_new_tokens=20, temperature=1.0,
                                                                  seed=seed)).token_ids) for seed in range(4)}
    assert len(others) > 1, "different seeds should give different samples"
    return a


RAGGED_PROMPTS = ("Why?", "What happens in the video?", "Which shape moves first, and where does it go?")


def ragged_step_inputs(target, video):
    """A ragged step's parts: a decode, a chain and a tree (tokens, trees), each on its own cache
    (states), the caches of different lengths (different prompts)."""
    engine = Engine(target, spec=SpecConfig(method="none"))
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.zeros(4, 1), parents=torch.tensor([-1, -1, 0, 1]))
    tokens = [torch.tensor(t) for t in ([3], [3, 4, 5, 6, 7], [3, 5, 6, 7, 8])]
    states = []
    for prompt in RAGGED_PROMPTS:
        inputs = engine.prepare(video, prompt)
        states.append(target.prefill(inputs, inputs["input_ids"].shape[1] + 8).state)
    assert len({s.length for s in states}) == 3
    return states, tokens, [None, None, tree]
