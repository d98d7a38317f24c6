"""The Sparrow draft at batch 8: every request's proposals, step after step, are those of the
same request drafting alone, on the static levels (the batch's keys gathered once, its chains
in one call: the C++ kernel's and torch's) and on the per-request reference path; greedy and
seeded requests mixed, of different context lengths and depths, with padding rows in the batch."""

import pytest
import torch

from sparrow import SamplingParams, SpecConfig
from sparrow.kernels import draft_chain
from sparrow.speculative.draft_context import DraftContext
from sparrow.speculative.proposer import DraftRequest, StepResult
from sparrow.speculative.sampling import PositionNoise, new_generator
from sparrow.speculative.sparrow_proposer import SparrowProposer
from sparrow.tiny import tiny_draft

SPEC = SpecConfig(num_draft_tokens=4, window=6, anchors=5, glimpse=2, adaptive_k=False, draft_step="static")
PROMPTS = (4, 9, 23, 7, 30, 12, 5)          # seven requests: bucket 8, one padding row
KS = (4, 2, 3, 4, 1, 4, 3)
GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=1.0, seed=9)


def _run(draft, step: str, members: list[int], steps: int = 5) -> dict[int, list[torch.Tensor]]:
    """The requests `members` drafting together for `steps` steps on the `step` path; each step
    commits the same emitted tokens for a request whatever its neighbours (its first draft token
    and one drawn by the request's own generator). Returns each request's proposals."""
    proposer = SparrowProposer(draft, SpecConfig(**{**{f: getattr(SPEC, f) for f in SPEC.__dataclass_fields__},
                                                    "draft_step": step}))
    states = {i: proposer.begin_context(DraftContext.synthetic(draft, PROMPTS[i], SPEC.glimpse,
                                                               torch.Generator().manual_seed(i)), 60)
              for i in members}
    draws = {i: torch.Generator().manual_seed(100 + i) for i in members}
    noise = {i: PositionNoise(SEEDED.seed + i) for i in members}
    out = {i: [] for i in members}
    for t in range(steps):
        for i in members:
            noise[i].position = 2 * t               # (the output position the step drafts from)
        batch = [DraftRequest(states[i], KS[i], SEEDED if i % 2 else GREEDY, new_generator(i),
                              noise=noise[i] if i % 2 else None) for i in members]
        for i, p in zip(members, proposer.propose(batch)):
            out[i].append(p)
        results = []
        for i in members:
            g = draws[i]
            tokens = out[i][-1].tokens[:1].tolist() + [int(torch.randint(0, draft.config.vocab_size, (1,), generator=g))]
            results.append(StepResult(None, tokens, torch.randn(len(tokens), draft.fuse.in_features, generator=g)))
        proposer.commit([states[i] for i in members], results)
    return out


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_a_batch_of_drafts_equals_each_request_alone(qwen_target, monkeypatch, impl):
    if impl == "kernel" and not draft_chain.ready():
        draft_chain.EXTENSION.load()
        if not draft_chain.ready():
            pytest.skip("the C++ draft kernel is not built here")
    monkeypatch.setattr(draft_chain, "IMPL", impl)
    draft = tiny_draft(qwen_target, seed=1)
    everyone = list(range(len(PROMPTS)))
    together = _run(draft, "static", everyone)
    reference = _run(draft, "reference", everyone)
    for i in everyone:
        alone = _run(draft, "static", [i])[i]
        for t, (a, b, r) in enumerate(zip(together[i], alone, reference[i])):
            where = f"request {i}, step {t}"
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, r.tokens), where
            assert len(a.tokens) == KS[i], where
            torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=1e-5, msg=where)
            torch.testing.assert_close(a.scores, r.scores, atol=1e-5, rtol=1e-5, msg=where)



def test_compacting_the_draft_cache_changes_no_proposal(qwen_target, monkeypatch):
    """A draft cache compacted as it fills (entries no later query can see dropped) proposes what
    one never compacted proposes, over enough steps for many compactions."""
    from sparrow.models.draft import SparrowDraft

    draft = tiny_draft(qwen_target, seed=1)
    everyone = list(range(len(PROMPTS)))
    dropped = []
    real_evict = SparrowProposer._evict

    def evict(self, kv, next_pos, window):
        n = len(kv)
        real_evict(self, kv, next_pos, window)
        dropped.append(n - len(kv))

    monkeypatch.setattr(SparrowProposer, "_evict", evict)
    compacted = _run(draft, "static", everyone, steps=30)
    assert sum(d > 0 for d in dropped) >= 2 * len(everyone)              # every cache compacted, more than once
    real_new_kv = SparrowDraft.new_kv
    monkeypatch.setattr(SparrowDraft, "new_kv", lambda self, capacity: real_new_kv(self, capacity + 1000))
    dropped.clear()
    whole = _run(draft, "reference", everyone, steps=30)
    assert not any(dropped)
    for i in everyone:
        for t, (a, b) in enumerate(zip(compacted[i], whole[i])):
            assert torch.equal(a.tokens, b.tokens), f"request {i}, step {t}"
            torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=1e-5)
