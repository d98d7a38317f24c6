"""Video-affinity routing: the same key always ranks the same replica first, keys spread over
replicas, and a replica leaving moves only its own keys."""

from sparrow.services.routing import rendezvous_rank


def test_rendezvous_rank_is_stable_spread_and_moves_only_the_leavers_keys():
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"video-{i}" for i in range(400)]
    first = {k: rendezvous_rank(k, replicas)[0] for k in keys}
    assert first == {k: rendezvous_rank(k, list(reversed(replicas)))[0] for k in keys}   # order-free
    counts = [list(first.values()).count(r) for r in replicas]
    assert min(counts) > 60                                                            # ~100 each
    survivors = replicas[1:]
    moved = [k for k in keys if rendezvous_rank(k, survivors)[0] != first[k]]
    assert set(moved) == {k for k in keys if first[k] == "r0"}                         # only r0's keys
