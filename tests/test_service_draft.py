"""The remote draft protocol without a transport: DraftWorkers in this process stand in for
draft replicas (real drafts, real state cache), so replicas can die at exact calls.

What must hold: drafting remotely changes nothing, not even the acceptance counts or a
seeded sample (the replicas share a real Redis as the state cache); a step of several
requests is ONE call, and a request that lost its context is sent again alone; a replica
dying costs a retry on another replica that rebuilds from the state cache; no replica left
means the colocated draft; a dead state cache means the context travels inline; a finished
or abandoned request frees its sessions and cache entries; the draft distributions come back
bit for bit, as sparse rows when the request's sampling truncates them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest_services import SPEC_KWARGS

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.services.draft_service import DraftProbs, DraftWorker, LocalDraftClient, RemoteDraftProposer
from sparrow.speculative.sparrow_proposer import SparrowProposer
from sparrow.speculative.sampling import logits_to_probs
from sparrow.services.state_cache import RedisStateCache
from sparrow.tiny import synthetic_frames, tiny_draft, tiny_target

SPEC = SpecConfig(**SPEC_KWARGS)
PROMPT = "What happens in the video?"
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
TOP_K = SamplingParams(max_new_tokens=40, temperature=1.0, top_k=8, seed=5, ignore_eos=True)


class Replicas:
    """Draft replicas behind a router, as Serve's multiplexing routes a DraftDeployment: a
    batch goes to the replica its client id lives on; a call to a dead replica fails, and the
    next goes to a live one. `before(replicas, batch)` runs before each call is served (to
    evict sessions at an exact step); every call's batch is kept."""

    def __init__(self, n: int, draft, cache, kill_at_call: int | None = None, kill_all: bool = False, before=None,
                 spec: SpecConfig = SPEC):
        self.clients = [LocalDraftClient(DraftWorker(SparrowProposer(draft, spec), cache)) for _ in range(n)]
        self.dead: set[int] = set()
        self.home: dict[str, int] = {}
        self.calls, self.kill_at_call, self.kill_all, self.before = 0, kill_at_call, kill_all, before
        self.rebuilds = [0] * n
        self.batches, self.replies = [], []

    def step(self, batch, timeout_s=None):
        self.calls += 1
        self.batches.append(batch)
        if self.calls == self.kill_at_call:
            self.dead |= set(range(len(self.clients))) if self.kill_all else {self.home[batch.client]}
        home = self.home.get(batch.client)
        if home in self.dead:
            del self.home[batch.client]
            raise ConnectionError(f"draft replica {home} died")
        alive = [i for i in range(len(self.clients)) if i not in self.dead]
        if not alive:
            raise ConnectionError("no draft replica")
        home = self.home.setdefault(batch.client, alive[0])
        self.rebuilds[home] += sum(s.context is not None or s.context_key is not None for s in batch.steps)
        if self.before is not None:
            self.before(self, batch)
        replies = self.clients[home].step(batch)
        self.replies.append(replies)
        return replies

    def end(self, client: str, session: str) -> None:
        for c in self.clients:
            c.end(client, session)

    def live_sessions(self) -> int:
        return sum(c.live_sessions() for c in self.clients)

    def evict(self, batch, session: str) -> None:
        """The replica serving `batch` forgets one session (LRU, idle timeout, restart)."""
        self.clients[self.home[batch.client]].clients[batch.client].end(session)


class CountingProposer(RemoteDraftProposer):
    """Counts the engine's propose calls: the scheduler makes one per step that drafts."""

    def __init__(self, *args):
        super().__init__(*args)
        self.proposes = 0

    def propose(self, batch):
        self.proposes += 1
        return super().propose(batch)


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen2_5_vl", seed=0)
    return target, tiny_draft(target, seed=0), synthetic_frames(4, 56, 56, seed=1)


@pytest.fixture(scope="module")
def colocated(models):
    target, draft, _ = models
    return Engine(target, draft, SPEC)


def contexts(redis_server) -> list:
    """Draft contexts stored in Redis (their manifests)."""
    return redis_server.client().keys("sparrow:draftctx:*:m")


