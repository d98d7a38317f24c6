"""Uploaded videos (stored by content hash: on disk, or in the shared state cache) and the
identities that key a video's cached prefill. Path and URL allowlists are
sparrow.video.SourcePolicy's; receiving an upload is services.uploads'.

Every identity is the SHA-256 of the video's bytes, however the video came (bytes, upload,
path): a prefill cached for one can only ever serve the same bytes. The state cache checks
its own entries (sizes, checksums); what an upload's key promises, that its bytes hash to
it, is checked here on every read.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from sparrow.errors import InvalidRequest, VideoTooLarge, VideoUnreadable
from sparrow.services.state_cache import StateCache
from sparrow.video import SourcePolicy
from sparrow.video.policy import shown
from sparrow.video.sources import open_regular_file

from sparrow.services.grpc_status import SourceChanged, VideoNotFound

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
                raise VideoUnreadable(f"video file {shown(path.name)} is empty (0 bytes)")
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
            raise SourceChanged(f"video file {shown(self.path.name)} changed while it was being read; retry")

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
            raise VideoNotFound(f"no video file {shown(path.name)} in the media directory") from None
        raise exc from None            # the OSError behind it names the full path: not for the caller


class VideoStore:
    """Uploaded videos by SHA-256. With a shared state cache (Redis) they live there, so every
    replica sees them; otherwise as files in a directory of this server (`directory`; None: a
    fresh temporary one, removed by `close`), so a stored upload costs disk, not memory. Either
    way they expire ttl_s after they were stored, and an entry whose bytes do not hash to its
    id (swapped, overwritten) is deleted, never served. On disk the oldest go first once the
    files pass max_bytes together. Uploads arrive in `directory` too (services.uploads)."""

    def __init__(self, cache: StateCache, ttl_s: float = 3600.0, directory: str | os.PathLike | None = None,
                 max_bytes: int = 16 << 30):
        self.cache, self.ttl_s, self.max_bytes = cache, ttl_s, max_bytes
        self.on_disk = not cache.shared
        self._temporary = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="sparrow-uploads-") if directory is None else directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._files = SourcePolicy(media_root=self.directory)     # stored files are opened as paths are
        self._lock = threading.Lock()

    @staticmethod
    def key(video_id: str) -> str:
        if not _VIDEO_ID.match(video_id):
            raise InvalidRequest(f"video_id must be 64 lowercase hex digits (a SHA-256), got {video_id[:80]!r}")
        return f"video:{video_id}"

    def contains(self, video_id: str) -> bool:
        """Whether an entry seems to be there (cheap; reading it verifies)."""
        key = self.key(video_id)
        return self._fresh(video_id) is not None if self.on_disk else self.cache.contains(key)

    def stored(self, video_id: str) -> bool:
        """Whether the shared copy (on disk: the file) was read back whole and hashes to
        video_id (reads it all, a block at a time on disk)."""
        if not self.on_disk:
            return self._verified(video_id, self.cache.get_shared(self.key(video_id))) is not None
        try:
            self.open(video_id).close()
        except VideoNotFound:
            return False
        return True

    def keep(self, spooled: Path, video_id: str) -> None:
        """Store the complete upload spooled at `spooled` (in `directory`) under video_id,
        its SHA-256: on disk the file is renamed into place; a shared cache gets its bytes."""
        self.key(video_id)
        if not self.on_disk:
            # The cache's entry format holds the bytes at once: Redis's own memory bounds it.
            data = np.fromfile(spooled, dtype=np.uint8)
            self.cache.put(self.key(video_id), {"bytes": torch.from_numpy(data)}, ttl_s=self.ttl_s)
            return
        os.replace(spooled, self._path(video_id))        # atomic: readers see the whole file or none
        self._evict()

    def open(self, video_id: str) -> HashedFile:
        """The stored file, opened and hashed (on disk only); VideoNotFound when it is missing,
        expired or does not hash to its id (then deleted)."""
        path = self._fresh(video_id)
        if path is None:
            raise VideoNotFound(f"no video with id {video_id}: upload it (again) first")
        opened = HashedFile(path, self._files, max_bytes=1 << 62)
        if opened.content_id != video_id:
            opened.close()
            log.warning("uploaded video %s: the stored file is not that video; deleted", video_id)
            path.unlink(missing_ok=True)
            raise VideoNotFound(f"no video with id {video_id}: upload it (again) first")
        return opened

    def reader(self, video_id: str) -> tuple[Callable[[], BinaryIO], Callable[[], None], Callable[[], None]]:
        """(load, check, close) of a stored file for one request (on disk only): load() opens
        and hashes it when the decode needs it (VideoNotFound if it went meanwhile), check()
        after decoding, close() once the request is done."""
        held: list[HashedFile] = []

        def load() -> BinaryIO:
            held.append(self.open(video_id))
            return held[-1].reader()

        def check() -> None:
            if held:
                held[-1].check_unchanged()

        def close() -> None:
            for opened in held:
                opened.close()

        return load, check, close

    def get(self, video_id: str) -> bytes:
        """The stored bytes (shared cache only: on disk, `open`)."""
        data = self._verified(video_id, self.cache.get(self.key(video_id)))
        if data is None:
            raise VideoNotFound(f"no video with id {video_id}: upload it (again) first")
        return data

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.directory, ignore_errors=True)

    # ----- on disk -------------------------------------------------------------------------------
    def _path(self, video_id: str) -> Path:
        return self.directory / video_id

    def _fresh(self, video_id: str) -> Path | None:
        """The stored file's path, or None when there is none or it expired (then deleted)."""
        path = self._path(video_id)
        try:
            stored_at = path.stat().st_mtime
        except OSError:
            return None
        if time.time() - stored_at > self.ttl_s:
            path.unlink(missing_ok=True)
            return None
        return path

    def _evict(self) -> None:
        """Expired files go; then the oldest, while the stored files pass max_bytes."""
        with self._lock:
            files = []
            for path in self.directory.iterdir():
                if _VIDEO_ID.match(path.name):
                    with contextlib.suppress(OSError):
                        st = path.stat()
                        files.append((st.st_mtime, st.st_size, path))
            files.sort()
            total, now = sum(size for _, size, _ in files), time.time()
            for stored_at, size, path in files:
                if now - stored_at <= self.ttl_s and total <= self.max_bytes:
                    break
                path.unlink(missing_ok=True)
                total -= size

    # ----- in a shared cache -----------------------------------------------------------------------
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
