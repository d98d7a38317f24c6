"""The default draft policy: each request's k from what a step costs and what its draft earns.
Stub cost models fix the costs (drafting always pays / never pays / pays for some requests of a
batch only), so each test says which k the policy must pick; the measured model is checked
against known costs; and through the engine, a cost model that says drafting never pays makes
the default engine decode without a single draft while its output stays the target's."""

from types import SimpleNamespace

import numpy as np
import pytest

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.draft_policy import DraftPolicy, TreeTrim
from sparrow.step_costs import CostModel, MeasuredCosts
from sparrow.tiny import tiny_draft

K = 4


class StubCosts(CostModel):
    """verify = a + sum over rows of (b + c * ctx / 1000); draft = d * depth (x the drafting
    requests ** batch_power). Always ready, never asks for a sample, records what it is told."""

    def __init__(self, a=0.0, b=0.0, c=0.0, d=0.0, batch_power=0.0):
        self.a, self.b, self.c, self.d, self.batch_power = a, b, c, d, batch_power
        self.recorded = []

    def ready(self, contexts=None):
        return True

    def knows_jump(self, contexts):
        return True

    def wants_sample(self, step, contexts=None):
        return False

    def verify_s(self, rows, contexts, doubt=0.0):
        return self.a + sum(r * (self.b + self.c * x / 1000) for r, x in zip(rows, contexts))

    def draft_s(self, depth, requests=1, contexts=None):
        return self.d * depth * requests ** self.batch_power

    def record(self, rows, contexts, verify_s, depth, draft_s):
        self.recorded.append((list(rows), list(contexts), depth))


def request(alpha: float, context: int, k: int = K, pinned: bool = False, remaining: int = 100):
    """What the policy reads of a request (sparrow.request.Request has these)."""
    return SimpleNamespace(k=k, pinned_k=pinned, draft_state=object(), context=context,
                           accepted=round(alpha * 10_000), rejected=round((1 - alpha) * 10_000),   # its own record
                           drafted=10_000, idle=0, backoff=0,
                           output=SimpleNamespace(remaining=remaining), sampling=SimpleNamespace(greedy=True))


ALWAYS = StubCosts(a=0.010)                      # rows cost nothing, the draft nothing: draft all
NEVER = StubCosts(a=0.001, b=0.010, d=0.005)     # every row as dear as a step, the draft dear too
BY_LENGTH = StubCosts(a=0.002, b=0.0001, c=0.00002, d=0.0002)  # a row's attention is what costs


def test_drafting_that_always_pays_drafts_to_the_cap():
    policy = DraftPolicy(K, adaptive=True, costs=ALWAYS)
    batch = [request(0.3, 500), request(0.9, 25_000), request(0.6, 8_000, remaining=3)]
    assert policy.choose(batch) == [K, K, 2]        # the last may emit 2 more tokens at most


def test_drafting_that_never_pays_is_off_for_every_request():
    policy = DraftPolicy(K, adaptive=True, costs=NEVER)
    assert policy.choose([request(0.95, 500), request(0.6, 25_000)]) == [0, 0]


def test_each_request_drafts_what_pays_for_it():
    """One batch, one cost model: a well-predicted request on a short video drafts deep; a
    failing draft on a 25k-token video, whose rows read 25k keys each, does not draft; a good
    draft on a 25k-token video drafts, but less deep than on the short one."""
    policy = DraftPolicy(K, adaptive=True, costs=BY_LENGTH)
    ks = policy.choose([request(0.9, 500), request(0.1, 25_000), request(0.9, 25_000)])
    assert ks[0] == K and ks[1] == 0 and 0 < ks[2] < K


def test_a_draft_that_pays_for_one_request_may_not_for_eight():
    """The draft's levels run for the whole batch in one call, but a call for eight requests
    costs more than for one (measured at 0.5k, k = 4: ~1.2 ms against ~2.8 ms). A so-so draft
    (alpha 0.6, text past an answer's end) drafts alone and not in a batch of eight whose draft
    cost grows with it; priced as one request's, the eight would draft."""
    grows = StubCosts(a=0.007, b=0.0001, d=0.0005, batch_power=1.0)
    flat = StubCosts(a=0.007, b=0.0001, d=0.0005)
    assert DraftPolicy(K, adaptive=True, costs=grows).choose([request(0.6, 500)])[0] > 0
    assert DraftPolicy(K, adaptive=True, costs=grows).choose([request(0.6, 500)] * 8) == [0] * 8
    assert min(DraftPolicy(K, adaptive=True, costs=flat).choose([request(0.6, 500)] * 8)) > 0


