"""What a live session knows of its source: the clock that turns the source's timestamps into
stream seconds, the camera time of each frame, and whether the source has gone silent.

Stream seconds count from the session's first frame and never jump back: a source whose
timestamps restart (a camera reboot, a PTS wrap, a re-encoded segment) or a new media (a
codec switch, a container fed again after a failure) continues one frame slot after the
newest frame. What the source said is kept beside it: each frame's source PTS and the
wall-clock time it reached the session (CameraTime), so an answer can be matched to the
camera's own clock as well as to the stream's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

# Source timestamps that go back further than this are a reset (the stream time goes on);
# less is jitter, and the frame falls in a slot already taken (it is not sampled).
RESET_S = 1.0


@dataclass(frozen=True, slots=True)
class CameraTime:
    """When a frame was, three ways."""

    stream_s: float          # seconds since the session's first frame (continuous)
    source_pts_s: float      # the source's own timestamp (container PTS, or the client's time)
    wall_time_s: float       # Unix seconds when the frame reached the session


class SourceClock:
    """Source timestamps -> stream seconds. The first frame is at 0; a frame of a new media
    (`new_media`) or after a reset lands one source frame interval after the newest frame
    (the last one seen between two frames; 1 / fps before there is one)."""

    def __init__(self, fps: float):
        self.interval = 1.0 / fps
        self._offset: float | None = None     # stream_s = source pts + offset
        self._last_pts: float | None = None
        self._restart = False
        self.newest: CameraTime | None = None

    def new_media(self) -> None:
        """The next frame starts a new media: its timestamps say nothing of the old one's."""
        self._restart = True

    def place(self, pts: float, wall_time_s: float | None = None) -> tuple[CameraTime, bool]:
        """(the frame's camera time, whether the source's timestamps were reset here)."""
        newest, reset = self.newest, False
        if self._offset is None:
            self._offset = -pts
        elif self._restart or pts + self._offset < newest.stream_s - RESET_S:
            reset = not self._restart
            self._offset = newest.stream_s + self.interval - pts
        elif 0 < pts - self._last_pts <= RESET_S:
            self.interval = pts - self._last_pts
        self._restart, self._last_pts = False, pts

        camera = CameraTime(pts + self._offset, pts, time.time() if wall_time_s is None else wall_time_s)
        if newest is None or camera.stream_s >= newest.stream_s:
            self.newest = camera
        return camera, reset


class SilenceWatch:
    """Calls `on_change(True, silent_s)` once no frame has come for `after_s` wall seconds
    (counted from its start), and `on_change(False, silent_s)` when one comes again; on a
    thread of its own until `stop`."""

    def __init__(self, after_s: float, on_change: Callable[[bool, float], None]):
        self.after_s, self.on_change = after_s, on_change
        self._cv = threading.Condition()
        self._last = time.monotonic()
        self._stale = self._stopped = False
        self._thread = threading.Thread(target=self._run, name="sparrow-live-silence", daemon=True)
        self._thread.start()

    @property
    def stale(self) -> bool:
        with self._cv:
            return self._stale or (not self._stopped and time.monotonic() - self._last >= self.after_s)

    def frame(self) -> None:
        """A frame came now."""
        with self._cv:
            now, was = time.monotonic(), self._stale
            silent, self._last, self._stale = now - self._last, now, False
            if was:
                self._cv.notify_all()         # the watch waits for the next silence again
        if was:
            self.on_change(False, silent)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._stale = False
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._stale or time.monotonic() - self._last < self.after_s):
                    left = self._last + self.after_s - time.monotonic()
                    self._cv.wait(None if self._stale else max(left, 0.001))
                if self._stopped:
                    return
                self._stale, silent = True, time.monotonic() - self._last
            self.on_change(True, silent)


__all__ = ["CameraTime", "RESET_S", "SilenceWatch", "SourceClock"]
