"""The draft, served apart from the target: any replica can serve any request.

    target replica                                        draft replica (DraftWorker)
    RemoteDraftProposer.propose  -- DraftBatch -->        ONE batched commit of what the last
      (every request of the step)   [DraftStep, ...]      step emitted, ONE batched propose
                                 <-- [DraftReply, ...] -- per request: tokens (+ q, generator state)

One call per verify step for all of a target replica's drafting requests: the tokens each
request's previous step emitted (with the target's features) ride along with its part of the
batch. The batch is routed by the target replica's client id, so all of its sessions live on
one draft replica (rendezvous hashing of the id over the live replicas, services.ray_app): a
dead replica means those sessions rebuild on the next one, which the retried call reaches.

A replica that has not seen a request, or whose copy is stale or was evicted, answers that
request's part with `need_context`; the proposer then sends just those requests again, with
their draft context by a state-cache key (or inline, when the cache could not store it), and
the replica rebuilds them. When no replica answers `attempts` calls in a row, or the step has
waited `failover_s` on them (a dead deployment whose replacement is still starting, a hung
replica), the requests left draft with a colocated copy of the draft for the rest of their
lives, and for `retry_after_s` the requests that come after them do so at once, without
waiting on the replicas again. At temperature 0
the answer is the same whichever drafts (speculative decoding is lossless); with sampling,
each request's generator state (a seeded request's: its seed and output position) travels
with its part of every call, so its draws are the same as well. A request's part never depends on its neighbours': every request has its own
session, generator and reply, and the batched draft passes are per-request exact.

What comes back per request is what exact acceptance needs (DraftProbs): see there.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from sparrow.services.state_cache import StateCache
from sparrow.config import SamplingParams, SpecConfig
from sparrow.speculative.sparrow_proposer import SparrowProposer, SparrowState
from sparrow.speculative.draft_context import DraftContext, build_context
from sparrow.speculative.proposer import BeginInput, DraftRequest, DraftState, Pending, Proposal, StepResult
from sparrow.speculative.sampling import PositionNoise

log = logging.getLogger(__name__)


class DraftUnavailable(RuntimeError):
    """No draft replica answered (dead, unreachable, timed out)."""


@dataclass(slots=True)
class DraftStep:
    """One request's part of a call from a target to a draft replica."""

    session: str                          # the request's draft session
    length: int                           # context entries the replica holds once `commit_*` is applied
    commit_tokens: list[int]              # emitted by the last verify step(s), not yet sent
    commit_features: torch.Tensor | None  # (m, F*H) target features before each of them
    k: int                                # draft tokens wanted
    sampling: SamplingParams
    rng_state: torch.Tensor | None        # the request's generator state (sampling only)
    context_key: str | None = None        # rebuild from this state-cache entry first ...
    context: dict[str, torch.Tensor] | None = None   # ... or from these tensors
    noise_position: int | None = None     # a seeded request's next output position (sampling.PositionNoise)


@dataclass(slots=True)
class DraftBatch:
    """One call: every drafting request of one target replica's step."""

    client: str                           # the target replica's draft client: the routing key
    steps: list[DraftStep]