def test_measured_draft_costs_grow_with_the_requests_drafting():
    """d0 + d1 * depth + d2 * depth * (requests - 1), fitted; a step's drafting requests are
    those with draft rows. Until a step with several is measured, the batch term is 0."""
    costs, alone = MeasuredCosts(), MeasuredCosts()
    for _ in range(3):
        for depth in (1, 2, 4):
            for n in (1, 3, 8):
                rows = [depth + 1] * n + [1]                 # n drafting requests and one plain one
                costs.record(rows, [500] * (n + 1), 0.01, depth, 0.0005 + 0.0003 * depth + 0.0002 * depth * (n - 1))
            alone.record([depth + 1], [500], 0.01, depth, 0.0005 + 0.0003 * depth)
    assert costs.draft_s(4, 8) == pytest.approx(0.0005 + 0.0012 + 0.0056, rel=1e-6)
    assert costs.draft_s(4) == pytest.approx(0.0017, rel=1e-6) and costs.draft_s(4, 0) == 0.0
    assert alone.draft_s(4, 8) == pytest.approx(alone.draft_s(4), rel=1e-6) == pytest.approx(0.0017, rel=1e-6)


def test_a_draft_whose_cost_grows_with_the_context_is_priced_at_the_steps_length():
    """An EAGLE-style draft reads the whole context: 4 levels cost ~1 ms at 0.5k and ~6 ms at 16k.
    Fitted over all lengths alike, the 16k steps priced a 0.5k one ~3x too dear and the engine
    stopped drafting at 0.5k where it paid (0.95x plain against fixed k's 1.56x). Fitted near
    the step's length, each is priced as measured; a bounded draft (the same cost everywhere)
    is priced the same everywhere."""
    by_length, bounded = MeasuredCosts(), MeasuredCosts()
    for _ in range(6):
        for ctx in (500, 16_000):
            for depth in (2, 4):
                per_level = 0.00025 if ctx == 500 else 0.0015
                by_length.record([depth + 1], [ctx], 0.01, depth, per_level * depth)
                bounded.record([depth + 1], [ctx], 0.01, depth, 0.0003 * depth)
    assert by_length.draft_s(4, 1, [500]) == pytest.approx(0.001, rel=0.1)
    assert by_length.draft_s(4, 1, [16_000]) == pytest.approx(0.006, rel=0.1)
    assert by_length.draft_s(4, 1, [500]) < by_length.draft_s(4) < by_length.draft_s(4, 1, [16_000])
    for ctx in (500, 4000, 16_000):
        assert bounded.draft_s(4, 1, [ctx]) == pytest.approx(0.0012, rel=1e-6)


def test_a_draft_dear_only_at_long_lengths_still_drafts_at_short_ones():
    """Through the policy: the same draft, acceptance and verify costs at 0.5k and 16k; only the
    draft's cost differs by length. At 0.5k it drafts, at 16k (a draft dearer than what its
    tokens save) it does not."""
    costs = MeasuredCosts()
    for _ in range(8):
        for ctx in (500, 16_000):
            for depth, rows in ((0, 1), (2, 3), (4, 5)):
                verify = 0.004 + 0.0002 * rows + (0.0005 if rows > 1 else 0.0)
                costs.record([rows], [ctx], verify, depth, (0.00025 if ctx == 500 else 0.004) * depth)
    policy = DraftPolicy(K, adaptive=True, costs=costs)
    policy.accepted, policy.rejected = 6.0, 4.0                 # an engine alpha of 0.6
    assert costs.ready([500]) and costs.ready([16_000]) and costs.knows_jump([500]) and costs.knows_jump([16_000])
    assert policy._best([request(0.6, 500)], [K], [0]) != [0]
    assert policy._best([request(0.6, 16_000)], [K], [0]) == [0]


def test_a_draft_that_stops_being_accepted_stops_drafting_within_a_few_steps():
    """Through a caption the draft earns 2-4 tokens a step; past its end (text it never
    learned) none. A request's own record fades (RECENT) and the engine's prior weighs a few
    steps, so rejected steps stop it within ~a dozen, where a lifetime count of its good steps
    kept it drafting for 30 and more (measured at 0.5k: Sparrow 0.75-0.9x plain on such streams)."""
    policy = DraftPolicy(K, adaptive=True, costs=StubCosts(a=0.003, b=0.0002, d=0.0004))   # 0.5k-like
    r = request(0.0, 500)
    r.accepted = r.rejected = r.drafted = 0           # a new request
    for _ in range(6):
        ks = policy.choose([r])
        assert ks[0] > 0
        policy.record([r], [ks[0] + 1], 0.0, ks[0], 0.0, ks, ks)         # every draft accepted
    assert policy.choose([r]) == [K]
    drafted = 0
    while (ks := policy.choose([r]))[0] > 0 and drafted < 30:
        drafted += 1
        policy.record([r], [ks[0] + 1], 0.0, ks[0], 0.0, ks, [0])
    assert drafted <= 15, drafted      # 13: the deeper positions' chances are the engine's (they passed)


