"""The shared state cache: named groups of tensors, with a TTL, that any replica can read.

    put(key, {name: tensor}, ttl_s) -> stored?     get(key) -> {name: tensor} | None (a miss)

Backends behind one interface:
  MemoryStateCache   in-process, the embedded default: an LRU under a byte budget, with TTLs.
  RedisStateCache    shared by every replica. Tensors are serialized with safetensors and
                     split into chunks of at most 8 MiB (Redis strings stop at 512 MiB); the
                     chunks are written first and a manifest (dtype and shape of each tensor,
                     chunk count, byte count, SHA-256) last, so a reader never sees half an entry.
  TieredStateCache   memory in front of Redis: what this process wrote stays readable here
                     when Redis goes away.

A missing manifest, a missing chunk, a failed checksum or an unreachable Redis is a miss:
the caller recomputes. A reader never gets garbage and a request never fails because of
the cache. Returned tensors are shared with the cache: treat them as read-only.
"""

from __future__ import annotations

import abc
import hashlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

log = logging.getLogger(__name__)

MiB = 1 << 20
MAX_CHUNK_BYTES = 8 * MiB
Tensors = dict[str, torch.Tensor]


def tensors_nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class StateCache(abc.ABC):
    """Tensors by key, with a TTL. `shared`: whether other processes see what this one writes."""

    shared: bool = False

    @abc.abstractmethod
    def put(self, key: str, tensors: Tensors, ttl_s: float | None = None) -> bool:
        """Store (replacing any entry under key). False when not stored (too large, backend down)."""

    @abc.abstractmethod
    def get(self, key: str) -> Tensors | None:
        """The entry, or None for a miss (absent, expired, incomplete, corrupt, backend down)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    def contains(self, key: str) -> bool:
        return self.get(key) is not None

    def close(self) -> None:
        pass


class MemoryStateCache(StateCache):
    """In-process LRU: entries over max_entry_bytes are refused, the least recently used are
    evicted past max_total_bytes, expired ones are dropped when seen."""

    def __init__(self, max_total_bytes: int = 4 << 30, max_entry_bytes: int | None = None,
                 default_ttl_s: float = 600.0):
        self.max_total_bytes = max_total_bytes
        self.max_entry_bytes = min(max_entry_bytes or max_total_bytes, max_total_bytes)
        self.default_ttl_s = default_ttl_s
        self._entries: OrderedDict[str, tuple[Tensors, int, float]] = OrderedDict()  # key -> (tensors, bytes, expiry)
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def put(self, key: str, tensors: Tensors, ttl_s: float | None = None) -> bool:
        nbytes = tensors_nbytes(tensors)
        if nbytes > self.max_entry_bytes:
            return False
        expiry = time.monotonic() + (ttl_s if ttl_s is not None else self.default_ttl_s)
        with self._lock:
            self._drop(key)
            self._entries[key] = (dict(tensors), nbytes, expiry)
            self._bytes += nbytes
            while self._bytes > self.max_total_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def get(self, key: str) -> Tensors | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry[2] <= time.monotonic():
                self._drop(key)
                return None
            self._entries.move_to_end(key)
            return dict(entry[0])

    def delete(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[1]


class RedisStateCache(StateCache):
    """Entries in Redis as chunked safetensors bytes plus a manifest written last.

    Keys: `{prefix}{key}:m` holds the manifest (JSON); `{prefix}{key}:{nonce}:{i}` chunk i.
    A fresh nonce per put means a reader of an entry being replaced sees the old one or the
    new one, never a mix. Chunks live a little longer than their manifest, so an entry ends
    by its manifest expiring. Total memory is Redis's own `maxmemory` (configure an LRU
    policy there); `max_entry_bytes` refuses single entries larger than that.

    When Redis does not answer, operations are misses and, for `retry_after_s`, are not even
    tried, so a dead Redis costs requests no time; a warning is logged once per outage.
    """

    shared = True

    def __init__(self, url: str, *, prefix: str = "sparrow:", chunk_bytes: int = MAX_CHUNK_BYTES,
                 default_ttl_s: float = 600.0, max_entry_bytes: int = 1 << 30,
                 socket_timeout_s: float = 1.0, retry_after_s: float = 2.0):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        self.url, self.prefix, self.chunk_bytes = url, prefix, chunk_bytes
        self.default_ttl_s, self.max_entry_bytes = default_ttl_s, max_entry_bytes
        self.retry_after_s = retry_after_s
        # No client-side retries: a miss now is cheaper than a request stalled on backoff.
        self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                           socket_connect_timeout=socket_timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self._errors = (redis.exceptions.RedisError, OSError)
        self._down_until = 0.0

    # ----- keys ----------------------------------------------------------------------------
    def manifest_key(self, key: str) -> str:
        return f"{self.prefix}{key}:m"

    def chunk_key(self, key: str, nonce: str, i: int) -> str:
        return f"{self.prefix}{key}:{nonce}:{i}"

    # ----- operations ------------------------------------------------------------------------
    def put(self, key: str, tensors: Tensors, ttl_s: float | None = None) -> bool:
        blob = st_save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
        if len(blob) > self.max_entry_bytes:
            log.warning("state cache: %s is %d bytes, over the entry limit %d; not stored",
                        key, len(blob), self.max_entry_bytes)
            return False
        ttl_ms = max(1, int(1000 * (ttl_s if ttl_s is not None else self.default_ttl_s)))
        nonce = uuid.uuid4().hex[:12]
        view = memoryview(blob)
        chunks = [view[i:i + self.chunk_bytes] for i in range(0, len(blob), self.chunk_bytes)]
        manifest = {
            "format": "safetensors", "nonce": nonce, "chunks": len(chunks), "nbytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
            "tensors": {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
                        for k, v in tensors.items()},
        }

        def write(client) -> None:
            pipe = client.pipeline(transaction=False)
            for i, chunk in enumerate(chunks):
                pipe.set(self.chunk_key(key, nonce, i), chunk.tobytes(), px=ttl_ms + 5000)
            pipe.execute()
            client.set(self.manifest_key(key), json.dumps(manifest), px=ttl_ms)   # last

        return self._call(write, False) is not False

    def get(self, key: str) -> Tensors | None:
        def read(client) -> Tensors | None:
            raw = client.get(self.manifest_key(key))
            if raw is None:
                return None
            manifest = json.loads(raw)
            keys = [self.chunk_key(key, manifest["nonce"], i) for i in range(manifest["chunks"])]
            parts = []
            for start in range(0, len(keys), 16):      # bound each reply to 16 chunks (128 MiB)
                parts += client.mget(keys[start:start + 16])
            if any(p is None for p in parts):
                log.info("state cache: %s has a missing chunk; treated as a miss", key)
                return None
            return _decode(key, b"".join(parts), manifest)

        return self._call(read, None)

    def delete(self, key: str) -> None:
        def remove(client) -> None:
            raw = client.get(self.manifest_key(key))
            client.delete(self.manifest_key(key))
            if raw is not None:
                manifest = json.loads(raw)
                names = [self.chunk_key(key, manifest["nonce"], i) for i in range(manifest["chunks"])]
                if names:
                    client.delete(*names)

        self._call(remove, None)

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda client: client.exists(self.manifest_key(key)), False))

    def close(self) -> None:
        self.client.close()

    def _call(self, op, on_error):
        """Run op(client); Redis errors become on_error, and pause Redis for retry_after_s."""
        if time.monotonic() < self._down_until:
            return on_error
        try:
            return op(self.client)
        except self._errors as exc:
            log.warning("state cache: Redis at %s unavailable (%s); recomputing instead for %.0f s",
                        self.url, exc, self.retry_after_s)
            self._down_until = time.monotonic() + self.retry_after_s
            return on_error
        except (ValueError, KeyError, TypeError) as exc:   # a malformed manifest
            log.warning("state cache: unreadable manifest (%s); treated as a miss", exc)
            return on_error


def _decode(key: str, blob: bytes, manifest: dict) -> Tensors | None:
    """Bytes -> tensors, or None when they are not exactly what the manifest promised."""
    if len(blob) != manifest["nbytes"] or hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
        log.warning("state cache: %s failed its checksum; treated as a miss", key)
        return None
    try:
        tensors = st_load(blob)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        log.warning("state cache: %s does not parse (%s); treated as a miss", key, exc)
        return None
    described = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in tensors.items()}
    if described != manifest["tensors"]:
        log.warning("state cache: %s does not match its manifest; treated as a miss", key)
        return None
    return tensors


class TieredStateCache(StateCache):
    """A local MemoryStateCache in front of a shared cache: writes go to both, reads try the
    local copy first. Entries written here survive the shared backend going away."""

    shared = True

    def __init__(self, local: MemoryStateCache, remote: StateCache):
        self.local, self.remote = local, remote

    def put(self, key: str, tensors: Tensors, ttl_s: float | None = None) -> bool:
        stored_local = self.local.put(key, tensors, ttl_s)
        return self.remote.put(key, tensors, ttl_s) or stored_local

    def get(self, key: str) -> Tensors | None:
        found = self.local.get(key)
        if found is None:
            found = self.remote.get(key)
            if found is not None:
                self.local.put(key, found)
        return found

    def delete(self, key: str) -> None:
        self.local.delete(key)
        self.remote.delete(key)

    def contains(self, key: str) -> bool:
        return self.local.contains(key) or self.remote.contains(key)

    def close(self) -> None:
        self.remote.close()


def open_cache(spec: str | None, **options) -> StateCache:
    """"memory" (or None) -> MemoryStateCache; "redis://host:port/db" -> Redis behind a local tier."""
    if spec in (None, "", "memory"):
        return MemoryStateCache(**{k: v for k, v in options.items() if k in ("max_total_bytes", "default_ttl_s")})
    if spec.startswith(("redis://", "rediss://", "unix://")):
        local = MemoryStateCache(**{k: v for k, v in options.items() if k in ("max_total_bytes", "default_ttl_s")})
        remote = RedisStateCache(spec, **{k: v for k, v in options.items() if k != "max_total_bytes"})
        return TieredStateCache(local, remote)
    raise ValueError(f"cache must be 'memory' or a redis:// URL, got {spec!r}")