@dataclass(slots=True)
class DraftProbs:
    """A proposal's (k, V) float32 draft distributions on the wire, bit for bit (a tree's
    (M, V) rows the same way).

    Acceptance (accept_speculative) reads q_i(x_i) at every drafted position and the whole
    row q_n of the first rejected one, to draw from max(0, p_n - q_n); n is known only after
    the target's verify, and the proposal must be whole before it. So every row must arrive,
    and exactly: lossless sampling needs the q of acceptance to be the very q each draft token
    was drawn from (a bf16/fp16 copy, or a q recomputed on another device, is not).

    The rows go as float32 values, but only the nonzero ones, with their flat int32 indices,
    whenever that is smaller than the dense rows: a request whose own sampling is limited by
    top-k or top-p makes the draft draw from that truncated distribution (draw_token), so its
    rows hold at most ~top_k nonzeros: k x top_k x 8 bytes instead of k x V x 4. Writing the
    values into zeros gives back the identical tensor (zeros stay zeros, every other entry is
    the same float32), so acceptance and the seeded replay are exactly those of a colocated
    draft. Plain temperature sampling gives a dense float32 softmax; the remote placement has
    the draft draw from its own q cut to its most likely tokens instead (SpecConfig.draft_mass /
    draft_max_candidates, services.settings.REMOTE_DRAFT_CUT), which acceptance then reads, so
    its rows are sparse too and the output is still exactly the target's distribution
    (BENCHMARKS.md, remote draft bytes).
    """

    shape: tuple[int, int]                # (k, V)
    values: torch.Tensor                  # (k, V) dense, or (nnz,) the nonzero entries in row-major order
    index: torch.Tensor | None = None     # (nnz,) int32 flat indices into (k, V); None when dense

    @classmethod
    def encode(cls, probs: torch.Tensor) -> "DraftProbs":
        k, v = probs.shape
        probs = probs.detach().cpu()      # the wire carries host tensors; decode puts them on the target's device
        flat = probs.reshape(-1)
        index = flat.nonzero().squeeze(1)
        # 8 bytes a nonzero entry (int32 index + float32 value) against 4 bytes every entry.
        if index.numel() * 8 >= flat.numel() * flat.element_size() or k * v >= 1 << 31:
            return cls((k, v), probs)
        return cls((k, v), flat[index], index.to(torch.int32))

    def decode(self, device: torch.device | str = "cpu") -> torch.Tensor:
        if self.index is None:
            return self.values.to(device)
        k, v = self.shape
        dense = torch.zeros(k * v, dtype=self.values.dtype)
        dense[self.index.long()] = self.values
        return dense.view(k, v).to(device)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (self.index.nbytes if self.index is not None else 0)


@dataclass(slots=True)
class DraftReply:
    """One request's part of the answer to a DraftBatch."""

    tokens: torch.Tensor | None = None    # (N,) long: the proposal's nodes (a chain: N = k)
    probs: DraftProbs | None = None       # (M, V) when sampling
    rng_state: torch.Tensor | None = None
    need_context: bool = False
    parents: torch.Tensor | None = None   # a draft tree's shape (sparrow.speculative.tree.DraftTree); None: a chain
    draw: torch.Tensor | None = None


@dataclass(slots=True, weakref_slot=True)
class DraftSession:
    """One request's draft state on one replica."""

    id: str = ""
    state: object | None = None           # SparrowState
    length: int = 0
    touched: float = 0.0                  # time.monotonic() of the last step

    def clear(self) -> None:
        self.state, self.length = None, 0


@dataclass(eq=False, slots=True, weakref_slot=True)
class DraftSessions:
    """The sessions of one target replica's requests on one draft replica. The lock keeps a
    retried batch (the target timed out and called again) from running beside the one it
    replaces: the second then finds the sessions one step ahead and asks for their context."""

    client: str = ""
    by_id: dict[str, DraftSession] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def end(self, session: str) -> None:
        self.by_id.pop(session, None)

    def drop_idle(self, now: float, idle_s: float) -> None:
        """Forget sessions idle for idle_s; skipped while a step runs (the caller must not wait)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            for sid, session in list(self.by_id.items()):
                if now - session.touched > idle_s:
                    del self.by_id[sid]
        finally:
            self.lock.release()

    def live(self, now: float) -> dict[str, float]:
        """Session id -> seconds since its last step, for sessions that hold draft state."""
        return {sid: now - s.touched for sid, s in list(self.by_id.items()) if s.state is not None}


class DraftWorker:
    """Serves DraftBatches with a SparrowProposer; holds no video and no target."""

    def __init__(self, proposer: SparrowProposer, cache: StateCache):
        self.proposer, self.cache = proposer, cache

    def step(self, sessions: DraftSessions, batch: DraftBatch) -> list[DraftReply]:
        """Rebuild the requests that carry a context, ONE batched commit for those with new
        tokens, ONE batched propose for every request that is in step; the others are
        answered need_context."""
        with sessions.lock:
            now = time.monotonic()
            parts = [sessions.by_id.setdefault(call.session, DraftSession(call.session)) for call in batch.steps]
            for session in parts:
                session.touched = now
            ready = [i for i, (session, call) in enumerate(zip(parts, batch.steps)) if self._in_step(session, call)]
            commits = [i for i in ready if batch.steps[i].commit_tokens]
            if commits:
                self.proposer.commit([parts[i].state for i in commits],
                                     [StepResult(None, batch.steps[i].commit_tokens, batch.steps[i].commit_features)
                                      for i in commits])
                for i in commits:
                    parts[i].length += len(batch.steps[i].commit_tokens)
            generators = [_generator(batch.steps[i].rng_state) for i in ready]
            proposals = self.proposer.propose([DraftRequest(parts[i].state, batch.steps[i].k, batch.steps[i].sampling, g,
                                                            noise=_noise(batch.steps[i]))
                                               for i, g in zip(ready, generators)]) if ready else []
            replies = [DraftReply(need_context=True) for _ in batch.steps]
            for i, g, proposal in zip(ready, generators, proposals):
                probs = DraftProbs.encode(proposal.probs) if proposal.probs is not None else None
                rng = g.get_state() if batch.steps[i].rng_state is not None else None
                replies[i] = DraftReply(proposal.tokens, probs, rng, parents=proposal.parents, draw=proposal.draw)
            return replies

    def _in_step(self, session: DraftSession, call: DraftStep) -> bool:
        """Whether the session can draft for this call: rebuilt from the context the call
        carries, or already holding the `call.length - len(call.commit_tokens)` entries the
        call's commits extend."""
        if call.context is not None or call.context_key is not None:
            tensors = call.context if call.context is not None else self.cache.get(call.context_key)
            if tensors is None:                     # evicted, expired or the cache is down
                return False
            try:
                ctx = DraftContext.from_tensors(tensors)
                session.state, session.length = self.proposer.begin_context(ctx), ctx.token_ids.shape[0]
            except Exception:  # noqa: BLE001 - one request's bad context must not fail its neighbours' call
                log.warning("draft session %s: context not usable", call.session, exc_info=True)
                session.clear()
                return False
            return True
        # never seen here, or out of step (a call this replica never got, or a retried one)
        return session.state is not None and session.length + len(call.commit_tokens) == call.length


