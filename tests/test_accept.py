"""The acceptance functions: greedy prefix matching and lossless speculative sampling."""

import pytest
import torch

from sparrow.speculative.accept import accept_greedy, accept_speculative
from sparrow.speculative.sampling import PositionNoise, gumbel_noise, logits_to_probs


def _one_hot_logits(tokens, vocab=8):
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize("draft,target,n,nxt", [
    ([1, 2, 3], [1, 2, 3, 4], 3, 4),     # all accepted, bonus 4
    ([1, 2, 3], [1, 5, 3, 4], 1, 5),     # second rejected, recovered 5
    ([7, 2, 3], [1, 2, 3, 4], 0, 1),     # none accepted
])
def test_greedy_prefix(draft, target, n, nxt):
    r = accept_greedy(torch.tensor(draft), _one_hot_logits(target))
    assert (r.num_accepted, r.next_token) == (n, nxt)
    assert r.tokens(torch.tensor(draft)) == draft[:n] + [nxt]


def _empirical(fn, trials, vocab):
    counts = torch.zeros(vocab)
    for _ in range(trials):
        counts[fn()] += 1
    return counts / trials


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_speculative_sampling_preserves_target_distribution(deterministic_draft):
    """First and second emitted tokens follow the target's p, whatever the draft's q."""
    vocab, trials = 6, 20000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, -1)     # target, k=2 -> 3 rows
    q = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1)     # draft, far from p
    rng = torch.Generator().manual_seed(1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab, vocab)
    for _ in range(trials):
        if deterministic_draft:
            d = torch.tensor([2, 4])
            r = accept_speculative(d, None, p, rng)
        else:
            d = torch.multinomial(q, 1, generator=rng).view(-1)
            r = accept_speculative(d, q, p, rng)
        toks = r.tokens(d)
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[0], toks[1]] += 1
    first /= trials
    assert torch.allclose(first, p[0], atol=0.015), (first, p[0])
    # Given the first token was the draft's accepted token x, the second follows p[1].
    x = int(second.sum(1).argmax())
    cond = second[x] / second[x].sum()
    assert second[x].sum() > 1000
    assert torch.allclose(cond, p[1], atol=0.04), (cond, p[1])


def test_sampling_rejects_everything_when_draft_has_zero_target_mass():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    rng = torch.Generator().manual_seed(0)
    r = accept_speculative(torch.tensor([2]), torch.tensor([[0.0, 0.0, 1.0]]), p, rng)
    assert r.num_accepted == 0 and r.next_token == 1


def test_logits_to_probs_top_k_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    pk = logits_to_probs(logits, 1.0, top_k=2)
    assert (pk[2:] == 0).all() and abs(float(pk.sum()) - 1) < 1e-6
    pp = logits_to_probs(logits, 1.0, top_p=0.7)
    full = torch.softmax(logits, -1)
    assert full[0] < 0.7 < full[0] + full[1]
    assert (pp[2:] == 0).all() and (pp[:2] > 0).all()
    hot = logits_to_probs(logits, 0.01)
    assert float(hot[0]) > 0.999


def test_cut_tail_keeps_the_most_likely_tokens_and_renormalizes():
    """sampling.cut_tail: the smallest set of most likely tokens holding `mass`, at most
    `max_candidates`, renormalized; the first token always stays; off = q itself."""
    from sparrow.speculative.sampling import cut_tail

    q = torch.tensor([[0.05, 0.5, 0.3, 0.1, 0.05], [0.9, 0.04, 0.03, 0.02, 0.01]])
    assert cut_tail(q) is q
    got = cut_tail(q, mass=0.75)
    torch.testing.assert_close(got[0], torch.tensor([0, 0.5, 0.3, 0, 0]) / 0.8)     # 0.5 < 0.75, 0.8 >= 0.75
    torch.testing.assert_close(got[1], torch.tensor([1.0, 0, 0, 0, 0]))            # 0.9 alone holds it
    got = cut_tail(q, max_candidates=3)
    torch.testing.assert_close(got[0], torch.tensor([0, 0.5, 0.3, 0.1, 0]) / 0.9)
    assert int((cut_tail(q, mass=1e-6) > 0).sum()) == 2                             # one token a row
    assert cut_tail(q, mass=1.0, max_candidates=5) is q                              # a cap >= V is no cap


def test_position_noise_draws_follow_p_and_are_keyed_by_seed_and_position():
    """Seeded sampling's Gumbel-max: over seeds (and over positions) the argmax of log p + noise
    is distributed as p; the same (seed, position) always gives the same noise; a draft's pick
    of n is n distinct tokens, its first the draft's own Gumbel-max draw."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g) * 1.5, -1)
    over_seeds = torch.tensor([int(PositionNoise(seed).scores(p[None], torch.zeros(1, dtype=torch.long)).argmax())
                               for seed in range(6000)])
    assert torch.allclose(torch.bincount(over_seeds, minlength=6) / 6000, p, atol=0.02)
    noise = PositionNoise(5)
    over_positions = noise.scores(p.expand(20000, 6), torch.arange(20000)).argmax(-1)
    assert torch.allclose(torch.bincount(over_positions, minlength=6) / 20000, p, atol=0.01)
    assert torch.equal(gumbel_noise(5, torch.tensor([7, 9]), 6), gumbel_noise(5, torch.tensor([7, 9]), 6))
    assert not torch.equal(gumbel_noise(5, torch.tensor([7]), 6), gumbel_noise(6, torch.tensor([7]), 6))
    assert not torch.equal(gumbel_noise(5, torch.tensor([7]), 6), gumbel_noise(5, torch.tensor([8]), 6))
    noise.position = 40                                  # offsets count from the next token's position
    picks = noise.pick(p, 2, n=3)
    assert len(set(picks)) == 3
    assert picks[0] == int(PositionNoise(5).scores(p[None], torch.tensor([42])).argmax())