def remote_engine(models, replicas, cache) -> Engine:
    target, draft, _ = models
    return Engine(target, spec=SPEC, proposer=CountingProposer(replicas, SparrowProposer(draft, SPEC), SPEC, cache))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, TOP_K], ids=["greedy", "sampled", "top-k"])
@pytest.mark.parametrize("failure", ["none", "one replica dies", "all replicas die"])
def test_remote_draft_gives_the_colocated_answer(models, colocated, sampling, failure, redis_url, redis_server):
    target, draft, video = models
    expected = colocated.generate(video, PROMPT, sampling)
    cache = RedisStateCache(redis_url)
    replicas = Replicas(2, draft, cache, kill_at_call={"none": None}.get(failure, 6),
                        kill_all=failure == "all replicas die")
    out = remote_engine(models, replicas, cache).generate(video, PROMPT, sampling)
    assert out.token_ids == expected.token_ids
    # The rebuilt draft state is the colocated one: the same drafts get accepted.
    assert (out.metrics.steps, out.metrics.accepted_tokens) == (expected.metrics.steps, expected.metrics.accepted_tokens)
    assert replicas.calls >= 6 and replicas.live_sessions() == 0 and contexts(redis_server) == []
    if failure == "one replica dies":
        assert replicas.dead == {0} and replicas.rebuilds == [1, 1]        # the survivor rebuilt from the cache
    if failure == "all replicas die":
        assert replicas.calls <= 6 + 3                                    # 3 attempts, then the colocated draft
    probs = [r.probs for replies in replicas.replies for r in replies if not r.need_context]
    if sampling.greedy or sampling.top_k == 0:
        # greedy, and seeded chains with the plain tempered q (one call): no rows travel (a seeded
        # request's acceptance reads its position noise, not q)
        assert probs and all(p is None for p in probs)
    else:      # rows travel as their nonzero entries where that is smaller, else whole
        assert probs and all((p.index is not None) == (int((p.decode() > 0).sum()) * 8 < p.decode().numel() * 4)
                             for p in probs)
        if sampling.top_k > 0:
            assert all(p.index is not None for p in probs)


def test_remote_draft_cut_sends_few_entries_and_gives_the_colocated_answer(models, redis_url):
    """Plain temperature sampling (no top-k / top-p) with the draft's own cut (SpecConfig
    draft_mass / draft_max_candidates, what the remote placement sets): the rows travel as at
    most that many entries each, and the answer equals the colocated draft's with the same
    spec, token for token (the same q drawn from and accepted against)."""
    target, draft, video = models
    spec = SpecConfig(**{**SPEC_KWARGS, "draft_mass": 0.99, "draft_max_candidates": 12})
    expected = Engine(target, draft, spec).generate(video, PROMPT, SAMPLED)
    cache = RedisStateCache(redis_url)
    replicas = Replicas(2, draft, cache, spec=spec)
    engine = Engine(target, spec=spec, proposer=CountingProposer(replicas, SparrowProposer(draft, spec), spec, cache))
    out = engine.generate(video, PROMPT, SAMPLED)
    assert out.token_ids == expected.token_ids
    assert (out.metrics.steps, out.metrics.accepted_tokens) == (expected.metrics.steps, expected.metrics.accepted_tokens)
    probs = [r.probs for replies in replicas.replies for r in replies if not r.need_context]
    assert probs and all(p.index is not None and p.index.numel() <= 12 * p.shape[0] for p in probs)
    uncut = Engine(target, draft, SPEC).generate(video, PROMPT, SAMPLED)
    assert uncut.token_ids == expected.token_ids           # seeded: plain decoding's tokens, whatever was drafted
    drafted = lambda out: (out.metrics.steps, out.metrics.accepted_tokens)             # noqa: E731
    assert drafted(uncut) != drafted(expected)             # the cut really changed what the draft drew


