"""The scheduler: one per engine, owning every running request (continuous batching).

    submit -> prepare (a worker thread: video decode, prompt, prefix-cache lookup; a request
              whose video's first prefill is running waits for it, then reads the cache)
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

A request's tokens depend only on its own inputs and seed: greedy output and seeded sampled
output (Gumbel-max under noise keyed by seed and position, speculative/sampling.py) are those
of plain decoding whatever k, tree or batch a step gives it, so the policy adapts every
request's k; an unseeded sampled request draws from its own generator. Requests join and
leave between steps; one request's error, abort or stop ends that request only.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from .config import EngineConfig, SamplingParams
from .draft_policy import DraftPolicy, TreeTrim
from .errors import ResourceExhausted
from .model_runner import ModelRunner
from .output import TokenDelta
from .prefix_cache import PrefillsInFlight, PrefixEntry
from .request import Request
from .scheduler_exit import stopped_at_exit
from .step_costs import CostModel
from .tuning_gate import GATE as TUNING_GATE

log = logging.getLogger(__name__)

FIRST_SLICE = 256      # prompt positions of the engine's first prefill slice while streams decode
ALONE_SLICES = 4       # a prefill alone runs slices of about this many prefill_slice_s
SLICE_GROWTH = 2       # a prefill's slice at most this many times its previous one's positions
STARVED_SLICES = 5     # a prefill that waited this many prefill_slice_s since its last slice goes first



class Scheduler:
    def __init__(self, runner: ModelRunner, config: EngineConfig, costs: CostModel | None = None):
        self.runner, self.config = runner, config
        spec, drafts = runner.spec, runner.proposer is not None
        self.trim = TreeTrim() if spec.adaptive_tree and drafts else None
        self.policy = DraftPolicy(spec.num_draft_tokens if drafts else 0, spec.adaptive_k, costs,
                                  measure=spec.adaptive_k or self.trim is not None)   # costs read by k or the cut
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._ready: deque[Request] = deque()        # prepared, handed over by worker threads
        self._waiting: deque[Request] = deque()      # waiting for KV memory (scheduler thread only)
        self._prefilling: deque[Request] = deque()
        self._running: list[Request] = []
        self._to_prepare: deque[Request] = deque()   # submitted, not yet prepared
        self._in_flight = PrefillsInFlight()         # video keys being prefilled, and who waits for them
        # call_soon work (live ingest), one queue per key (a live session), served round-robin
        self._tasks: dict[Any, deque[tuple[Callable[[], Any], Future]]] = {}
        self._preparers = 0                          # worker threads preparing them
        self.turn_done: list[Callable[[], None]] = []  # called on this thread after each phase of a turn
        self._thread: threading.Thread | None = None
        self._closed = False
        self._next_slice_at = 0.0                    # perf_counter time the next prefill slice may run
        self._fresh_s_per_token = 0.0                # a first slice's seconds per position, last measured
        # Counters for operators and tests: decode steps, the largest batch, requests that had
        # to wait for KV memory, prefill slices run, prefills finished in a shared forward (with
        # others); requests that ended (abort, deadline) before their preparation began, while it
        # ran (stopped at the next packet, or before the patchify), or after its last check (the
        # patchify or prompt build then wasted); requests that waited for their video's running
        # prefill instead of prefilling it again; slots given back with their video's rows in place.
        self.stats = {"steps": 0, "max_batch": 0, "waited_for_memory": 0, "prefill_slices": 0, "tasks": 0,
                      "prefills_together": 0, "ended_before_prepare": 0, "ended_while_preparing": 0,
                      "prepared_dead": 0, "waited_for_prefill": 0, "prefix_in_place": 0}

    # ----- submission (any thread) ---------------------------------------------------------------
    def submit(self, video, prompt: str, sampling: SamplingParams, options, video_key: str | None,
               num_draft_tokens: int | None, sink: Callable[[Any], None], entry: PrefixEntry | None = None,
               first_token_ids: tuple[int, ...] = (), deadline: float | None = None) -> Request:
        request = Request(next(self._ids), video, prompt, sampling, options, video_key, num_draft_tokens, sink)
        request.entry, request.first_token_ids, request.aborted.deadline = entry, first_token_ids, deadline
        if self._closed:
            raise RuntimeError("the engine is closed")
        with self._cv:
            queued = len(self._to_prepare) + len(self._waiting) + len(self._ready) + len(self._in_flight)
            if queued >= self.config.max_waiting + self.config.max_running:
                raise ResourceExhausted(f"{queued} requests are already waiting; try again later")
            self._to_prepare.append(request)
            self._add_preparers(1)
        return request

    def _add_preparers(self, n: int) -> None:
        """Under _cv: a worker thread for each of `n` requests just queued, up to prepare_threads."""
        for _ in range(min(n, self.config.prepare_threads - self._preparers)):
            self._preparers += 1
            self._start(threading.Thread(target=self._prepare_loop, name="sparrow-prepare", daemon=True))

    def call_soon(self, fn: Callable[[], Any], key: Any = None) -> Future:
        """Run `fn` on the scheduler thread between steps (work that uses the target model
        outside a request: a live session's frame prefill). It is paced like a prefill slice:
        while streams decode, tasks and prefill slices share about prefill_share of the time.
        Tasks of one `key` (a live session) run in order; keys take turns, one task each
        (round-robin), so one session's backlog never delays another's frames. Keep a task
        short (one slice). The future gets its result or exception."""
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._tasks.setdefault(key, deque()).append((fn, future))
            self._ensure_thread()
            self._cv.notify_all()
        return future

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling)

    def idle(self) -> bool:
        """Nothing held: no request being prepared, waiting, prefilling or decoding, no task queued."""
        with self._cv:
            return not (self._to_prepare or self._in_flight.waiting() or self._ready or self._waiting
                        or self._prefilling or self._running or self._tasks)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def shutdown(self) -> None:
        """Close and abort every request it holds (their threads then end at the next step)."""
        self.close()
        with self._cv:
            held = [*self._to_prepare, *self._in_flight.waiting(), *self._ready, *self._waiting,
                    *self._prefilling, *self._running]
        for request in held:
            request.abort()

    def _start(self, thread: threading.Thread) -> None:
        stopped_at_exit(self, thread)
        thread.start()

    # ----- preparation (at most prepare_threads worker threads, gone when idle) ---------------
    def _prepare_loop(self) -> None:
        while True:
            with self._cv:
                if not self._to_prepare:
                    self._preparers -= 1
                    return
                request = self._to_prepare.popleft()
                if self._waits_for_prefill(request):
                    continue
            # An ended request costs nothing more: not prepared at all, or its decode stopped at
            # the next packet (RequestAborted); admission then finishes it as "abort".
            if request.aborted.is_set():
                self.stats["ended_before_prepare"] += 1
            else:
                try:
                    self.runner.prepare(request)
                except BaseException as exc:  # noqa: BLE001 - handed to the request's reader
                    if not request.aborted.is_set():
                        request.sink(exc)
                        self._settle(request, finished=False)
                        continue
                    self.stats["ended_while_preparing"] += 1
                else:
                    if request.aborted.is_set():       # ended just as its preparation finished
                        self.stats["prepared_dead"] += 1
            with self._cv:
                self._ready.append(request)
                self._ensure_thread()
                self._cv.notify_all()

    def _waits_for_prefill(self, request: Request) -> bool:
        """Under _cv: True when the request's video is being prefilled for another request (it
        waits for that prefill, then reads the prefix cache); otherwise a request whose video
        is not cached leads its key, and later requests for it wait for this one."""
        cache, key = self.runner.prefix_cache, request.video_key
        if cache is None or key is None or request.entry is not None or request.aborted.is_set():
            return False
        if self._in_flight.join(key, request, cached=key in cache):
            self.stats["waited_for_prefill"] += 1
            self._ensure_thread()                     # its loop ends a waiter that aborts
            return True
        return False

    def _settle(self, request: Request, finished: bool) -> None:
        """The request's video prefill is done (`finished`: its prefix went to the cache if it
        fits there) or will never be: whoever waited for it goes on to be prepared, first in
        line (an ended leader's first waiter leads and prefills the video itself)."""
        with self._cv:
            key = self._in_flight.leads(request)
            cached = finished and key is not None and key in self.runner.prefix_cache
            going = self._in_flight.settle(request, finished, cached)
            self._to_prepare.extendleft(reversed(going))
            self._add_preparers(len(going))

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="sparrow-scheduler", daemon=True)
            self._start(self._thread)

    # ----- the loop (the scheduler thread) -----------------------------------------------------
    def _loop(self) -> None:
        idle_since = None
        while True:
            with self._cv:
                self._waiting.extend(self._ready)
                self._ready.clear()
                ended = self._in_flight.drop(lambda r: r.aborted.is_set())    # admission ends them
                self.stats["ended_before_prepare"] += len(ended)
                self._waiting.extend(ended)
                busy = bool(self._waiting or self._prefilling or self._running or self._tasks)
                if not busy:
                    # An idle scheduler lets its thread go (a later submit starts another), unless
                    # requests wait for a prefill still being prepared (an abort ends them here).
                    idle_since = idle_since or time.monotonic()
                    if not len(self._in_flight) and (self._closed or time.monotonic() - idle_since > 2.0):
                        self._thread = None
                        return
                    self._cv.wait(timeout=0.5)
                    continue
            idle_since = None
            try:
                self._admit()
                with TUNING_GATE.serving():       # a path tuner's timed calls go between turns
                    # each phase's events go out as it ends: a first token is not held behind a step
                    for phase in (self._prefill_slice, self._run_task, self._decode_step):
                        phase()
                        self._phase_done()
            except Exception as exc:  # noqa: BLE001 - a failed batched forward fails the requests in it
                log.exception("scheduler step failed")
                for request in list(self._running) + list(self._prefilling):
                    self._finish(request, error=exc)
            self._phase_done()

    def _phase_done(self) -> None:
        for done in self.turn_done:
            done()

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _admit(self) -> None:
        """Waiting requests get a KV slot in arrival order, while memory and max_running allow."""
        cfg = self.config
        # Ended requests leave every queue at once (not when they reach its head): their KV
        # slots and prefill jobs are freed within one loop turn.
        for request in [r for r in (*self._waiting, *self._prefilling) if r.aborted.is_set()]:
            self._finish(request, "abort")
        while self._waiting:
            request = self._waiting[0]
            if self.num_running >= cfg.max_running:
                return
            slot = self.runner.arena.allocate(request.capacity, request.entry.prefix if request.entry else None)
            if slot is None:
                if not request.waited:
                    request.waited = True
                    self.stats["waited_for_memory"] += 1
                waited = time.monotonic() - request.submitted
                if waited > cfg.queue_timeout_s:
                    self._waiting.popleft()
                    self._finish(request, error=ResourceExhausted(
                        f"waited {waited:.1f} s for {request.capacity} tokens of KV memory "
                        f"({self.runner.arena.free_tokens} of {self.runner.arena.tokens} free); try again later"))
                    continue
                return
            self._waiting.popleft()
            request.slot = slot
            self.stats["prefix_in_place"] += slot.preloaded is not None     # its video's rows were still there
            request.prefill_turn_at = time.perf_counter()
            try:
                request.job = self.runner.prefill_job(request)
            except Exception as exc:  # noqa: BLE001 - this request's inputs, not the engine's
                self._finish(request, error=exc)
                continue
            self._prefilling.append(request)

    def _prefill_slice(self) -> None:
        """One chunk of one prefill: a long prompt is spread over several loop turns. The
        prefill with the fewest positions left goes first (a short question is not queued
        behind a 25k-token video), except that one that has waited STARVED_SLICES x
        prefill_slice_s since its last slice goes first (a long prefill is never starved, and
        a short one is not made to wait for the long one's turn mid-way). While streams
        decode or other prefills wait, a slice is sized to about prefill_slice_s: from the
        measured seconds per position of the request's last slice (it grows with the cached
        length, so a slice is at most SLICE_GROWTH x the last one's positions), and for a
        request's first slice from the last first slice measured (a short question's whole
        prompt is one slice, not a probe and a rest with another prefill's turn between);
        while streams decode, slices also wait their turn so that prefill takes about
        prefill_share of the time. Alone, a prefill runs slices of about ALONE_SLICES x
        prefill_slice_s (at most a chunk): a request that arrives meanwhile waits at most that
        for its first slice."""
        if not self._prefilling:
            return
        cfg, now = self.config, time.perf_counter()
        if self._running and now < self._next_slice_at:
            return
        request = self._next_prefill()
        if request.aborted.is_set():
            self._prefilling.remove(request)
            self._finish(request, "abort")
            return
        limit, per_token = None, request.prefill_s_per_token or self._fresh_s_per_token
        if self._running or len(self._prefilling) > 1:     # nothing measured yet: a probe of FIRST_SLICE
            limit = max(16, int(cfg.prefill_slice_s / per_token)) if per_token else FIRST_SLICE
        elif per_token:                          # alone: longer slices, still short enough for a newcomer
            limit = max(16, int(ALONE_SLICES * cfg.prefill_slice_s / per_token))
        if request.job.short:
            self._finish_short(request, limit)
            return
        if limit is not None and request.prefill_last_slice:
            limit = min(limit, SLICE_GROWTH * request.prefill_last_slice)
        start, first = request.job.cursor, not request.prefill_last_slice
        t0 = time.perf_counter()
        try:
            done = request.job.step(limit)
        except Exception as exc:  # noqa: BLE001 - e.g. a vision tower that rejects this video
            self._prefilling.remove(request)
            self._finish(request, error=exc)
            return
        spent = time.perf_counter() - t0
        request.metrics.prefill_seconds += spent
        request.prefill_last_slice = max(1, request.job.cursor - start)
        request.prefill_s_per_token = spent / request.prefill_last_slice
        request.prefill_turn_at = time.perf_counter()
        if first:
            self._fresh_s_per_token = request.prefill_s_per_token
        self._next_slice_at = time.perf_counter() + spent * (1 - cfg.prefill_share) / cfg.prefill_share
        self.stats["prefill_slices"] += 1
        if done:
            self._prefilling.remove(request)
            self._start_decoding(request)

    def _finish_short(self, first: Request, limit: int | None) -> None:
        """`first`'s prefill is short (at most TOGETHER_ROWS positions left: a question after a
        cached video): it finishes in one forward with every other short prefill (fewest positions
        first) that fits in about one slice's positions (`limit`; None: no bound), as decode
        steps batch requests; the forward is paced as one slice."""
        group, rows = [first], first.job.remaining
        for other in sorted(self._prefilling, key=lambda r: r.job.remaining):
            n = other.job.remaining
            if other is not first and other.job.short and not other.aborted.is_set() \
                    and (limit is None or rows + n <= limit):
                group.append(other)
                rows += n
        ready = []
        for request in group:               # each one's embeddings first: its error is its own
            try:
                request.job.embed()
            except Exception as exc:  # noqa: BLE001 - this request's inputs, not the engine's
                self._prefilling.remove(request)
                self._finish(request, error=exc)
            else:
                ready.append(request)
        if not ready:
            return
        fresh = any(not r.prefill_last_slice for r in ready)
        positions = {r.id: r.job.remaining for r in ready}
        rows = sum(positions.values())
        t0 = time.perf_counter()
        try:
            self.runner.finish_prefills(ready)
        except Exception as exc:  # noqa: BLE001 - the shared forward failed: every request in it
            for request in ready:
                self._prefilling.remove(request)
                self._finish(request, error=exc)
            return
        spent = time.perf_counter() - t0
        cfg, per_token = self.config, spent / rows
        for request in ready:
            request.prefill_last_slice = max(1, positions[request.id])
            request.metrics.prefill_seconds += per_token * positions[request.id]
            request.prefill_s_per_token = per_token
        if fresh:
            self._fresh_s_per_token = per_token
        self._next_slice_at = time.perf_counter() + spent * (1 - cfg.prefill_share) / cfg.prefill_share
        self.stats["prefill_slices"] += 1
        self.stats["prefills_together"] += len(ready) if len(ready) > 1 else 0
        for request in ready:
            self._prefilling.remove(request)
            self._start_decoding(request)

    def _start_decoding(self, request: Request) -> None:
        """A request's prefill is done: its first token, and it joins the decode batch."""
        try:
            first = self.runner.start_decoding(request)
        except Exception as exc:  # noqa: BLE001
            self._finish(request, error=exc)
            return
        self._settle(request, finished=True)
        self._running.append(request)
        self._emit(request, [first])

    def _next_prefill(self) -> Request:
        """The prefill whose slice runs next: fewest positions left (ties: the oldest), unless
        one has waited STARVED_SLICES x prefill_slice_s for a slice (the longest waiting)."""
        starved = time.perf_counter() - STARVED_SLICES * self.config.prefill_slice_s
        waiting = min(self._prefilling, key=lambda r: r.prefill_turn_at)
        if waiting.prefill_turn_at < starved:
            return waiting
        return min(self._prefilling, key=lambda r: r.job.end - r.job.cursor)     # min keeps the first of ties

    def _run_task(self) -> None:
        """One call_soon task (the next key's turn), paced like a prefill slice while streams decode."""
        if not self._tasks or (self._running and time.perf_counter() < self._next_slice_at):
            return
        with self._cv:
            # The key whose turn it is goes to the back of the turns (a dict keeps insertion order).
            key = next(iter(self._tasks))
            queue = self._tasks.pop(key)
            fn, future = queue.popleft()
            if queue:
                self._tasks[key] = queue
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
        """One step for the running batch: decide each request's k, then the runner's phases
        (propose -> verify + accept -> commit), then each request's tokens go out."""
        for request in [r for r in self._running if r.aborted.is_set()]:
            self._finish(request, "abort")
        batch = list(self._running)
        if not batch:
            return
        ks = self.policy.choose(batch)
        proposals = self.runner.propose(batch, ks)
        if self.trim is not None:
            proposals = self.trim.cut(batch, proposals, self.policy.linear_costs(batch))
        results = self.runner.verify(batch, proposals)
        self.runner.commit(batch, results)
        self._record(batch, ks, proposals, results)
        for request, result in zip(batch, results):
            self._emit(request, result.tokens)

    def _record(self, batch: list[Request], ks: list[int], proposals: list, results: list) -> None:
        """What the step measured: the policies' cost fits, each request's metrics and acceptance."""
        times = self.runner.times
        self.stats["steps"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
        rows = [1 + (p.size if p is not None else 0) for p in proposals]
        self.policy.record(batch, rows, times.verify_s, max(ks), times.draft_s, ks,
                           [res.accept.num_accepted for res in results])
        if self.trim is not None:
            self.trim.record(proposals, [res.accept.num_accepted for res in results])
        policy_s = self.policy.lap() + (self.trim.lap() if self.trim is not None else 0.0)
        for request, k, proposal, result in zip(batch, ks, proposals, results):
            m = request.metrics
            m.draft_seconds, m.verify_seconds = m.draft_seconds + times.draft_s, m.verify_seconds + times.verify_s
            m.policy_seconds += policy_s
            m.record_step(k, result.accept.num_accepted, proposal.size if proposal is not None else 0,
                          emitted=request.output.kept(result.tokens))   # the policies learn from the raw count

    def _emit(self, request: Request, tokens: list[int]) -> None:
        delta = request.output.push(tokens)
        if delta.token_ids or delta.text:
            request.sink(TokenDelta(delta.token_ids, delta.text))
        if delta.finish is not None:
            self._finish(request, delta.finish)
        elif request.aborted.is_set():
            self._finish(request, "abort")

    def _finish(self, request: Request, finish: str | None = None, error: BaseException | None = None) -> None:
        """The request leaves: its KV slot and draft state are freed before its reader hears."""
        if request.done:
            return
        request.done = True
        self._settle(request, finished=False)
        final = self.runner.final(request, finish) if error is None else error
        for queue in (self._running, self._prefilling, self._waiting):
            if request in queue:
                queue.remove(request)
        try:
            self.runner.release(request)
        except Exception:  # noqa: BLE001 - a remote draft that is gone already
            log.warning("draft state of request %d not released", request.id, exc_info=True)
        request.sink(final)
