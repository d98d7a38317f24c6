"""What a decode step costs on this machine, measured online: the model the draft policy
(draft_policy.py) asks before it decides how much to draft.

A step verifies rows_r = 1 + drafts_r tokens for each request r of the batch, whose target
cache holds ctx_r tokens. Its verify time is fitted as

    verify = a + b * sum_r rows_r + e * sum_r ctx_r / 1000 + c * sum_r rows_r * ctx_r / 1000
               + j * (requests with rows_r > 1)

(a: the step's fixed cost; b: a row through the MLPs and the head; e: reading a request's
cached keys, once a step for all its rows (the packed verify, kernels/packed.py); c: a row's
own attention work over those keys, which on a CPU at 25k tokens is a large share of a step and
on a GPU near nothing; j: what verifying several rows costs over a decode step's one, paid once
a request: a decode step attends by one SDPA call, a verify by the packed split, with its
log-sum-exp merge. Measured at 25k (benchmarks.verify_cost): 1 / 2 / 3 / 5 rows 10.5 / 13.1 /
13.8 / 15.0 ms, a jump of ~2 ms and then ~0.6 ms a row; a line through the 3- and 5-row steps
alone put a decode step 2 ms too dear, and drafting paid on paper where it did not). The draft's
time for a step of depth k with n drafting requests is d0 + d1 * k + d2 * k * (n - 1) (the
batch's levels run in one call; measured at 0.5k with eager static steps, k = 4: ~1.2 ms for one
request, ~2.8 ms for eight), least squares over the last samples, local in the cached length as
the verify fit is (a draft that reads the whole context costs more the longer it is: _fit_draft);
until a step with several drafting requests is measured, d2 is 0. Every coefficient is kept >= 0.

The verify fit is in two stages, because this box's speed drifts: a plain 25k step took 10 ms
in one video and 15-20 ms in the next. Fitted on raw samples, the drift leaked into the row
terms: at 25k a drafting policy takes almost only 5-row steps, so a row's cost rested on two or
three 3-row ones; from a slow stretch their slope came out negative, the fit priced a row at
0 ms where it cost ~1 ms, and the default engine drafted 4 deep at an acceptance of 0.3 (0.66-
0.82x plain on that video); from another stretch a row cost 2-3 ms and drafting stopped where
it paid. So the terms that differ between steps of one batch (b, c, j) are fitted on the
differences between consecutive steps (`pairs`: PAIR_GAP apart at most, the same number of
requests at about the same length, their rows different), where a slow drift cancels (a spike,
one step 7 ms slow, does not: the pairs are fitted by least absolute deviations), and (a, e) on what those
leave of the samples, the recent ones (RECENT_HALF_LIFE) weighing most.

The fit is local in the cached length: a sample's weight falls with how far its mean cached
length is from the step's, by octaves (LOCALITY), because one line does not hold across lengths
(below ~8k keys the CPU verify runs one masked call, above it the packed split; fitted
globally, the 0.5k and 25k samples made a 25k row look twice as dear as it is, and the default
engine stopped drafting where drafting paid). The model is ready at a length once, near it
(within NEAR octaves), two consecutive drafting steps differ in rows (`knows_jump`: a drafting
step beside a decode step, for j; the policy takes a decode step to learn it only where the
jump could change its choice): the 0.5k samples of
one video say nothing of a row at 25k (fitted from them, a 25k row looked 7 ms dear where it
costs ~1 ms, and the default engine stopped drafting on the next long video). The first step of
each size (rows in all) in each octave of cached length, and of each draft depth, is not a
sample: it pays one-time costs (kernels chosen or loaded, buffers allocated for a new shape)
that can be several times a warm step's. Measured: the first 25k steps after 0.5k ones took
54.5 ms (5 rows: the CPU prefix kernel loads on its first long cache), 17.7 ms (3 rows) and
14.5 ms (1 row) where warm ones take ~14, ~12 and ~10; taken as samples, the first priced a
25k row at 8 ms, and the default engine drafted nothing on that video or the next two (tau
1.00-1.38 where fixed k had 4.6). So a new length costs four exploring steps, not two. Nor is a
step OUTLIER times slower than the fit predicts, nor a draft OUTLIER times dearer than the
step's verify (a compile of a new draft shape - its greedy chain and its sampled level compile
at different steps -, a pause). A step is called a one-off only where the fit has samples of its own
length (_samples_near). The model says when it needs a sample it cannot get from the
steps the policy would choose anyway (`wants_sample`): until it can tell a row's cost from the
step's, and now and then so that a change of load is noticed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Protocol, Sequence

import numpy as np

WINDOW = 64            # samples (and pairs) kept per fit
NEAR = 1.0             # octaves of cached length within which samples make the model ready there
LOCALITY = 0.5         # a verify sample d octaves of cached length away weighs 1 / (1 + (d / LOCALITY)^2)
OUTLIER = 5.0          # a sample this many times the fit's prediction is a one-off, not a cost ...
LOCAL_SAMPLES = 4      # ... where the fit has this many samples near the step's length (_samples_near)
RESAMPLE_EVERY = 50    # steps between samples taken only to keep the fit current
PAIR_GAP = 1.0         # seconds between two steps' ends within which their difference is a sample
PAIR_OCTAVES = 0.1     # ... and how far apart their mean cached lengths may be (the same batch, a few tokens on)
RECENT_HALF_LIFE = 16  # samples over which a sample's weight in the fixed costs (a, e) halves
ROBUST_PASSES = 8      # reweighted passes of the least-deviations fit of the pairs
SINGULAR = 1e-10       # a normal-equations determinant this small against its diagonal's: numpy's lstsq instead
# Past FRESH samples the fits are redone every REFIT_EVERY samples (pairs, draft steps), not after every step:
# the policy reads them each step, and at batch 8 refitting after every step was ~8% of a 0.5k
# step's time (profiled). With recency's half-life of 16 samples a fit 3 samples old differs little.
FRESH = 16
REFIT_EVERY = 4

# a sample: rows, ctx / 1000, rows x ctx / 1000, drafting requests, log2 of the mean cached length, requests, s
ROWS, KILO, ATTENTION, DRAFTING, OCTAVES, REQUESTS, SECONDS = range(7)
STEP = [ROWS, ATTENTION, DRAFTING]        # the terms two steps of one batch differ by (b, c, j)


class CostModel(Protocol):
    """Seconds a step would take; what the policy compares expected tokens against. `version`,
    where a model has one, changes whenever its answers may have (a refit); a model without
    one (None) is asked afresh every step."""

    version: int | None = None

    def ready(self, contexts: Sequence[int] | None = None) -> bool: ...

    def knows_jump(self, contexts: Sequence[int]) -> bool: ...

    def wants_sample(self, step: int, contexts: Sequence[int] | None = None) -> bool: ...

    def verify_s(self, rows: Sequence[int], contexts: Sequence[int]) -> float: ...

    def draft_s(self, depth: int, requests: int = 1, contexts: Sequence[int] | None = None) -> float: ...

    def record(self, rows: Sequence[int], contexts: Sequence[int], verify_s: float, depth: int,
               draft_s: float) -> None: ...

    def marginal(self, context: int) -> tuple[float, float, float]:
        """For one request of this cached length: (one more verified row, a verify step over a
        decode step before its rows, a decode step alone), from verify_s at 1, 2 and 3 rows (the
        policy asks for each request every step; a model may read them off its fit in one call)."""
        one, two, three = (self.verify_s([r], [context]) for r in (1, 2, 3))
        return three - two, two - one - (three - two), one


class _Refits:
    """When a fit over a window of samples is redone: after each of the first FRESH samples, then
    every REFIT_EVERY (or at once, when `now`)."""

    def __init__(self):
        self.since = 0

    def due(self, samples: int, now: bool = False) -> bool:
        self.since += 1
        if now or samples <= FRESH or self.since >= REFIT_EVERY:
            self.since = 0
            return True
        return False


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a coefficient the fit would make negative is
    dropped (0) and the rest refitted (an active set, at most as many passes as columns). The fits
    here have at most 3 columns, so each pass solves the normal equations in closed form (~8 us
    where an SVD a pass was ~18, and several times that in a step's cold caches: the policy refits
    every few steps); where they are near singular, by numpy's least squares."""
    gram, rhs = (x.T @ x).tolist(), (x.T @ y).tolist()
    active = list(range(x.shape[1]))
    coef = [0.0] * x.shape[1]
    while active:
        sol = _solve_small([[gram[i][j] for j in active] for i in active], [rhs[i] for i in active])
        if sol is None:
            sol = np.linalg.lstsq(x[:, active], y, rcond=None)[0].tolist()
        if min(sol) >= 0:
            for i, v in zip(active, sol):
                coef[i] = v
            break
        active.pop(sol.index(min(sol)))
    return np.array(coef)