def test_a_request_that_stopped_drafting_probes_one_deep_backing_off_while_its_probes_fail():
    """Acceptance comes in runs: a request stopped by a few rejections is not stopped for good.
    After PROBE_AFTER idle steps it drafts one token; a rejected probe doubles the wait, an
    accepted one starts its record afresh and it drafts deep again. Where drafting cannot pay
    at any acceptance it never probes."""
    policy = DraftPolicy(K, adaptive=True, costs=StubCosts(a=0.010, b=0.0025, d=0.0005))    # 25k-like
    for _ in range(50):
        policy.record([request(0.9, 25_000)], [K + 1], 0.02, K, 0.002, [K], [K])          # the engine's draft does well
    r = request(0.0, 25_000)
    r.accepted, r.rejected, r.drafted = 0.1, 3.0, 20             # its own last steps all rejected

    def idle_until_it_drafts(accepted: int) -> tuple[int, int]:
        for idle in range(1000):
            k = policy.choose([r])[0]
            policy.record([r], [k + 1], 0.012, k, 0.0005 * k, [k], [min(k, accepted)])
            if k:
                return idle, k
        raise AssertionError("never drafted again")

    assert idle_until_it_drafts(0) == (DraftPolicy.PROBE_AFTER, 1)          # a probe, one deep, rejected
    assert idle_until_it_drafts(0) == (2 * DraftPolicy.PROBE_AFTER, 1)      # ... so the next waits twice as long
    assert idle_until_it_drafts(1) == (4 * DraftPolicy.PROBE_AFTER, 1)      # accepted: its record starts afresh
    assert policy.choose([r]) == [K]
    for _ in range(20 * DraftPolicy.PROBE_AFTER_MAX):                       # a failing draft: one row a
        k = policy.choose([r])[0]                                           # PROBE_AFTER_MAX steps at most
        policy.record([r], [k + 1], 0.012, k, 0.0005 * k, [k], [0])
    assert r.backoff == DraftPolicy.PROBE_AFTER_MAX
    pinned = request(0.0, 25_000, k=3, pinned=True)                         # an explicit k is never cut to a probe
    pinned.accepted, pinned.rejected, pinned.idle = 0.1, 3.0, 100
    assert policy.choose([pinned]) == [3]
    stopped = request(0.0, 500)
    stopped.accepted, stopped.rejected, stopped.drafted = 0.1, 3.0, 20
    never = DraftPolicy(K, adaptive=True, costs=NEVER)
    for _ in range(4 * DraftPolicy.PROBE_AFTER_MAX):
        assert never.choose([stopped]) == [0]
        never.record([stopped], [1], 0.001, 0, 0.0, [0], [0])


def test_pinned_requests_keep_their_k_and_the_policy_can_be_off():
    batch = [request(0.9, 500, k=3, pinned=True), request(0.3, 500)]
    assert DraftPolicy(K, adaptive=True, costs=NEVER).choose(batch) == [3, 0]
    assert DraftPolicy(K, adaptive=False, costs=NEVER).choose(batch) == [3, K]


def test_measured_costs_recover_a_known_cost_and_stay_nonnegative():
    costs = MeasuredCosts()
    assert not costs.ready() and costs.wants_sample(0)
    rng = np.random.default_rng(0)
    a, b, c = 0.004, 0.0005, 0.0003
    for _ in range(40):
        rows = list(rng.integers(1, 6, size=3))
        ctx = list(rng.integers(100, 25_000, size=3))
        costs.record(rows, ctx, a + b * sum(rows) + c * sum(r * x for r, x in zip(rows, ctx)) / 1000,
                     depth=max(rows) - 1, draft_s=0.001 + 0.0005 * (max(rows) - 1))
    assert costs.ready() and not costs.wants_sample(1) and costs.wants_sample(49)
    assert costs.verify_s([5], [25_000]) == pytest.approx(a + 5 * b + 5 * c * 25, rel=1e-6)
    assert costs.draft_s(4) == pytest.approx(0.003, rel=1e-6) and costs.draft_s(0) == 0.0
    flat = MeasuredCosts()                       # time falls with rows: no negative row cost
    for rows, s in ((1, 0.010), (5, 0.009), (3, 0.0095)) * 2:
        flat.record([rows], [1000], s, 0, 0.0)
    assert flat.verify_s([5], [1000]) >= flat.verify_s([1], [1000]) >= 0


def test_a_requests_marginal_costs_are_the_fits_differences():
    """MeasuredCosts.marginal (what the policy reads for each request every step) is what three
    verify_s calls at 1, 2 and 3 rows give: a row's cost, the jump, a decode step."""
    costs = MeasuredCosts()
    rng = np.random.default_rng(1)
    for _ in range(40):
        rows = list(rng.integers(1, 6, size=2))
        ctx = list(rng.integers(100, 25_000, size=2))
        costs.record(rows, ctx, 0.004 + 0.0005 * sum(rows) + 0.002 * sum(r > 1 for r in rows)
                     + 0.0003 * sum(r * x for r, x in zip(rows, ctx)) / 1000, max(rows) - 1, 0.001)
    for ctx in (36, 520, 8_000, 25_056):
        one, two, three = (costs.verify_s([r], [ctx]) for r in (1, 2, 3))
        assert costs.marginal(ctx) == pytest.approx((three - two, two - one - (three - two), one), rel=1e-9, abs=1e-12)


