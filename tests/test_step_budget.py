"""A step budget (EngineConfig.step_budget_s, a latency objective) in the draft policy: the
choice is cut, deepest draft positions first, until the step's predicted time fits, while a
decode step of the batch fits; otherwise the best rate stands. Stub costs fix each step's
time, so each test says which ks the policy must pick; through the engine, a budget that cuts
every drafting step leaves the output the target's own."""

import random

import pytest
from test_draft_policy import K, StubCosts, request

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.config import EngineConfig
from sparrow.draft_policy import DraftPolicy
from sparrow.errors import InvalidRequest
from sparrow.tiny import tiny_draft

ROWS_COST = StubCosts(a=0.010, b=0.001)      # a step of 8: 18 ms decoding, 26 ms at k = 1, 50 ms at k = 4


def step_s(costs: StubCosts, batch, ks) -> float:
    return costs.verify_s([k + 1 for k in ks], [r.context for r in batch]) + costs.draft_s(max(ks))


def test_a_budget_cuts_the_deepest_positions_until_the_step_fits():
    batch = [request(0.9, 500) for _ in range(8)]
    assert DraftPolicy(K, adaptive=True, costs=ROWS_COST).choose(batch) == [K] * 8       # 50 ms: the best rate
    policy = DraftPolicy(K, adaptive=True, costs=ROWS_COST, step_budget_s=0.035)
    assert policy.choose(batch) == [2] * 8               # k = 3 is 42 ms, k = 2 is 34 ms
    assert policy.budget_cuts == 1
    assert DraftPolicy(K, adaptive=True, costs=ROWS_COST, step_budget_s=0.05).choose(batch) == [K] * 8


def test_where_not_even_a_decode_step_fits_the_best_rate_stands():
    batch = [request(0.9, 500) for _ in range(8)]
    policy = DraftPolicy(K, adaptive=True, costs=ROWS_COST, step_budget_s=0.015)   # decoding alone is 18 ms
    assert policy.choose(batch) == [K] * 8 and policy.budget_cuts == 0


def test_a_pinned_k_is_kept_under_a_budget():
    batch = [request(0.9, 500, k=3, pinned=True)] + [request(0.9, 500) for _ in range(7)]
    policy = DraftPolicy(K, adaptive=True, costs=ROWS_COST, step_budget_s=0.035)
    ks = policy.choose(batch)
    assert ks[0] == 3 and step_s(ROWS_COST, batch, ks) <= 0.035 and max(ks[1:]) < K


def test_a_budgeted_choice_fits_or_is_the_unbudgeted_one_and_never_drafts_deeper():
    """Random batches (lengths, acceptance, pinned ks) and costs: with a budget each request
    drafts at most what it drafts without, and the step fits the budget whenever decoding
    (the pinned requests at their k) fits it."""
    rng = random.Random(46)
    cut = 0
    for _ in range(300):
        costs = StubCosts(a=rng.uniform(0.001, 0.02), b=rng.uniform(0, 0.004), c=rng.uniform(0, 0.0005),
                          d=rng.uniform(0, 0.003))
        batch = [request(rng.uniform(0.2, 0.95), rng.choice((128, 500, 8000, 25_000)),
                         pinned=rng.random() < 0.1, k=rng.randint(1, K)) for _ in range(rng.randint(1, 12))]
        budget = rng.uniform(0.005, 0.12)
        free = DraftPolicy(K, adaptive=True, costs=costs).choose(batch)
        policy = DraftPolicy(K, adaptive=True, costs=costs, step_budget_s=budget)
        ks = policy.choose(batch)
        assert all(k <= f for k, f in zip(ks, free))
        decoding = [r.k if r.pinned_k else 0 for r in batch]
        if step_s(costs, batch, decoding) <= budget:
            assert step_s(costs, batch, ks) <= budget + 1e-12
        else:
            assert ks == free
        cut += ks != free
    assert cut > 15          # the budget bound in a fair share of the cases (23 of 300)


def test_the_budget_is_validated_and_reaches_the_policy_and_output_stays_the_targets(qwen_target, small_video):
    with pytest.raises(InvalidRequest):
        EngineConfig(step_budget_s=0.0)
    draft = tiny_draft(qwen_target, seed=3)
    spec = SpecConfig(num_draft_tokens=K, window=8, anchors=16)
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = Engine(qwen_target, spec=SpecConfig(method="none")).generate(small_video, "What happens?", sampling)
    # a step 10 ms and 1 ms a row: a 12 ms budget allows one draft token a step, where the first steps would draft more
    engine = Engine(qwen_target, draft, spec, config=EngineConfig(step_budget_s=0.012),
                    step_costs=StubCosts(a=0.010, b=0.001))
    assert engine.scheduler.policy.step_budget_s == 0.012
    out = engine.generate(small_video, "What happens?", sampling)
    assert out.token_ids == plain.token_ids
    assert 0 < out.metrics.draft_tokens <= out.metrics.steps and engine.scheduler.policy.budget_cuts > 0
