"""How much to draft: k per request per step (DraftPolicy) and which tree nodes are worth
verifying (TreeTrim), both from costs measured on this machine and this batch."""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import time

from .request import Request
from .step_costs import CostModel, MeasuredCosts


def _timed(method):
    """A policy method whose time goes to its object's `seconds`, which `lap` reads and
    resets: each request's metrics.policy_seconds (the scheduler adds each step's lap)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
    return timed


class _Laps:
    """The time in the policy's methods since the last lap."""

    seconds = 0.0

    def lap(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class DraftPolicy(_Laps):
    """k per request per step, from what a step costs on this machine (a CostModel, step_costs.py:
    fitted online by default) and each request's per-token acceptance alpha, estimated from its
    accepted and rejected draft tokens. A request drafting k tokens is expected to emit what such
    steps emitted (expected_tokens: the engine's measured chance of each draft position given the
    one before, the request's alpha as the prior and for the first position); the step's time is its
    verify (every request's rows, each over its own cached length) plus the draft's (by depth; none
    when nobody drafts). A request's alpha starts from the engine's (all its requests' acceptance so
    far, decayed), worth PRIOR_WEIGHT of its own draft steps, so one unlucky first step neither
    stops a good draft nor a failing draft's record keeps a new request drafting. (At weight 3 with
    lifetime counts one rejection on a 25k video once stopped a request for good; that was with 25k
    rows priced ~8x too dear by cold samples, step_costs.py. Priced right, a 25k row is ~0.1 of a
    step and drafting pays down to an alpha of ~0.3; at 0.5k, where a drafting step costs ~1.7 plain
    ones, down to ~0.5.) A request with no record of its own is valued at least PROBE_ALPHA: the
    engine's record is other requests' (other videos, other prompts, text past an end of turn), and
    below it a new request would never draft and so never show that its own draft does well (one
    probing step at most: after it, its own record speaks). A request's own record fades by RECENT a
    drafting step: what its draft earns changes within an answer (measured at 0.5k: 2-4 tokens a
    step through a caption, then none past its end), and on a lifetime count a run of good steps
    kept a failing draft drafting 4 deep for 20-30 steps, each a rejected verify and a draft call
    (Sparrow 0.75-0.9x plain on such streams). The policy picks the ks that maximise the batch's
    expected tokens per second: for each common depth K it lowers each request's k, one at a time,
    wherever that raises the rate (a request whose draft fails, or whose rows are dear at its
    length, drafts less or not at all), and keeps the best. So drafting stops where it cannot pay: a
    failing draft, a big batch, a slow verify.

    While the cost model cannot yet tell a row's cost from the step's at the batch's cached
    length (a long video after short ones is new ground), and now and then after (the model
    asks: `wants_sample`), a step drafts a depth chosen to teach it: the deepest and half of it
    in turn at first, then each depth in turn. A request's price for drafting k is k rows plus,
    once (k > 0), what a verify step costs over a decode step (at 25k on this CPU ~2 ms before
    its first row, step_costs.py). Until that jump is measured at the length, the choice is
    made again with drafting priced a whole decode step dearer: where that changes it (a draft
    of middling acceptance), every other step is a decode step, which measures the jump beside
    the drafting one before it (`jump_probes`); a good draft is not held up by it (measured: a
    plain step in each new length's exploration cost the first 25k video ~1.5 of its ~5 steps'
    tokens). Requests whose k is pinned (an explicit k) always get their own k.

    The engine's acceptance weighs as PRIOR_WEIGHT of a request's own events at first and less
    as the request's own drafting steps come in (PRIOR_STEPS): at a fixed weight, against a
    request's own record that fades by RECENT, a request whose every draft failed for 28 steps
    still expected ~0.4 a token from its engine's four good videos before, and drafted 3-4 deep
    (0.66-0.82x plain on that 25k video).

    A request that stopped drafting tries again: its own record changes only on its drafting
    steps, so a short run of rejections (acceptance comes in runs: at 25k a narration's hard
    stretch, then easy text again) once stopped a request for 18-50 steps, until the cost model's
    next sample drafted it again, where its drafts were mostly at once accepted (world v2 pair,
    two 25k videos at T = 0: 139 of 291 steps decoded; fixed k drafted them at tau 3.2). So a request
    PROBE_AFTER steps idle is valued again as one with no record of its own (the engine's
    acceptance, at least PROBE_ALPHA) for a step, at most one draft deep (the cheapest question):
    the search drafts it where that pays at such an acceptance (never where drafting cannot pay at
    all). An accepted probe starts the request's own record afresh from it; a rejected one doubles
    the wait (up to PROBE_AFTER_MAX), so a draft that has stopped paying for good costs one row
    every PROBE_AFTER_MAX steps.

    A search that put every request at its cap is kept for the next step when that step
    accepted every draft and the cost model is unchanged (its `version`: MeasuredCosts redoes
    its fits together, one step in REFIT_EVERY): more accepted drafts raise each alpha, which
    makes deeper drafts worth more, so the search would answer the same. A rejection, a refit,
    a cap that falls or another batch searches again. Measured on the world pair at 0.5k, one
    stream (16 fresh videos, the same for both): the search and the fits it reads took 0.36 ms
    a step (of ~5.5), 0.16 ms with 43 of 73 steps kept.
    """

    PRIOR_WEIGHT = 3.0         # the engine's acceptance counts as this many of a request's own events ...
    PRIOR_STEPS = 4.0          # ... at first: after this many drafting steps of its own, half as many
    PROBE_ALPHA = 2 / 3        # what a request with no record of its own is worth at least
    DECAY = 0.99               # per drafting step, on the engine's acceptance counts
    RECENT = 0.7               # per drafting step, on a request's own (a memory of ~3 steps)
    PROBE_AFTER = 12           # idle steps after which a request that stopped drafting is valued afresh ...
    PROBE_AFTER_MAX = 64       # ... doubled after each probe that fails, up to this

    def __init__(self, k_max: int, adaptive: bool, costs: CostModel | None = None, measure: bool = True):
        self.k_max, self.adaptive = k_max, adaptive
        # whether steps feed the cost model: not when nothing reads it (a fixed k, chains), where
        # its refits were ~0.2 ms of a 0.5k step
        self.measure = measure
        self.costs: CostModel = costs if costs is not None else MeasuredCosts()
        self._steps = itertools.count()
        self._samples = itertools.count()
        self.jump_probes = 0               # decode steps taken to measure the jump (step_costs.knows_jump)
        self._probe_turns = itertools.count()
        self.accepted, self.rejected = 2.0, 1.0       # the engine's, decayed (a weak prior of 2/3)
        # Per draft position j: steps that reached it (every earlier draft accepted) and that
        # accepted it, decayed; their ratio is the chance of j given j - 1 (expected_tokens).
        self.reached, self.passed = [0.0] * k_max, [0.0] * k_max
        # A search that put every request at its cap, kept while it stands (choose): the ks, then,
        # once its step accepted every draft, the batch, those ks and the cost model's version.
        self._chosen: tuple[int, ...] | None = None
        self._kept: tuple | None = None
        self.kept_steps = 0                # steps that kept the last search's ks (for operators and tests)

    @property
    def engine_alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def alpha(self, request: Request) -> float:
        """Per-token acceptance: accepted / (accepted + rejections), the engine's as a prior;
        with no record of its own, at least PROBE_ALPHA."""
        w = self.PRIOR_WEIGHT * self.PRIOR_STEPS / (self.PRIOR_STEPS + request.drafted)
        if request.accepted + request.rejected == 0 or self._due(request):
            return max(self.engine_alpha, self.PROBE_ALPHA)
        return (request.accepted + w * self.engine_alpha) / (request.accepted + request.rejected + w)

    def _due(self, request: Request) -> bool:
        """Whether a request whose k adapts, with a record of its own, has been idle long enough
        to be valued afresh (a pinned k or a fixed policy never probes)."""
        return (request.idle >= (request.backoff or self.PROBE_AFTER) and request.accepted + request.rejected > 0
                and self.adaptive and not request.pinned_k)

    def expected_tokens(self, request: Request) -> list[float]:
        """Tokens one step is expected to emit for this request at k = 0 .. k_max. Acceptance
        is not one coin per token: a draft that got the first tokens right tends to get the
        next ones (measured at 25k: 0.54, then 0.74, 0.78, 0.80 given the one before). Each
        position's chance given the one before is the engine's measured one, with the
        request's alpha as a prior worth PRIOR_WEIGHT steps (no evidence yet: one coin per
        token); the first position's is the request's alpha scaled by how the engine's first
        drafts fared against what its per-token rate predicts (passed / (reached x engine
        alpha), with PRIOR_WEIGHT steps of 1:1 as a prior: a failing engine's 0 / 0 is no
        evidence that a request's own good record overstates its first draft). A later
        position's chance is lowered by the request's alpha over the engine's where that is
        below 1: the engine's chances come from ~100 steps (DECAY), mostly other videos', and a
        request whose draft fails on its video rarely reaches a later position to correct them
        (simulated: after four good 25k videos, one at an alpha of 0.3 kept drafting 4 deep)."""
        alpha, engine, w = self.alpha(request), self.engine_alpha, self.PRIOR_WEIGHT
        out, reach = [1.0], 1.0
        for j, (reached, passed) in enumerate(zip(self.reached, self.passed)):
            if j == 0:      # first drafts passed against what the per-token rate predicts, w of 1:1 as a prior
                chance = alpha * (passed + w) / (reached * engine + w)
            else:           # the engine's chance, lowered as far as this request's draft fares below the engine's
                chance = (passed + w * alpha) / (reached + w) * min(1.0, alpha / engine)
            reach *= min(0.999, chance)
            out.append(out[-1] + reach)
        return out

    @_timed
    def choose(self, batch: list[Request]) -> list[int]:
        caps = [min(1 if self._due(r) else r.k, max(0, r.output.remaining - 1)) if r.draft_state is not None else 0
                for r in batch]
        free = [i for i, r in enumerate(batch) if not r.pinned_k and caps[i] > 0]
        if not self.adaptive or not free:
            return caps
        ctx = [r.context for r in batch]
        if self.costs.wants_sample(next(self._steps), ctx):
            n = next(self._samples)
            # new ground: two drafting depths in turn (both emit tokens)
            k = (self.k_max if n % 2 == 0 else self.k_max // 2) if not self.costs.ready(ctx) else n % (self.k_max + 1)
            return [min(c, k) if i in free else c for i, c in enumerate(caps)]
        version = self.costs.version
        if version is not None and self._kept == (_batch_key(batch), tuple(caps), version):
            self.kept_steps += 1
            self._chosen = self._kept[1]
            return caps
        self._chosen = None
        ks = self._best(batch, caps, free)
        if any(ks[i] for i in free) and not self.costs.knows_jump(ctx) and self._best(batch, caps, free, True) != ks:
            # the unknown jump could change the choice: decode steps between drafting ones measure it
            if next(self._probe_turns) % 2 == 0:
                self.jump_probes += 1
                return [0 if i in free else c for i, c in enumerate(caps)]
        if version is not None and ks == caps:
            self._chosen = tuple(caps)
        return ks

    def _best(self, batch: list[Request], caps: list[int], free: list[int], dear_jump: bool = False) -> list[int]:
        """The ks of the best expected rate; dear_jump: drafting priced at least a decode step more."""
        ctx = [r.context for r in batch]
        gain = [self.expected_tokens(r) for r in batch]          # tokens by k, per request
        # at each request's own length: a drafted row's cost, and drafting's at all (a verify over a
        # decode step); requests at one length share the three calls
        by_length: dict[int, tuple[float, float, float]] = {}
        prices: dict[int, tuple[float, float, float]] = {}        # request -> (row, jump, the fitted jump)
        for i in free:
            if ctx[i] not in by_length:
                row, jump, one = self.costs.marginal(ctx[i])
                by_length[ctx[i]] = (row, max(jump, one) if dear_jump else jump, jump)
            prices[i] = by_length[ctx[i]]
        draft = {}                                                # (depth, drafting requests) -> seconds

        def draft_s(depth: int, drafting: int) -> float:
            if (depth, drafting) not in draft:
                draft[depth, drafting] = self.costs.draft_s(depth, drafting, ctx)
            return draft[depth, drafting]

        if len(free) == len(batch):
            hopeless = self._hopeless(batch, caps, gain, prices, draft_s)
            if hopeless:
                caps = [0 if i in hopeless else c for i, c in enumerate(caps)]
                free = [i for i in free if i not in hopeless]
                if not free:
                    return caps

        best, best_rate = None, -1.0
        for depth in range(self.k_max + 1):
            ks = [min(c, depth) if i in free else c for i, c in enumerate(caps)]
            deepest, drafting = max(ks), sum(k > 0 for k in ks)
            tokens = sum(g[k] if k < len(g) else _expected_tokens(self.alpha(r), k)     # a pinned k past k_max
                         for g, k, r in zip(gain, ks, batch))
            verify_s = self.costs.verify_s([k + 1 for k in ks], ctx) + sum(
                prices[i][1] - prices[i][2] for i in free if ks[i] > 0)          # a dear jump over the fitted one
            for i in free:           # each request's own k, the others held; a request that stops drafting
                row, jump, _ = prices[i]                               # spares the step its rows and the draft
                base_t, base_s = tokens - gain[i][ks[i]], verify_s - row * ks[i] - jump * (ks[i] > 0)
                others = drafting - (ks[i] > 0)
                plain, drafts = base_s + draft_s(deepest, others), base_s + jump + draft_s(deepest, others + 1)
                g = gain[i]
                rates = [(base_t + g[k]) / max(drafts + row * k if k else plain, 1e-12) for k in range(ks[i] + 1)]
                ks[i] = rates.index(max(rates))
                tokens, verify_s = base_t + gain[i][ks[i]], base_s + row * ks[i] + jump * (ks[i] > 0)
                drafting = others + (ks[i] > 0)
            rate = tokens / max(verify_s + draft_s(max(ks), drafting), 1e-12)
            if rate > best_rate:
                best, best_rate = ks, rate
        return best

    def _hopeless(self, batch: list[Request], caps: list[int], gain: list[list[float]],
                  prices: dict[int, tuple[float, float, float]], draft_s) -> set[int]:
        """The requests whose draft of no depth is worth what it costs at the rate of a decode
        step for all: drafting k costs a request at least its k rows, its jump and one more
        drafting request's share of a draft step (the step's own part shared with others). The
        best choice has at least that rate (all decoding is one choice), and adding such a
        request to any choice of that rate or more lowers it, so they are left out of the
        search (all of them, the usual case of failing or finished drafts: no search, which at
        batch 8 is ~0.4 ms a step)."""
        decode = self.costs.verify_s([1] * len(batch), [r.context for r in batch])
        rate = len(batch) / max(decode, 1e-12)
        share = {k: max(0.0, min(draft_s(k, 2) - draft_s(k, 1), draft_s(k, 1))) for k in range(1, self.k_max + 1)}
        out = set()
        for i, g in enumerate(gain):
            row, jump, _ = prices[i]
            if all(g[k] - g[0] <= rate * (row * k + jump + share[k]) for k in range(1, min(caps[i], len(g) - 1) + 1)):
                out.add(i)
        return out

    @_timed
    def linear_costs(self, batch: list[Request]) -> tuple[float, float] | None:
        """A drafting step of the batch as a + b * (draft nodes verified): its verify time with
        no node (the line through its drafting steps, which a decode step does not lie on) and
        the mean cost of one more row (for TreeTrim); None until the model is ready."""
        ctx = [r.context for r in batch]
        if not self.costs.ready(ctx):
            return None
        one, two = self.costs.verify_s([2] * len(batch), ctx), self.costs.verify_s([3] * len(batch), ctx)
        return 2 * one - two, (two - one) / len(batch)

    @_timed
    def record(self, batch: list[Request], rows: list[int], verify_s: float, depth: int, draft_s: float,
               ks: list[int], accepted: list[int]) -> None:
        """What a step measured: its costs, and each drafting request's accepted drafts (a
        rejection when fewer than its k), into the request's and the engine's acceptance; a
        request that did not draft, one step more idle."""
        if self.measure:
            self.costs.record(rows, [r.context for r in batch], verify_s, depth, draft_s)
        chosen, self._chosen, self._kept = self._chosen, None, None
        for request, k, n in zip(batch, ks, accepted):
            if k == 0:
                request.idle += request.draft_state is not None
                continue
            if self._due(request):                           # a probe
                if n > 0:                                     # accepted: its own record starts afresh
                    request.accepted = request.rejected = 0.0
                else:                                         # rejected: wait twice as long
                    request.backoff = min(2 * (request.backoff or self.PROBE_AFTER), self.PROBE_AFTER_MAX)
            if n > 0:
                request.backoff = 0
            request.idle = 0
            request.drafted += 1
            request.accepted = self.RECENT * request.accepted + n
            request.rejected = self.RECENT * request.rejected + (n < k)
            self.accepted = self.DECAY * self.accepted + n
            self.rejected = self.DECAY * self.rejected + (n < k)
            for j in range(min(k, n + 1, self.k_max)):          # positions this step reached
                self.reached[j] = self.DECAY * self.reached[j] + 1
                self.passed[j] = self.DECAY * self.passed[j] + (j < n)
        if chosen == tuple(ks) and all(n >= k for k, n in zip(ks, accepted)):
            self._kept = (_batch_key(batch), chosen, self.costs.version)


class TreeTrim(_Laps):
    """Cut each step's greedy draft trees to the nodes worth verifying, from measured costs.

    A step's verify time is a + b * (draft nodes verified) (DraftPolicy.linear_costs, from the
    measured cost model: on a CPU at 25k cached tokens b is a large share of a decode step, on
    a GPU near zero). A
    node is accepted with about its path's draft probability exp(score) times a calibration
    c_d for its depth d (accepted / predicted so far at that depth). One calibration for every
    depth misjudged them apart: at 25k the verified nodes of depth 1 / 2 / 3 / 4 were accepted
    0.88 / 1.13 / 1.33 / 1.09 times as often as it predicted (acceptance comes in runs: a draft
    that got a token right tends to get the next), so the cut spent rows on depth-1 siblings and
    almost never kept a depth-4 node. Nodes are taken across the whole batch, the highest gain
    first among those whose parent is taken (so what is kept is a tree), while a node's gain per
    second of verify cost beats the step's tokens per second so far, so a batch gives
    each request fewer nodes, a long cache (large b) fewer than a short one, and a GPU keeps the
    whole tree. Until the fit has two distinct step sizes, trees are cut to 1/1, 1/2 and 1/4 of
    their size in turn (explore). Greedy output does not depend on the tree, so this is
    lossless; sampled requests are never cut.
    """

    EXPLORE_EVERY = 50
    DECAY = 0.98             # per recorded tree, on the sums of every depth it reaches

    def __init__(self):
        # per depth (index d - 1): decayed sums of predicted and accepted nodes, each from a
        # weak prior of c = 1 (a depth not yet verified keeps c = 1)
        self.predicted: list[float] = []
        self.accepted: list[float] = []
        self._steps = itertools.count()

    def calibration(self, depth: int) -> float:
        """Accepted over predicted nodes at this depth so far (1 where none was verified)."""
        if depth > len(self.predicted):
            return 1.0
        return min(2.0, max(0.1, self.accepted[depth - 1] / self.predicted[depth - 1]))

    @_timed
    def cut(self, batch: list[Request], proposals: list, fit: tuple[float, float] | None) -> list:
        step = next(self._steps)
        cuttable = [i for i, (r, p) in enumerate(zip(batch, proposals))
                    if p is not None and p.scores is not None and r.sampling.greedy and p.size > 1]
        if not cuttable:
            return proposals
        out = list(proposals)
        if fit is None or step % self.EXPLORE_EVERY == 0:
            shift = step % 3
            for i in cuttable:
                out[i] = proposals[i].best(max(1, proposals[i].size >> shift))
            return out
        a, b = fit
        fixed = sum(p.size for i, p in enumerate(proposals) if p is not None and i not in cuttable)
        cost = a + b * fixed
        tokens = float(len(batch))
        gains, frontier = {}, []         # request -> its nodes' gains; the nodes whose parent is kept
        for i in cuttable:
            scores, depths = proposals[i].scores.tolist(), proposals[i].depths().tolist()
            gains[i] = [self.calibration(d) * math.exp(s) for s, d in zip(scores, depths)]
            frontier += [(-gains[i][j], i, j) for j in proposals[i].children()[0]]
        heapq.heapify(frontier)
        keep: dict[int, list[int]] = {i: [] for i in cuttable}
        while frontier:
            gain, i, j = heapq.heappop(frontier)
            if b > 0 and -gain * cost <= b * tokens:      # gain / b <= tokens / cost: it would slow the step
                break
            keep[i].append(j)
            tokens -= gain
            cost += b
            for child in proposals[i].children()[j + 1]:
                heapq.heappush(frontier, (-gains[i][child], i, child))
        for i in cuttable:
            out[i] = proposals[i].subtree(keep[i]) if keep[i] else None
        return out

    @_timed
    def record(self, proposals: list, accepted: list[int]) -> None:
        """A step's trees (None: no draft) and each one's accepted drafts."""
        for proposal, n in zip(proposals, accepted):
            if proposal is None or proposal.scores is None:
                continue
            depths = proposal.depths().tolist()
            deepest = max(depths)
            while len(self.predicted) < deepest:
                self.predicted.append(1.0)
                self.accepted.append(1.0)
            for d in range(deepest):
                self.predicted[d] *= self.DECAY
                self.accepted[d] *= self.DECAY
            for d, p in zip(depths, proposal.scores.exp().tolist()):
                self.predicted[d - 1] += p
            for d in range(min(n, deepest)):              # its accepted path: one node at each depth to n
                self.accepted[d] += 1.0


def _expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step emits with k drafts at per-token acceptance alpha (incl. the bonus)."""
    if k <= 0:
        return 1.0
    alpha = min(alpha, 0.999)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def _batch_key(batch: list[Request]) -> tuple[tuple[int, int], ...]:
    """The batch's requests as the policy last saw them: each one's identity and its drafting
    steps so far (a new request in a finished one's place has none)."""
    return tuple((id(r), r.drafted) for r in batch)
