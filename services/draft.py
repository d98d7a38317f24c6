"""The draft, served apart from the target: any replica can serve any request.

    target replica                                   draft replica (DraftWorker)
    RemoteDraftProposer.propose  -- DraftStep -->    commit last step's tokens, propose k
                                 <-- DraftReply --   tokens (+ probs, generator state)

One call per verify step: the tokens the previous step emitted (with the target's features)
ride along with the request for the next proposal. A replica that has not seen the request,
or whose copy is stale, answers `need_context`; the proposer then sends the request's draft
context by a state-cache key (or inline, when the cache could not store it) and the replica
rebuilds from it. So a replica dying costs a retry elsewhere, and when no replica answers
the proposer drafts with a colocated copy of the draft. At temperature 0 the answer is the
same whichever drafts (speculative decoding is lossless); with sampling, the request's
generator state travels with each call, so the draw sequence is the same as well.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from sparrow.state_cache import StateCache
from sparrow.config import SamplingParams, SpecConfig
from sparrow.spec.propose import DraftContext, SparrowProposer, build_context
from sparrow.spec.proposer import BeginInput, DraftRequest, Proposal, StepResult

log = logging.getLogger(__name__)


class DraftUnavailable(RuntimeError):
    """No draft replica answered (dead, unreachable, timed out)."""


@dataclass(slots=True)
class DraftStep:
    """One call from a target to a draft replica."""

    session: str                          # the request's draft session
    length: int                           # context entries the replica holds once `commit_*` is applied
    commit_tokens: list[int]              # emitted by the last verify step, not yet sent
    commit_features: torch.Tensor | None  # (m, F*H) target features before each of them
    k: int                                # draft tokens wanted
    sampling: SamplingParams
    rng_state: torch.Tensor | None        # the request's generator state (sampling only)
    context_key: str | None = None        # rebuild from this state-cache entry first ...
    context: dict[str, torch.Tensor] | None = None   # ... or from these tensors


@dataclass(slots=True)
class DraftReply:
    tokens: torch.Tensor | None = None    # (k,) long
    probs: torch.Tensor | None = None     # (k, V) when sampling
    rng_state: torch.Tensor | None = None
    need_context: bool = False
    replica: str = ""


@dataclass(slots=True, weakref_slot=True)
class DraftSession:
    """One request's draft state on one replica."""

    id: str = ""
    state: object | None = None           # SparrowState
    length: int = 0
    touched: float = 0.0                  # time.monotonic() of the last step

    def clear(self) -> None:
        self.state, self.length = None, 0


class DraftWorker:
    """Serves DraftSteps with a SparrowProposer; holds no video and no target."""

    def __init__(self, proposer: SparrowProposer, cache: StateCache):
        self.proposer, self.cache = proposer, cache

    def step(self, session: DraftSession, call: DraftStep) -> DraftReply:
        session.touched = time.monotonic()
        if call.context is not None or call.context_key is not None:
            tensors = call.context if call.context is not None else self.cache.get(call.context_key)
            if tensors is None:                     # evicted, expired or the cache is down
                return DraftReply(need_context=True)
            ctx = DraftContext.from_tensors(tensors)
            session.state, session.length = self.proposer.begin_context(ctx), ctx.token_ids.shape[0]
        elif session.state is None or session.length + len(call.commit_tokens) != call.length:
            return DraftReply(need_context=True)    # never seen here, or out of step
        elif call.commit_tokens:
            self.proposer.commit([session.state], [StepResult(None, call.commit_tokens, call.commit_features)])
            session.length += len(call.commit_tokens)
        generator = torch.Generator()
        if call.rng_state is not None:
            generator.set_state(call.rng_state)
        proposal = self.proposer.propose([DraftRequest(session.state, call.k, call.sampling, generator)])[0]
        return DraftReply(proposal.tokens, proposal.probs, generator.get_state() if call.rng_state is not None else None)


class LocalDraftClient:
    """DraftWorker sessions in this process: the transport-free client (tests, benchmarks)."""

    def __init__(self, worker: DraftWorker):
        self.worker = worker
        self.sessions: dict[str, DraftSession] = {}

    def step(self, call: DraftStep) -> DraftReply:
        return self.worker.step(self.sessions.setdefault(call.session, DraftSession(call.session)), call)

    def end(self, session: str) -> None:
        self.sessions.pop(session, None)


@dataclass(slots=True)
class RemoteDraftState:
    session: str
    context: DraftContext                  # what begin() was given: the prompt part
    tokens: list[int] = field(default_factory=list)       # every token committed since
    recent: deque = field(default_factory=deque)          # features (F*H,) of the last `window` commits
    pending_tokens: list[int] = field(default_factory=list)
    pending_features: list[torch.Tensor] = field(default_factory=list)
    rebuild: bool = True                   # the next call must carry the context
    inline: bool = False                   # ... as tensors: the state cache did not keep it
    cache_keys: list[str] = field(default_factory=list)
    local: object | None = None            # SparrowState of the colocated fallback, once in use
    failovers: int = 0

    @property
    def length(self) -> int:
        return self.context.token_ids.shape[0] + len(self.tokens)


