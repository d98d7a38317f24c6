"""A live session's alert incidents and standing answers, for whoever subscribes by session id:
the server-sent event stream `GET /v1/live/{session_id}/events` a dashboard reads, beside the
webhook and the Live call's own stream.

    LiveEventHub.tee(responses)       passes a Live call's responses through, publishing its
                                      incidents and standing answers under its session id
    LiveEventHub.subscribe(id)        those events from now on, until the session ends

No imports of the live subsystem: the hub reads sparrow.v1 LiveResponse messages only. A
subscriber that falls `MAX_BEHIND` events behind is ended with a `lagged` event rather than
holding the session's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from google.protobuf.json_format import MessageToDict

from sparrow.services.grpc_status import VideoNotFound

MAX_BEHIND = 1024          # events a subscriber may have unread
KEEPALIVE_S = 15.0         # an SSE comment this often keeps proxies from closing an idle stream
_END = object()


class SessionNotFound(VideoNotFound):
    """No live session with this id is open here (404)."""


class LiveEventHub:
    def __init__(self):
        self._subscribers: dict[str, set[asyncio.Queue]] = {}      # open session id -> its subscribers

    async def tee(self, responses: AsyncIterator) -> AsyncIterator:
        """`responses` (a Live call's), unchanged; its session is subscribable from its
        LiveOpened message until the stream ends."""
        session_id = None
        try:
            async with contextlib.aclosing(responses) as inner:     # closing this closes the call's stream
                async for response in inner:
                    kind = response.WhichOneof("kind")
                    if kind == "opened":
                        session_id = response.opened.session_id
                        self._subscribers[session_id] = set()
                    elif session_id is not None and _published(response, kind):
                        self._publish(session_id, {"event": "incident" if kind == "incident" else f"standing_{kind}",
                                                   "data": MessageToDict(getattr(response, kind))})
                    yield response
        finally:
            if session_id is not None:
                for queue in self._subscribers.pop(session_id, ()):
                    _put(queue, _END)

    def is_open(self, session_id: str) -> bool:
        return session_id in self._subscribers

    async def subscribe(self, session_id: str) -> AsyncIterator[dict]:
        """{"event": name, "data": {...}} for each event of the session: first `subscribed`,
        then incident, standing_chunk, standing_done, and `ended` when the session ends."""
        subscribers = self._subscribers.get(session_id)
        if subscribers is None:
            raise SessionNotFound(f"no live session {session_id!r} is open on this server")
        queue: asyncio.Queue = asyncio.Queue(MAX_BEHIND + 1)
        subscribers.add(queue)
        try:
            yield {"event": "subscribed", "data": {"session_id": session_id}}
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield {"event": None, "data": None}          # a keep-alive comment
                    continue
                if item is _END:
                    yield {"event": "ended", "data": {"session_id": session_id}}
                    return
                yield item
                if item["event"] == "lagged":
                    return
        finally:
            subscribers.discard(queue)

    def _publish(self, session_id: str, event: dict) -> None:
        for queue in list(self._subscribers.get(session_id, ())):
            if queue.qsize() >= MAX_BEHIND:
                self._subscribers[session_id].discard(queue)
                _put(queue, {"event": "lagged", "data": {"message": f"over {MAX_BEHIND} events unread"}})
            else:
                queue.put_nowait(event)


def _published(response, kind: str) -> bool:
    if kind == "incident":
        return True
    return kind in ("chunk", "done") and getattr(response, kind).standing


def _put(queue: asyncio.Queue, item) -> None:
    try:
        queue.put_nowait(item)
    except asyncio.QueueFull:
        pass                   # its reader has MAX_BEHIND events to read before it sees the end


def session_events(service, session_id: str) -> AsyncIterator[dict]:
    """The embedded service's hub's events for one session."""
    return service.live_events.subscribe(session_id)


async def sse_events(first: dict, events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Events as SSE: `event: <name>` and `data: <json>`; keep-alives as comments."""
    try:
        yield _sse(first)
        async for event in events:
            yield _sse(event)
    finally:
        await events.aclose()


def _sse(event: dict) -> str:
    if event["event"] is None:
        return ": keep-alive\n\n"
    return f"event: {event['event']}\ndata: {json.dumps(event['data'])}\n\n"
