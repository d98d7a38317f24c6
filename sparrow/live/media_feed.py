"""A live session's container bytes, as media: MPEG-TS framing checked, one decoder per media.

    feed(chunk) -> a new media when none is open (MPEG-TS if the chunk starts with a sync byte,
                   else another container: fragmented MP4), its packet framing checked
                -> a change of the program's video stream (codec or PID): the old media's
                   decoder hands over its last frames, then a new media starts there
                -> each segment to the media's LiveDecoder (video/growing_stream.py), frames to the session

The session's lock guards which decoder is current; chunks go in order under a lock of their
own, so a media switch waits for the old decoder without holding the session."""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from sparrow.video.growing_stream import LiveDecoder
from sparrow.video.ts_framing import TS_SYNC, Segment, TsFraming


class MediaFeed:
    """on_new_media(): a media starts (the stream clock goes on from the newest frame);
    on_frames(frames, times) and on_error(exc): the decoder's thread; on_switch(what): the
    video stream changed. check_open() raises when the session is closed."""

    def __init__(self, lock: threading.RLock, check_open: Callable[[], None], on_new_media: Callable[[], None],
                 on_frames: Callable[[np.ndarray, np.ndarray], None], on_error: Callable[[BaseException], None],
                 on_switch: Callable[[str], None]):
        self._lock, self._check_open = lock, check_open
        self._on_new_media, self._on_frames, self._on_error, self._on_switch = on_new_media, on_frames, on_error, on_switch
        self._decoder: LiveDecoder | None = None
        self._framing: TsFraming | None = None    # MPEG-TS media: packet framing and program changes
        self._feeding = threading.Lock()          # chunks in order; a media switch waits for the old decoder

    def feed(self, chunk: bytes) -> None:
        chunk = bytes(chunk)
        with self._feeding:
            with self._lock:
                self._check_open()
                if chunk and (self._decoder is None or self._decoder.finished):
                    self._framing = TsFraming() if chunk[0] == TS_SYNC else None
            segments = self._framing.push(chunk) if self._framing is not None else [Segment(chunk)]
            for segment in segments:
                if segment.switch is not None:
                    self._switch(segment.switch)
                self._current().feed(segment.data)

    def finish(self) -> None:
        """No more bytes: the current media's decoder hands over its last frames."""
        decoder = self._now()
        if decoder is not None:
            decoder.close()
            decoder.join()

    def drain(self, timeout: float | None) -> None:
        """Wait until the current media's decoder has handed over what it was fed."""
        decoder = self._now()
        if decoder is not None:
            decoder.drain(timeout)

    def detach(self) -> LiveDecoder | None:
        """The current decoder, no longer current (the caller aborts it). Session lock held."""
        decoder, self._decoder = self._decoder, None
        return decoder

    def _now(self) -> LiveDecoder | None:
        with self._lock:
            return self._decoder

    def _current(self) -> LiveDecoder:
        with self._lock:
            self._check_open()
            if self._decoder is None or self._decoder.finished:
                self._on_new_media()         # its first frame follows the newest frame so far
                self._decoder = LiveDecoder(self._on_frames, self._on_error)
            return self._decoder

    def _switch(self, what: str) -> None:
        """The video stream changed: the old media's decoder hands over its last frames first."""
        decoder = self._now()
        if decoder is not None:
            decoder.close()
            decoder.join()
        self._on_switch(what)
