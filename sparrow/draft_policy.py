"""How much to draft: k per request per step (DraftPolicy) and which tree nodes are worth
verifying (TreeTrim), both from costs measured on this machine and this batch."""

from __future__ import annotations

import itertools
import math
from collections import deque

from .request import Request


class _LinearFit:
    """y = a + b * x over the last `window` samples (least squares; a, b >= 0)."""

    def __init__(self, window: int = 64):
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)

    def add(self, x: float, y: float) -> None:
        self.samples.append((float(x), float(y)))

    def __bool__(self) -> bool:
        return bool(self.samples)

    def fit(self) -> tuple[float, float] | None:
        xs = [x for x, _ in self.samples]
        if len(set(xs)) < 2:
            return None
        n = len(xs)
        mx, my = sum(xs) / n, sum(y for _, y in self.samples) / n
        var = sum((x - mx) ** 2 for x in xs)
        b = max(0.0, sum((x - mx) * (y - my) for x, y in self.samples) / var)
        return max(0.0, my - b * mx), b


class DraftPolicy:
    """k per request per step, from measured costs. A step's verify time is fitted as
    a + b * (tokens verified), its draft time as d0 + d1 * k (k > 0: proposing k tokens and
    committing to the draft what earlier steps emitted; a step without drafts defers its
    commit, so k = 0 costs the draft nothing); each request's per-token acceptance alpha is
    estimated from its accepted and rejected draft tokens. A common k for the adaptive
    requests of a batch of n is the one that maximises the expected tokens per second,

        sum_r (1 - alpha_r^(k+1)) / (1 - alpha_r)  /  (a + b * (n (k + 1) + pinned) + [k > 0] (d0 + d1 k))

    so k shrinks, down to plain decoding, as the batch grows or acceptance falls. Until both
    fits have seen distinct step sizes it explores k = 0 .. k_max in turn, and again now and
    then, so a change of load is noticed. Requests whose k is pinned (seeded sampling, an
    explicit k) always get their own k.
    """

    EXPLORE_EVERY = 50

    def __init__(self, k_max: int, adaptive: bool):
        self.k_max, self.adaptive = k_max, adaptive
        self.verify = _LinearFit()
        self.draft = _LinearFit()
        self._steps = itertools.count()

    @property
    def samples(self):
        return self.verify.samples

    def choose(self, batch: list[Request]) -> list[int]:
        caps = [min(r.k, max(0, r.output.remaining - 1)) if r.draft_state is not None else 0 for r in batch]
        free = [i for i, r in enumerate(batch) if not r.pinned_k and caps[i] > 0]
        if not self.adaptive or not free:
            return caps
        step = next(self._steps)
        exploring = step < 3 * (self.k_max + 1) or step % self.EXPLORE_EVERY == 0
        k = step % (self.k_max + 1) if exploring else self._best(batch, caps, free)
        for i in free:
            caps[i] = min(caps[i], k)
        return caps

    def _best(self, batch: list[Request], caps: list[int], free: list[int]) -> int:
        verify, draft = self.verify.fit(), self.draft.fit()
        if verify is None or draft is None:
            return self.k_max
        (a, b), (d0, d1) = verify, draft
        pinned_tokens = sum(caps[i] + 1 for i in range(len(batch)) if i not in free)
        best, best_rate = 0, -1.0
        for k in range(self.k_max + 1):
            emitted = sum(_expected_tokens(batch[i].alpha, min(k, caps[i])) for i in free)
            cost = a + b * (pinned_tokens + len(free) * (k + 1)) + ((d0 + d1 * k) if k > 0 else 0.0)
            rate = emitted / max(cost, 1e-9)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def record(self, tokens_verified: int, verify_s: float, draft_positions: int, draft_s: float) -> None:
        self.verify.add(tokens_verified, verify_s)
        if draft_positions > 0:
            self.draft.add(draft_positions, draft_s)


class TreeTrim:
    """Cut each step's greedy draft trees to the nodes worth verifying, from measured costs.

    A step's verify time is a + b * (tokens verified) (DraftPolicy's fit, on this device: on
    a CPU at 25k cached tokens b is a large share of a decode step, on a GPU near zero). A
    node is accepted with about its path's draft probability exp(score) times a calibration
    c (accepted / predicted so far). Nodes are taken across the whole batch in order of that
    gain while a node's gain per second of verify cost beats the step's tokens per second so
    far, so a batch gives each request fewer nodes, a long cache (large b) fewer than a
    short one, and a GPU keeps the whole tree. Until the fit has two distinct step sizes,
    trees are cut to 1/1, 1/2 and 1/4 of their size in turn (explore). Greedy output does not
    depend on the tree, so this is lossless; sampled requests are never cut.
    """

    EXPLORE_EVERY = 50

    def __init__(self):
        self.predicted, self.accepted = 1.0, 1.0          # decayed sums (a weak prior of c = 1)
        self._steps = itertools.count()

    @property
    def calibration(self) -> float:
        return min(2.0, max(0.1, self.accepted / self.predicted))

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
        c = self.calibration
        fixed = sum(p.size for i, p in enumerate(proposals) if p is not None and i not in cuttable)
        cost = a + b * (len(batch) + fixed)
        tokens = float(len(batch))
        candidates = sorted(((c * math.exp(float(s)), i, j) for i in cuttable
                             for j, s in enumerate(proposals[i].scores.tolist())), key=lambda t: (-t[0], t[1], t[2]))
        keep = {i: 0 for i in cuttable}
        for gain, i, _ in candidates:
            if b > 0 and gain * cost <= b * tokens:       # gain / b <= tokens / cost: it would slow the step
                break
            keep[i] += 1
            tokens += gain
            cost += b
        for i in cuttable:
            out[i] = proposals[i].best(keep[i]) if keep[i] > 0 else None
        return out

    def record(self, proposal, num_accepted: int) -> None:
        if proposal is None or proposal.scores is None:
            return
        self.predicted = 0.98 * self.predicted + float(proposal.scores.exp().sum())
        self.accepted = 0.98 * self.accepted + num_accepted


def _expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step emits with k drafts at per-token acceptance alpha (incl. the bonus)."""
    if k <= 0:
        return 1.0
    alpha = min(alpha, 0.999)
    return (1 - alpha ** (k + 1)) / (1 - alpha)
