"""The scheduler: one per engine, owning every running request (continuous batching).

    submit -> prepare (a worker thread: video decode, prompt, prefix-cache lookup)
           -> waiting (admission: a KV-arena slot of prompt + max new + k + 1 tokens)
           -> prefilling (a chunk per loop turn, between decode steps)
           -> running (one batched step per loop turn) -> done

A decode step for the running batch reads as its phases:

    k       how many draft tokens each request gets this step (DraftPolicy; 0: plain decoding)
    propose one batched draft pass for the requests that draft
    verify  one ragged target forward over every request's last token + its drafts
    accept  per request, through accept.py, with the request's own generator
    advance roll each target cache back to what was accepted; commit to the draft
    emit    OutputProcessor: stop tokens, stop strings, length, incremental text

A request's tokens depend only on its own inputs and seed: its generator is its own and is
drawn from in a fixed order (its drafts, then its acceptance); a seeded sampled request keeps
its k for its whole life, so its draws are those of its solo run (greedy output does not
depend on k at all). Requests join and leave between steps; one request's error, abort or
stop ends that request only.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .config import SamplingParams
from .errors import InvalidRequest, ResourceExhausted
from .metrics import SpecMetrics
from .models.kv_cache import KVArena, KVSlot
from .models.target import FeatureNeeds, PrefillJob, TargetState
from .output import OutputProcessor
from .prefix_cache import PrefixEntry
from .speculative.accept import AcceptResult, accept_tree_greedy, accept_tree_speculative
from .speculative.proposer import DraftRequest, Proposal, StepResult
from .speculative.tree import DraftTree
from .speculative.sampling import draw_token, logits_to_probs

log = logging.getLogger(__name__)

MAX_DRAFT_TOKENS = 32
FIRST_SLICE = 256      # prompt positions of a prefill's first slice while streams decode


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine internals (how requests share the machine), apart from the speculation policy
    (SpecConfig) and each request's sampling (SamplingParams).

    kv_cache_bytes       the target KV arena: admission is by these bytes, not a request count
    max_running          requests prefilling or decoding at once
    max_waiting          requests waiting for KV memory; past it, new ones are refused
    queue_timeout_s      how long a request may wait for KV memory before it is refused
    prefill_chunk_tokens the most prompt positions per prefill slice
    prefill_slice_s      while streams are decoding, a slice is sized to take about this long
                         (from the measured cost of the request's previous slice: it grows with
                         the cached length), so a running stream waits about this much at most
    prefill_share        ... and prefill gets about this share of the time while streams decode
                         (the rest goes to decode steps); alone, a prefill runs at full chunks
    prepare_threads      videos decoded at once (off the scheduler thread)
    step_draft_nodes     draft-tree nodes a whole step may verify, shared by the requests that
                         draft (each gets at most its equal share, however large its tree
                         could be); 0: no cap. Verify cost grows with the tokens scored, so a
                         batch gives each request a smaller tree (BENCHMARKS.md: verify cost).
                         A seeded sampled request keeps its whole tree: its tree decides its
                         draws, which must be those of its solo run.
    """

    kv_cache_bytes: int = 2 << 30
    max_running: int = 64
    max_waiting: int = 256
    queue_timeout_s: float = 30.0
    prefill_chunk_tokens: int = 2048
    prefill_slice_s: float = 0.1
    prefill_share: float = 0.5
    step_draft_nodes: int = 0
    prepare_threads: int = 2

    def __post_init__(self) -> None:
        for name in ("kv_cache_bytes", "max_running", "prefill_chunk_tokens", "prepare_threads"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0 or not self.queue_timeout_s >= 0:
            raise InvalidRequest("max_waiting and queue_timeout_s must be >= 0")
        if self.step_draft_nodes < 0:
            raise InvalidRequest("step_draft_nodes must be >= 0")
        if not self.prefill_slice_s > 0 or not 0 < self.prefill_share <= 1:
            raise InvalidRequest("need prefill_slice_s > 0 and 0 < prefill_share <= 1")


@dataclass(eq=False)
class Request:
    """One request's life in the scheduler. Only the scheduler thread touches the fields
    below `sink` once the request is queued; `abort()` is safe from any thread."""

    id: int
    video: Any
    prompt: Any                             # the question: a string, or chat turns (sparrow.chat)
    sampling: SamplingParams
    options: Any
    video_key: str | None
    requested_k: int | None
    sink: Callable[[Any], None]             # receives TokenDelta, then GenerationOutput or an exception
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    submitted: float = field(default_factory=time.monotonic)
    aborted: threading.Event = field(default_factory=threading.Event)
    k: int = 0                              # most draft tokens a step may give it
    pinned_k: bool = False                  # seeded sampling (or an explicit k): k never adapts
    needs: FeatureNeeds = FeatureNeeds()
    inputs: dict | None = None
    processed: Any = None
    entry: PrefixEntry | None = None
    capacity: int = 0
    slot: KVSlot | None = None
    job: PrefillJob | None = None
    state: TargetState | None = None
    draft_state: Any = None
    generator: torch.Generator | None = None
    output: OutputProcessor | None = None
    accepted: int = 0                       # its draft tokens accepted so far ...
    rejected: int = 0                       # ... and verify steps that rejected one
    pending_commits: list = field(default_factory=list)   # StepResults not yet given to the draft
    decode_start: float = 0.0
    waited: bool = False                    # counted once in the scheduler's waited_for_memory
    prefill_s_per_token: float = 0.0        # measured on its last prefill slice
    done: bool = False

    def abort(self) -> None:
        self.aborted.set()

    @property
    def alpha(self) -> float:
        """Per-token acceptance: accepted / (accepted + rejections), with a weak prior of 2/3."""
        return (self.accepted + 2) / (self.accepted + self.rejected + 3)


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


class Scheduler:
    def __init__(self, engine, config: EngineConfig):
        self.engine, self.config = engine, config
        spec = engine.spec
        self.policy = DraftPolicy(spec.num_draft_tokens if engine.proposer is not None else 0, spec.adaptive_k)
        self.trim = TreeTrim() if spec.adaptive_tree and engine.proposer is not None else None
        self.arena: KVArena | None = None
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._ready: deque[Request] = deque()        # prepared, handed over by worker threads
        self._waiting: deque[Request] = deque()      # waiting for KV memory (scheduler thread only)
        self._prefilling: deque[Request] = deque()
        self._running: list[Request] = []
        self._to_prepare: deque[Request] = deque()   # submitted, not yet prepared
        self._tasks: deque[tuple[Callable[[], Any], Future]] = deque()   # call_soon work (live ingest)
        self._preparers = 0                          # worker threads preparing them
        self._thread: threading.Thread | None = None
        self._closed = False
        self._next_slice_at = 0.0                    # perf_counter time the next prefill slice may run
        # Counters for operators and tests: decode steps, the largest batch, requests that had
        # to wait for KV memory, prefill slices run.
        self.stats = {"steps": 0, "max_batch": 0, "waited_for_memory": 0, "prefill_slices": 0, "tasks": 0}

    # ----- submission (any thread) ---------------------------------------------------------------
    def submit(self, video, prompt: str, sampling: SamplingParams, options, video_key: str | None,
               num_draft_tokens: int | None, sink: Callable[[Any], None], entry: PrefixEntry | None = None) -> Request:
        request = Request(next(self._ids), video, prompt, sampling, options, video_key, num_draft_tokens, sink)
        request.entry = entry
        if self._closed:
            raise RuntimeError("the engine is closed")
        with self._cv:
            queued = len(self._to_prepare) + len(self._waiting) + len(self._ready)
            if queued >= self.config.max_waiting + self.config.max_running:
                raise ResourceExhausted(f"{queued} requests are already waiting; try again later")
            self._to_prepare.append(request)
            if self._preparers < self.config.prepare_threads:
                self._preparers += 1
                threading.Thread(target=self._prepare_loop, name="sparrow-prepare", daemon=True).start()
        return request

    def call_soon(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the scheduler thread between steps (work that uses the target model
        outside a request: a live session's frame prefill). It is paced like a prefill slice:
        while streams decode, tasks and prefill slices share about prefill_share of the time.
        Keep a task short (one slice). The future gets its result or exception."""
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._tasks.append((fn, future))
            self._ensure_thread()
            self._cv.notify_all()
        return future

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # ----- preparation (at most prepare_threads worker threads, gone when idle) ---------------
    def _prepare_loop(self) -> None:
        while True:
            with self._cv:
                if not self._to_prepare:
                    self._preparers -= 1
                    return
                request = self._to_prepare.popleft()
            try:
                self.engine._prepare_request(request)
            except BaseException as exc:  # noqa: BLE001 - handed to the request's reader
                request.sink(exc)
                continue
            with self._cv:
                self._ready.append(request)
                self._ensure_thread()
                self._cv.notify_all()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="sparrow-scheduler", daemon=True)
            self._thread.start()

    # ----- the loop (the scheduler thread) -----------------------------------------------------
    def _loop(self) -> None:
        idle_since = None
        while True:
            with self._cv:
                self._waiting.extend(self._ready)
                self._ready.clear()
                busy = bool(self._waiting or self._prefilling or self._running or self._tasks)
                if not busy:
                    # An idle scheduler lets its thread go (a later submit starts another).
                    idle_since = idle_since or time.monotonic()
                    if self._closed or time.monotonic() - idle_since > 2.0:
                        self._thread = None
                        return
                    self._cv.wait(timeout=0.5)
                    continue
            idle_since = None
            try:
                self._admit()
                self._prefill_slice()
                self._run_task()
                self._decode_step()
            except Exception as exc:  # noqa: BLE001 - a failed batched forward fails the requests in it
                log.exception("scheduler step failed")
                for request in list(self._running) + list(self._prefilling):
                    self._finish(request, error=exc)

    def _admit(self) -> None:
        """Waiting requests get a KV slot in arrival order, while memory and max_running allow."""
        cfg = self.config
        while self._waiting:
            request = self._waiting[0]
            if request.aborted.is_set():
                self._waiting.popleft()
                self._finish(request, "abort")
                continue
            if self.num_running >= cfg.max_running:
                return
            slot = self._arena().allocate(request.capacity)
            if slot is None:
                if not request.waited:
                    request.waited = True
                    self.stats["waited_for_memory"] += 1
                waited = time.monotonic() - request.submitted
                if waited > cfg.queue_timeout_s:
                    self._waiting.popleft()
                    self._finish(request, error=ResourceExhausted(
                        f"waited {waited:.1f} s for {request.capacity} tokens of KV memory "
                        f"({self._arena().free_tokens} of {self._arena().tokens} free); try again later"))
                    continue
                return
            self._waiting.popleft()
            request.slot = slot
            try:
                request.job = self.engine._prefill_job(request)
            except Exception as exc:  # noqa: BLE001 - this request's inputs, not the engine's
                self._finish(request, error=exc)
                continue
            self._prefilling.append(request)

    def _prefill_slice(self) -> None:
        """One chunk of the oldest prefill: a long prompt is spread over several loop turns.
        While streams decode, a slice is sized to about prefill_slice_s (from the measured
        seconds per position of the request's last slice) and slices wait their turn so that
        prefill takes about prefill_share of the time; alone, a prefill runs full chunks."""
        if not self._prefilling:
            return
        cfg, now = self.config, time.perf_counter()
        if self._running and now < self._next_slice_at:
            return
        request = self._prefilling[0]
        if request.aborted.is_set():
            self._prefilling.popleft()
            self._finish(request, "abort")
            return
        limit = None
        if self._running:         # unmeasured yet: a probe of FIRST_SLICE positions
            limit = (max(16, int(cfg.prefill_slice_s / request.prefill_s_per_token))
                     if request.prefill_s_per_token else FIRST_SLICE)
        start = request.job.cursor
        t0 = time.perf_counter()
        try:
            done = request.job.step(limit)
        except Exception as exc:  # noqa: BLE001 - e.g. a vision tower that rejects this video
            self._prefilling.popleft()
            self._finish(request, error=exc)
            return
        spent = time.perf_counter() - t0
        request.metrics.prefill_seconds += spent
        request.prefill_s_per_token = spent / max(1, request.job.cursor - start)
        self._next_slice_at = time.perf_counter() + spent * (1 - cfg.prefill_share) / cfg.prefill_share
        self.stats["prefill_slices"] += 1
        if done:
            self._prefilling.popleft()
            try:
                first = self.engine._start_decoding(request)
            except Exception as exc:  # noqa: BLE001
                self._finish(request, error=exc)
                return
            self._running.append(request)
            self._emit(request, [first])

    def _run_task(self) -> None:
        """One call_soon task, paced like a prefill slice while streams decode."""
        if not self._tasks or (self._running and time.perf_counter() < self._next_slice_at):
            return
        with self._cv:
            fn, future = self._tasks.popleft()
        if not future.set_running_or_notify_cancel():
            return
        t0 = time.perf_counter()
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - the caller's error, handed back to it
            future.set_exception(exc)
        spent = time.perf_counter() - t0
        cfg = self.config
        self._next_slice_at = time.perf_counter() + spent * (1 - cfg.prefill_share) / cfg.prefill_share
        self.stats["tasks"] += 1

    def _decode_step(self) -> None:
        for request in [r for r in self._running if r.aborted.is_set()]:
            self._finish(request, "abort")
        batch = list(self._running)
        if not batch:
            return
        ks = self.policy.choose(batch)
        self.stats["steps"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
        t0 = time.perf_counter()
        self._catch_up([r for r, k in zip(batch, ks) if k > 0])
        proposals = self._propose(batch, ks)
        if self.trim is not None:
            proposals = self.trim.cut(batch, proposals, self.policy.verify.fit())
        t1 = time.perf_counter()
        results = self._verify_and_accept(batch, proposals)
        t2 = time.perf_counter()
        self._commit(batch, ks, results)
        t3 = time.perf_counter()
        verified = sum(1 + (p.size if p is not None else 0) for p in proposals)
        self.policy.record(verified, t2 - t1, max(ks), (t1 - t0) + (t3 - t2))
        if self.trim is not None:
            for proposal, result in zip(proposals, results):
                self.trim.record(proposal, result.accept.num_accepted)
        for request, k, proposal, result in zip(batch, ks, proposals, results):
            m = request.metrics
            m.draft_seconds += (t1 - t0) + (t3 - t2)
            m.verify_seconds += t2 - t1
            m.record_step(k, result.accept.num_accepted, proposal.size if proposal is not None else 0)
            if k > 0:
                request.accepted += result.accept.num_accepted
                request.rejected += result.accept.num_accepted < k
            self._emit(request, result.tokens)

    # ----- the phases ----------------------------------------------------------------------------
    def _propose(self, batch: list[Request], ks: list[int]) -> list[Proposal | None]:
        drafting = [i for i, k in enumerate(ks) if k > 0]
        proposals: list[Proposal | None] = [None] * len(batch)
        if drafting:
            cap = self.config.step_draft_nodes
            sharing = sum(not batch[i].sampling.replayable for i in drafting)
            share = max(1, cap // sharing) if cap and sharing else None
            calls = [DraftRequest(batch[i].draft_state, ks[i], batch[i].sampling, batch[i].generator,
                                  None if batch[i].sampling.replayable else share) for i in drafting]
            for i, proposal in zip(drafting, self.engine.proposer.propose(calls)):
                proposals[i] = proposal
        return proposals

    def _verify_and_accept(self, batch: list[Request], proposals: list[Proposal | None]) -> list[StepResult]:
        engine = self.engine
        device = engine.target.device
        tokens = []
        for request, proposal in zip(batch, proposals):
            last = torch.tensor([request.output.token_ids[-1]], dtype=torch.long)
            tokens.append(torch.cat([last, proposal.tokens]) if proposal is not None else last)
        drafts = any(r.draft_state is not None for r in batch)
        layers = engine.proposer.needs.feature_layers if drafts else ()
        logits, feats = engine.target.verify([r.state for r in batch], [t.to(device) for t in tokens], layers,
                                             trees=proposals)
        results = []
        for request, proposal, lg, ft in zip(batch, proposals, logits, feats):
            accept = _accept(proposal, lg, request.sampling, request.generator)
            engine.target.keep_path(request.state, lg.shape[0], list(accept.path))
            emitted = accept.tokens(proposal.tokens if proposal is not None else _NO_DRAFT)
            # The target's features before each emitted token: at the root, then at each accepted node.
            rows = [0] + [i + 1 for i in accept.path]
            results.append(StepResult(accept, emitted, ft[rows] if ft is not None else None))
        return results

    def _commit(self, batch: list[Request], ks: list[int], results: list[StepResult]) -> None:
        """The draft learns what each step emitted. A request that did not draft this step
        keeps its results for later (`_catch_up`): plain steps cost the draft nothing."""
        pairs = []
        for request, k, result in zip(batch, ks, results):
            if request.draft_state is None:
                continue
            if k > 0:
                pairs.append((request.draft_state, result))
            else:
                request.pending_commits.append(result)
        if pairs:
            self.engine.proposer.commit([s for s, _ in pairs], [res for _, res in pairs])

    def _catch_up(self, drafting: list[Request]) -> None:
        """Before a request drafts again: the steps it decoded without drafting, in one commit."""
        late = [r for r in drafting if r.pending_commits]
        if not late:
            return
        merged = [StepResult(None, [t for res in r.pending_commits for t in res.tokens],
                             torch.cat([res.features for res in r.pending_commits])) for r in late]
        self.engine.proposer.commit([r.draft_state for r in late], merged)
        for r in late:
            r.pending_commits.clear()

    def _emit(self, request: Request, tokens: list[int]) -> None:
        delta = request.output.push(tokens)
        if delta.token_ids or delta.text:
            request.sink(self.engine._delta(delta))
        if delta.finish is not None:
            self._finish(request, delta.finish)
        elif request.aborted.is_set():
            self._finish(request, "abort")

    def _finish(self, request: Request, finish: str | None = None, error: BaseException | None = None) -> None:
        """The request leaves: its KV slot and draft state are freed before its reader hears."""
        if request.done:
            return
        request.done = True
        final = self.engine._final(request, finish) if error is None else error
        for queue in (self._running, self._prefilling, self._waiting):
            if request in queue:
                queue.remove(request)
        if request.slot is not None:
            request.slot.release()
        if request.draft_state is not None:
            try:
                self.engine.proposer.end(request.draft_state)
            except Exception:  # noqa: BLE001 - a remote draft that is gone already
                log.warning("draft state of request %d not released", request.id, exc_info=True)
        request.state = request.draft_state = request.job = request.inputs = request.processed = None
        request.slot = None
        request.sink(final)

    def _arena(self) -> KVArena:
        if self.arena is None:
            target = self.engine.target
            self.arena = KVArena.for_model(target.text_config, self.config.kv_cache_bytes, target.hf.dtype,
                                           target.device)
        return self.arena


_NO_DRAFT = torch.empty(0, dtype=torch.long)


def _accept(proposal: Proposal | None, logits: torch.Tensor, sampling: SamplingParams,
            generator: torch.Generator) -> AcceptResult:
    """The one acceptance path (trees, chains included); a step without drafts is acceptance
    of an empty tree."""
    tree = proposal if proposal is not None else DraftTree.chain(_NO_DRAFT)
    if sampling.greedy:
        return accept_tree_greedy(tree, logits)
    p = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return accept_tree_speculative(tree, p, generator)


def first_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    return draw_token(logits, sampling, generator)[0]
