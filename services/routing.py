"""Routing requests about one video to the target replica that holds its prefill.

A target replica keeps recent videos' prefills (KV caches) in its prefix cache, which no
other replica can read: a second question about a video is cheap only on the replica that
answered the first. SparrowClient names the video in every call's `multiplexed_model_id`
metadata (its id, or the hash of inline bytes, or its path/URL); Serve hands that key to the
deployment's request router, and this one ranks the running replicas by rendezvous hashing
of (key, replica): every proxy computes the same first choice from the first request on, with
nothing to learn or propagate (Serve's own multiplex routing learns which replica "loaded" a
key and is eventually consistent: measured 17 of 20 second questions reused the prefill, see
tests/test_ray_serve.py). When replicas come or go only the keys of those replicas move.
Calls with no key (Abort, GetModelInfo, health) are spread as usual; a preferred replica that
is full is passed over for the next in rank (a prefill again, never a wrong answer).
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def rendezvous_rank(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids, most preferred first, for `key` (highest random weight hashing)."""
    weight = lambda rid: hashlib.sha256(f"{key}\x00{rid}".encode()).digest()   # noqa: E731
    return sorted(replica_ids, key=weight, reverse=True)


class VideoAffinityRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key or len(candidate_replicas) <= 1:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in rendezvous_rank(key, list(by_id))]
