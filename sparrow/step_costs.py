"""What a decode step costs on this machine, measured online: the model the draft policy
(draft_policy.py) asks before it decides how much to draft.

A step verifies rows_r = 1 + drafts_r tokens for each request r of the batch, whose target
cache holds ctx_r tokens. Its verify time is fitted as

    verify = a + b * sum_r rows_r + e * sum_r ctx_r / 1000 + c * sum_r rows_r * ctx_r / 1000

(a: the step's fixed cost; b: a row through the MLPs and the head; e: reading a request's
cached keys, once a step for all its rows (the packed verify, kernels/packed.py); c: a row's
own attention work over those keys, which on a CPU at 25k tokens is a large share of a step and
on a GPU near nothing), and the draft's time for a step of depth k with n drafting requests as
d0 + d1 * k + d2 * k * (n - 1) (the batch's levels run in one call; measured at 0.5k with eager
static steps, k = 4: ~1.2 ms for one request, ~2.8 ms for eight; fitted as one line in k, a
batch of eight was priced as one). Both are least squares over the last samples, coefficients
kept >= 0; until a step with several drafting requests is measured, d2 is 0. The verify fit is local in the cached length: a
sample's weight falls with how far its mean cached length is from the step's, by octaves
(LOCALITY), because one line does not hold across lengths (below ~8k keys the CPU verify runs
one masked call, above it the packed split, kernels/packed.py; fitted globally, the 0.5k and
25k samples made a 25k row look twice as dear as it is, and the default engine stopped
drafting where drafting paid). The model is ready at a length once the samples near it
(within NEAR octaves) have two step sizes: the 0.5k samples of one video say nothing of a row
at 25k (fitted from them, a 25k row looked 7 ms dear where it costs ~1 ms, and the default
engine stopped drafting on the next long video). The first step of each size (rows in all) in
each octave of cached length, and of each draft depth, is not a sample: it pays one-time costs
(kernels chosen or loaded, buffers allocated for a new shape) that can be several times a warm
step's. Measured: the first 25k steps after 0.5k ones took 54.5 ms (5 rows: the CPU prefix
kernel loads on its first long cache), 17.7 ms (3 rows) and 14.5 ms (1 row) where warm ones
take ~14, ~12 and ~10; taken as samples, the first priced a 25k row at 8 ms, and the default
engine drafted nothing on that video or the next two (tau 1.00-1.38 where fixed k had 4.6).
So a new length costs four exploring steps, not two. Nor is a step OUTLIER times slower than the fit
predicts, nor a draft OUTLIER times dearer than the step's verify (a compile of a new draft
shape - its greedy chain and its sampled level compile at different steps -, a pause). The model says when it needs a sample it cannot get
from the steps the policy would choose anyway (`wants_sample`): until it can tell a row's
cost from the step's, and now and then so that a change of load is noticed.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, Sequence

import numpy as np

WINDOW = 64            # samples kept per fit
NEAR = 1.0             # octaves of cached length within which samples make the model ready there
LOCALITY = 0.5         # a verify sample d octaves of cached length away weighs 1 / (1 + (d / LOCALITY)^2)
OUTLIER = 5.0          # a sample this many times the fit's prediction is a one-off, not a cost
RESAMPLE_EVERY = 50    # steps between samples taken only to keep the fit current


class CostModel(Protocol):
    """Seconds a step would take; what the policy compares expected tokens against."""

    def ready(self, contexts: Sequence[int] | None = None) -> bool: ...

    def wants_sample(self, step: int, contexts: Sequence[int] | None = None) -> bool: ...

    def verify_s(self, rows: Sequence[int], contexts: Sequence[int]) -> float: ...

    def draft_s(self, depth: int, requests: int = 1) -> float: ...

    def record(self, rows: Sequence[int], contexts: Sequence[int], verify_s: float, depth: int,
               draft_s: float) -> None: ...


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a coefficient the fit would make negative is
    dropped (0) and the rest refitted (an active set, at most as many passes as columns)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


class MeasuredCosts:
    """The default CostModel: fitted from the steps this engine ran."""

    def __init__(self, window: int = WINDOW, resample_every: int = RESAMPLE_EVERY):
        # verify: (rows, ctx / 1000, rows x ctx / 1000, log2 of the mean cached length, seconds)
        self.verify_samples: deque[tuple[float, float, float, float, float]] = deque(maxlen=window)
        self.draft_samples: deque[tuple[float, float, float]] = deque(maxlen=window)    # (depth, requests, s)
        self.resample_every = resample_every
        self._verify: dict[int, np.ndarray] = {}      # half-octave of cached length -> (a, b, e, c), lazily
        self._draft: tuple[float, float, float] | None = None
        self._seen_rows: set[tuple[int, int]] = set()   # (rows in all, octave of cached length) run once (warm)
        self._seen_depths: set[int] = set()

    def ready(self, contexts: Sequence[int] | None = None) -> bool:
        """A row's cost and the step's are apart: two step sizes sampled (near this length)."""
        near = _octaves(contexts) if contexts is not None else None
        return len({s[0] for s in self.verify_samples if near is None or abs(s[3] - near) <= NEAR}) >= 2

    def wants_sample(self, step: int, contexts: Sequence[int] | None = None) -> bool:
        return not self.ready(contexts) or step % self.resample_every == self.resample_every - 1

    def verify_s(self, rows: Sequence[int], contexts: Sequence[int]) -> float:
        a, b, e, c = self._fit_verify(_octaves(contexts))
        return float(a + b * sum(rows) + e * sum(contexts) / 1000.0 + c * _attention(rows, contexts))

    def draft_s(self, depth: int, requests: int = 1) -> float:
        """A draft step `depth` deep for `requests` drafting requests."""
        if depth <= 0 or requests <= 0:
            return 0.0
        d0, d1, d2 = self._fit_draft()
        return d0 + d1 * depth + d2 * depth * (requests - 1)

    def record(self, rows: Sequence[int], contexts: Sequence[int], verify_s: float, depth: int,
               draft_s: float) -> None:
        total, octaves = int(sum(rows)), _octaves(contexts)
        size = (total, round(octaves))
        if size in self._seen_rows and not (self.ready(contexts) and verify_s > OUTLIER * self.verify_s(rows, contexts)):
            self.verify_samples.append((float(total), sum(contexts) / 1000.0, _attention(rows, contexts), octaves,
                                        float(verify_s)))
            self._verify.clear()
        self._seen_rows.add(size)
        if depth > 0:
            # a draft step is never OUTLIER x dearer than its own fit or than the step's verify
            # (a one-layer draft against the target): one that is paid something once
            drafting = max(1, sum(1 for r in rows if r > 1))
            usual = max(verify_s, self.draft_s(depth, drafting) if self.draft_samples else 0.0)
            if depth in self._seen_depths and draft_s <= OUTLIER * usual:
                self.draft_samples.append((float(depth), float(drafting), float(draft_s)))
                self._draft = None
            self._seen_depths.add(depth)

    def _fit_verify(self, octaves: float) -> np.ndarray:
        """(a, b, e, c) weighted towards samples near `octaves` (log2 of the step's mean cached
        length); kept per half-octave. Callers check `ready` first."""
        key = round(2 * octaves)
        if key not in self._verify:
            data = np.array(self.verify_samples)
            w = np.sqrt(1.0 / (1.0 + ((data[:, 3] - key / 2) / LOCALITY) ** 2))
            x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]]) * w[:, None]
            self._verify[key] = _nonnegative_lstsq(x, data[:, 4] * w)
        return self._verify[key]

    def _fit_draft(self) -> tuple[float, float, float]:
        """(d0, d1, d2); with one depth seen so far, proportional to the depth (d0 = 0); none
        seen: free (the verify samples decide, and the first drafting step measures it)."""
        if self._draft is None:
            if not self.draft_samples:
                return 0.0, 0.0, 0.0
            data = np.array(self.draft_samples)
            depth, batch = data[:, 0], data[:, 0] * (data[:, 1] - 1)
            if len(set(depth)) < 2:
                d1, d2 = _nonnegative_lstsq(np.column_stack([depth, batch]), data[:, 2])
                self._draft = (0.0, float(d1), float(d2))
            else:
                d0, d1, d2 = _nonnegative_lstsq(np.column_stack([np.ones(len(data)), depth, batch]), data[:, 2])
                self._draft = (float(d0), float(d1), float(d2))
        return self._draft


def _octaves(contexts: Sequence[int]) -> float:
    """log2 of a step's mean cached length (where its verify cost is fitted)."""
    return float(np.log2(max(1.0, sum(contexts) / max(1, len(contexts)))))


def _attention(rows: Sequence[int], contexts: Sequence[int]) -> float:
    """Thousands of (query row, cached key) pairs a step's attention reads."""
    return float(sum(r * c for r, c in zip(rows, contexts))) / 1000.0