def test_back_at_a_length_whose_samples_were_evicted_the_steps_there_are_samples_not_outliers():
    """0.5k steps, then a long 25k answer (its samples fill the window; its pairs, fewer, leave
    0.5k's), then 0.5k again: the fit there rests on 25k samples alone (a and e collinear at one
    length) and priced a 0.5k decode step at 1.3 ms where it took 8.5; every real 0.5k step,
    OUTLIER x that, was dropped as a one-off, so the price never moved and the default engine drafted
    nothing on the next short video (world v2 pair, fixed k 2.2x plain there). A step is an
    outlier only against a fit with samples of its own length."""
    def verify(rows: int, ctx: int) -> float:        # a 0.5k decode step 6.6 ms, a 25k one 18.3 ms
        return 0.006 + 0.0003 * rows + 0.0004 * ctx / 1000 + 0.00008 * rows * ctx / 1000 + 0.001 * (rows > 1)

    for seed in range(5):                            # 5% noise a step: the 25k samples alone fit a and e anyhow
        rng = np.random.default_rng(seed)
        costs = MeasuredCosts()
        for i in range(40):
            rows = (5, 3, 1)[i % 3]
            costs.record([rows], [520 + i], verify(rows, 520 + i) * np.exp(rng.normal(0, 0.05)), rows - 1, 0.001)
        for i in range(120):                          # a 25k answer: mostly 5 rows, now and then 3
            rows = 3 if i % 20 == 0 else 5
            costs.record([rows], [25_000 + i], verify(rows, 25_000 + i) * np.exp(rng.normal(0, 0.05)), rows - 1, 0.001)
        assert all(s[4] > 14 for s in costs.verify_samples) and costs.ready([600])      # 0.5k's samples gone
        for i in range(12):                           # decode steps back at 0.5k
            costs.record([1], [600 + i], verify(1, 600 + i) * np.exp(rng.normal(0, 0.05)), 0, 0.0)
        assert costs.marginal(612)[2] == pytest.approx(verify(1, 612), rel=0.3), seed


def test_requests_whose_drafts_cannot_pay_are_left_out_of_the_search(monkeypatch):
    """A request whose draft is worth less than what it costs at the all-decode rate (its rows,
    its jump, one more request's share of the draft step) is decided as k = 0 before the search;
    a batch of such requests is answered without it, and a good one among them still drafts."""
    policy = DraftPolicy(K, adaptive=True, costs=StubCosts(a=0.004, b=0.0001, d=0.0003, batch_power=1.0))
    calls = []
    real = policy._hopeless
    monkeypatch.setattr(policy, "_hopeless", lambda *a: calls.append(real(*a)) or calls[-1])
    assert policy.choose([request(0.05, 500)] * 8) == [0] * 8 and calls[-1] == set(range(8))
    ks = policy.choose([request(0.05, 500)] * 7 + [request(0.95, 500)])
    assert calls[-1] == set(range(7)) and ks[:7] == [0] * 7 and ks[7] > 0


def test_verify_costs_are_fitted_near_the_steps_cached_length_and_one_offs_are_not_samples():
    """Two regimes no single line holds (short caches: rows nearly free; 25k: each row ~1 ms on
    top of a 10 ms step): each length's prediction follows its own samples. A step 5x slower
    than predicted (a draft compile) is no sample."""
    costs = MeasuredCosts()
    for rep in range(3):
        for rows in (1, 5, 3, 2):
            costs.record([rows], [500], 0.003 + 0.0001 * rows, rows - 1, 0.001 * (rows - 1))
        for rows in (1, 5, 3, 2):
            costs.record([rows], [25_000], 0.009 + 0.001 * rows, rows - 1, 0.001 * (rows - 1))
    assert costs.verify_s([5], [25_000]) / costs.verify_s([1], [25_000]) == pytest.approx(14 / 10, rel=0.05)
    assert costs.verify_s([5], [500]) / costs.verify_s([1], [500]) == pytest.approx(3.5 / 3.1, rel=0.05)
    first = MeasuredCosts()                                        # no draft sample yet: the verify bounds it
    first.record([5], [25_000], 0.014, 4, 0.002)                  # cold (first of its depth)
    first.record([5], [25_000], 0.014, 4, 10.0)                   # the sampled level compiling
    assert first.draft_s(4) == 0.0
    before = costs.draft_s(4)
    costs.record([5], [25_000], 0.014, 4, 10.0)                   # compiling the draft: 10 s
    costs.record([5], [25_000], 0.5, 4, 0.004)                    # a pause of the process
    assert costs.draft_s(4) == pytest.approx(before)
    assert costs.verify_s([5], [25_000]) == pytest.approx(0.014, rel=0.05)