def test_one_draft_call_per_step_for_concurrent_requests(models, colocated, redis_url):
    """Four requests running together (greedy, seeded sampling, top-k, two videos): each
    step is one call carrying all of them, and each answer is its solo colocated run."""
    target, draft, video = models
    other = synthetic_frames(6, 56, 56, seed=7)
    # Long enough that all four run together for many steps, however their starts spread.
    jobs = [(v, replace(s, max_new_tokens=160)) for v, s in [(video, GREEDY), (other, SAMPLED), (video, TOP_K),
                                                             (other, GREEDY)]]
    expected = [colocated.generate(v, PROMPT, s).token_ids for v, s in jobs]
    cache = RedisStateCache(redis_url)
    replicas = Replicas(2, draft, cache)
    engine = remote_engine(models, replicas, cache)
    streams = [engine.stream(v, PROMPT, s) for v, s in jobs]
    outputs = [[t for delta in gen for t in delta.token_ids] for gen in streams]
    assert outputs == expected
    assert replicas.calls == engine.proposer.proposes                 # one call per drafting step, no more
    assert max(len(b.steps) for b in replicas.batches) == len(jobs)   # ... carrying every running request
    # One call per request per step would be one per verify step of each request.
    assert replicas.calls <= sum(gen.output.metrics.steps for gen in streams) / 2
    assert len({b.client for b in replicas.batches}) == 1 and replicas.rebuilds == [len(jobs), 0]


def test_only_requests_that_lost_their_context_are_sent_again(models, colocated, redis_url):
    """A replica that lost one session of a batch answers it need_context and drafts the
    others; the same step's next call carries that request alone, with its context."""
    target, draft, video = models
    jobs = [(video, replace(SAMPLED, max_new_tokens=120)), (synthetic_frames(6, 56, 56, seed=7), GREEDY)]
    expected = [colocated.generate(v, PROMPT, s).token_ids for v, s in jobs]
    evicted = []

    def evict_once(replicas, batch):
        if not evicted and replicas.calls > 3 and len(batch.steps) == 2:
            evicted.append((replicas.calls, batch.steps[0].session))
            replicas.evict(batch, batch.steps[0].session)

    cache = RedisStateCache(redis_url)
    replicas = Replicas(1, draft, cache, before=evict_once)
    engine = remote_engine(models, replicas, cache)
    # k pinned: both requests draft every step (the adaptive policy may hold one back, and then
    # no call carries both)
    streams = [engine.stream(v, PROMPT, s, num_draft_tokens=SPEC.num_draft_tokens) for v, s in jobs]
    assert [[t for delta in gen for t in delta.token_ids] for gen in streams] == expected
    (call, session), = evicted
    first, retry = replicas.replies[call - 1], replicas.batches[call]
    assert [r.need_context for r in first] == [True, False]
    assert [s.session for s in retry.steps] == [session] and retry.steps[0].context_key is not None
    assert replicas.calls == engine.proposer.proposes + 1 and replicas.rebuilds == [len(jobs) + 1]


def test_a_bad_context_fails_only_its_own_request(models, colocated):
    """A context the replica cannot use (here: damaged in flight) is answered need_context
    for that request alone; its neighbours in the call get their drafts."""
    from sparrow.services.state_cache import MemoryStateCache

    target, draft, video = models
    jobs = [(video, replace(GREEDY, max_new_tokens=120)), (synthetic_frames(6, 56, 56, seed=7), SAMPLED)]
    expected = [colocated.generate(v, PROMPT, s).token_ids for v, s in jobs]
    damaged = []

    def damage_once(replicas, batch):
        inline = [i for i, s in enumerate(batch.steps) if s.context is not None]
        if not damaged and len(batch.steps) == 2 and inline:
            damaged.append((replicas.calls, inline[0]))
            batch.steps[inline[0]].context = {"token_ids": batch.steps[inline[0]].context["token_ids"]}

    replicas = Replicas(1, draft, MemoryStateCache(), before=damage_once)     # unshared: contexts go inline
    engine = remote_engine(models, replicas, MemoryStateCache())
    streams = [engine.stream(v, PROMPT, s) for v, s in jobs]
    assert [[t for delta in gen for t in delta.token_ids] for gen in streams] == expected
    (call, index), = damaged
    assert [r.need_context for r in replicas.replies[call - 1]] == [i == index for i in range(2)]
    assert engine.proposer.fallbacks == 0