def _solve_small(g: list[list[float]], h: list[float]) -> list[float] | None:
    """g @ s = h for a symmetric positive semi-definite g of side 1-3, by Cramer's rule; None
    when g is (near) singular or larger."""
    n = len(h)
    if n == 1:
        return [h[0] / g[0][0]] if g[0][0] > 0 else None
    if n == 2:
        det = g[0][0] * g[1][1] - g[0][1] * g[1][0]
        if not abs(det) > SINGULAR * abs(g[0][0] * g[1][1]):
            return None
        return [(h[0] * g[1][1] - g[0][1] * h[1]) / det, (g[0][0] * h[1] - h[0] * g[1][0]) / det]
    if n != 3:
        return None
    (a, b, c), (d, e, f), (p, q, r) = g
    minors = [[e * r - f * q, c * q - b * r, b * f - c * e],
              [f * p - d * r, a * r - c * p, c * d - a * f],
              [d * q - e * p, b * p - a * q, a * e - b * d]]
    det = a * minors[0][0] + b * minors[1][0] + c * minors[2][0]
    if not abs(det) > SINGULAR * abs(a * e * r):
        return None
    return [sum(m * v for m, v in zip(row, h)) / det for row in minors]


class MeasuredCosts(CostModel):
    """The default CostModel: fitted from the steps this engine ran."""

    def __init__(self, window: int = WINDOW, resample_every: int = RESAMPLE_EVERY):
        self.verify_samples: deque[tuple[float, ...]] = deque(maxlen=window)     # (ROWS .. SECONDS)
        # consecutive samples' differences where their rows differ (OCTAVES: their mean)
        self.pairs: deque[tuple[float, ...]] = deque(maxlen=window)
        # (depth, drafting requests, log2 of the step's mean cached length, s)
        self.draft_samples: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self.resample_every = resample_every
        self._verify: dict[int, tuple[float, ...]] = {}   # half-octave of cached length -> (a, b, e, c, j), lazily
        self._steps: dict[int, np.ndarray] = {}       # ... -> (b, c, j), lazily; cleared when the pairs' fit is due
        self._draft: dict[int | None, tuple[float, float, float]] = {}     # half-octave -> (d0, d1, d2), lazily
        self._seen_rows: set[tuple[int, int]] = set()   # (rows in all, octave of cached length) run once (warm)
        self._seen_depths: set[int] = set()
        self._last: tuple[tuple[float, ...], float] | None = None     # the last sample, and when it was recorded
        self._refit_samples, self._refit_pairs, self._refit_drafts = _Refits(), _Refits(), _Refits()
        self.version = 0      # bumped whenever a fit is to be redone: what the model says may have changed

    def ready(self, contexts: Sequence[int] | None = None) -> bool:
        """A row's cost and the step's are apart: near this length two consecutive drafting
        steps differ in rows."""
        near = _octaves(contexts) if contexts is not None else None
        return any(p[DRAFTING] == 0 and (near is None or abs(p[OCTAVES] - near) <= NEAR) for p in self.pairs)

    def knows_jump(self, contexts: Sequence[int]) -> bool:
        """What drafting costs over a decode step (j) is measured near this length: a drafting
        step followed a decode step there or preceded one (until then j is taken as 0)."""
        return self._jump_near(_octaves(contexts))

    def _jump_near(self, octaves: float) -> bool:
        return any(p[DRAFTING] != 0 and abs(p[OCTAVES] - octaves) <= NEAR for p in self.pairs)

    def wants_sample(self, step: int, contexts: Sequence[int] | None = None) -> bool:
        return not self.ready(contexts) or step % self.resample_every == self.resample_every - 1

    def verify_s(self, rows: Sequence[int], contexts: Sequence[int]) -> float:
        a, b, e, c, j = self._fit_verify(_octaves(contexts))
        drafting = sum(r > 1 for r in rows)
        return a + b * sum(rows) + e * sum(contexts) / 1000.0 + c * _attention(rows, contexts) + j * drafting

    def marginal(self, context: int) -> tuple[float, float, float]:
        """CostModel.marginal read off the fit in one call."""
        a, b, e, c, j = self._fit_verify(_octaves((context,)))
        row = b + c * context / 1000.0
        return row, j, a + e * context / 1000.0 + row

    def draft_s(self, depth: int, requests: int = 1, contexts: Sequence[int] | None = None) -> float:
        """A draft step `depth` deep for `requests` drafting requests, in a step of these cached
        lengths (None: fitted over every length alike)."""
        if depth <= 0 or requests <= 0:
            return 0.0
        d0, d1, d2 = self._fit_draft(_octaves(contexts) if contexts is not None else None)
        return d0 + d1 * depth + d2 * depth * (requests - 1)

    def record(self, rows: Sequence[int], contexts: Sequence[int], verify_s: float, depth: int,
               draft_s: float) -> None:
        total, octaves = int(sum(rows)), _octaves(contexts)
        size, refit = (total, round(octaves)), False
        if size in self._seen_rows and not (self._samples_near(octaves) and self.ready(contexts)
                                            and verify_s > OUTLIER * self.verify_s(rows, contexts)):
            sample = (float(total), sum(contexts) / 1000.0, _attention(rows, contexts), float(sum(r > 1 for r in rows)),
                      octaves, float(len(rows)), float(verify_s))
            now = time.monotonic()
            last = self._last[0] if self._last is not None and now - self._last[1] <= PAIR_GAP else None
            if (last is not None and last[REQUESTS] == sample[REQUESTS]
                    and abs(last[OCTAVES] - sample[OCTAVES]) <= PAIR_OCTAVES):
                diff = tuple(s - t for s, t in zip(sample, last))
                if diff[ROWS] != 0:
                    self.pairs.append(diff[:OCTAVES] + ((sample[OCTAVES] + last[OCTAVES]) / 2,) + diff[REQUESTS:])
                    if self._refit_pairs.due(len(self.pairs)):
                        self._steps.clear()
                        self.version += 1
            self.verify_samples.append(sample)
            self._last = (sample, now)
            refit = self._refit_samples.due(len(self.verify_samples), now=not self._steps)
            if refit:
                self._verify.clear()
                self.version += 1
        else:
            self._last = None          # a step that is no sample breaks the run of consecutive ones
        self._seen_rows.add(size)
        if depth > 0:
            # a draft step is never OUTLIER x dearer than its own fit or than the step's verify
            # (a one-layer draft against the target): one that is paid something once
            drafting = max(1, sum(1 for r in rows if r > 1))
            usual = max(verify_s, self.draft_s(depth, drafting, contexts) if self.draft_samples else 0.0)
            if depth in self._seen_depths and draft_s <= OUTLIER * usual:
                self.draft_samples.append((float(depth), float(drafting), octaves, float(draft_s)))
                # with the verify fit's when that is redone: one step in REFIT_EVERY redoes both, and the
                # policy keeps its choice between (DraftPolicy.choose)
                if self._refit_drafts.due(len(self.draft_samples), now=refit):
                    self._draft.clear()
                    self.version += 1
            self._seen_depths.add(depth)

    def _samples_near(self, octaves: float) -> bool:
        """Whether the window holds LOCAL_SAMPLES samples within NEAR octaves of this length: only a
        fit that rests on them can call a step there a one-off. After a long answer at another
        length has filled the window, the fit here rests on that length's samples alone (where a
        and e are one line through a single length, apart by noise): it once priced a 0.5k decode
        step at 0.6 ms where it took 8.5, and every real step, OUTLIER x that, was dropped, so the
        price never moved and the engine drafted nothing on the next short video."""
        return sum(abs(s[OCTAVES] - octaves) <= NEAR for s in self.verify_samples) >= LOCAL_SAMPLES

    def _fit_verify(self, octaves: float) -> tuple[float, ...]:
        """(a, b, e, c, j) weighted towards samples near `octaves` (log2 of the step's mean
        cached length). Kept per half-octave (as Python floats: the policy reads it ~25 times a
        step); callers check `ready` first."""
        key = round(2 * octaves)
        if key not in self._verify:
            at = key / 2
            if key not in self._steps:
                pairs = np.array(self.pairs)
                w = np.sqrt(_locality(pairs[:, OCTAVES], at))
                self._steps[key] = _least_deviations(pairs[:, STEP] * w[:, None], pairs[:, SECONDS] * w)
            step = self._steps[key]
            if not self._jump_near(at):
                # what drafting costs over a decode step is known only where a drafting step ran
                # beside a decode one (knows_jump); elsewhere it is 0 until measured, not borrowed
                # from far lengths (25k's, priced into a 0.5k step, stopped a draft there for good:
                # it never drafted again to measure it)
                step = np.array([step[0], step[1], 0.0])
            b, c, j = step
            data = np.array(self.verify_samples)
            weight = np.sqrt(_locality(data[:, OCTAVES], at) * 0.5 ** (np.arange(len(data))[::-1] / RECENT_HALF_LIFE))
            rest = data[:, SECONDS] - data[:, STEP] @ step
            a, e = _nonnegative_lstsq(np.column_stack([np.ones(len(data)), data[:, KILO]]) * weight[:, None], rest * weight)
            self._verify[key] = (float(a), float(b), float(e), float(c), float(j))
        return self._verify[key]

    def _fit_draft(self, octaves: float | None = None) -> tuple[float, float, float]:
        """(d0, d1, d2) weighted towards samples near `octaves` (None: all alike), kept per
        half-octave; with one depth seen so far, proportional to the depth (d0 = 0); none seen:
        free (the verify samples decide, and the first drafting step measures it). Local in the
        cached length because a draft that reads the whole context (EAGLE-style, SpecVLM's pruned
        one) costs more the longer it is: fitted over all lengths alike, the 16k steps of an
        EAGLE-style draft priced its 0.5k ones ~3x too dear, and the default engine stopped
        drafting at 0.5k where fixed k ran 1.56x plain (0.95x). A draft of a bounded window
        (Sparrow's text-anchored one) costs the same at every length, and fits the same."""
        key = None if octaves is None else round(2 * octaves)
        if key not in self._draft:
            if not self.draft_samples:
                return 0.0, 0.0, 0.0
            data = np.array(self.draft_samples)
            w = np.ones(len(data)) if key is None else np.sqrt(_locality(data[:, 2], key / 2))
            depth, batch = data[:, 0], data[:, 0] * (data[:, 1] - 1)
            if len(set(depth)) < 2:
                d1, d2 = _nonnegative_lstsq(np.column_stack([depth, batch]) * w[:, None], data[:, 3] * w)
                self._draft[key] = (0.0, float(d1), float(d2))
            else:
                d0, d1, d2 = _nonnegative_lstsq(np.column_stack([np.ones(len(data)), depth, batch]) * w[:, None],
                                                data[:, 3] * w)
                self._draft[key] = (float(d0), float(d1), float(d2))
        return self._draft[key]