def test_until_the_costs_are_known_it_samples_two_depths_in_turn_at_each_length():
    """The first step of each size at each length is a cold one (its cost is not a sample):
    two of each, the deepest and half of it. A much longer video is new ground: what a row
    costs there is sampled again (two steps of each size: its first ones pay one-time costs,
    such as a kernel loading) before the policy trusts the fit (from 1k samples alone a 25k row
    would be priced by the 1k steps' slope; from the cold 25k steps, ~8x too dear). What a
    verify costs over a decode step before its first row (at 25k 10.5 ms against 13.1 for two
    rows) needs a decode step beside a drafting one: a good draft drafts on without it, a
    middling one takes decode steps until it is measured, then drafts by the measured costs."""
    policy = DraftPolicy(K, adaptive=True)
    batch = [request(0.9, 1000)]
    for cold in (10.0, 1.0):
        assert policy.choose(batch) == [K]
        policy.record(batch, [K + 1], 0.022 * cold, K, 0.002 * cold, [K], [K])
        assert policy.choose(batch) == [K // 2]
        policy.record(batch, [K // 2 + 1], 0.017 * cold, K // 2, 0.001 * cold, [K // 2], [K // 2])
    assert policy.costs.ready([1000]) and policy.linear_costs(batch) == pytest.approx((0.012, 0.0025))
    assert policy.costs.draft_s(K) == pytest.approx(0.002) and not policy.costs.knows_jump([1000])
    assert policy.choose(batch) == [K] and policy.jump_probes == 0        # drafting pays whatever the jump
    long = [request(0.9, 25_000)]
    assert not policy.costs.ready([25_000]) and policy.linear_costs(long) is None
    for first in (True, False):                 # measured: 54.5 and 17.7 ms first, then ~14.5 and ~13
        assert policy.choose(long) == [K]
        policy.record(long, [K + 1], 0.0545 if first else 0.0145, K, 0.002, [K], [K])
        assert policy.choose(long) == [K // 2]
        policy.record(long, [K // 2 + 1], 0.0177 if first else 0.013, K // 2, 0.001, [K // 2], [K // 2])
        assert policy.costs.ready([25_000]) is not first
    assert policy.linear_costs(long) == pytest.approx((0.0115, 0.00075), rel=0.05)      # not 1k's 0.0025
    middling = [request(0.45, 25_000)]          # pays at a jump of 0 (10.5 ms a decode step), not at 10 ms
    for seconds in (0.0145, 0.0105):            # a decode step (its first one at 25k is cold), a drafting one
        assert policy.choose(middling) == [0] and not policy.costs.knows_jump([25_000])
        policy.record(middling, [1], seconds, 0, 0.0, [0], [0])
        drafting = policy.choose(middling)
        assert drafting != [0]
        policy.record(middling, [drafting[0] + 1], 0.0125 + 0.00075 * drafting[0], drafting[0], 0.001, drafting, [1])
    assert policy.costs.knows_jump([25_000]) and policy.jump_probes == 2
    assert policy.costs.verify_s([1], [25_000]) == pytest.approx(0.0105, rel=0.05)
    assert policy.costs.verify_s([2], [25_000]) - policy.costs.verify_s([1], [25_000]) == pytest.approx(0.00275, rel=0.1)   # a 2 ms jump and a row


def test_the_jump_is_not_borrowed_from_a_far_length():
    """What drafting costs over a decode step, measured at 25k (2 ms), says nothing of 0.5k, where
    a draft that only ever drafted has not measured it: taken from 25k it priced a 0.5k drafting
    step at more than a decode step's cost, and a middling draft stopped there for good (never
    drafting again, it never measured it). Until measured near its length it is 0, and the policy
    drafts (or takes the decode step that measures it)."""
    costs = MeasuredCosts()
    for rep in range(8):
        for rows in (1, 5, 1, 3):                               # 25k: decode and drafting steps in turn
            costs.record([rows], [25_000], 0.009 + 0.002 * (rows > 1) + 0.001 * rows, rows - 1, 0.0004)
    for rep in range(8):
        for rows in (5, 3):                                     # 0.5k: drafting steps only
            costs.record([rows], [500], 0.0007 + 0.0001 * rows, rows - 1, 0.0003)
    assert costs.knows_jump([25_000]) and not costs.knows_jump([500])
    assert costs.marginal(25_000)[1] == pytest.approx(0.002, rel=0.1)
    assert costs.marginal(500)[1] == 0.0
    policy = DraftPolicy(K, adaptive=True, costs=costs)
    middling = [request(0.74, 500)]
    assert policy.choose(middling) != [0] or policy.choose(middling) != [0]    # drafts, or probes then drafts


def test_a_rows_cost_is_fitted_from_consecutive_steps_so_a_drifting_box_does_not_hide_it():
    """A box whose speed drifts: the small steps came in a slow stretch (+9 ms), the 5-row ones
    in a fast one. Least squares over the raw samples finds rows free (a slope < 0); the
    differences between consecutive steps carry no drift and give what a row costs (0.6 ms) and
    what drafting at all costs over a decode step (2 ms), and a step's fixed cost follows the
    recent samples."""
    def verify(rows, slow, i):
        return 0.010 + 0.002 * (rows > 1) + 0.0006 * (rows - 1) + 0.009 * slow + 0.00003 * (-1) ** i
    costs = MeasuredCosts()
    for rows in (5, 3, 1):                            # cold steps: the first of each size is no sample
        costs.record([rows], [25_000], 0.030, rows - 1, 0.0)
    assert not costs.ready([25_000])
    steps = [(1, 1), (3, 1), (3, 1), (1, 1), (3, 1), (5, 1)] * 2 + [(5, 0), (5, 0), (3, 0), (5, 0), (5, 0), (1, 0)] * 2
    for i, (rows, slow) in enumerate(steps):
        costs.record([rows], [25_000 + i], verify(rows, slow, i), rows - 1, 0.0)
    assert costs.ready([25_000])
    one, two, three = (costs.verify_s([r], [25_000]) for r in (1, 2, 3))
    assert three - two == pytest.approx(0.0006, rel=0.1) and two - one == pytest.approx(0.0026, rel=0.1)
    assert 0.010 <= one < 0.0145                                  # between the stretches (10 and 19), nearer the recent
    data = np.array(costs.verify_samples)
    raw, *_ = np.linalg.lstsq(np.column_stack([np.ones(len(data)), data[:, 0]]), data[:, -1], rcond=None)
    assert raw[1] < 0                                             # what the raw samples say
    spiky = MeasuredCosts()                           # one step 7 ms slow: its two pairs are left out
    for i, (rows, slow) in enumerate([(5, 0), (3, 0), (1, 0)] + [(5, 0), (3, 0), (1, 0)] * 6):
        spiky.record([rows], [25_000 + i], verify(rows, 0, i) + 0.007 * (i == 10), rows - 1, 0.0)
    assert spiky.verify_s([3], [25_000]) - spiky.verify_s([2], [25_000]) == pytest.approx(0.0006, rel=0.1)


def _simulated_stream(policy, rng, alpha, steps, context, decode_s, jump_s, row_s):
    """`steps` steps of one request on a simulated box: a decode step decode_s, a verify step
    jump_s more and row_s a drafted row, the draft 0.3 ms a level; the box's speed drifting
    (x e^N(0, 0.02) a step), each step +-0.4 ms, one in 20 a 6 ms spike; each draft token
    accepted with chance alpha. Its tokens per second over plain decoding's on the same box."""
    r = request(alpha, context)
    r.accepted = r.rejected = r.drafted = 0
    tokens = seconds = plain = 0.0
    speed = 1.0
    for _ in range(steps):
        k = policy.choose([r])[0]
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        speed *= np.exp(rng.normal(0.0, 0.02))
        spike = 0.006 * (rng.random() < 0.05)
        verify_s = speed * (decode_s + (jump_s + row_s * k if k else 0.0)) + rng.normal(0.0, 0.0004) + spike
        policy.record([r], [k + 1], verify_s, k, 0.0003 * k, [k], [accepted])
        tokens, seconds, plain = tokens + accepted + 1, seconds + verify_s + 0.0003 * k, plain + speed * decode_s + spike
        r.context += accepted + 1
    return tokens / seconds * plain / steps


def test_a_failing_draft_after_good_ones_is_no_slower_than_plain_on_a_noisy_box():
    """The measured case, simulated (at 25k a decode step 10.5 ms, a verify 2 ms more and 0.6 ms
    a row): three good 0.5k videos, four good 25k ones, then 25k videos whose drafts fail (0.05
    a token, as on the real one: 8 of 108 accepted) or mostly fail (0.3). The engine's record
    promises long runs of accepted drafts, and a 25k row's cost rests on a few noisy steps; with
    the cost fitted on raw samples and the engine's record as a fixed prior, such a video ran at
    0.66-0.82x plain. Now the failing videos stay within ~5% of plain and the good ones draft."""
    runs = {0.05: [], 0.3: [], 0.85: []}
    for seed in range(6):
        for alpha in (0.05, 0.3):
            rng = np.random.default_rng(seed)
            policy = DraftPolicy(K, adaptive=True)
            for _ in range(3):
                _simulated_stream(policy, rng, 0.85, 20, 500, 0.003, 0.0003, 0.0004)
            runs[0.85] += [_simulated_stream(policy, rng, 0.85, 20, 25_000, 0.0105, 0.002, 0.0006) for _ in range(4)]
            runs[alpha].append(_simulated_stream(policy, rng, alpha, 40, 25_000, 0.0105, 0.002, 0.0006))
    assert min(runs[0.05]) >= 0.9 and np.median(runs[0.05]) >= 0.93, runs[0.05]
    assert min(runs[0.3]) >= 0.9 and np.median(runs[0.3]) >= 0.93, runs[0.3]
    assert np.median(runs[0.85]) >= 2.0, runs[0.85]


def test_a_requests_acceptance_starts_from_the_engines():
    """One bad first step does not stop a request whose engine's draft does well; on an engine
    whose draft keeps failing a new request probes once (the engine's record is other
    requests'), and after its own probe fails it expects little and stops drafting."""
    good, bad = DraftPolicy(K, adaptive=True, costs=ALWAYS), DraftPolicy(K, adaptive=True, costs=ALWAYS)
    for _ in range(50):
        good.record([request(0.9, 500)], [K + 1], 0.01, K, 0.001, [K], [K])
        bad.record([request(0.9, 500)], [K + 1], 0.01, K, 0.001, [K], [0])
    unlucky = SimpleNamespace(accepted=0, rejected=1, drafted=1, idle=0, backoff=0)
    assert good.alpha(unlucky) > 0.6 and bad.alpha(unlucky) < 0.1
    assert bad.engine_alpha < 0.1 and bad.alpha(SimpleNamespace(accepted=0, rejected=0, drafted=0, idle=0, backoff=0)) == pytest.approx(2 / 3)
    # where a row is dear (25k on a CPU), the failing engine's record alone would keep a new request
    # plain; its probe drafts, its failure stops it, its success keeps it drafting
    costs = StubCosts(a=0.010, b=0.0025, d=0.0005)
    policy = DraftPolicy(K, adaptive=True, costs=costs)
    for _ in range(50):
        policy.record([request(0.9, 25_000)], [K + 1], 0.02, K, 0.002, [K], [0])
    new = SimpleNamespace(**{**vars(request(0.5, 25_000)), "accepted": 0, "rejected": 0, "drafted": 0})
    assert policy.choose([new]) != [0]
    failed = SimpleNamespace(**{**vars(new), "rejected": 1, "drafted": 1})
    held = SimpleNamespace(**{**vars(new), "accepted": 4, "drafted": 1})
    assert policy.choose([failed]) == [0] and policy.choose([held]) != [0]
    proven = SimpleNamespace(**{**vars(new), "accepted": 40, "rejected": 2, "drafted": 12})     # its own record outweighs
    assert policy.choose([proven])[0] >= K - 1


def test_tree_trim_reads_the_policys_costs():
    """With a row as dear as the step, a greedy tree is cut to nothing; free rows keep it whole."""
    import torch

    from sparrow.speculative.tree import DraftTree
    tree = DraftTree(torch.arange(6), scores=torch.log(torch.tensor([0.9, 0.8, 0.5, 0.3, 0.2, 0.1])))
    batch = [request(0.9, 1000)]
    trim = TreeTrim()
    trim.cut(batch, [tree], None)                  # its first step explores
    dear = trim.cut(batch, [tree], DraftPolicy(K, True, StubCosts(a=0.01, b=0.1)).linear_costs(batch))
    free = trim.cut(batch, [tree], DraftPolicy(K, True, StubCosts(a=0.01)).linear_costs(batch))
    assert dear == [None] and free[0].size == 6


def test_the_default_engine_never_drafts_where_drafting_cannot_pay(qwen_target, small_video):
    """Adaptive k is the default; told that drafting never pays, the engine decodes plainly
    (greedy output the target's); told it always pays, it drafts every step."""
    draft = tiny_draft(qwen_target, seed=3)
    spec = SpecConfig(num_draft_tokens=K, window=8, anchors=16)
    assert spec.adaptive_k
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = Engine(qwen_target, spec=SpecConfig(method="none")).generate(small_video, "What happens?", sampling)
    never = Engine(qwen_target, draft, spec, step_costs=StubCosts(a=0.001, b=0.01, d=0.01))
    out = never.generate(small_video, "What happens?", sampling)
    assert out.token_ids == plain.token_ids and out.metrics.draft_tokens == 0 and out.metrics.steps == 23
    always = Engine(qwen_target, draft, spec, step_costs=StubCosts(a=0.01))
    out = always.generate(small_video, "What happens?", sampling)
    assert out.token_ids == plain.token_ids
    assert out.metrics.draft_tokens >= K * (out.metrics.steps - K)   # all but the last steps draft k


def test_acceptance_that_comes_in_runs_is_valued_as_measured():
    """Steps whose first draft is a coin flip but whose later drafts almost always follow an
    accepted one (as at 25k): the tokens the policy expects at each k are what such steps
    emitted, where one per-token rate (the engine's, 0.75 here) would promise 1.75 at k = 1
    and so misjudge which k pays."""
    costs = StubCosts(a=0.010, b=0.0025, d=0.0005)
    policy = DraftPolicy(K, adaptive=True, costs=costs)
    outcomes = [0, K, 0, K, 0, K, 0, K - 1]                  # accepted drafts of 8 steps at k = K
    for step in range(400):
        policy.record([request(0.5, 25_000)], [K + 1], 0.02, K, 0.002, [K], [outcomes[step % 8]])
    fresh = SimpleNamespace(**{**vars(request(0.5, 25_000)), "accepted": 0, "rejected": 0, "drafted": 0})
    emitted = [1 + sum(min(n, k) for n in outcomes) / len(outcomes) for k in range(K + 1)]
    assert policy.engine_alpha == pytest.approx(0.75, abs=0.01)
    assert policy.expected_tokens(fresh) == pytest.approx(emitted, abs=0.05)
    assert policy.choose([fresh]) == [K]                 # 2.9 tokens for 2.45 steps' cost beats 1.5 for 1.55


class VersionedCosts(StubCosts):
    """StubCosts with a version (MeasuredCosts bumps its own at each refit)."""

    version = 0


def test_a_choice_at_every_cap_is_kept_while_its_drafts_are_accepted_and_the_fit_stands():
    """The search and the fits it reads were ~0.5 ms of a ~7 ms 0.5k step (world pair, one
    stream). A search that put every request at its cap is kept for the next step when that
    step accepted every draft (each alpha rose, which makes deeper drafts worth more) and the
    cost model is the same (its version); a rejection, a refit or another batch searches again.
    Kept or searched, the ks are what the search says."""
    costs = VersionedCosts(a=0.003, b=0.0002, d=0.0004)
    policy = DraftPolicy(K, adaptive=True, costs=costs)
    batch = [request(0.9, 500), request(0.8, 500)]

    def step(rejects: int = 0) -> int:
        """One step, the last request's last draft rejected `rejects` times; the kept steps so far."""
        ks = policy.choose(batch)
        assert ks == policy._best(batch, [K] * len(batch), list(range(len(batch)))) == [K] * len(batch)
        policy.record(batch, [k + 1 for k in ks], 0.0, max(ks), 0.0, ks, ks[:-1] + [ks[-1] - rejects])
        return policy.kept_steps

    assert [step(), step(), step()] == [0, 1, 2]
    assert [step(rejects=1), step(), step()] == [3, 3, 4]      # searched after the rejection
    costs.version += 1
    assert [step(), step()] == [4, 5]                          # searched after the refit
    batch[1] = request(0.8, 500)                               # another request in the batch
    assert [step(), step()] == [5, 6]
    batch.append(request(0.9, 500, remaining=3))               # a cap below K: never all at K
    ks = policy.choose(batch)
    assert ks[-1] == 2 and policy.kept_steps == 6


def test_a_cost_model_without_a_version_is_asked_every_step():
    policy = DraftPolicy(K, adaptive=True, costs=StubCosts(a=0.003, b=0.0002, d=0.0004))
    batch = [request(0.9, 500)]
    for _ in range(4):
        ks = policy.choose(batch)
        policy.record(batch, [k + 1 for k in ks], 0.0, max(ks), 0.0, ks, ks)
    assert ks == [K] and policy.kept_steps == 0


def test_a_policy_whose_costs_nobody_reads_does_not_measure_them(qwen_target, small_video):
    """A fixed k with chains reads no cost (the adaptive k and the tree cut do): its steps do
    not feed the model, whose refits were ~0.2 ms of a 0.5k step; the adaptive engine's do.
    Either way a request's metrics hold its steps' time in the policy (policy_seconds)."""
    draft = tiny_draft(qwen_target, seed=3)
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    recorded = {}
    for adaptive in (False, True):
        costs = StubCosts(a=0.01)
        spec = SpecConfig(num_draft_tokens=K, window=8, anchors=16, adaptive_k=adaptive)
        out = Engine(qwen_target, draft, spec, step_costs=costs).generate(small_video, "What happens?", sampling)
        assert out.metrics.draft_tokens > 0
        assert 0 < out.metrics.policy_seconds < out.metrics.decode_seconds      # the policy's time, timed
        recorded[adaptive] = len(costs.recorded)
    assert recorded == {False: 0, True: recorded[True]} and recorded[True] > 0


def test_the_closed_form_nonnegative_fit_equals_the_svd_one():
    """step_costs fits by the normal equations in closed form (1-3 columns; numpy's least
    squares where they are near singular): on random problems, columns of very different scales
    and near-collinear ones (a row's cost and its attention at one length), the coefficients are
    those of the same active set solved by SVD."""
    from sparrow.step_costs import _nonnegative_lstsq

    def reference(x, y):
        active, coef = list(range(x.shape[1])), np.zeros(x.shape[1])
        while active:
            sol = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
            if (sol >= 0).all():
                coef[active] = sol
                return coef
            active.pop(int(np.argmin(sol)))
        return coef

    rng = np.random.default_rng(7)
    for _ in range(3000):
        n = int(rng.integers(1, 4))
        x = rng.random((int(rng.integers(n, 64)), n)) * rng.choice([1e-3, 1.0, 30.0], n)
        if n > 1 and rng.random() < 0.3:
            x[:, -1] = 25 * x[:, 0] + 1e-4 * rng.random(len(x))         # near collinear
        y = 0.01 * rng.normal(size=len(x)) + 0.001 * x @ rng.normal(size=n)
        want = reference(x, y)
        np.testing.assert_allclose(_nonnegative_lstsq(x, y), want, rtol=0, atol=1e-9 * max(1e-12, np.abs(want).max()))