class RemoteDraftProposer:
    """The proposer interface (sparrow.spec.propose) with the draft on draft replicas.

    client: `step(DraftStep) -> DraftReply` (raises on an unreachable replica) and
    `end(session)`. fallback: a colocated SparrowProposer, used for the rest of a request
    once `attempts` calls in a row got no proposal.
    """

    def __init__(self, client, fallback: SparrowProposer, spec: SpecConfig, cache: StateCache,
                 attempts: int = 3, context_ttl_s: float = 600.0):
        self.client, self.fallback, self.spec, self.cache = client, fallback, spec, cache
        self.needs = fallback.needs
        self.attempts, self.context_ttl_s = attempts, context_ttl_s
        self.failovers = 0        # calls that failed and were retried (all requests; for operators)
        self.fallbacks = 0        # requests that finished with the colocated draft
        self.rebuilds = 0         # calls a replica answered with need_context (new to it, or stale)
        self.sessions: set[str] = set()   # draft sessions of running requests

    def begin(self, start: BeginInput) -> RemoteDraftState:
        spec = self.spec
        return self.begin_context(build_context(start.prefill, start.first_token, spec.glimpse, spec.draft_context,
                                                spec.prune_keep))

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        """One call per request to its draft session (sessions may live on different replicas)."""
        return [self.propose_one(r.state, r.k, r.sampling, r.generator) for r in batch]

    def commit(self, states: list[RemoteDraftState], results: list[StepResult]) -> None:
        for state, result in zip(states, results):
            self.commit_one(state, result)

    def begin_context(self, ctx: DraftContext) -> RemoteDraftState:
        # A full-attention context ("all"/"pruned") reads every commit: keep them all.
        keep = self.spec.window if self.spec.draft_context == "text" else None
        state = RemoteDraftState(uuid.uuid4().hex, ctx, recent=deque(maxlen=keep))
        self.sessions.add(state.session)
        self._publish(state)      # the replica that takes the first call rebuilds from the state cache
        return state

    def propose_one(self, state: RemoteDraftState, k: int, sampling: SamplingParams,
                    generator: torch.Generator) -> Proposal:
        if state.local is not None:
            return self.fallback.propose([DraftRequest(state.local, k, sampling, generator)])[0]
        for _ in range(self.attempts):
            try:
                reply = self.client.step(self._call(state, k, sampling, generator))
            except Exception as exc:  # noqa: BLE001 - any transport failure: try another replica
                log.warning("draft replica failed (%s: %s); retrying", type(exc).__name__, exc)
                state.failovers += 1
                self.failovers += 1
                self._publish(state)
                continue
            if reply.need_context:
                self.rebuilds += 1
                if state.rebuild:
                    state.inline = True      # the replica could not read the context from the cache
                else:
                    self._publish(state)     # the replica has not seen this request, or lost it
                continue
            state.pending_tokens, state.pending_features, state.rebuild = [], [], False
            if reply.rng_state is not None:
                generator.set_state(reply.rng_state)
            return Proposal(reply.tokens, reply.probs)
        log.warning("no draft replica answered %d calls; drafting in this process for the rest of the request",
                    self.attempts)
        self.fallbacks += 1
        state.local = self.fallback.begin_context(self._context_now(state))
        return self.fallback.propose([DraftRequest(state.local, k, sampling, generator)])[0]

    def commit_one(self, state: RemoteDraftState, result: StepResult) -> None:
        if state.local is not None:
            self.fallback.commit([state.local], [result])
            return
        tokens, features = result.tokens, result.features
        state.tokens.extend(tokens)
        state.recent.extend(features)
        state.pending_tokens.extend(tokens)
        state.pending_features.append(features)

    def end(self, state: RemoteDraftState) -> None:
        """Free the request's state on the draft replica and in the cache (best effort:
        replicas also drop idle sessions, and cache entries expire)."""
        self.sessions.discard(state.session)
        try:
            self.client.end(state.session)
        except Exception as exc:  # noqa: BLE001 - the replica may be gone
            log.info("draft session %s not ended on its replica: %s", state.session, exc)
        for key in state.cache_keys:
            self.cache.delete(key)

    # ----- helpers -------------------------------------------------------------------------------
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

    def _call(self, state: RemoteDraftState, k: int, sampling: SamplingParams, generator) -> DraftStep:
        rng = None if sampling.greedy else generator.get_state()
        if state.rebuild:
            context = self._context_now(state).to_tensors() if state.inline else None
            key = None if state.inline else state.cache_keys[-1]
            return DraftStep(state.session, state.length, [], None, k, sampling, rng, key, context)
        features = torch.cat(state.pending_features) if state.pending_features else None
        return DraftStep(state.session, state.length, list(state.pending_tokens), features, k, sampling, rng)

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
