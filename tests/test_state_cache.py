"""The state cache: exact round trips, chunking, manifest last, TTLs, budgets, and every
kind of damage (missing manifest or chunk, bad checksum, dead Redis) reads as a miss."""

import json
import threading
import time

import pytest
import torch

from sparrow.services.state_cache import (MAX_CHUNK_BYTES, MemoryStateCache, RedisStateCache, TieredStateCache, open_cache,
                           tensors_nbytes)


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "features": torch.randn(7, 48, generator=g),
        "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(11, dtype=torch.long),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 64),
    }


def assert_same(a: dict, b: dict) -> None:
    assert a is not None and b is not None and set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


# ----- memory ------------------------------------------------------------------------------------
def test_memory_round_trip_lru_budget_and_ttl():
    cache = MemoryStateCache(max_total_bytes=1000, default_ttl_s=60)
    t = sample_tensors()
    small = {"x": torch.zeros(100, dtype=torch.uint8)}
    assert MemoryStateCache().put("a", t)
    assert cache.put("a", small) and cache.put("b", small)
    assert cache.get("a") is not None                      # a is now the most recent
    assert cache.put("c", {"x": torch.zeros(850, dtype=torch.uint8)})
    assert cache.get("b") is None and cache.get("a") is not None and cache.total_bytes <= 1000
    assert not cache.put("huge", {"x": torch.zeros(2000, dtype=torch.uint8)})
    assert cache.put("short", small, ttl_s=0.05)
    time.sleep(0.1)
    assert cache.get("short") is None
    cache.delete("a")
    assert cache.get("a") is None and not cache.contains("a")


# ----- redis --------------------------------------------------------------------------------------
def test_redis_round_trip_exact(redis_url):
    cache = RedisStateCache(redis_url)
    t = sample_tensors()
    assert cache.put("ctx:1", t)
    assert_same(cache.get("ctx:1"), t)
    assert cache.contains("ctx:1") and cache.get("nope") is None
    assert cache.put("ctx:1", {"ids": torch.arange(3)})             # replace: the new entry, never a mix
    assert_same(cache.get("ctx:1"), {"ids": torch.arange(3)})
    cache.delete("ctx:1")
    assert cache.get("ctx:1") is None


def test_redis_chunks_at_most_8_mib_and_manifest_describes_them(redis_url, redis_server):
    # This test is about the layout, not the timeout: a loaded 2-core CI box once stalled a
    # 20 MiB read past the default 1 s socket timeout, which the cache rightly calls a miss.
    cache = RedisStateCache(redis_url, socket_timeout_s=10.0)
    big = {"video": torch.randint(0, 255, (20 * 1024 * 1024,), dtype=torch.uint8)}   # 20 MiB -> 3 chunks
    assert cache.put("video:big", big)
    client = redis_server.client()
    manifest = json.loads(client.get(cache.manifest_key("video:big")))
    assert manifest["chunks"] == 3 and manifest["nbytes"] > 20 * 1024 * 1024
    assert manifest["tensors"] == {"video": {"dtype": "uint8", "shape": [20 * 1024 * 1024]}}
    sizes = [client.strlen(cache.chunk_key("video:big", manifest["nonce"], i)) for i in range(3)]
    assert max(sizes) == MAX_CHUNK_BYTES and sum(sizes) == manifest["nbytes"]
    assert_same(cache.get("video:big"), big)


def test_redis_manifest_is_written_after_every_chunk(redis_url, redis_server):
    cache = RedisStateCache(redis_url, chunk_bytes=4096)
    seen: list[str] = []
    ready = threading.Event()

    def watch():
        with redis_server.client().monitor() as monitor:
            ready.set()
            for command in monitor.listen():
                seen.append(command["command"])
                if ":m " in command["command"] or command["command"].endswith(":m"):
                    return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    ready.wait(5)
    time.sleep(0.1)
    assert cache.put("ctx:order", {"x": torch.randn(5000)})          # 20 KB -> 5 chunks
    thread.join(5)
    writes = [c for c in seen if c.startswith("SET ")]
    assert len(writes) == 6
    assert writes[-1].split()[1].endswith(":m") and not any(c.split()[1].endswith(":m") for c in writes[:-1])


