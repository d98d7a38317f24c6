"""A live session's video read by the server itself from a URL (LiveOpen.url): http(s) or an
RTSP camera, under the service's URL allowlists (services/live/call.py opens it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sparrow.live.session import LiveSession
from sparrow.live.source_health import RESET_S
from sparrow.video import SourcePolicy, VideoOptions
from sparrow.video.decode import pyav_errors
from sparrow.video.sources import Deadline, open_media
from sparrow.video.stream import decoded_frames, video_stream


class UrlFeeder:
    """A session's video read by the server from a URL (checked against the source policy),
    decoded on a thread and pushed at the pace of its timestamps: a live source arrives at
    real time anyway, a file behind a URL plays as it would live (a timestamp jump waits at
    most RESET_S). Frames go to the session with their source PTS. Bytes count against the
    session's limit (count_bytes raises SessionLimit). `on_end` when the source ends, or
    `on_error` with a typed error (SourceUnavailable, VideoTimeout, VideoUnreadable, ...)."""

    def __init__(self, session: LiveSession, url: str, options: VideoOptions, policy: SourcePolicy, *,
                 on_error: Callable[[BaseException], None], on_end: Callable[[], None],
                 count_bytes: Callable[[int], None]):
        self.session, self.url, self.options, self.policy = session, url, options, policy
        self.on_error, self.on_end, self.count_bytes = on_error, on_end, count_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparrow-live-url", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            with pyav_errors(self.options, remote=True):
                self._play()
            if self._stop.is_set():
                return
            self.session.end_of_stream()
            self.on_end()
        except Exception as exc:  # noqa: BLE001 - reported on the session's stream
            if not self._stop.is_set() and not self.session.closed:
                self.on_error(exc)

    def _play(self) -> None:
        media = open_media(self.url, self.options, self.policy, Deadline(self.options.timeout_s))
        with media.open() as container:
            stream = video_stream(container, media.description)
            due, last = time.monotonic(), None
            for pts, frame in decoded_frames(container, stream, origin_pts=0, on_packet=self.count_bytes):
                if pts is None:                   # no pts: no time to play it at
                    continue
                due += 0.0 if last is None else min(max(pts - last, 0.0), RESET_S)
                last = pts
                if self._stop.wait(max(0.0, due - time.monotonic())):
                    return
                self.session.push_frames(frame.to_ndarray(format="rgb24")[None], [pts])


__all__ = ["UrlFeeder"]