def _noise(step: DraftStep) -> PositionNoise | None:
    """A seeded request's position noise, as the target holds it: the same draws as colocated."""
    if step.noise_position is None or step.sampling.seed is None:
        return None
    noise = PositionNoise(step.sampling.seed)
    noise.position = step.noise_position
    return noise


def _generator(rng_state: torch.Tensor | None) -> torch.Generator:
    generator = torch.Generator()
    if rng_state is not None:
        generator.set_state(rng_state)
    return generator


class LocalDraftClient:
    """A DraftWorker in this process, sessions kept per target client as a replica keeps
    them: the transport-free client (tests, benchmarks)."""

    def __init__(self, worker: DraftWorker):
        self.worker = worker
        self.clients: dict[str, DraftSessions] = {}

    def step(self, batch: DraftBatch, timeout_s: float | None = None) -> list[DraftReply]:
        return self.worker.step(self.clients.setdefault(batch.client, DraftSessions(batch.client)), batch)

    def end(self, client: str, session: str) -> None:
        if client in self.clients:
            self.clients[client].end(session)

    def live_sessions(self) -> int:
        return sum(len(s.by_id) for s in self.clients.values())


@dataclass(slots=True)
class RemoteDraftState(DraftState):
    session: str
    context: DraftContext                  # what begin() was given: the prompt part
    tokens: list[int] = field(default_factory=list)       # every token committed since
    recent: deque = field(default_factory=deque)          # features (F*H,) of the last `window` commits
    pending: Pending = field(default_factory=Pending)     # committed, sent with the next call (proposer.py)
    rebuild: bool = True                   # the next call must carry the context
    inline: bool = False                   # ... as tensors: the state cache did not keep it
    cache_keys: list[str] = field(default_factory=list)
    local: SparrowState | None = None      # the colocated fallback's state, once in use
    failovers: int = 0

    @property
    def length(self) -> int:
        return self.context.token_ids.shape[0] + len(self.tokens)

    def kv_bytes(self) -> int:
        """The colocated fallback's draft KV once in use; a draft replica's KV is not this process's (0)."""
        return self.local.kv_bytes() if self.local is not None else 0

    def max_keys(self) -> int:
        return self.local.max_keys() if self.local is not None else 0


@dataclass(frozen=True, slots=True)
class RemoteDraftStats:
    """How a target replica's remote draft has fared, for operators (all zero for a draft in
    the target's process)."""

    failovers: int = 0              # calls that failed and were retried
    timeouts: int = 0               # ... of them, calls that got no answer within the step's bound
    fallbacks: int = 0              # requests that finished with the colocated draft
    rebuilds: int = 0               # request parts a replica answered with need_context
    sessions: tuple[str, ...] = ()  # draft sessions of running requests, sorted


