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

A missing manifest, a missing chunk, a failed checksum, a manifest of another key, a size
over this cache's limits or an unreachable Redis is a miss: the caller recomputes, and a
damaged entry is deleted so that the next put replaces it. A reader never gets garbage and
a request never fails because of the cache. Returned tensors are shared with the cache:
treat them as read-only. What a key promises beyond that (uploads: their SHA-256) is for
the caller to check; see services.sources.VideoStore.
"""

from __future__ import annotations

import abc
import hashlib
import json
import logging
import math
import re
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
MIN_CHUNK_BYTES = 1024
# Bounds on what a reader accepts from Redis, checked before anything is allocated from them.
MAX_MANIFEST_BYTES = 1 * MiB     # a manifest of MAX_TENSORS names and shapes is far smaller
MAX_TENSORS = 4096
MAX_DIMS = 16
READ_BATCH_BYTES = 128 * MiB     # chunks asked for in one round trip, at most
_NONCE = re.compile(r"^[0-9a-f]{1,32}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DTYPE_BYTES = {name: getattr(torch, name).itemsize for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")}
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
        """Whether an entry seems to be there (a hint: `get` is the verified read)."""
        return self.get(key) is not None

    def get_shared(self, key: str) -> Tensors | None:
        """The entry as every replica would read it: for a tiered cache, the shared tier's
        copy, not this process's own. Use it before saying something is stored for all."""
        return self.get(key)

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

    Reads trust nothing they find in Redis (an eviction, a bad write, a shared Redis with
    another writer): every size in a manifest is checked against this cache's own limits
    before anything is allocated, chunks are read with a bound on their length, and the
    bytes must match the manifest's SHA-256 and the manifest must name the key it was read
    under (so an entry copied or swapped to another key is refused). A damaged entry is a
    miss and is deleted, so the next put under its key starts clean. `contains` only looks
    for the manifest: it is a hint, `get` is the verified read.

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

        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        if max_entry_bytes < 1:
            raise ValueError(f"max_entry_bytes must be >= 1, got {max_entry_bytes}")
        self.url, self.prefix, self.chunk_bytes = url, prefix, chunk_bytes
        self.default_ttl_s, self.max_entry_bytes = default_ttl_s, max_entry_bytes
        self.retry_after_s = retry_after_s
        # No client-side retries: a miss now is cheaper than a request stalled on backoff.
        self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                           socket_connect_timeout=socket_timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self._errors = (redis.exceptions.RedisError, OSError)
        self._down_until = 0.0
        # Delete a manifest only if it is still the one found damaged (compared as read: its
        # first MAX_MANIFEST_BYTES + 1 bytes): a writer may have replaced it meanwhile, and
        # its fresh entry must survive.
        self._delete_if_same = self.client.register_script(
            "if redis.call('GETRANGE', KEYS[1], 0, ARGV[2]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
            "return 0")

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
            "format": "safetensors", "key": key, "nonce": nonce, "chunks": len(chunks),
            "chunk_bytes": self.chunk_bytes, "nbytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
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
            raw = client.getrange(self.manifest_key(key), 0, MAX_MANIFEST_BYTES)   # never more than that
            if not raw:
                return None                        # absent (GETRANGE answers b"" for a missing key)
            manifest = None
            try:
                manifest = self._parse_manifest(key, raw)
                return _decode(self._read_chunks(client, key, manifest), manifest)
            except _Refused as refused:
                if not refused.damaged:            # well-formed, but over this reader's limits
                    log.warning("state cache: %s %s; treated as a miss", key, refused)
                    return None
                log.warning("state cache: %s %s; treated as a miss and deleted", key, refused)
                self._discard(client, key, raw, manifest)
                return None

        return self._call(read, None)

    def delete(self, key: str) -> None:
        def remove(client) -> None:
            raw = client.getrange(self.manifest_key(key), 0, MAX_MANIFEST_BYTES)
            client.delete(self.manifest_key(key))
            try:
                if raw:
                    self._delete_chunks(client, key, self._parse_manifest(key, raw))
            except _Refused:
                pass                  # chunks we cannot name safely expire by their TTL

        self._call(remove, None)

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda client: client.exists(self.manifest_key(key)), False))

    def close(self) -> None:
        self.client.close()

    # ----- reading what Redis holds, trusting none of it -------------------------------------------
    def _parse_manifest(self, key: str, raw: bytes) -> dict:
        """The manifest, when every field is well-formed and within this cache's limits; else
        _Refused. Nothing is allocated from a field before it is checked."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise _Refused(f"has a manifest over {MAX_MANIFEST_BYTES} bytes")
        try:
            m = json.loads(raw)
        except (ValueError, RecursionError):      # RecursionError: JSON nested thousands deep
            raise _Refused("has a manifest that is not JSON") from None
        if not isinstance(m, dict):
            raise _Refused("has a manifest that is not a JSON object")
        if m.get("key") != key:
            raise _Refused(f"holds the manifest of another key ({str(m.get('key'))[:80]!r})")
        nbytes, chunk_bytes, chunks = m.get("nbytes"), m.get("chunk_bytes"), m.get("chunks")
        if not (_is_int(nbytes) and nbytes > 0):
            raise _Refused(f"claims {str(nbytes)[:40]} bytes")
        if nbytes > self.max_entry_bytes:      # may be another replica's larger limit: not damage
            raise _Refused(f"is {nbytes} bytes, over this reader's entry limit {self.max_entry_bytes}", damaged=False)
        if not (_is_int(chunk_bytes) and MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES):
            raise _Refused(f"claims chunks of {str(chunk_bytes)[:40]} bytes, outside "
                           f"[{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
        if chunks != -(-nbytes // chunk_bytes):
            raise _Refused(f"claims {str(chunks)[:40]} chunks where {nbytes} bytes make {-(-nbytes // chunk_bytes)}")
        if not (isinstance(m.get("nonce"), str) and _NONCE.match(m["nonce"])):
            raise _Refused("has a malformed nonce")
        if not (isinstance(m.get("sha256"), str) and _SHA256.match(m["sha256"])):
            raise _Refused("has a malformed checksum")
        _check_described(m.get("tensors"), nbytes)
        return m

    def _read_chunks(self, client, key: str, m: dict) -> bytes:
        """The entry's bytes. Each chunk is read with GETRANGE up to one byte past its
        promised size, so a replaced or oversized chunk costs at most that; every chunk
        but the last must be exactly chunk_bytes long, and together exactly nbytes."""
        size, n = m["chunk_bytes"], m["chunks"]
        per_batch = max(1, READ_BATCH_BYTES // size)      # bounds each reply (and the memory it takes)
        parts = []
        for start in range(0, n, per_batch):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(n, start + per_batch)):
                pipe.getrange(self.chunk_key(key, m["nonce"], i), 0, size)
            for i, part in enumerate(pipe.execute(), start):
                expected = size if i < n - 1 else m["nbytes"] - size * (n - 1)
                if not part:
                    raise _Refused(f"has lost chunk {i} of {n}")
                if len(part) != expected:
                    raise _Refused(f"has chunk {i} of {len(part)} bytes, not {expected}")
                parts.append(part)
        return b"".join(parts)

    def _discard(self, client, key: str, raw: bytes, manifest: dict | None) -> None:
        """Delete a damaged entry, unless a writer has replaced it since it was read."""
        try:
            if self._delete_if_same(keys=[self.manifest_key(key)], args=[raw, MAX_MANIFEST_BYTES], client=client) \
                    and manifest:
                self._delete_chunks(client, key, manifest)
        except self._errors as exc:      # still a miss; the entry expires by its TTL
            log.info("state cache: could not delete damaged %s (%s)", key, exc)

    def _delete_chunks(self, client, key: str, m: dict) -> None:
        names = [self.chunk_key(key, m["nonce"], i) for i in range(m["chunks"])]   # bounded by the checks
        for start in range(0, len(names), 1024):
            client.delete(*names[start:start + 1024])

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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_described(tensors: object, nbytes: int) -> None:
    """Refuse a manifest's {name: {dtype, shape}} unless it is a bounded number of tensors of
    known dtypes whose sizes fit in the entry's bytes."""
    if not isinstance(tensors, dict) or len(tensors) > MAX_TENSORS:
        raise _Refused(f"describes its tensors badly (not a mapping of at most {MAX_TENSORS})")
    total = 0
    for name, d in tensors.items():
        if not (isinstance(d, dict) and d.get("dtype") in _DTYPE_BYTES and isinstance(d.get("shape"), list)
                and len(d["shape"]) <= MAX_DIMS and all(_is_int(s) and 0 <= s <= nbytes for s in d["shape"])):
            raise _Refused(f"describes tensor {str(name)[:80]!r} badly")
        total += math.prod(d["shape"]) * _DTYPE_BYTES[d["dtype"]]
        if total > nbytes:
            raise _Refused(f"describes tensors larger than its {nbytes} bytes")


def _decode(blob: bytes, manifest: dict) -> Tensors:
    """Bytes -> tensors, exactly as the manifest promised, or _Refused."""
    if len(blob) != manifest["nbytes"] or hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
        raise _Refused("failed its checksum")
    try:
        tensors = st_load(blob)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise _Refused(f"does not parse ({exc})") from None
    described = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in tensors.items()}
    if described != manifest["tensors"]:
        raise _Refused("does not match its manifest")
    return tensors


class _Refused(Exception):
    """Why an entry read from Redis is not returned. damaged: delete it (it can never be
    read); else it is only over this reader's limits and stays for others."""

    def __init__(self, reason: str, damaged: bool = True):
        super().__init__(reason)
        self.damaged = damaged


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

    def get_shared(self, key: str) -> Tensors | None:
        return self.remote.get_shared(key)

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
