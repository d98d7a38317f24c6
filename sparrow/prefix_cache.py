"""Recent video prefills, by video key, in the target's process (KV caches never move).

A second question about the same video starts from a copy of the cached KV cache of the
prompt up to the end of the video tokens, and neither decodes the video nor runs it through
the model again: its prefill is only its own text. LRU under a byte and an entry budget.

A question about a video whose first prefill is still running waits for it (PrefillsInFlight)
and then reads the cache, rather than decoding and prefilling the same video a second time.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

from .models.prefill import VideoPrefix
from .video import ProcessedVideo


@dataclass(frozen=True, slots=True)
class PrefixEntry:
    video: ProcessedVideo      # pixel values dropped: what building the prompt still needs
    prefix: VideoPrefix

    @classmethod
    def of(cls, video: ProcessedVideo, prefix: VideoPrefix) -> "PrefixEntry":
        return cls(dataclasses.replace(video, pixel_values_videos=video.pixel_values_videos[:0]), prefix)


class PrefixCache:
    def __init__(self, max_bytes: int = 8 << 30, max_entries: int = 32):
        if max_bytes <= 0 or max_entries <= 0:
            raise ValueError("max_bytes and max_entries must be > 0")
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()      # requests run in threads of one process

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries       # no LRU touch: a look, not a use

    def get(self, key: str) -> PrefixEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: str, entry: PrefixEntry) -> bool:
        size = entry.prefix.nbytes
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.prefix.nbytes
            self._entries[key] = entry
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.prefix.nbytes
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


class PrefillsInFlight:
    """Video keys whose first prefill is running: each led by the request that runs it, with the
    requests for the same video that wait for it, in arrival order. When the leader's prefix is
    in the cache they all go on (each prefills only its own text); when the leader ends without
    it (abort, error) the first waiter leads and prefills the video itself, the others wait for
    it; when the leader finished but the cache would not keep its prefix (over its byte budget)
    they all go on and prefill for themselves. Requests are held by identity (id). Not
    thread-safe: its owner (the scheduler) calls it under its own lock."""

    def __init__(self):
        self._key_of: dict[int, str] = {}           # id(leader) -> its video key
        self._leader: dict[str, Any] = {}           # video key -> leader
        self._waiters: dict[str, deque] = {}        # video key -> requests waiting for its leader
        self._free: set[int] = set()                # ids let go without a cached prefix: never wait again

    def __len__(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    def waiting(self) -> list:
        return [r for w in self._waiters.values() for r in w]

    def join(self, key: str, request, cached: bool) -> bool:
        """True: `request` waits for the running prefill of `key`. False: it reads the cache
        (`cached`: `key` is in it) or prefills itself (it leads `key` unless it was let go by a
        leader whose prefix the cache refused)."""
        if cached or id(request) in self._free:
            self._free.discard(id(request))
            return False
        leader = self._leader.get(key)
        if leader is None:
            self._leader[key], self._key_of[id(request)], self._waiters[key] = request, key, deque()
            return False
        if leader is request:                       # a waiter made leader, back for its preparation
            return False
        self._waiters[key].append(request)
        return True

    def leads(self, request) -> str | None:
        return self._key_of.get(id(request))

    def settle(self, request, finished: bool, cached: bool) -> list:
        """`request` leads no more: its prefill `finished` (the prefix `cached`, or not), or it
        ended. Returns the waiters that go on now (to be prepared); [] if it led nothing."""
        self._free.discard(id(request))
        key = self._key_of.pop(id(request), None)
        if key is None:
            return []
        del self._leader[key]
        waiters = self._waiters.pop(key)
        if not waiters:
            return []
        if finished:
            if not cached:
                self._free.update(map(id, waiters))
            return list(waiters)
        leader = waiters.popleft()
        self._leader[key], self._key_of[id(leader)], self._waiters[key] = leader, key, waiters
        return [leader]

    def drop(self, ended: Callable[[Any], bool]) -> list:
        """The waiters for which `ended(request)` (aborted, past their deadline), taken out."""
        gone = []
        for waiters in self._waiters.values():
            for request in [r for r in waiters if ended(r)]:
                waiters.remove(request)
                gone.append(request)
        return gone