class RemoteDraftProposer:
    """The Proposer contract (sparrow.speculative.proposer) with the draft on draft replicas.

    client: `step(DraftBatch, timeout_s) -> list[DraftReply]` (raises on an unreachable
    replica, and when no answer came within timeout_s) and `end(client_id, session)`.
    fallback: a colocated SparrowProposer, used for the rest of a request once `attempts` calls
    in a row, or `failover_s` of one step, got it no proposal.
    """

    def __init__(self, client, fallback: SparrowProposer, spec: SpecConfig, cache: StateCache,
                 attempts: int = 3, context_ttl_s: float = 600.0, failover_s: float = 1.0,
                 retry_after_s: float = 10.0):
        self.client, self.fallback, self.spec, self.cache = client, fallback, spec, cache
        self.needs = fallback.needs
        self.attempts, self.context_ttl_s = attempts, context_ttl_s
        self.failover_s, self.retry_after_s = failover_s, retry_after_s
        self.down_until = 0.0     # time.monotonic() until which the replicas are not waited on (they just failed)
        self.client_id = uuid.uuid4().hex   # this target replica's sessions all go where this id is routed
        self.device = next(fallback.draft.parameters()).device    # where acceptance reads the draft's q
        self.failovers = 0        # calls that failed and were retried (for operators)
        self.timeouts = 0         # ... of them, calls that got no answer in time (a slow replica, not a lost one)
        self.fallbacks = 0        # requests that finished with the colocated draft
        self.rebuilds = 0         # request parts a replica answered with need_context (new to it, or stale)
        self.sessions: set[str] = set()   # draft sessions of running requests

    def stats(self) -> RemoteDraftStats:
        return RemoteDraftStats(self.failovers, self.timeouts, self.fallbacks, self.rebuilds, tuple(sorted(self.sessions)))

    def begin(self, start: BeginInput) -> RemoteDraftState:
        spec = self.spec
        return self.begin_context(build_context(start.prefill, start.first_token, spec.glimpse, spec.draft_context,
                                                spec.prune_keep))

    def begin_context(self, ctx: DraftContext) -> RemoteDraftState:
        # A full-attention context ("all"/"pruned") reads every commit: keep them all.
        keep = self.spec.window if self.spec.draft_context == "text" else None
        state = RemoteDraftState(uuid.uuid4().hex, ctx, recent=deque(maxlen=keep))
        self.sessions.add(state.session)
        self._publish(state)      # the replica that takes the first call rebuilds from the state cache
        return state

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        """One call for every remotely drafted request of the step; a second (and third)
        call carries only the requests the first could not serve; the colocated draft serves,
        in one batched pass, those no call served and those already drafting locally."""
        proposals: list[Proposal | None] = [None] * len(batch)
        pending = [i for i, r in enumerate(batch) if r.state.local is None]
        start = time.monotonic()
        failed = bool(pending) and start < self.down_until          # they just failed: do not wait on them again yet
        for _ in range(0 if failed else self.attempts):
            left = self.failover_s - (time.monotonic() - start)
            if not pending or left <= 0:
                break
            pending, failed = self._call_replicas(batch, pending, proposals, left)
        if pending:
            if failed and start >= self.down_until:
                self.down_until = time.monotonic() + self.retry_after_s
            log.warning("no draft replica answered %d request(s) in %.2f s; drafting them in this process for the "
                        "rest of their lives", len(pending), time.monotonic() - start)
            self.fallbacks += len(pending)
            for i in pending:
                batch[i].state.local = self.fallback.begin_context(self._context_now(batch[i].state))
        local = [i for i in range(len(batch)) if proposals[i] is None]
        if local:
            drafts = self.fallback.propose([DraftRequest(batch[i].state.local, batch[i].k, batch[i].sampling,
                                                         batch[i].generator, noise=batch[i].noise) for i in local])
            for i, proposal in zip(local, drafts):
                proposals[i] = proposal
        return proposals

    def commit(self, states: list[RemoteDraftState], results: list[StepResult]) -> None:
        local = [(s, r) for s, r in zip(states, results) if s.local is not None]
        if local:
            self.fallback.commit([s.local for s, _ in local], [r for _, r in local])
        for state, result in zip(states, results):
            if state.local is None:     # goes with the request's next call
                state.tokens.extend(result.tokens)
                state.recent.extend(result.features)
                state.pending.add(result)

    def end(self, state: RemoteDraftState) -> None:
        """Free the request's state on the draft replica and in the cache (best effort:
        replicas also drop idle sessions, and cache entries expire)."""
        self.sessions.discard(state.session)
        try:
            self.client.end(self.client_id, state.session)
        except Exception as exc:  # noqa: BLE001 - the replica may be gone
            log.info("draft session %s not ended on its replica: %s", state.session, exc)
        for key in state.cache_keys:
            self.cache.delete(key)

    # ----- helpers -------------------------------------------------------------------------------
    def _call_replicas(self, batch: list[DraftRequest], pending: list[int], proposals: list[Proposal | None],
                       timeout_s: float) -> tuple[list[int], bool]:
        """One DraftBatch for the requests `pending` (indices into batch), answered within
        timeout_s; fills their proposals and returns the ones still without one, and whether
        the call failed (no answer at all)."""
        calls = [self._call(batch[i].state, batch[i].k, batch[i].sampling, batch[i].generator, batch[i].noise)
                 for i in pending]
        try:
            replies = self.client.step(DraftBatch(self.client_id, calls), timeout_s)
            if len(replies) != len(calls):
                raise DraftUnavailable(f"{len(replies)} replies to a batch of {len(calls)}")
        except Exception as exc:  # noqa: BLE001 - any transport failure: try another replica
            log.warning("draft replica failed (%s: %s); retrying", type(exc).__name__, exc)
            self.failovers += 1
            self.timeouts += isinstance(exc, TimeoutError)
            for i in pending:
                batch[i].state.failovers += 1
                self._publish(batch[i].state)     # the sessions rebuild wherever the next call lands
            return pending, True
        retry = []
        for i, reply in zip(pending, replies):
            state = batch[i].state
            if reply.need_context:
                self.rebuilds += 1
                if state.rebuild:
                    state.inline = True      # the replica could not read the context from the cache
                else:
                    self._publish(state)     # the replica has not seen this request, or lost it
                retry.append(i)
                continue
            state.pending, state.rebuild = Pending(), False
            if reply.rng_state is not None:
                batch[i].generator.set_state(reply.rng_state)
            probs = reply.probs.decode(self.device) if reply.probs is not None else None
            proposals[i] = Proposal(reply.tokens, probs, reply.parents, reply.draw)
        return retry, False

    def _publish(self, state: RemoteDraftState) -> None:
        """The next call carries the context as it is now: by cache key when it can be stored."""
        state.rebuild = True
        state.inline = state.inline or not self.cache.shared    # replicas cannot read this process's memory
        if not state.inline:
            key = f"draftctx:{state.session}:{state.length}"
            if self.cache.put(key, self._context_now(state).to_tensors(), self.context_ttl_s):
                state.cache_keys.append(key)
            else:
                state.inline = True

    def _call(self, state: RemoteDraftState, k: int, sampling: SamplingParams, generator,
              noise: PositionNoise | None) -> DraftStep:
        rng = None if sampling.greedy or noise is not None else generator.get_state()
        position = noise.position if noise is not None else None
        if state.rebuild:
            context = self._context_now(state).to_tensors() if state.inline else None
            key = None if state.inline else state.cache_keys[-1]
            return DraftStep(state.session, state.length, [], None, k, sampling, rng, key, context, position)
        features = torch.cat(state.pending.features) if state.pending.features else None
        return DraftStep(state.session, state.length, list(state.pending.tokens), features, k, sampling, rng,
                         noise_position=position)

    def _context_now(self, state: RemoteDraftState) -> DraftContext:
        """The prompt context plus every commit since. begin() reads only the anchors (in
        the prompt part) and the last `window` entries, so zeros stand in for the features of
        older commits: the proposer keeps a bounded log, however long the answer."""
        ctx, n = state.context, len(state.tokens)
        features = ctx.features.new_zeros(n, ctx.features.shape[1])          # (n, F*H)
        if state.recent:
            features[n - len(state.recent):] = torch.stack(list(state.recent))
        token_ids = torch.cat([ctx.token_ids, torch.tensor(state.tokens, dtype=torch.long, device=ctx.token_ids.device)])
        return DraftContext(token_ids, torch.cat([ctx.features, features]), ctx.num_prompt, ctx.glimpse,
                            ctx.num_visual)