@pytest.mark.parametrize("damage", ["drop_chunk", "flip_byte", "drop_manifest", "lie_about_shape", "garbage_manifest"])
def test_redis_damaged_entry_is_a_miss(redis_url, redis_server, damage):
    cache = RedisStateCache(redis_url, chunk_bytes=1024)
    assert cache.put("ctx:d", {"x": torch.randn(1000)})
    client = redis_server.client()
    mkey = cache.manifest_key("ctx:d")
    manifest = json.loads(client.get(mkey))
    chunk = cache.chunk_key("ctx:d", manifest["nonce"], 2)
    if damage == "drop_chunk":
        client.delete(chunk)
    elif damage == "flip_byte":
        byte = client.getrange(chunk, 10, 10)
        client.setrange(chunk, 10, bytes([byte[0] ^ 0xFF]))
    elif damage == "drop_manifest":
        client.delete(mkey)
    elif damage == "lie_about_shape":
        manifest["tensors"]["x"]["shape"] = [10, 100]
        client.set(mkey, json.dumps(manifest))
    else:
        client.set(mkey, b"{not json")
    assert cache.get("ctx:d") is None
    assert cache.put("ctx:d", {"x": torch.ones(3)}) and torch.equal(cache.get("ctx:d")["x"], torch.ones(3))


def test_redis_ttl_on_every_key_and_expiry(redis_url, redis_server):
    cache = RedisStateCache(redis_url, chunk_bytes=1024)
    assert cache.put("ctx:ttl", {"x": torch.randn(1000)}, ttl_s=0.3)
    client = redis_server.client()
    keys = client.keys("sparrow:ctx:ttl*")
    assert len(keys) == 5 and all(0 < client.pttl(k) <= 5300 for k in keys)
    assert cache.get("ctx:ttl") is not None
    time.sleep(0.45)
    assert cache.get("ctx:ttl") is None


def test_redis_entry_byte_limit(redis_url):
    cache = RedisStateCache(redis_url, max_entry_bytes=10_000)
    assert not cache.put("ctx:big", {"x": torch.zeros(5000)})
    assert cache.get("ctx:big") is None and cache.put("ctx:ok", {"x": torch.zeros(100)})


def test_redis_down_is_a_fast_miss_and_tiered_keeps_local_entries(own_redis, caplog):
    remote = RedisStateCache(own_redis.url, retry_after_s=0.5)
    tiered = TieredStateCache(MemoryStateCache(), remote)
    t = {"x": torch.arange(10)}
    assert tiered.put("video:v", t) and remote.get("video:v") is not None
    own_redis.stop()
    tried = []                       # every operation that reached for the network (each may stall)
    real_client = remote.client
    remote.client = type("Counted", (), {"__getattr__": lambda _, name: (tried.append(name),
                                                                          getattr(real_client, name))[1]})()
    with caplog.at_level("WARNING"):
        assert remote.get("video:v") is None and not remote.put("video:w", t) and not remote.contains("video:v")
        reached = len(tried)
        for _ in range(20):
            assert remote.get("video:v") is None                # skipped while marked down: no stall
    assert reached >= 1 and len(tried) == reached, f"{len(tried) - reached} reads tried a Redis marked down"
    remote.client = real_client
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    assert_same(tiered.get("video:v"), t)                        # still served from the local tier
    assert tiered.put("video:w", t) and tiered.get("video:w") is not None


def test_open_cache_specs(redis_url):
    assert isinstance(open_cache(None), MemoryStateCache) and not open_cache("memory").shared
    cache = open_cache(redis_url)
    assert isinstance(cache, TieredStateCache) and cache.shared
    with pytest.raises(ValueError):
        open_cache("memcached://x")
    assert tensors_nbytes(sample_tensors()) == 7 * 48 * 4 + 15 * 2 + 11 * 8 + 3