def _least_deviations(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients >= 0 that minimise the sum of |y - x @ coef| (least absolute deviations, by
    reweighted least squares from the least-squares start): a spike's two pairs, 7 ms off, pull a
    least-squares row cost below zero; here they weigh as what they are, two of the pairs."""
    coef = _nonnegative_lstsq(x, y)
    for _ in range(ROBUST_PASSES):
        off = np.abs(y - x @ coef)
        floor = max(1e-3 * float(np.median(off)), 1e-9)
        w = 1.0 / np.sqrt(np.maximum(off, floor))
        coef = _nonnegative_lstsq(x * w[:, None], y * w)
    return coef


def _locality(octaves: np.ndarray, at: float) -> np.ndarray:
    """A sample's weight in the fit at `at` (log2 of a cached length), by its own length's distance."""
    return 1.0 / (1.0 + ((octaves - at) / LOCALITY) ** 2)


def _octaves(contexts: Sequence[int]) -> float:
    """log2 of a step's mean cached length (where its verify cost is fitted)."""
    return math.log2(max(1.0, sum(contexts) / max(1, len(contexts))))


def _attention(rows: Sequence[int], contexts: Sequence[int]) -> float:
    """Thousands of (query row, cached key) pairs a step's attention reads."""
    return float(sum(r * c for r, c in zip(rows, contexts))) / 1000.0
