"""Recent video prefills, by video key, in the target's process (KV caches never move).

A second question about the same video starts from a copy of the cached KV cache of the
prompt up to the end of the video tokens, and neither decodes the video nor runs it through
the model again: its prefill is only its own text. LRU under a byte and an entry budget.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

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
