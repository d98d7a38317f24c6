"""A webhook sink: incidents POSTed as JSON to a URL, off the caller's thread.

    post(body) -> a bounded queue (full: the oldest waiting body is dropped, counted)
               -> one sender thread: POST, retried on a connection error, a timeout or a 5xx
                  (backoff doubling from backoff_s), given up after `attempts` (counted)

Each body carries an `incident_id` (also sent as the Idempotency-Key header): a body is posted
until one attempt is answered 2xx-4xx, so a receiver sees it once unless an attempt reached
it but its answer was lost (then the key tells the copies apart). `close()` sends what is
queued (within `flush_s`) and stops the thread. A redirect (3xx) is never followed: it could
lead off the allowed prefixes; it is a failed delivery, logged.

Which URLs a session may name: `WebhookPrefix` (the server's --allow-webhook entries), matched
on the parsed scheme, host and port, and a path-segment prefix of the path.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import deque
from dataclasses import dataclass

from sparrow.errors import InvalidRequest, SourceNotAllowed
from sparrow.video.policy import SplitUrl, split_url

log = logging.getLogger(__name__)
WEBHOOK_SCHEMES = ("http", "https")
_SCHEME_STARTS = tuple(f"{scheme}://" for scheme in WEBHOOK_SCHEMES)


@dataclass(frozen=True, slots=True)
class WebhookPrefix:
    """One allowed webhook prefix ("https://alerts.internal/hooks"): a URL is under it when its
    scheme, host and port are the same (a port left out is the scheme's default) and its path
    is the prefix's path or lies below it segment by segment ("/hooks" admits "/hooks/a", not
    "/hooksevil"; no path admits any)."""

    origin: tuple[str, str, int]        # scheme, host, port
    path: str                           # "" (any path) or "/hooks/" (always ending in "/")

    @classmethod
    def parse(cls, entry: str) -> "WebhookPrefix":
        """InvalidRequest for an entry that is no plain http(s) URL prefix."""
        if not isinstance(entry, str) or not entry.lower().startswith(_SCHEME_STARTS):
            raise InvalidRequest(f"webhook prefix {entry!r} must start with http:// or https://")
        try:
            parts = split_url(entry)
        except SourceNotAllowed as exc:
            raise InvalidRequest(f"webhook prefix {entry!r} is malformed: {exc}") from exc
        if parts.query or "#" in entry or _dot_segments(parts.path):
            raise InvalidRequest(f"webhook prefix {entry!r} must be scheme://host[:port][/path], without "
                                 "'.' or '..' segments, a query or a fragment")
        path = parts.path if parts.path.endswith("/") else parts.path + "/"
        return cls((parts.scheme, parts.host, parts.port), "" if path == "/" else path)

    def admits(self, url: SplitUrl) -> bool:
        if (url.scheme, url.host, url.port) != self.origin:
            return False
        return not self.path or url.path == self.path[:-1] or url.path.startswith(self.path)


def _dot_segments(path: str) -> bool:
    """Whether `path` has a "." or ".." segment (percent-encoded too, its slashes included),
    which a receiver could resolve out of the prefix it was checked under."""
    return any(segment in (".", "..") for segment in re.split(r"[/\\]", urllib.parse.unquote(path)))


def check_webhook_url(url: str, prefixes: tuple[str, ...]) -> None:
    """InvalidRequest for a URL that is no http(s) URL; SourceNotAllowed for one under none of
    `prefixes` (or one that two parsers could read apart: user info, a bad port, ...)."""
    if not url.lower().startswith(_SCHEME_STARTS):
        raise InvalidRequest(f"a webhook URL must be http or https, got {url[:64]!r}")
    parts = split_url(url)
    if not _dot_segments(parts.path) and any(WebhookPrefix.parse(p).admits(parts) for p in prefixes):
        return
    raise SourceNotAllowed("this webhook URL is not under the server's allowed webhook prefixes "
                           "(sparrow serve --allow-webhook): its scheme, host and port must be a prefix's own "
                           "(a port left out is the scheme's default), and its path at or below the prefix's")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """urllib follows 301/302/303 for a POST by default (as a GET); a 3xx here stays an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    max_queue: int = 256          # bodies waiting to be sent; more: the oldest is dropped
    attempts: int = 4             # tries per body
    backoff_s: float = 0.25       # wait before the second try; doubles each time
    timeout_s: float = 5.0        # per attempt
    flush_s: float = 5.0          # close() waits this long for the queue to empty

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.attempts < 1:
            raise ValueError("max_queue and attempts must be >= 1")
        if not (self.backoff_s >= 0 and self.timeout_s > 0 and self.flush_s >= 0):
            raise ValueError("backoff_s and flush_s must be >= 0, timeout_s > 0")


class WebhookSink:
    def __init__(self, url: str, config: WebhookConfig | None = None):
        self.url, self.config = url, config or WebhookConfig()
        self._queue: deque[dict] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._busy = False
        self.counts = {"sent": 0, "dropped": 0, "failed": 0, "retries": 0}
        self._thread = threading.Thread(target=self._run, name="sparrow-webhook", daemon=True)
        self._thread.start()

    def post(self, body: dict) -> str:
        """Queue a JSON body; returns its incident_id (set here unless the body has one)."""
        body = {**body, "incident_id": body.get("incident_id") or uuid.uuid4().hex}
        with self._cv:
            if self._closing:
                raise RuntimeError("the webhook sink is closed")
            if len(self._queue) >= self.config.max_queue:
                self._queue.popleft()
                self.counts["dropped"] += 1
            self._queue.append(body)
            self._cv.notify_all()
        return body["incident_id"]

    def close(self) -> None:
        """Send what is queued (up to flush_s), then stop; anything left is counted as dropped."""
        deadline = time.monotonic() + self.config.flush_s
        with self._cv:
            while (self._queue or self._busy) and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))
            self._closing = True
            self.counts["dropped"] += len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        self._thread.join(self.config.timeout_s + 1.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._closing and not self._queue:
                    return
                body = self._queue.popleft()
                self._busy = True
            try:
                sent = self._send(body)
            finally:
                with self._cv:
                    self._busy = False
                    self.counts["sent" if sent else "failed"] += 1
                    self._cv.notify_all()

    def _send(self, body: dict) -> bool:
        data = json.dumps(body).encode()
        wait = self.config.backoff_s
        for attempt in range(self.config.attempts):
            if attempt:
                with self._cv:
                    self.counts["retries"] += 1
                    self._cv.wait_for(lambda: self._closing, wait)   # closing: the remaining tries at once
                wait *= 2
            request = urllib.request.Request(self.url, data=data, method="POST", headers={
                "Content-Type": "application/json", "Idempotency-Key": body["incident_id"]})
            try:
                with _OPENER.open(request, timeout=self.config.timeout_s) as response:
                    response.read()
                return True
            except urllib.error.HTTPError as exc:
                if 300 <= exc.code < 400:     # not followed: the Location could be anywhere
                    log.warning("webhook %s answered HTTP %d (a redirect, not followed): the incident was not "
                                "delivered; allow and give the final URL", self.url, exc.code)
                    return False
                if exc.code < 500:            # the receiver refused this body: retrying will not help
                    log.warning("webhook %s refused an incident: HTTP %d", self.url, exc.code)
                    return False
            except (urllib.error.URLError, OSError) as exc:
                log.info("webhook %s: attempt %d failed: %s", self.url, attempt + 1, exc)
        log.warning("webhook %s: an incident was not delivered after %d attempts", self.url, self.config.attempts)
        return False


__all__ = ["WebhookConfig", "WebhookPrefix", "WebhookSink", "check_webhook_url"]