# ----- reads trust nothing in Redis: bounded, bound to their key, damage deleted ---------------------
def _peak_bytes(fn):
    """(result of fn(), the most memory Python allocated meanwhile)."""
    import tracemalloc
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("lie", [
    {"chunks": 10**6}, {"nbytes": 10**12, "chunks": 10**12 // MAX_CHUNK_BYTES + 1, "chunk_bytes": MAX_CHUNK_BYTES},
    {"chunk_bytes": 1}, {"nonce": "x" * 10**5}, {"key": "ctx:other"},
    {"tensors": {"x": {"dtype": "float32", "shape": [10**6, 10**6]}}},
    {"tensors": {f"t{i}": {"dtype": "uint8", "shape": [0]} for i in range(10_000)}},
], ids=["chunks", "nbytes", "chunk_bytes", "nonce", "other key", "shape", "tensor count"])
def test_redis_absurd_manifest_is_a_bounded_miss_and_deleted(redis_url, redis_server, lie):
    cache = RedisStateCache(redis_url, chunk_bytes=4096, max_entry_bytes=64 << 20)
    assert cache.put("ctx:a", {"x": torch.randn(3000)})
    client = redis_server.client()
    manifest = json.loads(client.get(cache.manifest_key("ctx:a")))
    client.set(cache.manifest_key("ctx:a"), json.dumps({**manifest, **lie}))
    commands = client.info("stats")["total_commands_processed"]
    found, peak = _peak_bytes(lambda: cache.get("ctx:a"))
    # a 1 MiB manifest at most, parsed; a few commands, not one a claimed chunk
    assert found is None and peak < 16 << 20
    assert client.info("stats")["total_commands_processed"] - commands <= 8
    if lie.get("nbytes", 0) > cache.max_entry_bytes:        # over this reader's limit: a miss, left for others
        assert client.exists(cache.manifest_key("ctx:a"))
    else:
        assert not client.exists(cache.manifest_key("ctx:a"))       # damage: deleted
    assert cache.put("ctx:a", {"x": torch.ones(3)}) and torch.equal(cache.get("ctx:a")["x"], torch.ones(3))


@pytest.mark.parametrize("manifest", [b"[" * 200_000, b"x" * (2 << 20), b"\xff\xfe", b"null", b'"a string"'])
def test_redis_unreadable_manifest_is_a_bounded_miss(redis_url, redis_server, manifest):
    cache = RedisStateCache(redis_url)
    redis_server.client().set(cache.manifest_key("ctx:m"), manifest)
    found, peak = _peak_bytes(lambda: cache.get("ctx:m"))
    assert found is None and peak < 4 << 20
    assert not redis_server.client().exists(cache.manifest_key("ctx:m"))


def test_redis_oversized_chunk_is_read_only_up_to_its_promised_size(redis_url, redis_server):
    cache = RedisStateCache(redis_url, chunk_bytes=4096)
    assert cache.put("ctx:big", {"x": torch.randn(3000)})         # 12 KB -> 3 chunks
    client = redis_server.client()
    manifest = json.loads(client.get(cache.manifest_key("ctx:big")))
    client.set(cache.chunk_key("ctx:big", manifest["nonce"], 1), b"\x00" * (64 << 20))   # 64 MiB where 4 KiB belong
    found, peak = _peak_bytes(lambda: cache.get("ctx:big"))
    assert found is None and peak < 4 << 20
    assert not client.exists(cache.chunk_key("ctx:big", manifest["nonce"], 1))           # the entry's chunks deleted


def test_redis_entry_copied_under_another_key_is_refused(redis_url, redis_server):
    cache = RedisStateCache(redis_url, chunk_bytes=1024)
    assert cache.put("ctx:src", {"x": torch.randn(600)})
    client = redis_server.client()
    manifest = json.loads(client.get(cache.manifest_key("ctx:src")))
    client.set(cache.manifest_key("ctx:dst"), client.get(cache.manifest_key("ctx:src")))
    for i in range(manifest["chunks"]):
        client.set(cache.chunk_key("ctx:dst", manifest["nonce"], i),
                   client.get(cache.chunk_key("ctx:src", manifest["nonce"], i)))
    assert cache.get("ctx:dst") is None and not cache.contains("ctx:dst")
    assert cache.get("ctx:src") is not None                          # the original is untouched


def test_redis_damage_found_does_not_delete_a_fresher_entry(redis_url, redis_server):
    """A reader that found damage deletes the manifest only if it is still the one it read:
    a writer that replaced the entry meanwhile keeps its fresh one."""
    cache = RedisStateCache(redis_url)
    assert cache.put("ctx:r", {"x": torch.zeros(4)})
    client = redis_server.client()
    stale = client.get(cache.manifest_key("ctx:r"))
    assert cache.put("ctx:r", {"x": torch.ones(4)})                 # the writer wins the race
    cache._discard(client, "ctx:r", stale, json.loads(stale))
    assert torch.equal(cache.get("ctx:r")["x"], torch.ones(4))
    cache._discard(client, "ctx:r", client.get(cache.manifest_key("ctx:r")), None)
    assert cache.get("ctx:r") is None


def test_tiered_get_shared_skips_the_local_copy(redis_url, redis_server):
    remote = RedisStateCache(redis_url)
    tiered = TieredStateCache(MemoryStateCache(), remote)
    assert tiered.put("video:v", {"x": torch.arange(3)})
    redis_server.client().delete(remote.manifest_key("video:v"))    # evicted from Redis
    assert tiered.get("video:v") is not None and tiered.get_shared("video:v") is None
