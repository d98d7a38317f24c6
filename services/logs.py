"""Structured logs: one JSON object per line, carrying the request id of the request the
log line belongs to.

    configure_logging("INFO", json=True)      once, at host start-up
    with request_context(request_id):         around a request's handling
        log.info("prefill done", extra={"visual_tokens": 4096})
    -> {"ts": "2026-...Z", "level": "INFO", "logger": "...", "msg": "prefill done",
        "request_id": "r-17", "visual_tokens": 4096}

The request id lives in a contextvar, so it follows the request through its coroutines and
into `asyncio.to_thread` calls. Plain executor threads (`loop.run_in_executor`) do not copy
the context: code that hands a request to such a thread must run it under
`contextvars.copy_context()` for that thread's lines to carry the id.

RequestIdFilter puts `request_id` on every record, so a formatter that is not ours (Ray
Serve's JSON logs) can still print it.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("sparrow_request_id", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


class RequestIdFilter(logging.Filter):
    """Sets record.request_id from the context (unless the call passed one in `extra`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601, ms), level, logger, msg, request_id
    when there is one, the `extra=` fields, and exc_info as text."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _STANDARD and key != "request_id" and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        # default=str: an extra field that is not JSON (a Path, an enum) is logged as text
        # rather than losing the whole line.
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str | int = "INFO", *, json_format: bool = True, stream=None) -> logging.Handler:
    """Replace the root logger's handlers with one that writes to `stream` (stderr), as
    JSON lines or as plain text with the request id. Returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if json_format else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
