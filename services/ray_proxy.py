"""What sparrow.v1.Sparrow runs in Ray Serve's gRPC proxy process: Serve's own handlers for its
methods, guarded so that a call that ends frees its replica slot (services.wire registers the
service there, through `guarded_handlers`).

Two holes in Serve 2.60's proxy, both seen leaving a TargetDeployment slot held after its call
was gone:

- Serve answers a streaming call with an async generator that forwards the replica's
  responses, and cancels the replica's request only when a cancellation reaches it where it
  waits for the replica (ProxyResponseGenerator.__anext__). gRPC cancels a call's task (its
  deadline, the client's cancel, the client's connection lost) wherever that task is: while
  gRPC itself writes a response, the generator is left suspended at its `yield`, later closed
  with GeneratorExit, and that path never cancels the replica's request, which runs on to its
  last token holding its slot. (The proxy then logs `GeneratorExit` raised at `yield result`
  in send_request_to_replica. Measured on a loaded 2-core box: 1 mid-stream gRPC deadline
  in 18, another run 1 in 60, each slot held on for tens of seconds, its answer running on.)
- The replica never sees a gRPC deadline: the proxy hands it the invocation metadata only,
  and gRPC keeps `grpc-timeout` out of those.

So here a streaming call's responses are pulled by a task of their own (ResponsePump) that is
only ever suspended inside Serve's generator; however the call ends, that task is cancelled
there and Serve cancels the replica's request. And every call's gRPC deadline is passed on as
`sparrow-timeout-ms` metadata (the earlier of it and one the client sent), which the replica
enforces itself (SparrowService aborts the generation at it, as the engine does). Serve's code
may then run after the call has ended, so it sees the call through ProxyCallContext, which
read what names the caller while the call was alive.

Light on purpose: the proxy process imports it (grpc and asyncio only).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator

log = logging.getLogger(__name__)

TIMEOUT_METADATA = "sparrow-timeout-ms"      # the deadline a replica reads (servicer.deadline_from_metadata)


@contextlib.contextmanager
def guarded_handlers(server) -> Iterator[None]:
    """While a service is registered on Serve's proxy server, its methods get guarded handlers.
    Serve's gRPCGenericServer builds each method's handler with its `service_handler_factory`
    as the method is registered; a server without one (not Serve's) is left as it is."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        log.warning("%s has no service_handler_factory: sparrow.v1.Sparrow's handlers are not guarded",
                    type(server).__name__)
        yield
        return

    def guarded_factory(service_method: str, streaming_type):
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        return (_guard_stream if inspect.isasyncgenfunction(handler) else _guard_unary)(handler)

    server.service_handler_factory = guarded_factory
    try:
        yield
    finally:
        server.service_handler_factory = factory


def _guard_unary(handler: Callable) -> Callable:
    """A call with one response: gRPC's cancel lands inside Serve's await (gRPC writes the
    response after the handler returns), so only the deadline needs passing on."""
    async def unary(request, context):
        return await handler(request, ProxyCallContext(context))
    return unary


def _guard_stream(handler: Callable) -> Callable:
    """A call with a response stream: its responses come through a ResponsePump. A stream
    that ends without an error after the call's deadline (gRPC's or `sparrow-timeout-ms`)
    ends DEADLINE_EXCEEDED here, as a gRPC deadline would end it: the deadline the proxy
    forwards is enforced at the proxy too, whatever way the replica's stream ended."""
    async def stream(request, context):
        call = ProxyCallContext(context)
        pump = ResponsePump(handler(request, call))
        context.add_done_callback(lambda _: pump.stop())     # the call is over, whatever gRPC's task was doing
        try:
            async for response in pump:
                yield response
        except ReplicaStreamCancelled:
            import grpc

            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica's stream was cancelled; retry the request")
        finally:
            pump.stop()
        if call.deadline is not None and time.monotonic() >= call.deadline:
            import grpc

            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
    return stream


