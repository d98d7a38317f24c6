"""Uploaded videos (stored by content hash in the state cache) and the identities that key
a video's cached prefill. Path and URL allowlists are sparrow.video.SourcePolicy's.

Every identity is the SHA-256 of the video's bytes, however the video came (bytes, upload,
path): a prefill cached for one can only ever serve the same bytes. The state cache checks
its own entries (sizes, checksums); what an upload's key promises, that its bytes hash to
it, is checked here on every read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from sparrow.errors import InvalidRequest, VideoTooLarge, VideoUnreadable
from sparrow.state_cache import StateCache
from sparrow.video import SourcePolicy
from sparrow.video.sources import open_regular_file

from .errors import SourceChanged, VideoNotFound

log = logging.getLogger(__name__)

_VIDEO_ID = re.compile(r"^[0-9a-f]{64}$")
_HASH_BLOCK = 1 << 20


def content_id(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class _Version:
    """What the kernel says about an open file: any write to it changes st_ctime, which no
    caller can set back (utime sets mtime, and ctime to now), unlike size and mtime."""

    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, fd: int) -> "_Version":
        st = os.fstat(fd)
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class HashedFile:
    """A video file opened once, hashed through that open file, and decoded from the same
    open file: a path swapped for another file afterwards (rename, `rsync -t`, `cp -p`) does
    not change what this request reads, and a file written in place between the hash and
    the decode is refused (SourceChanged) rather than decoded under the old hash.
    `close()` when the request is done."""

    def __init__(self, path: Path, policy: SourcePolicy, max_bytes: int):
        self.path = path
        self.file = _open_regular(path, policy)
        try:
            self.version = _Version.of(self.file.fileno())
            if self.version.size == 0:
                raise VideoUnreadable(f"video file {path.name!r} is empty (0 bytes)")
            if self.version.size > max_bytes:
                raise VideoTooLarge(f"video file is {self.version.size} bytes, over the limit of {max_bytes}")
            self.content_id = self._hash()
        except BaseException:
            self.file.close()
            raise

    def _hash(self) -> str:
        digest, block = hashlib.sha256(), bytearray(_HASH_BLOCK)
        view = memoryview(block)
        self.file.seek(0)
        while n := self.file.readinto(block):
            digest.update(view[:n])
        self.check_unchanged()
        return digest.hexdigest()

    def check_unchanged(self) -> None:
        if _Version.of(self.file.fileno()) != self.version:
            raise SourceChanged(f"video file {self.path.name!r} changed while it was being read; retry")

    def reader(self) -> BinaryIO:
        """The open file, for the decoder (sparrow.video reads it through views of its own
        and never closes it, so a second decode pass can read it again)."""
        return self.file

    def close(self) -> None:
        self.file.close()


def _open_regular(path: Path, policy: SourcePolicy) -> BinaryIO:
    """Open a regular file inside the media root, as sparrow.video opens paths (the same
    function), errors naming the file without the server's directories. A path that does
    not exist is VideoNotFound."""
    try:
        return open_regular_file(path, policy, shown=path.name)
    except VideoUnreadable as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            raise VideoNotFound(f"no video file {path.name!r} in the media directory") from None
        raise exc from None            # the OSError behind it names the full path: not for the caller


class VideoStore:
    """Uploaded videos by SHA-256, in the state cache: with Redis every replica sees them.
    An entry whose bytes do not hash to its id (swapped, overwritten) is deleted, never served."""

    def __init__(self, cache: StateCache, ttl_s: float = 3600.0):
        self.cache, self.ttl_s = cache, ttl_s

    @staticmethod
    def key(video_id: str) -> str:
        if not _VIDEO_ID.match(video_id):
            raise InvalidRequest(f"video_id must be 64 lowercase hex digits (a SHA-256), got {video_id[:80]!r}")
        return f"video:{video_id}"

    def contains(self, video_id: str) -> bool:
        """Whether an entry seems to be there (cheap; `get` verifies)."""
        return self.cache.contains(self.key(video_id))

    def stored(self, video_id: str) -> bool:
        """Whether the shared copy was read back whole and hashes to video_id (reads it all)."""
        return self._verified(video_id, self.cache.get_shared(self.key(video_id))) is not None

    def put(self, data: bytes) -> str:
        video_id = content_id(data)
        array = np.frombuffer(data, dtype=np.uint8)
        self.cache.put(self.key(video_id), {"bytes": torch.from_numpy(array.copy())}, ttl_s=self.ttl_s)
        return video_id

    def get(self, video_id: str) -> bytes:
        data = self._verified(video_id, self.cache.get(self.key(video_id)))
        if data is None:
            raise VideoNotFound(f"no video with id {video_id}: upload it (again) first")
        return data

    def _verified(self, video_id: str, found) -> bytes | None:
        if found is None:
            return None
        stored = found.get("bytes")
        if stored is None or stored.dtype != torch.uint8 or stored.dim() != 1:
            data = None
        else:
            data = stored.numpy().tobytes()
        if data is None or content_id(data) != video_id:
            log.warning("uploaded video %s: the stored bytes are not that video; deleted", video_id)
            self.cache.delete(self.key(video_id))
            return None
        return data