def test_dead_state_cache_sends_the_context_inline(models, colocated):
    target, draft, video = models
    expected = colocated.generate(video, PROMPT, SAMPLED)
    dead = RedisStateCache("redis://127.0.0.1:9/0", socket_timeout_s=0.2)   # nothing listens on port 9
    replicas = Replicas(2, draft, dead, kill_at_call=8)
    out = remote_engine(models, replicas, dead).generate(video, PROMPT, SAMPLED)
    assert out.token_ids == expected.token_ids and replicas.rebuilds == [1, 1]


def test_replica_losing_the_context_gets_it_again(models, colocated, redis_url):
    """A replica whose session was evicted answers need_context; the proposer re-publishes."""
    target, draft, video = models
    expected = colocated.generate(video, PROMPT, GREEDY)
    cache = RedisStateCache(redis_url)
    replicas = Replicas(1, draft, cache,
                        before=lambda r, batch: r.calls == 3 and r.evict(batch, batch.steps[0].session))
    out = remote_engine(models, replicas, cache).generate(video, PROMPT, GREEDY)
    assert out.token_ids == expected.token_ids and replicas.rebuilds == [2]
    assert [r.need_context for r in replicas.replies[2]] == [True]


def test_abandoned_request_frees_draft_sessions_and_cache(models, redis_url, redis_server):
    target, draft, video = models
    cache = RedisStateCache(redis_url)
    replicas = Replicas(1, draft, cache)
    gen = remote_engine(models, replicas, cache).stream(video, PROMPT, GREEDY)
    next(gen), next(gen)
    assert replicas.live_sessions() == 1 and len(contexts(redis_server)) == 1
    gen.close()                                          # a cancelled request: the loop is closed mid-way
    assert replicas.live_sessions() == 0 and contexts(redis_server) == []


def test_unshared_cache_sends_the_context_inline(models, colocated):
    """A process-local cache is no use to other replicas: the context goes inline at once."""
    from sparrow.services.state_cache import MemoryStateCache

    target, draft, video = models
    local = MemoryStateCache()
    replicas = Replicas(1, draft, MemoryStateCache())   # the replica's own cache: it never sees the target's
    out = remote_engine(models, replicas, local).generate(video, PROMPT, GREEDY)
    assert out.token_ids == colocated.generate(video, PROMPT, GREEDY).token_ids
    assert replicas.rebuilds == [1] and len(local._entries) == 0


@pytest.mark.parametrize("top_k, top_p, sparse", [(0, 1.0, False), (50, 1.0, True), (0, 0.5, True)],
                         ids=["untruncated", "top-k", "top-p"])
def test_draft_probs_travel_bit_for_bit(top_k, top_p, sparse):
    """At the 7B vocabulary: decode(encode(q)) is q itself, every bit; truncated rows go as
    their nonzero entries, and then in a fraction of the dense bytes."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 152_064, generator=gen) * 4        # (k, V)
    q = logits_to_probs(logits, 0.8, top_k, top_p)
    wire = DraftProbs.encode(q)
    back = wire.decode()
    assert back.dtype == q.dtype and torch.equal(back.view(torch.int32), q.view(torch.int32))
    assert (wire.index is not None) == sparse
    dense = q.numel() * 4
    assert wire.nbytes == dense if not sparse else wire.nbytes == int((q > 0).sum()) * 8 < dense / 4
    if top_k:
        assert wire.nbytes <= 4 * top_k * 8


def test_wire_benchmark_measures_what_travels():
    """benchmarks.draft_wire (the BENCHMARKS.md figures): a truncated round is a fraction of
    the dense one, and greedy sends no rows at all."""
    from benchmarks.draft_wire import measure

    dense, top_k, greedy = (measure(4096, 4, *case) for case in [(1.0, 0, 1.0), (1.0, 20, 1.0), (0.0, 0, 1.0)])
    # Pickled sizes may differ by a few bytes with what the process pickled before (memo, names).
    assert abs(dense["before"] - dense["after"]) < 64 and abs(dense["before"] - top_k["before"]) < 64
    assert dense["after"] > 4 * 4096 * 4
    assert top_k["after"] < dense["after"] / 5 and greedy["after"] < 1000