class ResponsePump:
    """Iterates `responses` on a task of its own, queueing each one, so that the task is only
    ever suspended inside `responses`: `stop()` cancels it there. The queue is not bounded,
    which holds nothing more than before: Serve's stream from the replica has no backpressure
    (the proxy's Ray worker buffers what the replica yields, read or not)."""

    _END = object()

    def __init__(self, responses: AsyncIterator):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._stopped = False
        self._task = asyncio.ensure_future(self._pull(responses))

    async def _pull(self, responses: AsyncIterator) -> None:
        try:
            async for response in responses:
                self._queue.put_nowait(response)
        except asyncio.CancelledError:
            if not self._stopped:     # cancelled inside Serve, not by stop(): the reader sees an error, not an end
                self._queue.put_nowait(_Raised(ReplicaStreamCancelled()))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, raised there
            self._queue.put_nowait(_Raised(exc))
        self._queue.put_nowait(self._END)

    def stop(self) -> None:
        self._stopped = True
        self._task.cancel()           # a no-op once the responses have ended

    def __aiter__(self) -> "ResponsePump":
        return self

    async def __anext__(self):
        item = await self._queue.get()
        if item is self._END:
            self._queue.put_nowait(item)      # asked again: still the end
            raise StopAsyncIteration
        if isinstance(item, _Raised):
            raise item.exc
        return item


class ReplicaStreamCancelled(Exception):
    """The replica's stream was cancelled inside Serve while the call was still open (a
    CancelledError raised into gRPC's handler would leave the call hanging to its deadline)."""


class _Raised:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class ProxyCallContext:
    """The call's context as Serve's proxy sees it here: its invocation metadata also carry the
    call's gRPC deadline, as `sparrow-timeout-ms` (the earlier of the two where the client sent
    one too; a malformed value is left for the replica to refuse); and what names the caller
    is read once, now. A guarded stream's responses may still pass through Serve's code after
    the call has ended (the pump, stopped, ends them there), and gRPC's peer() or
    auth_context() on an ended call crash the process (SIGSEGV, grpcio 1.85). The rest is the
    call's own context (setting a code or details on an ended call is harmless)."""

    def __init__(self, context):
        self._context = context
        self._metadata = _with_deadline(tuple(context.invocation_metadata() or ()), context.time_remaining())
        self.deadline = _deadline(self._metadata)        # time.monotonic(), or None
        self._peer, self._auth_context = context.peer(), context.auth_context()
        self._peer_identities, self._peer_identity_key = context.peer_identities(), context.peer_identity_key()

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    def invocation_metadata(self):
        return self._metadata

    def peer(self):
        return self._peer

    def auth_context(self):
        return self._auth_context

    def peer_identities(self):
        return self._peer_identities

    def peer_identity_key(self):
        return self._peer_identity_key


def _with_deadline(metadata: tuple, remaining: float | None) -> tuple:
    if remaining is None:
        return metadata
    sent = [value for key, value in metadata if key == TIMEOUT_METADATA]
    try:
        timeout_ms = min([max(0, int(remaining * 1000))] + [int(value) for value in sent])
    except ValueError:
        return metadata
    return tuple((k, v) for k, v in metadata if k != TIMEOUT_METADATA) + ((TIMEOUT_METADATA, str(timeout_ms)),)


def _deadline(metadata: tuple) -> float | None:
    """The earliest `sparrow-timeout-ms` deadline in `metadata`, as time.monotonic()."""
    try:
        ms = [int(value) for key, value in metadata if key == TIMEOUT_METADATA]
    except ValueError:
        return None                   # malformed: the replica refuses it
    return time.monotonic() + max(0, min(ms)) / 1000 if ms else None


__all__ = ["ProxyCallContext", "ReplicaStreamCancelled", "ResponsePump", "TIMEOUT_METADATA", "guarded_handlers"]
