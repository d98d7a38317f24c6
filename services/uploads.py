"""Receiving an upload (UploadVideo) in bounded memory.

Chunks are written to a spool file in the store's directory as they arrive, and hashed on the
way: an upload holds one chunk in memory, whatever its size. Uploads are admitted under two
limits (UploadLimit, RESOURCE_EXHAUSTED): how many may be in progress at once, and how many
bytes those have received together. Every upload sends all its bytes, even of a video the
server holds: its id is its bytes' SHA-256, so a client that only knows a hash learns nothing
and gets no video (a SHA-256 named on the first chunk is checked against the bytes). A complete upload is probed with PyAV (its container
opens, it has a video stream, its first frame decodes) before it is stored, so what is not a
video is refused (INVALID_ARGUMENT) and nothing of it is left behind. Storing is
services.sources.VideoStore's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from sparrow.errors import InvalidRequest, VideoTooLarge
from sparrow.video import VideoOptions, probe_video

from sparrow.services.grpc_status import UploadLimit
from sparrow.services.protos import pb
from sparrow.services.video_store import VideoStore


class UploadLimits:
    """Uploads in progress on this server and the bytes they have received. Used from one
    event loop only: a check and its update have no await between them."""

    def __init__(self, max_uploads: int, max_bytes_in_flight: int):
        self.max_uploads, self.max_bytes_in_flight = max_uploads, max_bytes_in_flight
        self.uploads = 0
        self.bytes_in_flight = 0

    @contextlib.contextmanager
    def admit(self) -> Iterator["_Admitted"]:
        """One upload in progress for the duration of the block; UploadLimit past max_uploads."""
        if self.uploads >= self.max_uploads:
            raise UploadLimit(f"{self.uploads} uploads in progress, the limit of this server "
                              f"({self.max_uploads}); retry later")
        self.uploads += 1
        admitted = _Admitted(self)
        try:
            yield admitted
        finally:
            self.uploads -= 1
            self.bytes_in_flight -= admitted.received


class _Admitted:
    def __init__(self, limits: UploadLimits):
        self.limits, self.received = limits, 0

    def add(self, nbytes: int) -> None:
        """Count nbytes more received; UploadLimit when the uploads in progress would then
        hold more than max_bytes_in_flight together."""
        limits = self.limits
        if limits.bytes_in_flight + nbytes > limits.max_bytes_in_flight:
            raise UploadLimit(f"the uploads in progress hold {limits.bytes_in_flight} bytes; this chunk would pass "
                              f"the limit of this server ({limits.max_bytes_in_flight}); retry later")
        limits.bytes_in_flight += nbytes
        self.received += nbytes


class Spool:
    """One upload being received: a file in `directory`, written and hashed chunk by chunk.
    `discard` removes it (a no-op once the store has moved it into place)."""

    def __init__(self, directory: Path):
        fd, name = tempfile.mkstemp(prefix=".upload-", dir=directory)
        self.path, self._file = Path(name), os.fdopen(fd, "wb")
        self.digest, self.size = hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self.digest.update(data)
        self.size += len(data)

    def finish(self) -> str:
        """Close the file; the upload's SHA-256 (hex)."""
        self._file.close()
        return self.digest.hexdigest()

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


async def receive_upload(chunks: AsyncIterator[pb.VideoChunk], videos: VideoStore, limits: UploadLimits,
                         max_bytes: int, probe_options: VideoOptions) -> pb.VideoRef:
    """Receive, check and store one upload; its VideoRef. max_bytes: the largest video
    (VideoTooLarge past it); probe_options: the bounds the probe decodes under."""
    with limits.admit() as admitted:
        spool = Spool(videos.directory)           # not in a thread: a cancel cannot orphan it
        try:
            claimed = None
            async for chunk in chunks:
                # A claimed hash is checked against the bytes, never taken for them: a stored
                # video is named only to a client that sent all of it.
                if claimed is None:
                    claimed = chunk.sha256.lower()
                data = chunk.data           # each read of the field is a fresh copy of the chunk
                if spool.size + len(data) > max_bytes:
                    raise VideoTooLarge(f"upload is over the limit of {max_bytes} bytes")
                admitted.add(len(data))
                await asyncio.to_thread(spool.write, data)
                del data, chunk             # not held while the next chunk arrives
            video_id = await asyncio.to_thread(spool.finish)
            if spool.size == 0:
                raise InvalidRequest("the upload holds no bytes (a SHA-256 alone names no video: send the "
                                     "video's bytes)")
            if claimed and claimed != video_id:
                raise InvalidRequest(f"the upload's SHA-256 is {video_id}, not the {claimed[:80]} its first chunk "
                                     "claimed")
            # Said stored only once the stored copy was read back whole and hashed; a damaged
            # one is deleted there, and this upload then writes it again.
            stored = await asyncio.to_thread(videos.stored, video_id)
            if not stored:
                await asyncio.to_thread(_probe, spool.path, probe_options)
                await asyncio.to_thread(videos.keep, spool.path, video_id)
            return pb.VideoRef(video_id=video_id, size_bytes=spool.size, already_stored=stored)
        finally:
            spool.discard()       # not awaited: it must run on a cancelled call too


def _probe(path: Path, options: VideoOptions) -> None:
    """probe_video on the spooled file, opened here: an error never names the server's paths."""
    with open(path, "rb") as file:
        probe_video(file, options)
