"""Container bytes of a live stream (MPEG-TS, fragmented MP4), decoded as they are fed.

A LiveDecoder reads one media: chunks go into a blocking pipe, a thread decodes them with
PyAV (video/stream.py) and hands RGB frames with their source PTS (seconds, as the container
stamps them) to a callback, a batch at a time. A live session (sparrow/live/session.py) starts one per
media, checks MPEG-TS framing before feeding it (video/ts_framing.py), and maps the PTS to
its stream time (live_source.py); unlike LiveSource (video/live.py) nothing is retained.
"""

from __future__ import annotations

import io
import queue
import threading
import time
from typing import Callable

import av
import numpy as np

from sparrow.errors import VideoUnreadable
from sparrow.video.stream import decoded_frames, video_stream

# Little probing: frames should flow from the first bytes of a live stream.
_OPEN_OPTIONS = {"probesize": "4096", "analyzeduration": "0"}


class LiveDecoder:
    """Decodes a container stream fed in chunks (MPEG-TS, fragmented MP4) on its own thread and
    hands RGB frames uint8 [T, H, W, 3] with their PTS (seconds in the stream's time base) to
    `on_frames`; a decode failure goes to `on_error` and ends this media."""

    def __init__(self, on_frames: Callable[[np.ndarray, np.ndarray], None],
                 on_error: Callable[[BaseException], None], batch: int = 1):
        self._pipe = _Pipe()
        self._on_frames, self._on_error = on_frames, on_error
        self._batch = batch
        self._done = threading.Event()
        self._aborted = False
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sparrow-live-decode", daemon=True)
        self._thread.start()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def feed(self, chunk: bytes) -> None:
        """The media's next bytes, split anywhere."""
        if chunk:
            self._pipe.write_chunk(chunk)

    def close(self) -> None:
        self._pipe.write_chunk(None)

    def abort(self) -> None:
        self._aborted = True
        self._pipe.write_chunk(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until the decoder has read every chunk fed so far (or finished)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._progress:
            while not self._done.is_set() and self._pipe.waiting > 0:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._progress.wait(timeout=0.05 if left is None else min(0.05, left))

    def _run(self) -> None:
        frames, times = [], []
        try:
            with av.open(self._pipe, mode="r", options=_OPEN_OPTIONS) as container:
                stream = video_stream(container, "the live media")
                stream.thread_type = "AUTO"
                for t, frame in decoded_frames(container, stream, origin_pts=0):
                    if self._aborted:
                        return
                    if t is None:
                        continue
                    frames.append(frame.to_ndarray(format="rgb24"))
                    times.append(t)
                    if len(frames) >= self._batch:
                        self._flush(frames, times)
                    with self._progress:
                        self._progress.notify_all()
            self._flush(frames, times)
        except _SinkError as exc:             # the session refused the frames: its own error, as is
            if not self._aborted:
                self._on_error(exc.error)
        except (av.error.FFmpegError, VideoUnreadable, ValueError) as exc:
            try:
                self._flush(frames, times)
            except _SinkError:
                pass
            if not self._aborted:
                error = exc if isinstance(exc, VideoUnreadable) else VideoUnreadable(
                    f"the live media could not be decoded: {exc}")
                self._on_error(error)
        except BaseException as exc:  # noqa: BLE001 - e.g. the session closed under it
            if not self._aborted:
                self._on_error(exc)
        finally:
            self._done.set()
            with self._progress:
                self._progress.notify_all()

    def _flush(self, frames: list, times: list) -> None:
        if frames:
            batch, stamps = np.stack(frames), np.array(times)
            frames.clear()
            times.clear()
            try:
                self._on_frames(batch, stamps)
            except Exception as exc:  # noqa: BLE001 - told apart from a decode failure above
                raise _SinkError(exc) from exc


class _Pipe(io.RawIOBase):
    """A blocking byte pipe: `write_chunk` from the feeding thread, `read` from the decoder's."""

    def __init__(self):
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._buf = b""
        self._eof = False

    def readable(self) -> bool:
        return True

    @property
    def waiting(self) -> int:
        """Chunks written and not yet read."""
        return self._chunks.qsize()

    def write_chunk(self, data: bytes | None) -> None:
        self._chunks.put(data)

    def readinto(self, b) -> int:
        while not self._buf and not self._eof:
            chunk = self._chunks.get()
            if chunk is None:
                self._eof = True
            else:
                self._buf = bytes(chunk)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


class _SinkError(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


__all__ = ["LiveDecoder"]
