"""The remote draft's bound on a failed draft deployment, without a transport: a client that
hangs (a stopped replica, or calls queued for a replica that is still starting) until the
timeout it is given, then raises TimeoutError as Serve's handle does.

What must hold: one step waits at most `failover_s` on it, all calls of the step together,
then drafts in the target's process, and the answer is the colocated one; for
`retry_after_s` after, a new request does not wait on the replicas at all; after that the
replicas are tried again (and, answering, serve the request).
"""

from __future__ import annotations

import time

import pytest
from conftest_services import SPEC_KWARGS

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.services.draft_service import DraftWorker, LocalDraftClient, RemoteDraftProposer
from sparrow.speculative.sparrow_proposer import SparrowProposer
from sparrow.services.state_cache import MemoryStateCache
from sparrow.tiny import synthetic_frames, tiny_draft, tiny_target

SPEC = SpecConfig(**SPEC_KWARGS)
PROMPT = "What happens in the video?"
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


class Hanging:
    """Draft replicas that answer (a DraftWorker in this process) until `hung` is set, then take
    every call's whole timeout and raise. Records each call's timeout and how long it took."""

    def __init__(self, draft):
        self.local = LocalDraftClient(DraftWorker(SparrowProposer(draft, SPEC), MemoryStateCache()))
        self.hung, self.calls = False, []

    def step(self, batch, timeout_s):
        start = time.monotonic()
        try:
            if self.hung:
                time.sleep(timeout_s)
                raise TimeoutError(f"no answer in {timeout_s:.2f} s")
            return self.local.step(batch, timeout_s)
        finally:
            self.calls.append((timeout_s, time.monotonic() - start))

    def end(self, client, session):
        self.local.end(client, session)


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen2_5_vl", seed=0)
    return target, tiny_draft(target, seed=0), synthetic_frames(4, 56, 56, seed=1)


def test_a_hung_draft_deployment_costs_one_failover_then_none(models):
    target, draft, video = models
    expected = Engine(target, draft, SPEC).generate(video, PROMPT, GREEDY)
    replicas = Hanging(draft)
    proposer = RemoteDraftProposer(replicas, SparrowProposer(draft, SPEC), SPEC, MemoryStateCache(),
                                   failover_s=0.3, retry_after_s=1.5)
    engine = Engine(target, spec=SPEC, proposer=proposer)

    # Mid-answer the replicas stop answering: one step waits 0.3 s (its calls together), then drafts here.
    stream, tokens, gaps, last = engine.stream(video, PROMPT, GREEDY), [], [], None
    for delta in stream:
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        tokens += delta.token_ids
        last = now
        if len(tokens) >= 8 and not replicas.hung:
            replicas.hung, hung_at = True, len(replicas.calls)
    assert tokens == expected.token_ids
    waited = replicas.calls[hung_at:]
    assert waited and sum(took for _, took in waited) < 0.3 + 0.1           # all its calls within the budget
    assert all(timeout <= 0.3 for timeout, _ in waited)
    assert max(gaps) < 0.3 + 0.5 and proposer.fallbacks == 1
    assert proposer.failovers >= 1 and proposer.stats().timeouts == proposer.failovers    # slow, not lost

    # A new request right after: drafted here at once, the replicas not called.
    calls = len(replicas.calls)
    assert engine.generate(video, PROMPT, GREEDY).token_ids == expected.token_ids
    assert len(replicas.calls) == calls and proposer.fallbacks == 2

    # Once retry_after_s has passed, and the replicas answer again, they serve new requests.
    replicas.hung = False
    time.sleep(max(0.0, proposer.down_until - time.monotonic()))
    out = engine.generate(video, PROMPT, GREEDY)
    assert out.token_ids == expected.token_ids
    assert len(replicas.calls) > calls and proposer.fallbacks == 2


class Refusing(Hanging):
    """Draft replicas whose calls fail at once (a replica gone: Serve's handle raises)."""

    def step(self, batch, timeout_s):
        self.calls.append((timeout_s, 0.0))
        raise ConnectionError("replica gone")


def test_a_failed_call_is_a_failover_but_not_a_timeout(models):
    """Operators (and tests/test_ray_serve.py) tell a slow replica from a lost one: both are
    failovers; only the call that got no answer within its bound is a timeout."""
    target, draft, video = models
    expected = Engine(target, draft, SPEC).generate(video, PROMPT, GREEDY)
    proposer = RemoteDraftProposer(Refusing(draft), SparrowProposer(draft, SPEC), SPEC, MemoryStateCache(),
                                   failover_s=0.3, retry_after_s=1.5)
    assert Engine(target, spec=SPEC, proposer=proposer).generate(video, PROMPT, GREEDY).token_ids == expected.token_ids
    stats = proposer.stats()
    assert stats.failovers == 3 and stats.timeouts == 0 and stats.fallbacks == 1     # `attempts` calls, then here
