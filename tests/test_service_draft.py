"""The remote draft protocol without a transport: DraftWorkers in this process stand in for
draft replicas (real drafts, real state cache), so replicas can die at exact steps.

What must hold: drafting remotely changes nothing, not even the acceptance counts or a
seeded sample (the replicas share a real Redis as the state cache); a replica dying costs a retry on another replica that rebuilds from the state
cache; no replica left means the colocated draft; a dead state cache means the context
travels inline; and a finished or abandoned request frees its sessions and cache entries.
"""

from __future__ import annotations

import pytest
from conftest_services import SPEC_KWARGS

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.services.draft import DraftWorker, LocalDraftClient, RemoteDraftProposer
from sparrow.spec.propose import SparrowProposer
from sparrow.state_cache import RedisStateCache
from sparrow.tiny import synthetic_frames, tiny_draft, tiny_target

SPEC = SpecConfig(**SPEC_KWARGS)
PROMPT = "What happens in the video?"
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)


class Replicas:
    """Draft replicas with session affinity and a kill switch, like a router in front of a
    DraftDeployment: a call to a dead replica fails, and the next goes to a live one."""

    def __init__(self, n: int, draft, cache, kill_at_call: int | None = None, kill_all: bool = False):
        self.clients = [LocalDraftClient(DraftWorker(SparrowProposer(draft, SPEC), cache)) for _ in range(n)]
        self.dead: set[int] = set()
        self.home: dict[str, int] = {}
        self.calls, self.kill_at_call, self.kill_all = 0, kill_at_call, kill_all
        self.rebuilds = [0] * n

    def step(self, call):
        self.calls += 1
        if self.calls == self.kill_at_call:
            self.dead |= set(range(len(self.clients))) if self.kill_all else {self.home[call.session]}
        home = self.home.get(call.session)
        if home in self.dead:
            del self.home[call.session]
            raise ConnectionError(f"draft replica {home} died")
        alive = [i for i in range(len(self.clients)) if i not in self.dead]
        if not alive:
            raise ConnectionError("no draft replica")
        home = self.home.setdefault(call.session, alive[0])
        self.rebuilds[home] += call.context is not None or call.context_key is not None
        return self.clients[home].step(call)

    def end(self, session: str) -> None:
        for client in self.clients:
            client.end(session)

    def live_sessions(self) -> int:
        return sum(len(c.sessions) for c in self.clients)


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen2_5_vl", seed=0)
    return target, tiny_draft(target, SPEC, seed=0), synthetic_frames(4, 56, 56, seed=1)


def contexts(redis_server) -> list:
    """Draft contexts stored in Redis (their manifests)."""
    return redis_server.client().keys("sparrow:draftctx:*:m")


def remote_engine(models, replicas, cache):
    target, draft, _ = models
    return Engine(target, spec=SPEC, proposer=RemoteDraftProposer(replicas, SparrowProposer(draft, SPEC), SPEC, cache))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("failure", ["none", "one replica dies", "all replicas die"])
def test_remote_draft_gives_the_colocated_answer(models, sampling, failure, redis_url, redis_server):
    target, draft, video = models
    expected = Engine(target, draft, SPEC).generate(video, PROMPT, sampling)
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


def test_dead_state_cache_sends_the_context_inline(models):
    target, draft, video = models
    expected = Engine(target, draft, SPEC).generate(video, PROMPT, SAMPLED)
    dead = RedisStateCache("redis://127.0.0.1:9/0", socket_timeout_s=0.2)   # nothing listens on port 9
    replicas = Replicas(2, draft, dead, kill_at_call=8)
    out = remote_engine(models, replicas, dead).generate(video, PROMPT, SAMPLED)
    assert out.token_ids == expected.token_ids and replicas.rebuilds == [1, 1]


def test_replica_losing_the_context_gets_it_again(models, redis_url):
    """A replica whose session was evicted answers need_context; the proposer re-publishes."""
    target, draft, video = models
    expected = Engine(target, draft, SPEC).generate(video, PROMPT, GREEDY)
    cache = RedisStateCache(redis_url)
    replicas = Replicas(1, draft, cache)
    engine = remote_engine(models, replicas, cache)
    gen = engine.stream(video, PROMPT, GREEDY)
    tokens = list(next(gen).token_ids) + list(next(gen).token_ids)
    replicas.clients[0].sessions.clear()                # evicted (LRU, idle timeout, restart)
    for delta in gen:
        tokens += delta.token_ids
    assert tokens == expected.token_ids and replicas.rebuilds == [2]


def test_abandoned_request_frees_draft_sessions_and_cache(models, redis_url, redis_server):
    target, draft, video = models
    cache = RedisStateCache(redis_url)
    replicas = Replicas(1, draft, cache)
    gen = remote_engine(models, replicas, cache).stream(video, PROMPT, GREEDY)
    next(gen), next(gen)
    assert replicas.live_sessions() == 1 and len(contexts(redis_server)) == 1
    gen.close()                                          # a cancelled request: the loop is closed mid-way
    assert replicas.live_sessions() == 0 and contexts(redis_server) == []


def test_unshared_cache_sends_the_context_inline(models):
    """A process-local cache is no use to other replicas: the context goes inline at once."""
    from sparrow.state_cache import MemoryStateCache

    target, draft, video = models
    local = MemoryStateCache()
    replicas = Replicas(1, draft, MemoryStateCache())   # the replica's own cache: it never sees the target's
    out = remote_engine(models, replicas, local).generate(video, PROMPT, GREEDY)
    assert out.token_ids == Engine(target, draft, SPEC).generate(video, PROMPT, GREEDY).token_ids
    assert replicas.rebuilds == [1] and len(local._entries) == 0
