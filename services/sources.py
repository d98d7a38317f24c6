"""Uploaded videos (stored by content hash in the state cache) and the identities that key
a video's cached prefill. Path and URL allowlists are sparrow.video.SourcePolicy's."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import torch

from sparrow.cache import StateCache
from sparrow.errors import InvalidRequest

from .errors import VideoNotFound

_VIDEO_ID = re.compile(r"^[0-9a-f]{64}$")


def content_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def path_id(path: Path) -> str:
    """A file's identity for the prefix cache without reading it: path, size and mtime.
    (Hashing a multi-GB file per request would cost more than its prefill saves.)"""
    st = path.stat()
    return hashlib.sha256(f"path:{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


class VideoStore:
    """Uploaded videos by SHA-256, in the state cache: with Redis every replica sees them."""

    def __init__(self, cache: StateCache, ttl_s: float = 3600.0):
        self.cache, self.ttl_s = cache, ttl_s

    @staticmethod
    def key(video_id: str) -> str:
        if not _VIDEO_ID.match(video_id):
            raise InvalidRequest(f"video_id must be 64 lowercase hex digits (a SHA-256), got {video_id[:80]!r}")
        return f"video:{video_id}"

    def contains(self, video_id: str) -> bool:
        return self.cache.contains(self.key(video_id))

    def put(self, data: bytes) -> str:
        video_id = content_id(data)
        array = np.frombuffer(data, dtype=np.uint8)
        self.cache.put(self.key(video_id), {"bytes": torch.from_numpy(array.copy())}, ttl_s=self.ttl_s)
        return video_id

    def get(self, video_id: str) -> bytes:
        found = self.cache.get(self.key(video_id))
        if found is None:
            raise VideoNotFound(f"no video with id {video_id}: upload it (again) first")
        return found["bytes"].numpy().tobytes()
